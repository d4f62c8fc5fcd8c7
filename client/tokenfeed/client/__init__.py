"""tokenfeed's trainer-side client: stream one rank's batches from a feeder.

    from tokenfeed.client import FeederClient

How to reach the feeder is one `Connection` value (addresses, `Security` for TLS, a
bearer token, `Timeouts`, `Backoff`), or FeederClient's flat keywords that build it.

Importing this package loads grpc, numpy and prometheus-client only; torch is
imported when a `device` is asked for (see `tokenfeed.client.device`). The error
tree (tokenfeed.core.errors) is re-exported here, so a trainer catches
`tokenfeed.client.DataLoss` without knowing where it lives.
"""

from tokenfeed.client.connection import Backoff, Connection, Security, Timeouts
from tokenfeed.client.info import DatasetInfo
from tokenfeed.client.loader import FeederClient
from tokenfeed.core.errors import (
    DataLoss,
    FailedPrecondition,
    FeederError,
    FeederUnavailable,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from tokenfeed.core.request import SamplingSpec

__all__ = [
    "Backoff",
    "Connection",
    "DataLoss",
    "DatasetInfo",
    "FailedPrecondition",
    "FeederClient",
    "FeederError",
    "FeederUnavailable",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "SamplingSpec",
    "Security",
    "Timeouts",
    "Unauthenticated",
]
