"""Mixtures: several sources blended by weight into one endless stream of windows.

docs/mixtures.md is the contract; each module owns one part of it:

    spec           sources and schedule -> exact, validated weight segments
    runtime        segments added while a run streams: their bytes, the merge rule, the
                   position of a step
    apportionment  which source each position takes: c(p) in closed form, never O(p)
    budget         what a run of N tokens draws from each source
    mixture        `Mixture`: spec, apportionment and budget in one object
    steps          a Mixture's steps: each rank's rows (source-major, keyed permutation)
    passes         a source's endless sequence of passes; PassOrders maps items to windows
    sampler        `MixtureSampler`: a mixture request over its sources' stores
    files          reading mixture files (YAML/JSON): the package's only I/O

Everything but files.py is pure; `files` is imported by its path where a mixture is
read (the client, the CLI, SamplingSpec.from_args). `sampler` builds on request.py,
which builds on this package, so it is imported by its path too
(``from tokenfeed.core.mixture.sampler import MixtureSampler``).
"""

from tokenfeed.core.errors import FailedPrecondition, InvalidArgument
from tokenfeed.core.mixture.budget import Budget, SourceBudget
from tokenfeed.core.mixture.mixture import Mixture
from tokenfeed.core.mixture.passes import PassOrders, source_seed, split_passes
from tokenfeed.core.mixture.runtime import RuntimeSegments, merge, step_position
from tokenfeed.core.mixture.spec import normalize, parse_weight
from tokenfeed.core.mixture.steps import MixtureRound, step_key, step_keys

__all__ = [
    "Budget",
    "FailedPrecondition",
    "InvalidArgument",
    "Mixture",
    "MixtureRound",
    "PassOrders",
    "RuntimeSegments",
    "SourceBudget",
    "merge",
    "normalize",
    "parse_weight",
    "source_seed",
    "split_passes",
    "step_key",
    "step_keys",
    "step_position",
]
