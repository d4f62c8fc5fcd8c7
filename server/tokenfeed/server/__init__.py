"""tokenfeed's feeder: the gRPC service, the shared chunk cache, message assembly,
configuration and metrics. The store format and the sampling math it serves live in
the core (tokenfeed.core); `tokenfeed serve` (tokenfeed.cli.serve) runs it.
"""
