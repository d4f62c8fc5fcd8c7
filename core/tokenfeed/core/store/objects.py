"""S3-compatible object storage for stores, on obstore, with our own retry loop.

    store = ObjectStore("s3://bucket/prefix")   # endpoint and keys: the AWS environment
    store.list("web/en/")        -> [ObjectInfo(key, size, etag)]   keys under the prefix
    store.head(key)              -> ObjectInfo
    store.get(key, size)         -> memoryview (whole object, in its own anonymous mmap)
    store.get_range(key, a, b)   -> bytes [a, b)
    store.put(key, data)
    store.delete_prefix(prefix)  -> number of objects deleted
    store.child("web/en")        -> the same connection, rooted deeper

Keys are relative to the URL's prefix; every error names the full `s3://bucket/key`.

Why obstore (measured against SeaweedFS): one 16 MB wheel with no Python dependencies
that imports in ~35 ms (boto3: ~36 MB, 0.8 s); the transfer runs in Rust with the GIL
released, so the feeder's event loop and batch assembly keep the CPU, and a body
arrives as buffers copied once into the cache's anonymous mmap; its connect, per-read
and overall timeouts are all settable (boto3's backoff is fixed: 1 s base for
SlowDown, with a quota that can stop retrying). Neither client retries everything
docs/stores.md ("Where stores live") promises (obstore does not retry a LIST body cut
short, boto3 not a GET body), so the retry loop is ours either way and obstore's own
is off (`max_retries` 0): one policy, one count and one WARNING per retry.

Retries: LIST, HEAD, GET and PUT are retried on 5xx (SlowDown included), 408/429,
timeouts, connection resets and bodies cut short: `RetryPolicy.attempts` (>= 5)
attempts with capped exponential backoff and full jitter. An attempt that delivered
bytes (GET) or keys (LIST) does not use up the budget: a whole-object GET resumes
where the body broke (a ranged GET of the rest guarded by If-Match on the ETag, so a
re-uploaded object restarts from 0 instead of mixing versions), LIST after the last
key it saw. When the attempts run out: StorageUnavailable (UNAVAILABLE) naming the
object.

Errors (tokenfeed.core.errors): 404 -> NotFound; 401/403 and NoSuchBucket ->
PermissionDenied, not retried, saying where the credentials came from but never what
they are; a size that differs from meta.json -> DataLoss; bad configuration ->
InvalidArgument. The client library's own message (URLs, XML bodies, debug dumps) is
never passed on: it is classified, reduced to a few words ("HTTP 503 SlowDown"),
scrubbed of the secret key and session token, and raised `from None`.

Configuration, in the order the AWS tools use: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_REGION /
AWS_DEFAULT_REGION, then the profile (AWS_PROFILE, else "default") in
AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE (static keys, region and endpoint_url are
read here; a profile that needs SSO, a role or credential_process goes through boto3's
resolver when boto3 is installed, else a clear error naming the profile). With no keys
anywhere obstore's default chain runs (web identity, ECS, instance metadata). An
http:// endpoint turns on obstore's allow_http.

obstore is the `s3` extra: without it, opening an s3:// location is an ImportError
that names the pip install.
"""

from __future__ import annotations

import builtins
import configparser
import copy
import hashlib
import logging
import os
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from tokenfeed.core.errors import (
    DataLoss,
    FeederError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StorageUnavailable,
)
from tokenfeed.core.store.memory import anonymous

log = logging.getLogger(__name__)

T = TypeVar("T")
# A GET body is copied into its chunk's map as it arrives, in pieces of at least this
# many bytes. Small pieces: obstore does not gather them into a buffer of its own first
# (one copy fewer), and malloc keeps reusing a few small buffers. With 4 MiB pieces,
# measured with 4 GETs of 4 MiB objects in flight against SeaweedFS: the heap grew by
# ~37 MiB and stayed there (glibc raises its mmap threshold after the first big free,
# so later 4 MiB buffers come from per-thread arenas), vs ~13 MiB at 64 KiB, with the
# same or less CPU per GET (4.8-5.0 ms vs 5.1-5.6).
STREAM_PIECE = 64 << 10
# What a GET in flight holds beside its chunk's own map: obstore's and hyper's buffers
# and the reading thread's share of the heap. Measured against SeaweedFS with 1, 2, 4
# and 8 GETs of 4 MiB objects in flight (malloc arenas limited to 2, as the feeder
# does): the heap peaked 2-3, 3, 5 and 9-12 MiB above idle, ~1.2-1.5 MiB per GET,
# whatever STREAM_PIECE (16 KiB to 1 MiB). The feeder's cache counts it per load in
# flight, so its memory bound holds with GETs in flight.
GET_BUFFER_BYTES = 3 << 19
SCHEME = "s3://"
INSTALL_HINT = "pip install 'tokenfeed[s3]'"


