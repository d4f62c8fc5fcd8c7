"""tokenfeed server side: token store, sampling engine, chunk cache and gRPC service.

`store`, `sampling` and `errors` are pure (numpy only) and shared with `prepare` and
the client; nothing in this package imports grpc until the service itself is loaded.
"""
