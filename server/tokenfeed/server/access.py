"""Who a call is, and what its job may read: tokens -> jobs, requests -> grants.

`Access` holds the feeder's current jobs (tenants.Tenants; None when the feeder
checks no token, and every call is the job "anonymous", reading everything). A reload
(credentials.py) swaps them whole. For each call the servicer asks:

* `job(metadata)`: the job of the call's bearer token, or Unauthenticated;
* `check(job, spec)`: that the job may read the request's dataset, or every source of
  its mixture. A grant is judged on what a name really is under the data root
  (Catalog.real_names: symlinks followed), so a link inside the root to an ungranted
  store is that store, and is refused. A name that does not exist is NOT_FOUND only
  when the grant covers it (the message lists what the job may read); otherwise
  PERMISSION_DENIED, so a job cannot probe the root outside its grant;
* `listing(job)`: the datasets an Info without a dataset shows it;
* after a reload, `recheck(entry)`: the job the stream's token now belongs to, or the
  error that ends the stream (its token withdrawn, or its stores out of the new grant).

Messages name the dataset and the job, never the token.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenfeed.core.errors import (
    FeederError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from tokenfeed.core.request import SamplingSpec
from tokenfeed.server.datasets import Catalog, Dataset
from tokenfeed.server.streams import StreamEntry
from tokenfeed.server.tenants import Job, Tenants, open_job

UNAUTHENTICATED = (
    "missing or unknown bearer token: send metadata 'authorization: Bearer <token>' with a "
    "token the feeder knows (its --auth-token-file, or a job of its --tokens-file)"
)
_EVERYTHING = (("**",),)


def bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` header, if any."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class Access:
    """The current jobs, and the checks every call goes through."""

    def __init__(self, catalog: Catalog, tenants: Tenants | None) -> None:
        self.catalog = catalog
        self.tenants = tenants
        self._open = open_job()

    def job(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Job:
        tenants = self.tenants
        if tenants is None:
            return self._open
        job = tenants.job_for(bearer(metadata))
        if job is None:
            raise Unauthenticated(UNAUTHENTICATED)
        return job

    def check(self, job: Job, spec: SamplingSpec) -> tuple[str, ...]:
        """The real names of what `spec` reads, once `job` may read all of it."""
        if spec.is_mixture:
            real: list[str] = []
            for name in spec.source_names:
                real += self.real_names(job, name, field=f"sources[{name!r}]")
            return tuple(real)
        return self.real_names(job, spec.dataset)

    @staticmethod
    def grants_everything(job: Job) -> bool:
        """Whether `job` may read every dataset (no real path can change that)."""
        return job.patterns == _EVERYTHING

    def real_names(self, job: Job, name: str, field: str | None = None) -> tuple[str, ...]:
        """What `name` really is, once `job` may read it: PermissionDenied naming the
        dataset and the job, NotFound (within the grant) or InvalidArgument otherwise."""
        at = f"{field}: " if field else ""
        try:
            real = self.catalog.real_names(name)
            if self.catalog.remote and job.patterns != _EVERYTHING and job.allows(name):
                # whether it exists (object storage has no links to resolve), so that a
                # missing one's message lists only the job's datasets
                self.catalog.get(name)
        except InvalidArgument as e:
            raise InvalidArgument(at + e.message, field=field) from None
        except NotFound as e:
            if job.patterns == _EVERYTHING:  # the catalog's message lists everything
                raise NotFound(at + e.message, field=field) from None
            if not job.allows(name):
                raise self._denied(job, name, at, field) from None
            shown = ", ".join(self.listing(job)[:10]) or "none"
            raise NotFound(
                f"{at}no dataset {name!r} under the data root; job {job.name!r} may read: {shown}",
                field=field,
            ) from None
        if job.patterns != _EVERYTHING and not all(job.allows(r) for r in real):
            raise self._denied(job, name, at, field, link=real != (name,))
        return real

    @staticmethod
    def _denied(job: Job, name: str, at: str, field: str | None, link: bool = False) -> FeederError:
        what = "a link to a store outside" if link else "outside"
        return PermissionDenied(
            f"{at}job {job.name!r} may not read dataset {name!r}: it is {what} the job's "
            "grant in the feeder's tokens file",
            field=field,
        )

    def listing(self, job: Job) -> list[str]:
        """The dataset names `job` may read (judged by what each really is)."""
        if job.patterns == _EVERYTHING:
            return self.catalog.names()
        out = []
        for name in self.catalog.names():
            try:
                real = self.catalog.real_names(name)
            except FeederError:
                continue
            if all(job.allows(r) for r in real):
                out.append(name)
        return out

    def datasets(self, job: Job) -> list[Dataset]:
        """Every store `job` may read that opens (Info without a dataset)."""
        if job.patterns == _EVERYTHING:
            return self.catalog.all()
        return self.catalog.all(self.listing(job))

    def recheck(self, entry: StreamEntry) -> Job | FeederError:
        """After a reload: the job the stream's token now belongs to, or why it ends."""
        old = entry.job
        tenants = self.tenants
        if old is None or tenants is None:
            return self._open
        job = tenants.by_digest.get(old.token_sha256)
        if job is None:
            return Unauthenticated(
                f"the token of job {old.name!r} was withdrawn from the feeder's tokens "
                "(reloaded); the stream ends"
            )
        for real in entry.real:
            if not job.allows(real):
                return PermissionDenied(
                    f"job {job.name!r} may no longer read dataset {real!r} (the feeder's "
                    "tokens file was reloaded); the stream ends"
                )
        return job
