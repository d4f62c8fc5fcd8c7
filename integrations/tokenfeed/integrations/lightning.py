"""Lightning streaming from a feeder: `FeederDataModule`.

    dm = FeederDataModule(
        "feeder:50051",
        train={"dataset": "fineweb", "seq_len": 1024, "batch_size": 8, "shuffle": True},
        val={"dataset": "fineweb", "split": "validation", "seq_len": 1024, "batch_size": 8},
        split_rate=0.99,                                    # shared by train and val
    )
    trainer.fit(model, datamodule=dm, ckpt_path="last")   # any number of devices

`setup()` builds each rank's FeederClient from the trainer's global rank and world
size (on the strategy's device unless the arguments name one). The train loader's
position is the first batch Lightning has not trained on: Lightning may read a batch
ahead of the loop, so a batch counts when it is handed to the model
(`on_before_batch_transfer`), not when it is read. `state_dict()` carries it into
every checkpoint (the train iterable is resumable too, so Lightning restores it in
the middle of an epoch without a warning), with the same or another number of
devices (docs/integrations.md, "Lightning").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

from tokenfeed.client import FeederClient
from tokenfeed.integrations.ranks import EpochMap, common_steps, rank_loader, require

_lightning = require("lightning", "lightning")
LightningDataModule: Any = _lightning.LightningDataModule


class FeederBatches:
    """One loader as a Lightning dataloader: its batches, its `len()`, the current
    epoch set at every iteration, and the position of what was trained."""

    def __init__(self, loader: FeederClient, epoch: Any = None, steps: int | None = None) -> None:
        self.loader = loader
        self._epoch = epoch  # () -> Lightning's current epoch; None: always epoch 0
        self._epochs = EpochMap(loader)
        self._steps = steps  # None: the loader's len(); else stop after this many
        # (epoch, offset, step) of the batches read and not yet trained, oldest first:
        # the oldest is where a resume starts (a batch's own position is the first
        # batch not trained on while it waits); with none, the loader's position is.
        self._untrained: deque[tuple[int, int, int]] = deque()

    def __len__(self) -> int:
        return len(self.loader) if self._steps is None else self._steps

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # A generator: Lightning calls iter() to check the type long before it reads,
        # and a stream opens only at the first next().
        loader = self.loader
        if not loader.is_mixture:
            loader.set_epoch(0 if self._epoch is None else self._epochs(int(self._epoch())))
        self._untrained.clear()  # a new epoch starts afresh: nothing of the last one waits
        limit = len(self) if self._steps is not None else None
        for n, batch in enumerate(loader):
            if limit is not None and n >= limit:
                return
            if self._epoch is not None:
                self._untrained.append(_position(batch))
            yield batch

    def trained(self, batch: Mapping[str, Any]) -> None:
        """`batch` goes to the model: it and the batches read before it are trained."""
        position = _position(batch)
        if position in self._untrained:
            while self._untrained.popleft() != position:
                pass

    def state_dict(self) -> dict[str, Any]:
        """The first batch not trained on."""
        state = self.loader.state_dict()
        if self._untrained:
            state["epoch"], state["offset"], state["step"] = self._untrained[0]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loader.load_state_dict(dict(state))
        self._epochs.reset()
        self._untrained.clear()


def _position(batch: Mapping[str, Any]) -> tuple[int, int, int]:
    return int(batch["epoch"]), int(batch["offset"]), int(batch["step"])


class FeederDataModule(LightningDataModule):  # type: ignore[misc]
    """A LightningDataModule over a feeder; see the module docstring.

    `train`/`val`: FeederClient keyword arguments of each loader (dataset or mixture,
    seq_len, batch_size, ...); `client_kwargs`: those both share (tls, token,
    timeouts, ...). Batches are the client's dicts.
    """

    def __init__(
        self,
        address: Any,
        *,
        train: Mapping[str, Any],
        val: Mapping[str, Any] | None = None,
        **client_kwargs: Any,
    ) -> None:
        super().__init__()
        self.address, self.client_kwargs = address, client_kwargs
        self.train_args, self.val_args = dict(train), None if val is None else dict(val)
        self.train_loader: FeederClient | None = None
        self.val_loader: FeederClient | None = None
        self._train: FeederBatches | None = None
        self._pending: dict[str, Any] | None = None  # a state loaded before setup()
        if val is None:  # no validation: Lightning sees the base class's hook, not ours
            self.val_dataloader = LightningDataModule.val_dataloader.__get__(self)  # type: ignore[method-assign]

    def _client(self, args: Mapping[str, Any], what: str) -> FeederClient:
        trainer = self.trainer
        return rank_loader(
            {"address": self.address, **self.client_kwargs, **args},
            trainer.global_rank,
            trainer.world_size,
            what,
            device=str(trainer.strategy.root_device),
        )

    def setup(self, stage: str) -> None:
        if self.train_loader is None:
            self.train_loader = self._client(self.train_args, "train")
            self._train = FeederBatches(self.train_loader, lambda: self.trainer.current_epoch)
        if self.val_args is not None and self.val_loader is None:
            self.val_loader = self._client(self.val_args, "val")
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def train_dataloader(self) -> FeederBatches:
        assert self._train is not None, "setup() builds the loaders"
        return self._train

    def val_dataloader(self) -> Any:
        assert self.val_loader is not None, "setup() builds the loaders"
        # Every rank runs as many steps: a metric logged with sync_dist reduces each one.
        return FeederBatches(self.val_loader, steps=common_steps(self.val_loader))

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self._train is not None and self.trainer.training:
            self._train.trained(batch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        if self._train is None:
            return {} if self._pending is None else dict(self._pending)
        return {"train": self._train.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._train is None:
            self._pending = dict(state_dict)
        elif "train" in state_dict:
            self._train.load_state_dict(state_dict["train"])
            self._pending = None

    def teardown(self, stage: str) -> None:
        """Close the loaders; their position stays (a later fit continues from it)."""
        if self._train is not None:
            self._pending = self.state_dict()
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.close()
        self.train_loader = self.val_loader = self._train = None
