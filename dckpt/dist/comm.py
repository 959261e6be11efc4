"""The collectives dckpt itself runs, on a group of its own, with a timeout.

dckpt never runs collectives on the training process group: it creates a dedicated gloo group
(CPU, works beside NCCL) at construction, on the main thread, and every collective it issues
goes there. With no process group initialised, the same calls work for a single process.
"""

from __future__ import annotations

import contextlib
import datetime
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["Comm", "Progress"]

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


PHASES = {
    "started": "the start of the save",
    "ready": "preparing the save (its state and tmp dir)",
    "written": "writing shards",
    "dcp_done": "DCP's save",
    "reported": "reporting files to the coordinator",
}
DECIDED = "decided"
"""Marked by rank 0 alone, once it committed or refused the save, before telling the others."""


class Progress:
    """Per-save progress markers in the job's key-value store, to name a late rank.

    Each rank marks the phases of a save it completed. When a wait fails (a timeout, or a peer
    that closed its connection), ``lagging`` tells which ranks had not completed which phase, so
    the error names them on every rank without another collective (after a gloo timeout the
    group is unusable anyway). Store errors are swallowed: markers only improve messages.
    """

    def __init__(self, comm: Comm) -> None:
        self._world = comm.world_size
        self._rank = comm.rank
        self._store: Any = None
        if comm.distributed:
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except (RuntimeError, ValueError, AttributeError):
                self._store = None

    def _key(self, save_id: str, phase: str, rank: int) -> str:
        return f"dckpt/{save_id}/{phase}/{rank}"

    def mark(self, save_id: str, phase: str) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):  # a marker is a hint, never a failure
                self._store.set(self._key(save_id, phase, self._rank), "1")

    def lagging(self, save_id: str) -> str:
        """'rank(s) 1 did not complete writing shards', or '' when nobody is known to lag."""
        if self._store is None:
            return ""
        try:
            for phase, what in PHASES.items():
                late = [
                    r
                    for r in range(self._world)
                    if not self._store.check([self._key(save_id, phase, r)])
                ]
                if late:
                    who = ", ".join(str(r) for r in late)
                    return f"rank(s) {who} did not complete {what} (seen from rank {self._rank})"
            if not self._store.check([self._key(save_id, DECIDED, 0)]):
                return f"rank 0 did not complete the commit (seen from rank {self._rank})"
        except Exception:
            return ""
        return ""

    def all_reported(self, save_id: str) -> bool:
        """Whether every rank reported its files, so rank 0 may have gone on to commit."""
        if self._store is None:
            return False
        try:
            return all(
                self._store.check([self._key(save_id, "reported", r)]) for r in range(self._world)
            )
        except Exception:
            return False

    def clear(self, save_id: str) -> None:
        if self._store is not None:
            for phase in (*PHASES, DECIDED):
                with contextlib.suppress(Exception):
                    self._store.delete_key(self._key(save_id, phase, self._rank))
