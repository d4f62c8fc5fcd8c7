"""tokenfeed's trainer-side client: stream one rank's batches from a feeder.

    from tokenfeed.client import FeederClient

Importing this package loads grpc, numpy and prometheus-client only; torch is
imported when a `device` is asked for (see `tokenfeed.client.device`).
"""

from tokenfeed.client.loader import FeederClient
from tokenfeed.client.stream import Backoff
from tokenfeed.client.transport import FeederUnavailable, PermissionDenied, Timeouts

__all__ = ["Backoff", "FeederClient", "FeederUnavailable", "PermissionDenied", "Timeouts"]
