"""Generated gRPC modules of tokenfeed.v1 (see feeder.proto; regenerate with `make protos`)."""
