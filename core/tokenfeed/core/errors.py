"""Domain errors: one class per outcome a caller can act on, and their one status table.

    FeederError                 base; `code` names the gRPC status it maps to
    ├── InvalidArgument         a parameter is out of range or inconsistent
    ├── NotFound                no such dataset / file
    ├── FailedPrecondition      valid request, but the data cannot satisfy it
    ├── DataLoss                a chunk is missing, truncated or corrupt
    │   └── ChecksumMismatch    ...its bytes do not match the checksum in meta.json
    ├── Unauthenticated         missing or wrong credentials
    ├── PermissionDenied        the credentials do not allow the call
    ├── ResourceExhausted       too many streams, message too large
    ├── FeederUnavailable       no feeder answered within the retry budget
    └── StorageUnavailable      object storage did not answer within its retry budget

Every part raises these: the pure core, the server (whose servicer turns them into
gRPC status codes in one place), the client (which turns status codes back into them,
so a trainer catches `tokenfeed.client.DataLoss`), prepare and the CLI (exit code 2).
Status codes are names (strings) here: nothing in the core imports grpc.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound="FeederError")


class FeederError(Exception):
    """`message` is what the caller sees; `field`, when set, names the request field at
    fault (``sources['web']``, ``schedule[1].from_tokens``) and starts the message."""

    code = "UNKNOWN"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    @classmethod
    def at(cls: type[E], field: str, message: str) -> E:
        """The error of the request field `field`: its message starts with the field."""
        return cls(f"{field}: {message}", field=field)


class InvalidArgument(FeederError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(FeederError, LookupError):
    code = "NOT_FOUND"


class FailedPrecondition(FeederError):
    code = "FAILED_PRECONDITION"


class DataLoss(FeederError):
    code = "DATA_LOSS"


class ChecksumMismatch(DataLoss):
    """A chunk read whole, of the right size, whose checksum differs from meta.json."""


class Unauthenticated(FeederError):
    code = "UNAUTHENTICATED"


class PermissionDenied(FeederError, PermissionError):
    code = "PERMISSION_DENIED"


class ResourceExhausted(FeederError):
    code = "RESOURCE_EXHAUSTED"


class FeederUnavailable(FeederError, ConnectionError):
    """No feeder answered within the retry budget (the last failure's message inside)."""

    code = "UNAVAILABLE"


class StorageUnavailable(FeederError, ConnectionError):
    """Object storage failed every attempt at a request (5xx, SlowDown, timeouts, resets).

    The message names the object (`s3://bucket/key`); the streams that need it end with
    UNAVAILABLE (the client reconnects and resumes) while the others keep going.
    """

    code = "UNAVAILABLE"


_BY_CODE: dict[str, type[FeederError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        DataLoss,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        FeederUnavailable,
    )
}


def error_for(code: str, message: str) -> FeederError:
    """The domain error for a status code name ("NOT_FOUND", ...); unknown codes give a
    plain FeederError that keeps the code."""
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(message)
    err = FeederError(message)
    err.code = code
    return err
