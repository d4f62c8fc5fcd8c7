"""The Hugging Face Trainer streaming from a feeder: `FeederTrainer`.

    trainer = FeederTrainer(
        model,
        TrainingArguments(output_dir="out", max_steps=1000, save_steps=100),
        train_loader={"address": "feeder:50051", "dataset": "fineweb", "seq_len": 1024,
                      "batch_size": 8, "shuffle": True, "seed": 1},
    )
    trainer.train(resume_from_checkpoint=True)   # any number of processes

What it changes in the Trainer (docs/integrations.md, "Hugging Face Trainer"):

- Each process streams its own rank's batches (`args.process_index` of
  `args.world_size`) straight to the model: accelerate neither dispatches them from
  rank 0 nor slices them, and the loader's `batch_size` is the per-device batch.
- `len()` is the loader's, so `num_train_epochs`, `max_steps` and
  `gradient_accumulation_steps` mean what they always mean; an epoch resumed in the
  middle has the loader's `steps_left` batches.
- Every checkpoint folder holds each rank's `state_dict()` (`tokenfeed-rank<r>.json`);
  a resume loads it and never skips batches by iterating (`ignore_data_skip`), with
  the same or another number of processes.
- The model gets `input_ids`, `labels` and `shift_labels`: the feeder's labels are
  already each position's target, so they go in as `shift_labels` (contiguous), which
  the causal-LM loss takes as is instead of shifting `labels` once more.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tokenfeed.client import FeederClient
from tokenfeed.core.atomic import write_atomic
from tokenfeed.integrations.ranks import EpochMap, agreed, common_steps, rank_loader, require

_transformers = require("transformers", "transformers")
_trainer_utils = require("transformers.trainer_utils", "transformers")
require("accelerate", "transformers")  # the Trainer's own requirement, said our way

Trainer: Any = _transformers.Trainer
TrainingArguments: Any = _transformers.TrainingArguments

log = logging.getLogger(__name__)

# What of a feeder batch reaches the model; the rest (`starts`, `step`, ...) rides in
# the inputs for `training_step` overrides and is dropped in `_prepare_inputs`.
MODEL_KEYS = ("input_ids", "labels", "shift_labels", "position_ids")
STATE_FILE = "tokenfeed-rank{rank}.json"


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A feeder batch as the Trainer's inputs: the targets as `shift_labels` (and as
    `labels`, which makes the model compute its loss and the Trainer count tokens),
    contiguous, as the loss views them flat."""
    targets = batch["labels"].contiguous()
    return {**batch, "labels": targets, "shift_labels": targets}


class FeederBatches:
    """A FeederClient as the Trainer's dataloader: its batches as model inputs, its
    `len()`, and `set_epoch` mapped onto the loader's epochs."""

    def __init__(self, loader: FeederClient, steps: int | None = None) -> None:
        self.loader = loader
        self._steps = steps  # None: the loader's len(); else stop after this many
        self._epochs = EpochMap(loader)  # the Trainer counts epochs in its own steps
        self._epoch: int | None = None

    def __len__(self) -> int:
        return len(self.loader) if self._steps is None else self._steps

    def set_epoch(self, epoch: int) -> None:
        own = self._epochs(epoch)
        if self._epoch != own:  # the Trainer may say it twice before iterating
            self._epoch = own
            self.loader.set_epoch(own)

    @property
    def steps_left(self) -> int:
        """Batches this epoch still has (after a resume: fewer than len())."""
        return self.loader.steps_left

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._epoch = None  # the next set_epoch applies again
        batches = iter(self.loader)
        if self._steps is None:
            return map(model_inputs, batches)
        return (model_inputs(b) for _, b in zip(range(self._steps), batches, strict=False))


