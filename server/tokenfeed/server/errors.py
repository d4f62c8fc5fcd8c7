"""Domain errors, one class per outcome a caller can act on.

    FeederError                 base; `code` names the gRPC status it maps to
    ├── InvalidArgument         a parameter is out of range or inconsistent
    ├── NotFound                no such dataset / file
    ├── FailedPrecondition      valid request, but the data cannot satisfy it
    ├── DataLoss                a chunk on disk is missing, truncated or corrupt
    ├── Unauthenticated         missing or wrong credentials
    └── ResourceExhausted       too many streams, batch too large

The pure modules raise these; the gRPC servicer turns them into status codes in one
place and the CLI into exit code 2. Nothing here imports grpc.
"""

from __future__ import annotations


class FeederError(Exception):
    code = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(FeederError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(FeederError, LookupError):
    code = "NOT_FOUND"


class FailedPrecondition(FeederError):
    code = "FAILED_PRECONDITION"


class DataLoss(FeederError):
    code = "DATA_LOSS"


class Unauthenticated(FeederError):
    code = "UNAUTHENTICATED"


class ResourceExhausted(FeederError):
    code = "RESOURCE_EXHAUSTED"
