"""tokenfeed's trainer-side client: stream one rank's batches from a feeder.

    from tokenfeed.client import FeederClient

Importing this package loads grpc, numpy and prometheus-client only; torch is
imported when a `device` is asked for (see `tokenfeed.client.device`). The error
tree (tokenfeed.core.errors) is re-exported here, so a trainer catches
`tokenfeed.client.DataLoss` without knowing where it lives.
"""

from tokenfeed.client.loader import DatasetInfo, FeederClient
from tokenfeed.client.stream import Backoff
from tokenfeed.client.transport import Timeouts
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
    "Timeouts",
    "Unauthenticated",
]