class FeederTrainer(Trainer):  # type: ignore[misc]
    """A `transformers.Trainer` fed by tokenfeed; see the module docstring.

    `train_loader`/`eval_loader`: a FeederClient built for this process, or a dict of
    FeederClient keyword arguments (with `address`), built here with this process's
    rank and world size and, unless the dict says otherwise, `device=args.device`.
    Every other argument is the Trainer's.
    """

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *,
        train_loader: FeederClient | Mapping[str, Any],
        eval_loader: FeederClient | Mapping[str, Any] | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        for name in ("train_dataset", "eval_dataset"):
            if trainer_kwargs.get(name) is not None:
                raise TypeError(f"FeederTrainer streams from the feeder: pass no {name}")
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        if args.label_smoothing_factor:
            raise ValueError(
                "label_smoothing_factor: the Trainer's label smoother shifts labels itself, "
                "and the feeder's labels are already the targets; smooth in the model's loss"
            )
        rank, world = args.process_index, args.world_size
        self.train_loader = rank_loader(
            train_loader, rank, world, "train_loader", device=str(args.device)
        )
        self.eval_loader = (
            None
            if eval_loader is None
            else rank_loader(eval_loader, rank, world, "eval_loader", device=str(args.device))
        )
        for loader in (self.train_loader, self.eval_loader):
            if loader is not None and loader.device is None:
                raise ValueError(
                    "FeederTrainer needs tensors: build the loader with a device "
                    "(a dict of arguments gets args.device)"
                )
        _batch_size(args, "per_device_train_batch_size", self.train_loader.batch_size)
        if self.eval_loader is not None:
            _batch_size(args, "per_device_eval_batch_size", self.eval_loader.batch_size)
        # The loader's state puts it at the first untrained batch: skipping by iterating
        # would skip that many more.
        args.ignore_data_skip = True
        super().__init__(model=model, args=args, **trainer_kwargs)
        self._train_batches = FeederBatches(self.train_loader)

    # ---------------------------------------------------------------- batches
    def get_train_dataloader(self) -> FeederBatches:
        return self._train_batches

    def get_eval_dataloader(self, eval_dataset: Any = None) -> FeederBatches:
        if eval_dataset is not None:
            raise TypeError("FeederTrainer evaluates on its eval_loader: pass no eval_dataset")
        if self.eval_loader is None:
            raise ValueError("FeederTrainer: evaluation needs an eval_loader")
        self.eval_loader.set_epoch(0)  # the whole validation split, every evaluation
        # Every process runs as many steps: the Trainer gathers each step's loss.
        return FeederBatches(self.eval_loader, common_steps(self.eval_loader))

    def _prepare_inputs(self, inputs: Mapping[str, Any]) -> Any:
        return super()._prepare_inputs({k: v for k, v in inputs.items() if k in MODEL_KEYS})

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """An epoch resumed in the middle has `steps_left` batches, not len(): telling
        the Trainer so makes its last gradient accumulation end on the epoch's last
        batch, as in a run that was never stopped."""
        batches = kwargs.get("train_dataloader")
        if (
            isinstance(batches, FeederBatches)
            and not batches.loader.is_mixture
            and {"epoch", "steps_in_epoch", "num_update_steps_per_epoch"} <= kwargs.keys()
        ):
            batches.set_epoch(kwargs["epoch"])
            steps = batches.steps_left
            accumulate = self.args.gradient_accumulation_steps
            kwargs["steps_in_epoch"] = max(steps, 1)
            kwargs["num_update_steps_per_epoch"] = max(math.ceil(steps / accumulate), 1)
        return super()._run_epoch(*args, **kwargs)

    # ------------------------------------------------------------- checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """The Trainer's train(); a resume also loads the loader's position from the
        checkpoint folder (any number of processes)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _trainer_utils.get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in {self.args.output_dir}")
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            self.train_loader.load_state_dict(load_loader_state(resume_from_checkpoint))
            self._train_batches = FeederBatches(self.train_loader)
            log.info("tokenfeed: resuming at %s", self.train_loader.state_dict())
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # The loader's state goes in first: a folder with the Trainer's state but without
        # this rank's position would resume nowhere.
        folder = Path(self._get_output_dir(trial=trial)) / (
            f"{_trainer_utils.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        folder.mkdir(parents=True, exist_ok=True)
        state = json.dumps(self.train_loader.state_dict(), sort_keys=True)
        write_atomic(folder / STATE_FILE.format(rank=self.args.process_index), state.encode())
        super()._save_checkpoint(model, trial)


def load_loader_state(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """The loader position a FeederTrainer checkpoint folder holds (every rank's file
    says the same; ValueError if not, or if there is none)."""
    pattern = os.path.join(glob.escape(os.fspath(checkpoint)), STATE_FILE.format(rank="*"))
    files = sorted(p for p in glob.glob(pattern) if re.search(r"rank\d+\.json$", p))
    if not files:
        raise ValueError(
            f"{checkpoint} holds no tokenfeed loader state ({STATE_FILE.format(rank='N')}): "
            f"was it saved by a FeederTrainer?"
        )
    return agreed((json.loads(Path(f).read_text()) for f in files), str(checkpoint))


def _batch_size(args: Any, field: str, batch_size: int) -> None:
    """Set `args.<field>` to the loader's batch size, warning if it said another."""
    default = type(args).__dataclass_fields__[field].default
    given = getattr(args, field)
    if given != batch_size and given != default:
        log.warning(
            "%s=%d, but the loader's batch_size is %d: each process trains on the "
            "loader's batches, so %s is set to %d",
            field,
            given,
            batch_size,
            field,
            batch_size,
        )
    setattr(args, field, batch_size)
