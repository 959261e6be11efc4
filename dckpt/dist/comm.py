"""The collectives dckpt itself runs, on a group of its own, with a timeout.

dckpt never runs collectives on the training process group: it creates a dedicated gloo group
(CPU, works beside NCCL) at construction, on the main thread, and every collective it issues
goes there. With no process group initialised, the same calls work for a single process.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["Comm"]

T = TypeVar("T")


class Comm:
    """Object collectives on dckpt's own gloo group (or a single process)."""

    def __init__(self, timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed:
            self.group: dist.ProcessGroup | None = None
            self.rank, self.world_size = 0, 1
            return
        if group is None:
            # Same ranks as the default group; gloo so it carries CPU objects beside NCCL.
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather(self, obj: T) -> list[T]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: T, dst: int = 0) -> list[T] | None:
        """Every rank's ``obj`` on ``dst`` (None elsewhere): what only one rank needs costs the
        others one send each, not the whole world's objects."""
        if not self.distributed:
            return [obj]
        assert self.group is not None
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, dst), group=self.group)
        return out

    def broadcast(self, obj: T, src: int = 0) -> T:
        if not self.distributed:
            return obj
        assert self.group is not None
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        return box[0]  # type: ignore[no-any-return]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (one small all-reduce, no pickling)."""
        if not self.distributed:
            return flag
        box = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
        return bool(box.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Silence DCP's "assuming a single process" warning when that is what we meant."""
        with warnings.catch_warnings():
            if not self.distributed:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield

    def close(self) -> None:
        if self.distributed and self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
