"""A batch sampler whose position is global, so a resume continues the data exactly.

``GlobalBatchSampler`` cuts each epoch's permutation (a pure function of seed and epoch) into
*global* batches of ``global_batch_size`` samples and yields this rank's share of each:
``global_batch[rank::world_size]``. Its state is ``(epoch, batches_done)``: the same on every
rank and independent of the world size, so a checkpoint saved on N ranks resumes on M ranks
with the very same remaining samples (as long as M divides the global batch size).

Use it as ``DataLoader(dataset, batch_sampler=sampler)``. ``batches_done`` advances when a
batch is handed out; with ``num_workers > 0`` the DataLoader prefetches, so save the position
from the training loop's own counter with ``set_position`` (the example trainer does).

``len()`` is a whole epoch (``batches_per_epoch``), whatever the position, as a script that
counts epochs or schedule steps from ``len(loader)`` expects; an iteration started in the
middle of an epoch (after a resume) yields the ``remaining`` batches of it. (``len()`` that
was the remainder made a script that derived its starting epoch from it stop early, with
no word.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import StateMismatchError

__all__ = ["GlobalBatchSampler"]


class GlobalBatchSampler(Sampler[list[int]]):
    """This rank's share of deterministic global batches; see the module docstring."""

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if global_batch_size <= 0 or dataset_len < global_batch_size:
            raise ValueError(
                f"need 0 < global_batch_size <= dataset_len, got {global_batch_size} and "
                f"{dataset_len}"
            )
        if global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not divisible by world_size "
                f"{world_size}: every rank must get the same number of samples"
            )
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.batches_done = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.dataset_len // self.global_batch_size  # the last partial batch is dropped

    def __len__(self) -> int:
        return self.batches_per_epoch  # a whole epoch: see the module docstring

    @property
    def remaining(self) -> int:
        """The batches the next iteration yields: what is left of the current epoch."""
        return self.batches_per_epoch - self.batches_done

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.dataset_len, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        while self.batches_done < self.batches_per_epoch:
            start = self.batches_done * self.global_batch_size
            batch = order[start : start + self.global_batch_size]
            self.batches_done += 1
            yield batch[self.rank :: self.world_size].tolist()
        self.epoch += 1
        self.batches_done = 0

    def set_position(self, epoch: int, batches_done: int) -> None:
        """Set where the next iteration starts (e.g. from the training loop's counters)."""
        if not 0 <= batches_done <= self.batches_per_epoch:
            raise ValueError(f"batches_done must be in [0, {self.batches_per_epoch}]")
        self.epoch, self.batches_done = epoch, batches_done

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "dataset_len", "global_batch_size", "shuffle"):
            if state[key] != getattr(self, key):
                hint = (
                    " (a global batch is samples per step over all ranks: with another world "
                    "size keep it, and give each rank its share)"
                    if key == "global_batch_size"
                    else ""
                )
                raise StateMismatchError(
                    f"data sampler {key} was {state[key]!r} when saved and is "
                    f"{getattr(self, key)!r} now: the remaining data would differ{hint}. Use "
                    "the saved value, or start a new run."
                )
        self.set_position(int(state["epoch"]), int(state["batches_done"]))
