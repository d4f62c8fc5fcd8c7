"""`OpenedMixtures`: what opening a mixture's stream needs that no rank or position changes.

Every rank of a job opens its stream with the same mixture, and a rank opens it again
at every reconnect, resume and run-time weight change. For 1,000 sources, locating
each source (its real path for the grant, its kind, its generation), assembling the
sources as one token space (mixtures.MixtureSpace) and building the sampler took
~0.1 s of CPU per open. The feeder keeps those of the last few mixtures it opened.

Never a store after its replacement: a kept mixture is used only while every source's
`meta.json`, looked up by its name under the data root, is still the same file
(device, inode, modification time, size): one stat per source. A store is rewritten
by writing its `meta.json` last, a name re-pointed by a link reaches another file,
and a source removed fails its stat. A mixture with a source that is not a native
store on a local root is not kept. The grant of a job that may not read everything
is judged on each source's real path, resolved at every open (Access.check) as
before; only a job that may read everything skips it. A kept sampler is shared by the
streams of its mixture (its pass orders' caches are locked: passes.PassOrders).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenfeed.core.errors import InvalidArgument, NotFound
from tokenfeed.core.mixture.sampler import MixtureSampler
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.store import META_NAME
from tokenfeed.server.access import Access
from tokenfeed.server.datasets import Catalog, Dataset
from tokenfeed.server.mixtures import MixtureSpace
from tokenfeed.server.tenants import Job

Signature = tuple[int, int, int, int]  # a meta.json's (device, inode, mtime_ns, size)


def _signature(path: str) -> Signature | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


@dataclass
class Opened:
    """A mixture's sources located and opened, as its stream's open leaves them."""

    real: tuple[str, ...]  # the sources' real names (what a reload's recheck judges)
    space: MixtureSpace
    sampler: MixtureSampler


@dataclass
class _Kept:
    metas: list[str]  # each source's meta.json by its name under the root
    signatures: list[Signature | None]
    real: tuple[str, ...]
    space: MixtureSpace
    # the samplers of specs over these sources, a spec known by identity: every rank's
    # request of a large mixture parses to the same one (SamplingSpec.from_proto)
    samplers: list[tuple[SamplingSpec, MixtureSampler]] = field(default_factory=list)


def located(catalog: Catalog, names: tuple[str, ...]) -> list[Dataset]:
    """A mixture's source datasets, in order (NotFound or InvalidArgument naming the
    source at fault)."""
    found = []
    for name in names:
        try:
            found.append(catalog.get(name))
        except NotFound as e:
            field = f"sources[{name!r}]"
            raise NotFound(f"{field}: {e.message}", field=field) from None
        except InvalidArgument as e:
            field = f"sources[{name!r}]"
            raise InvalidArgument(f"{field}: {e.message}", field=field) from None
    return found


class OpenedMixtures:
    """The last KEEP mixtures a feeder opened, by their sources' names."""

    KEEP = 8  # source lists kept
    SAMPLERS = 4  # specs per source list (a job's ranks share one; seeds, weight changes)

    def __init__(
        self,
        catalog: Catalog,
        access: Access,
        sampler_for: Callable[[SamplingSpec, list[Dataset]], MixtureSampler],
    ) -> None:
        self.catalog = catalog
        self.access = access
        self.sampler_for = sampler_for
        self._kept: OrderedDict[tuple[str, ...], _Kept] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, spec: SamplingSpec, job: Job) -> Opened:
        """`spec`'s sources, once `job` may read them all, located and opened as one
        token space, and its sampler. NotFound, InvalidArgument, PermissionDenied or
        FailedPrecondition naming the source at fault, as Access and Catalog say."""
        names = spec.source_names
        with self._lock:
            kept = self._kept.get(names)
            if kept is not None:
                self._kept.move_to_end(names)
        if kept is None or [_signature(m) for m in kept.metas] != kept.signatures:
            kept = self._locate(spec, job)
            real = kept.real
        elif self.access.grants_everything(job):
            real = kept.real
        else:
            real = self.access.check(job, spec)  # the grant, on the real paths of now
        with self._lock:
            sampler = next((s for sp, s in kept.samplers if sp is spec), None)
        if sampler is None:
            sampler = self.sampler_for(spec, list(kept.space.sources))
            with self._lock:
                kept.samplers.append((spec, sampler))
                del kept.samplers[: -self.SAMPLERS]
        return Opened(real, kept.space, sampler)

    def _locate(self, spec: SamplingSpec, job: Job) -> _Kept:
        """The full way: the grant, each source located and opened, kept if it can be."""
        names = spec.source_names
        metas = [os.path.join(self.catalog.root_text, name, META_NAME) for name in names]
        with self.catalog.names_once():  # each name located once, for the grant and to open
            real = self.access.check(job, spec)  # (every name checked plain first)
            # signed before the sources are opened: a store rewritten meanwhile is kept
            # with its old signature, so the next open finds it changed
            signatures = [_signature(m) for m in metas]
            sources = located(self.catalog, names)
        space = MixtureSpace.of(sources)  # the dtype check
        kept = _Kept(metas, signatures, real, space)
        keep = not self.catalog.remote and all(
            ds.store.format == "tokenfeed" and sig is not None and sig[2] == ds.generation
            for ds, sig in zip(sources, signatures, strict=True)
        )
        if keep:
            with self._lock:
                self._kept[names] = kept
                self._kept.move_to_end(names)
                while len(self._kept) > self.KEEP:
                    self._kept.popitem(last=False)
        return kept
