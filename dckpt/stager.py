"""The stager: copies this rank's share of the state into buffers reused between saves.

Role: the only part of a save that must happen while the training loop is held back. Once a
tensor is copied into a staging buffer, training may change the original; the bytes go to disk
from the copy, in the background.

Two kinds of leaves, decided per save in ``snapshot`` (foreground, inside ``save()``):
- *deferred*: tensors whose storage belongs to a parameter the hooked optimizer steps, or to
  that optimizer's state. These change only inside ``optimizer.step()``, so their copy may be
  taken after ``save()`` returned, as long as it is taken before the next optimizer step
  (``wait_staged`` is called by an optimizer step pre-hook). Their version counters are
  recorded in ``save()`` and checked when the copy is taken: a tensor changed in between
  fails the save instead of committing a torn snapshot. They are copied by
  ``StagingSavePlanner.finish_plan``, in the background, once DCP's global plan says which
  items this rank writes: replicated tensors that DCP de-duplicates onto another rank are
  never copied here.
- *eager*: everything else (buffers such as BatchNorm statistics, which change in forward, and
  every non-tensor value), copied or deep-copied before ``save()`` returns.

Buffers are allocated on first use, keyed by the tensor's name (and shard offset), and reused
while shape and dtype stay the same; on CUDA they are pinned and filled with non-blocking copies
on a side stream that first waits for the training stream. Invariant: a buffer is rewritten only
by the next save, and the next save starts only after the previous one finished writing.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .errors import SaveError

__all__ = ["Stager", "StagingSavePlanner", "storage_versions"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _ptr(t: torch.Tensor) -> int:
    return int(_local(t).untyped_storage().data_ptr())


def storage_versions(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Storage address → version counter of ``tensors`` (DTensors by their local shard).

    The version counter moves on every in-place change, so comparing it when the deferred copy
    is finally taken proves the copy holds the values of ``save()`` time.
    """
    return {_ptr(t): _local(t)._version for t in tensors if _local(t).numel() > 0}


class Stager:
    """Reusable staging buffers and the copies into them; see the module docstring."""

    def __init__(self) -> None:
        self._buffers: dict[Any, torch.Tensor] = {}
        self._stream: Any = None
        self._ready: Any = None  # CUDA event on the training stream, recorded in snapshot()

    @property
    def bytes_allocated(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer(self, key: Any, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(
                src.shape, dtype=src.dtype, device="cpu", pin_memory=src.device.type == "cuda"
            )
            self._buffers[key] = buf
        return buf

    def copy(self, key: Any, src: torch.Tensor) -> torch.Tensor:
        """Copy ``src`` into its reused CPU buffer; on CUDA, asynchronously on the side stream."""
        buf = self._buffer(key, src)
        if src.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=src.device)
            with torch.cuda.stream(self._stream):
                if self._ready is not None:
                    self._stream.wait_event(self._ready)
                buf.copy_(src, non_blocking=True)
        else:
            buf.copy_(src)
        return buf

    def synchronize(self) -> None:
        """Wait until every copy issued so far has landed in its buffer."""
        if self._stream is not None:
            self._stream.synchronize()

    def snapshot(self, state_dict: dict[str, Any], deferred: Mapping[int, int]) -> dict[str, Any]:
        """The state dict to hand the background writer.

        Tensors whose storage is in ``deferred`` stay references (copied later by the planner);
        other tensors are copied now into buffers; other values are deep-copied now.
        """
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._ready = torch.cuda.Event()
            self._ready.record()  # staging copies must see everything the training stream did

        def walk(path: tuple[Any, ...], obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                if _ptr(obj) in deferred:
                    return obj
                if isinstance(obj, DTensor):
                    local = self.copy(path, obj._local_tensor)
                    return DTensor(local, obj._spec, requires_grad=False)
                return self.copy(path, obj.detach())
            if isinstance(obj, dict):
                return {k: walk((*path, k), v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [walk((*path, i), v) for i, v in enumerate(obj)]
            if isinstance(obj, tuple):
                return tuple(walk((*path, i), v) for i, v in enumerate(obj))
            return copy.deepcopy(obj)

        snap: dict[str, Any] = walk((), state_dict)
        self.synchronize()  # eager copies are done before save() returns
        return snap


class StagingSavePlanner(DefaultSavePlanner):
    """DCP's save planner (with plan caching) that stages deferred items once the plan is final.

    ``finish_plan`` runs on every rank after DCP de-duplicated the global plan: it copies the
    still-live tensors of the items *this* rank writes into the stager's buffers, then sets
    ``staged``. ``resolve_data`` hands DCP the staged copies.
    """

    def __init__(
        self,
        stager: Stager,
        deferred: Mapping[int, int],
        staged: threading.Event,
        cancelled: Callable[[], bool],
        on_stage: Callable[[], None] | None = None,
    ) -> None:
        # No plan caching: DCP's cache compares plans without dtypes, so a model cast between
        # two saves would commit metadata with the old dtype. Planning is cheap next to I/O.
        super().__init__()
        self._stager = stager
        self._deferred = deferred
        self._staged = staged
        self._cancelled = cancelled
        self._on_stage = on_stage
        self._copies: dict[MetadataIndex, torch.Tensor] = {}
        self.staged_bytes = 0

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        try:
            if self._cancelled():
                raise SaveError("the save was cancelled: its staging took longer than allowed")
            if self._on_stage is not None:
                self._on_stage()  # inside DCP's plan step, so an error fails every rank at once
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                live = self.lookup_object(item.index)
                if isinstance(live, torch.Tensor) and _ptr(live) in self._deferred:
                    if _local(live)._version != self._deferred[_ptr(live)]:
                        raise SaveError(
                            f"{item.index.fqn} changed in place after save() returned and "
                            "before its copy was taken, so this save would not be a "
                            "consistent snapshot; it is abandoned. Call "
                            "manager.before_optimizer_step() before changing parameters "
                            "outside optimizer.step(), or use overlap_staging=False."
                        )
                    key = ("item", item.index.fqn, tuple(item.index.offset or ()))
                    buf = self._stager.copy(key, live.detach())
                    self._copies[item.index] = buf
                    self.staged_bytes += buf.numel() * buf.element_size()
            self._stager.synchronize()
        finally:
            self._staged.set()  # also on failure: nobody may wait forever on a failed save
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        staged = self._copies.get(write_item.index)
        return staged if staged is not None else super().resolve_data(write_item)
