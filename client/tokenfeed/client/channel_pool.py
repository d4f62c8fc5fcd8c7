"""One gRPC channel per process and destination, shared by every client in the process.

gRPC's synchronous API polls each channel that has calls in flight from a thread of
its own, which wakes on a timer: a process with a channel per client pays one such
thread per client even while every client waits with a full buffer. gRPC's advice is
one channel per destination, shared; this module is that sharing.

A channel is keyed by the process id (a forked child never touches its parent's
channels), the target, the channel options and the TLS credentials: clients that would
have opened identical channels share one. Each holder `acquire`s it and `release`s it
once; the last release closes it.

After a failure a holder releases with `retire=True`: the channel leaves the pool, so
whoever acquires that destination next (that holder too, once its backoff is over)
dials a fresh channel rather than one in gRPC's internal reconnect backoff. Holders
whose streams on it are fine keep using it; the last of them closes it. Every channel
has a subchannel pool of its own (`grpc.use_local_subchannel_pool`), so a fresh channel
is a fresh connection, not one shared underneath with the retired channel.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import grpc

from tokenfeed.client import responses
from tokenfeed.client.connection import Security
from tokenfeed.v1 import feeder_pb2, feeder_pb2_grpc

Options = tuple[tuple[str, int | str], ...]
Key = tuple[int, str, Options, Security]


_STREAM_BATCHES = feeder_pb2.DESCRIPTOR.services_by_name["Feeder"].methods_by_name["StreamBatches"]


@dataclass(eq=False)
class SharedChannel:
    """A pooled channel, its stub, and how many hold it. `stream_batches` is the stub's
    StreamBatches with the client's own response decoding (`responses.decode`)."""

    key: Key
    channel: grpc.Channel
    stub: feeder_pb2_grpc.FeederStub = field(init=False)
    stream_batches: grpc.UnaryStreamMultiCallable = field(init=False)
    holders: int = 0

    def __post_init__(self) -> None:
        self.stub = feeder_pb2_grpc.FeederStub(self.channel)
        self.stream_batches = self.channel.unary_stream(
            f"/{_STREAM_BATCHES.containing_service.full_name}/{_STREAM_BATCHES.name}",
            request_serializer=feeder_pb2.StreamBatchesRequest.SerializeToString,
            response_deserializer=responses.decode,
            _registered_method=True,
        )

    @property
    def target(self) -> str:
        return self.key[1]


class ChannelPool:
    """The channels of this process, by (pid, target, options, credentials)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pooled: dict[Key, SharedChannel] = {}

    def acquire(self, target: str, options: Options, security: Security) -> SharedChannel:
        """The pooled channel to `target` (opened if there is none): one more holder."""
        key = (os.getpid(), target, options, security)
        with self._lock:
            shared = self._pooled.get(key)
            if shared is None:
                shared = SharedChannel(key, _dial(target, options, security))
                self._pooled[key] = shared
            shared.holders += 1
            return shared

    def release(self, shared: SharedChannel, retire: bool = False) -> None:
        """One holder fewer; `retire` takes the channel out of the pool (a failure was
        seen on it). The last holder closes it."""
        if shared.key[0] != os.getpid():
            return  # the parent's, inherited over fork: the parent closes it
        with self._lock:
            shared.holders -= 1
            last = shared.holders == 0
            if (last or retire) and self._pooled.get(shared.key) is shared:
                del self._pooled[shared.key]
        if last:
            shared.channel.close()

    def pooled(self, target: str | None = None) -> list[SharedChannel]:
        """This process's pooled channels (to `target`): what new clients would share."""
        pid = os.getpid()
        with self._lock:
            return [
                s
                for s in self._pooled.values()
                if s.key[0] == pid and (target is None or s.target == target)
            ]

    def _after_fork_in_child(self) -> None:
        # The parent's channels stay the parent's; a lock held at fork time by another
        # thread would never be released here.
        self._lock = threading.Lock()
        self._pooled = {}


def _dial(target: str, options: Options, security: Security) -> grpc.Channel:
    opts = [*options, ("grpc.use_local_subchannel_pool", 1)]
    if not security.tls:
        return grpc.insecure_channel(target, options=opts)
    creds = grpc.ssl_channel_credentials(
        security.root_certificates, security.private_key, security.certificate_chain
    )
    return grpc.secure_channel(target, creds, options=opts)


POOL = ChannelPool()
os.register_at_fork(after_in_child=POOL._after_fork_in_child)