def is_url(location: object) -> bool:
    """Whether a location names object storage (`s3://bucket/prefix`)."""
    return isinstance(location, str) and location.startswith(SCHEME)


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ImportError(f"s3:// locations need obstore, the `s3` extra: {INSTALL_HINT}") from None
    return obstore


# ---------------------------------------------------------------------- policy


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter: sleep U(0, min(cap, base * 2**n))."""

    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0
    connect_timeout: float = 5.0
    read_timeout: float = 30.0  # silence on an open connection, per read
    request_timeout: float = 600.0  # a whole request, 32 MiB on a slow link included

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise InvalidArgument(f"attempts must be >= 1, got {self.attempts}")
        if not 0 <= self.base_delay <= self.max_delay:
            raise InvalidArgument(
                f"need 0 <= base_delay <= max_delay, got {self.base_delay}, {self.max_delay}"
            )

    def delay(self, retry: int, rng: random.Random) -> float:
        """Sleep before retry number `retry` (0 = the first retry)."""
        return rng.uniform(0.0, min(self.max_delay, self.base_delay * (2.0 ** min(retry, 60))))


# A job that writes a store (prepare, import) outlives a short outage of object storage
# or of the name lookup before it: 10 attempts, waits of up to 40 s in all (the default
# policy: 6 and 3.1 s). A feeder's reads keep the default, so that the streams that
# need an object hear of an outage soon and their clients reconnect.
WRITER_POLICY = RetryPolicy(attempts=10, max_delay=15.0)


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's prefix
    size: int
    etag: str | None = None


@dataclass(frozen=True)
class S3Url:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> S3Url:
        if not url.startswith(SCHEME):
            raise InvalidArgument(f"{url!r} is not an s3:// URL (s3://bucket/prefix)")
        bucket, _, prefix = url[len(SCHEME) :].partition("/")
        if not bucket:
            raise InvalidArgument(f"{url!r} names no bucket (s3://bucket/prefix)")
        parts = [p for p in prefix.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise InvalidArgument(f"{url!r}: '.' and '..' are not allowed in an s3:// prefix")
        return cls(bucket, "".join(p + "/" for p in parts))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}".rstrip("/")


# ---------------------------------------------------------------------- config


@dataclass
class S3Settings:
    """What goes to obstore; `secrets` lists the strings no message may contain."""

    config: dict[str, Any] = field(default_factory=dict)
    credential_provider: Any = None
    secrets: tuple[str, ...] = ()
    source: str = "environment"  # where the credentials came from (safe to show)

    def __repr__(self) -> str:  # never the keys
        return f"S3Settings(endpoint={self.config.get('endpoint')!r}, source={self.source!r})"


_ADVANCED_PROFILE_KEYS = (
    "role_arn",
    "sso_session",
    "sso_start_url",
    "credential_process",
    "web_identity_token_file",
    "source_profile",
)


def _profile(env: Mapping[str, str]) -> tuple[str, dict[str, str], str]:
    name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    creds = os.path.expanduser(env.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"))
    config = os.path.expanduser(env.get("AWS_CONFIG_FILE", "~/.aws/config"))
    found: dict[str, str] = {}
    section = "default" if name == "default" else f"profile {name}"
    for path, sect in ((config, section), (creds, name)):
        cp = configparser.RawConfigParser()
        try:
            cp.read(path)
        except configparser.Error as e:
            raise InvalidArgument(f"{path}: unreadable AWS config ({type(e).__name__})") from None
        if cp.has_section(sect):
            found.update(cp.items(sect))
    if env.get("AWS_PROFILE") and not found:
        raise InvalidArgument(f"AWS_PROFILE={name!r} but no such profile in {config} or {creds}")
    return name, found, f"{config} / {creds}"


def resolve_settings(env: Mapping[str, str] | None = None) -> S3Settings:
    """Endpoint, region and credentials from the AWS environment and config files."""
    env = os.environ if env is None else env
    s = S3Settings()
    name, prof, _ = _profile(env)
    endpoint = (
        env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or prof.get("endpoint_url")
    )
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or prof.get("region")
    if endpoint:
        s.config["endpoint"] = endpoint
    if region:
        s.config["region"] = region
    key_id, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    token = env.get("AWS_SESSION_TOKEN")
    if key_id and secret:
        s.source = "the environment (AWS_ACCESS_KEY_ID)"
    elif prof.get("aws_access_key_id") and prof.get("aws_secret_access_key"):
        key_id, secret = prof["aws_access_key_id"], prof["aws_secret_access_key"]
        token = prof.get("aws_session_token")
        s.source = f"AWS profile {name!r}"
    elif any(k in prof for k in _ADVANCED_PROFILE_KEYS):
        try:
            import boto3  # type: ignore[import-not-found,unused-ignore]
            from obstore.auth.boto3 import Boto3CredentialProvider
        except ImportError:
            raise InvalidArgument(
                f"AWS profile {name!r} gets its credentials from a role, SSO or a process: "
                "pip install boto3 to use it, or set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY"
            ) from None
        s.credential_provider = Boto3CredentialProvider(boto3.Session(profile_name=name))
        s.source = f"AWS profile {name!r} (through boto3)"
        key_id = secret = None
    else:
        key_id = secret = None
        s.source = "the default chain (web identity, ECS, instance metadata): no keys set"
    if key_id and secret:
        s.config.update(access_key_id=key_id, secret_access_key=secret)
        if token:
            s.config["token"] = token
    s.secrets = tuple(x for x in (secret, token) if x)
    return s


# ---------------------------------------------------------------------- errors in

_STATUS = re.compile(r"status(?: code)?:? (\d{3})", re.IGNORECASE)
_CODE = re.compile(r"<Code>([A-Za-z0-9.]+)</Code>")


def _classify(e: BaseException) -> tuple[str, str]:
    """(kind, short cause) of a client exception; kind: notfound, denied, changed,
    retry or fatal. obstore reports some cases only in its message text (NoSuchBucket
    arrives as a GenericError): tests pin every case we depend on."""
    oe = _obstore().exceptions
    text = str(e)
    m = _STATUS.search(text)
    status = int(m.group(1)) if m else None
    c = _CODE.search(text)
    code = c.group(1) if c else None
    what = (f"HTTP {status}" + (f" {code}" if code else "")) if status else None
    if isinstance(e, (oe.NotFoundError, FileNotFoundError)) and code != "NoSuchBucket":
        return "notfound", what or "not found"
    if isinstance(e, (oe.PermissionDeniedError, oe.UnauthenticatedError)) or status in (401, 403):
        return "denied", what or "access denied"
    if code == "NoSuchBucket":
        return "denied", what or "no such bucket"
    if isinstance(e, oe.PreconditionError) or status == 412:
        return "changed", "object changed while being read (ETag mismatch)"
    if status is not None:
        if status >= 500 or status in (408, 429):
            return "retry", what or f"HTTP {status}"
        return "fatal", what or f"HTTP {status}"
    # obstore's message carries its settings ("retry_timeout: 180s"): not a cause
    low = re.sub(r"retry_timeout: \S+", "", text.lower())
    if "timed out" in low or "timeout" in low:
        return "retry", "timeout"
    if "dns error" in low or "failed to lookup address" in low:
        return "retry", "name lookup failed"
    if "connection refused" in low or "tcp connect error" in low:
        return "retry", "connection refused"
    if any(w in low for w in ("body error", "connection", "reset", "broken pipe", "cut short")):
        return "retry", "connection reset or body cut short"
    if isinstance(e, (OSError, oe.GenericError)):
        return "retry", type(e).__name__
    return "fatal", type(e).__name__


# ---------------------------------------------------------------------- store


class ObjectStore:
    """One s3:// prefix: list, head, get (whole or a range), put, delete; all retried."""

    def __init__(
        self,
        url: str,
        *,
        policy: RetryPolicy | None = None,
        env: Mapping[str, str] | None = None,
        seed: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        obs = _obstore()
        self.url = S3Url.parse(url)
        self.policy = policy or RetryPolicy()
        self._settings = resolve_settings(env)
        self._rng = random.Random(seed)
        self._sleep = sleep
        self.retries = 0  # retries so far, all children included (tests, metrics)
        self._counter = self  # children count into their root
        cfg = dict(self._settings.config)
        endpoint = str(cfg.get("endpoint", ""))
        client: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=self.policy.connect_timeout),
            "read_timeout": timedelta(seconds=self.policy.read_timeout),
            "timeout": timedelta(seconds=self.policy.request_timeout),
        }
        if endpoint.startswith("http://"):
            client["allow_http"] = True
        try:
            self._store = obs.store.S3Store(
                self.url.bucket,
                config=cfg,
                client_options=client,
                retry_config={"max_retries": 0},
                credential_provider=self._settings.credential_provider,
            )
        except Exception as e:  # obstore raises several config errors
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise InvalidArgument(
                f"{self.url}: bad S3 configuration ({self._scrub(first)})"
            ) from None
        log.info(
            "object storage %s (endpoint %s, credentials from %s)",
            self.url,
            endpoint or "AWS default",
            self._settings.source,
        )

    def child(self, sub: str) -> ObjectStore:
        """The same connection and policy, rooted at `sub` (relative) below this prefix."""
        other = copy.copy(self)
        other.url = S3Url.parse(f"{SCHEME}{self.url.bucket}/{self.url.prefix}{sub}")
        return other

    def __repr__(self) -> str:
        return f"ObjectStore({str(self.url)!r})"

    def full(self, key: str) -> str:
        """The object's full URL, for messages."""
        return f"{SCHEME}{self.url.bucket}/{self.url.prefix}{key}"

    def _path(self, key: str) -> str:
        return self.url.prefix + key

    def _scrub(self, text: str) -> str:
        for s in self._settings.secrets:
            text = text.replace(s, "***")
        return re.sub(r"(X-Amz-(Signature|Credential|Security-Token))=[^&\s]+", r"\1=***", text)

    def _fail(self, op: str, key: str, e: BaseException, attempts: int) -> FeederError:
        kind, cause = _classify(e)
        cause = self._scrub(cause)
        url = self.full(key)
        if kind == "notfound":
            return NotFound(f"{url}: {op}: no such object ({cause})")
        if kind == "denied":
            return PermissionDenied(
                f"{url}: {op}: {cause}: check the bucket name and the AWS credentials "
                f"(from {self._settings.source})"
            )
        if kind == "fatal":
            return StorageUnavailable(f"{url}: {op} failed: {cause}")
        return StorageUnavailable(f"{url}: {op} failed after {attempts} attempt(s): {cause}")

    def _retrying(
        self, op: str, key: str, fn: Callable[[], T], progress: Callable[[], int] | None = None
    ) -> T:
        """Run fn until it succeeds, fails for good, or the attempts run out.

        `progress()` (bytes or keys so far) lets a resumable call keep its budget while
        it moves forward: only failures without progress count.
        """
        failures = attempts = 0
        last = progress() if progress else 0
        while True:
            attempts += 1
            try:
                return fn()
            except FeederError:
                raise
            except Exception as e:  # classified below
                kind, cause = _classify(e)
                if kind not in ("retry", "changed"):
                    raise self._fail(op, key, e, attempts) from None
                now = progress() if progress else 0
                failures = 0 if now > last else failures + 1
                last = now
                if failures >= self.policy.attempts:
                    raise self._fail(op, key, e, attempts) from None
                d = self.policy.delay(failures - 1, self._rng)
                self._counter.retries += 1
                log.warning(
                    "%s %s: %s; retry %d of %d in %.2fs",
                    op,
                    self.full(key),
                    self._scrub(cause),
                    failures,
                    self.policy.attempts - 1,
                    d,
                )
                self._sleep(d)

    # ------------------------------------------------------------ operations

    def check_access(self) -> None:
        """One LIST page under the prefix: PermissionDenied (bad credentials, no such
        bucket) or StorageUnavailable when the root cannot be listed."""
        obs = _obstore()

        def page() -> None:
            for _batch in obs.list(self._store, prefix=self.url.prefix or None, chunk_size=1):
                break

        self._retrying("LIST", "", page)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, sorted by key; resumes on error."""
        obs = _obstore()
        out: list[ObjectInfo] = []
        n = len(self.url.prefix)

        def pages() -> list[ObjectInfo]:
            after = self.url.prefix + out[-1].key if out else None
            stream = obs.list(
                self._store, prefix=self._path(prefix) or None, offset=after, chunk_size=1000
            )
            for batch in stream:
                for m in batch:
                    out.append(ObjectInfo(m["path"][n:], int(m["size"]), m.get("e_tag")))
            return out

        return sorted(
            self._retrying("LIST", prefix, pages, progress=lambda: len(out)), key=lambda o: o.key
        )

    def head(self, key: str) -> ObjectInfo:
        obs = _obstore()

        def call() -> ObjectInfo:
            m = obs.head(self._store, self._path(key))
            return ObjectInfo(key, int(m["size"]), m.get("e_tag"))

        return self._retrying("HEAD", key, call)

    def get(self, key: str, size: int | None = None) -> memoryview:
        """The whole object as a memoryview over its own anonymous mmap (freed on drop).

        `size`, when known (meta.json), is checked first: a mismatch is DataLoss. A
        broken body is resumed from where it stopped.
        """
        obs = _obstore()
        oe = obs.exceptions
        state: dict[str, Any] = {"got": 0, "etag": None, "buf": None, "size": size}

        def attempt() -> memoryview:
            got = state["got"]
            opts: dict[str, Any] = {}
            if state["buf"] is not None and got:
                opts = {"range": (got, state["size"]), "if_match": state["etag"]}
            try:
                res = obs.get(self._store, self._path(key), options=opts or None)
            except oe.PreconditionError:  # re-uploaded meanwhile: start over
                state.update(got=0, etag=None, buf=None)
                raise
            if state["buf"] is None:
                total = int(res.meta["size"])
                if size is not None and total != size:
                    raise DataLoss(f"{self.full(key)}: object has {total} bytes, expected {size}")
                state["size"] = total
                state["etag"] = res.meta.get("e_tag")
                state["buf"] = anonymous(total)
            buf = state["buf"]
            for piece in res.stream(min_chunk_size=STREAM_PIECE):
                mv = memoryview(piece)
                n = len(mv)
                if got + n > state["size"]:
                    raise DataLoss(f"{self.full(key)}: object grew while being read")
                buf[got : got + n] = mv
                got += n
                state["got"] = got
            if got != state["size"]:
                raise ConnectionResetError(f"body cut short at {got} of {state['size']} bytes")
            return memoryview(buf)[: state["size"]]

        return self._retrying("GET", key, attempt, progress=lambda: int(state["got"]))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (retried whole; meant for small reads)."""
        obs = _obstore()
        if not 0 <= start <= end:
            raise InvalidArgument(f"bad range [{start}, {end})")
        if start == end:
            return b""

        def call() -> bytes:
            data = obs.get_range(self._store, self._path(key), start=start, end=end)
            if len(data) != end - start:
                raise ConnectionResetError(f"range cut short: {len(data)} of {end - start}")
            return bytes(data)

        return self._retrying("GET", key, call)

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Write one object whole (a PUT replaces atomically, so a retry is safe)."""
        obs = _obstore()
        self._retrying("PUT", key, lambda: obs.put(self._store, self._path(key), data))

    def delete(self, keys: builtins.list[str]) -> None:
        obs = _obstore()
        for i in range(0, len(keys), 1000):
            batch = [self._path(k) for k in keys[i : i + 1000]]
            self._retrying(
                "DELETE",
                keys[i],
                lambda b=batch: obs.delete(self._store, b),  # type: ignore[misc]
            )

    def delete_prefix(self, prefix: str = "") -> int:
        """Delete every object under `prefix` (relative to the store); returns the count."""
        keys = [o.key for o in self.list(prefix)]
        self.delete(keys)
        return len(keys)


def etag_generation(etag: str | None, size: int) -> int:
    """A stable 63-bit number for an object version (cache keys of a store's chunks)."""
    digest = hashlib.blake2b(f"{etag}:{size}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
