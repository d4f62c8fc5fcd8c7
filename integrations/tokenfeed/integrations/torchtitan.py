"""torchtitan streaming from a feeder: `FeederDataLoader` and its `Config`.

In a torchtitan job, the trainer config's dataloader selects it:

    dataloader=FeederDataLoader.Config(address="feeder:50051", dataset="fineweb",
                                       shuffle=True, seed=1)

torchtitan builds it with `build(dp_rank=, dp_world_size=, seq_len=,
local_batch_size=, ...)`: its seq_len and local batch size win. The loader yields
torchtitan's `({"input": input_ids}, labels)` pairs (with `documents=True` also
`"positions"`, the per-document position ids torchtitan's attention masks read),
endless across epochs: torchtitan never calls set_epoch, so an epoch's end starts the
next. Tensors stay on the CPU, where torchtitan expects them.

Checkpoints (docs/integrations.md, "torchtitan"): `state_dict()` is
`{"dp_rank_<r>": <this rank's position as JSON>}`, so torchtitan's
CheckpointManager (DCP) saves one entry per data-parallel rank, all the same global
position. A loader that has not streamed yet, which is what a resume loads into,
asks for dp rank 0's entry instead of its own: that one exists whatever the number
of dp ranks that saved it, so a resume with more or fewer dp ranks continues from
the saved position.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from tokenfeed.client import FeederClient
from tokenfeed.integrations.ranks import require

_dataloader = require("torchtitan.components.dataloader", "torchtitan")
BaseDataLoader: Any = _dataloader.BaseDataLoader

RANK_KEY = "dp_rank_{rank}"


class FeederDataLoader(BaseDataLoader):  # type: ignore[misc]
    """A torchtitan BaseDataLoader over this dp rank's stream; see the module docstring.

    `client_kwargs` are FeederClient's (dataset or mixture, seq_len, batch_size, ...);
    the dp rank and world size are its rank and world size, and `device` defaults to
    "cpu". `batch` is the feeder's batch behind the last pair (its `starts`, `step`,
    `epoch`, ...).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):  # type: ignore[misc]
        """A torchtitan config of the loader: where the feeder is and what to stream;
        torchtitan's build call gives the dp rank, seq_len and local batch size."""

        address: str = "localhost:50051"
        """The feeder's address (several: comma-separated)."""
        mixture: dict[str, str] = field(default_factory=dict)
        """Dataset name -> weight, instead of `dataset` (megatron.parse_blend makes one)."""
        split_rate: float = 1.0
        stride: int | None = None
        shift: int = 1
        seed: int = 0
        shuffle: bool = False
        shuffle_blocks: int = 0
        documents: bool = False
        """Also yield "positions" (position ids that restart at each document)."""
        mask_cross_document_labels: bool = False
        token: str | None = None
        tls: bool = False
        connect_timeout: float | None = None

        def build(self, **kwargs: Any) -> FeederDataLoader:
            """torchtitan's build call: dp_rank, dp_world_size, seq_len and
            local_batch_size are used; the rest (tokenizer, snapshot_every_n_steps)
            has no meaning for a feeder."""
            if self.dataset_path:
                raise ValueError("dataset_path: a feeder serves its stores by name (dataset=)")
            options = {
                f.name: getattr(self, f.name)
                for f in fields(self)
                if f.name not in ("dataset", "dataset_path", "address", "mixture", "_owner")
            }
            source = {"mixture": dict(self.mixture)} if self.mixture else {"dataset": self.dataset}
            return FeederDataLoader(
                self.address,
                dp_rank=kwargs["dp_rank"],
                dp_world_size=kwargs["dp_world_size"],
                seq_len=kwargs["seq_len"],
                batch_size=kwargs["local_batch_size"],
                **source,
                **options,
            )

    def __init__(
        self, address: Any, *, dp_rank: int, dp_world_size: int, **client_kwargs: Any
    ) -> None:
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.loader = FeederClient(
            address,
            rank=dp_rank,
            world_size=dp_world_size,
            **{"device": "cpu", **client_kwargs},
        )
        self.batch: dict[str, Any] | None = None
        self._loaded = False

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
        loader = self.loader
        while True:
            for batch in loader:
                self.batch = batch
                inputs = {"input": batch["input_ids"]}
                if "position_ids" in batch:
                    inputs["positions"] = batch["position_ids"]
                yield inputs, batch["labels"]
            loader.set_epoch(int(loader.state_dict()["epoch"]) + 1)

    def state_dict(self) -> dict[str, Any]:
        fresh = self.batch is None and not self._loaded
        key = RANK_KEY.format(rank=0 if fresh else self.dp_rank)
        return {key: json.dumps(self.loader.state_dict(), sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        entries = [v for k, v in state_dict.items() if k.startswith("dp_rank_")]
        if len(entries) != 1:
            raise ValueError(f"a FeederDataLoader state has one dp_rank_* entry, got {state_dict}")
        self.loader.load_state_dict(json.loads(entries[0]))
        self._loaded = True
        self.batch = None

    def close(self) -> None:
        self.loader.close()
