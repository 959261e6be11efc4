"""The stager: takes this rank's snapshot of the state into buffers reused between saves.

Role: the only part of a save that must see the state as it is at ``save()`` time. Once a
tensor is in a staging buffer, training may change the original; the bytes go to disk from the
buffer, in the background.

Where each tensor this rank writes goes, decided in ``snapshot`` (inside ``save()``):

- a CUDA tensor, while the device budget lasts (``device_staging_bytes``; by default 1/8 of
  the GPU, capped by what is free at the first save, and shrunk if an allocation runs out of
  memory): a device buffer, copied on the *training* stream (the current stream of the
  tensor's device). The copy is queued, not waited for, and every later kernel on that stream
  (the next forward, ``optimizer.step()``, an in-place edit) runs after it: the snapshot is
  the ``save()``-time state by construction, at HBM speed. The background later drains the
  device buffers to pinned host buffers on a side stream of that device, after an event
  recorded behind the copies, while training runs, so the state crosses PCIe once per save.
- a CUDA tensor beyond the budget: a pinned host buffer, also queued on the training stream
  (non-blocking), so it too is ordered before anything that follows; training kernels wait for
  that PCIe copy on the GPU, the host does not.
- a CPU tensor: a host buffer, copied before ``save()`` returns.
- every non-tensor value: deep-copied before ``save()`` returns (a tensor inside one, as in a
  tuple of tensors, which DCP pickles whole, is copied to the CPU synchronously), so a dict,
  list or counter the loop changes right after ``save()`` is saved as it was.

The value checks (dckpt.save.value_checks: replica digests, non-finite values) see the same
``save()``-time state: a CUDA tensor's are queued on the training stream beside its copy; a
host tensor's run on its staged copy in the background (``inspect_staged``), or inside
``save()`` on the live tensor when this rank does not stage it (another rank writes it).

A synchronous save (``live``) writes the live tensors; it first waits for every kernel queued
on their devices, since the save thread reads them from another stream.

Only with ``overlap_staging=True`` may a copy be taken *after* ``save()`` returned: the
tensors the hooked optimizer changes (its parameters and state) that would go to the host are
*deferred* and copied by ``StagingSavePlanner.finish_plan`` in the background, before the next
``optimizer.step()`` (a step pre-hook waits). That rests on a promise the caller makes: nothing
but ``optimizer.step()`` changes them in between. The version counter of every tensor object
through which such a storage is reachable (the parameter and the state-dict alias, each as
wrapper and as local shard, which under FSDP2 are separate counters) is recorded in
``save()`` and compared when the copy is taken, so an in-place change through any of them
fails the save; a change through ``.data`` bypasses version counters and is not seen.

Only the tensors DCP's plan gave this rank at the previous save are copied: a replicated
tensor that DCP de-duplicates onto another rank is left as a reference and never read here.
The first save, and a save whose state structure changed, copies everything. If the plan
still hands this rank a tensor it did not copy, that save fails and the next copies all.

Buffers are keyed by the tensor's flattened name and reused while shape, dtype, device and
pinning stay the same; those a save did not use are released. Invariants: a buffer is
rewritten only by the next save, and the next save starts only after the previous one finished
writing; no side-stream copy is still running once ``staged`` is set, even after a failure.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ..errors import SaveError
from ..faults import Tamper
from ..phases import Phase, Trace
from ..storage.item_writes import ItemWrites
from ..storage.stable_file import StableFile
from ..storage.tamper import pick, staged_copy, tampered_copy
from ..storage.tensor_digest import copy_hashed, host_digest
from ..units import human_bytes
from .findings import Findings
from .value_checks import Inspection, replica_key

__all__ = [
    "Snapshot",
    "Stager",
    "StagingSavePlanner",
    "StagingStats",
    "Watch",
    "inspect_staged",
    "watch_versions",
]

Watch = dict[int, list[tuple[torch.Tensor, int]]]
"""Storage address → (tensor object, its version counter at ``save()``), for deferred copies."""

DEVICE_SHARE = 8
"""With no explicit budget, device buffers may take 1/8 of the GPU's memory."""

log = logging.getLogger("dckpt")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _ptr(t: torch.Tensor) -> int:
    return int(_local(t).untyped_storage().data_ptr())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def watch_versions(tensors: Iterable[torch.Tensor], into: Watch | None = None) -> Watch:
    """Record the version counter of each tensor *and* of its local shard, by storage.

    Every counter is later compared with itself only: under FSDP2 a parameter, its local
    shard and the state dict's alias of that shard carry separate counters that move under
    different ops, so comparing one object's counter with another's is meaningless.
    """
    watch: Watch = {} if into is None else into
    for t in tensors:
        if _local(t).numel() == 0:
            continue
        seen = watch.setdefault(_ptr(t), [])
        for obj in (t, _local(t)):
            if not any(o is obj for o, _ in seen):
                seen.append((obj, obj._version))
    return watch


@dataclass
class StagingStats:
    """Which path this rank's bytes took in one save, and what it cost."""

    device_bytes: int = 0
    """Copied device-to-device in save(), drained to pinned host buffers in the background."""
    pinned_bytes: int = 0
    """Copied device-to-host (pinned) on the training stream in save()."""
    host_bytes: int = 0
    """Copied host-to-host in save()."""
    deferred_bytes: int = 0
    """Copied after save() returned (``overlap_staging``), before the next optimizer step."""
    alloc_bytes: int = 0
    alloc_s: float = 0.0
    """New staging buffers (the first save, or after the state changed shape)."""
    device_copy_s: float = 0.0
    """GPU time of the copies queued on the training stream (training kernels wait for it)."""
    drain_s: float = 0.0
    """Wall time of the background drain of device buffers to pinned host buffers."""

    def as_timings(self) -> dict[str, float]:
        return {
            "staged_device_bytes": float(self.device_bytes),
            "staged_pinned_bytes": float(self.pinned_bytes),
            "staged_host_bytes": float(self.host_bytes),
            "staged_deferred_bytes": float(self.deferred_bytes),
            "staging_alloc_bytes": float(self.alloc_bytes),
            "staging_alloc_s": self.alloc_s,
            "device_copy_s": self.device_copy_s,
            "drain_s": self.drain_s,
        }


@dataclass
class Snapshot:
    """One save's state dict as handed to DCP, and how it was staged."""

    state_dict: dict[str, Any]
    live: bool = False
    """True for a synchronous save: the live state is written, nothing was staged."""
    signature: tuple[Any, ...] = ()
    staged: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    """fqn → (``device``/``pinned``/``host``, buffer) for every tensor copied in save()."""
    deferred: Watch = field(default_factory=dict)
    marks: dict[torch.device, tuple[Any, Any]] = field(default_factory=dict)
    """Per CUDA device: timing events recorded on its training stream before and after the
    copies queued in save(); a deferred or drain copy on that device waits for the second."""
    stats: StagingStats = field(default_factory=StagingStats)
    inspection: Inspection | None = None
    """This save's value checks (None: none), begun in save(), finished by ``inspect_staged``."""
    tamper: Tamper | None = None
    """A synchronous save's: the fault hook's falsified copy of what the writer is handed
    (its ``item`` named: the tensor it hits)."""
    stable: frozenset[str] = frozenset()
    """The names DCP gives the frozen parameters an incremental save writes to a file of
    their own (dckpt.storage.stable_file); empty: every item goes to DCP's files."""
    trainable: tuple[str, ...] = ()
    """The names of the parameters that require grad, as ``save()`` found them (the manifest's
    ``incremental.trainable``, ``dckpt export --trainable``; the capture's progress note)."""
    replicas: dict[str, str] = field(default_factory=dict)
    """Tensor name → replica key, for the tensors other ranks hold copies of that DCP keeps
    once (plain tensors; DTensor shards with a Replicate placement): ``replica_key``."""
    frozen: tuple[StableFile, int, int] | None = None
    """Once written (an incremental save): this save's file of frozen parameters, its bytes'
    step and how many steps share them (this one included); the route remembers it as a
    base once the save commits."""

    def ready(self, device: torch.device) -> Any:
        mark = self.marks.get(device)
        return None if mark is None else mark[1]

    def wait_ready(self) -> None:
        """Block until every copy queued in save() has landed; measures their GPU time."""
        for started, ready in self.marks.values():
            ready.synchronize()
            elapsed = started.elapsed_time(ready) / 1e3
            self.stats.device_copy_s = max(self.stats.device_copy_s, elapsed)


def _signature(flat: dict[str, Any]) -> tuple[Any, ...]:
    """What DCP's plan depends on: every name, and every tensor's shape, dtype, device and
    placements (its de-duplication also counts the non-tensor items, in order)."""
    return tuple(
        (
            fqn,
            tuple(v.shape),
            v.dtype,
            v.device.type,
            tuple(map(str, v.placements)) if isinstance(v, DTensor) else None,
        )
        if isinstance(v, torch.Tensor)
        else (fqn, type(v).__name__)
        for fqn, v in flat.items()
    )


def _host_copy(value: Any) -> Any:
    """A deep copy of a non-tensor value; a tensor inside it (a tuple of tensors is one DCP
    value) is copied to the CPU synchronously, so the copy is complete and ordered."""
    on_cpu = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), value)
    return copy.deepcopy(on_cpu)


def _cuda_devices(flat: dict[str, Any]) -> list[torch.device]:
    devices = {_local(v).device for v in flat.values() if isinstance(v, torch.Tensor)}
    return sorted((d for d in devices if d.type == "cuda"), key=str)


class Stager:
    """Reusable staging buffers and the copies into them; see the module docstring."""

    def __init__(self, device_budget: int | None = None) -> None:
        self.device_budget = device_budget
        self._budgets: dict[torch.device, int] = {}
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}
        self._plan: tuple[tuple[Any, ...], frozenset[str]] | None = None
        self._streams: dict[torch.device, Any] = {}

    def _budget(self, device: torch.device) -> int:
        """Device buffer bytes on ``device``: the configured budget, or (decided at the first
        save) 1/8 of the GPU, but never more than is free beyond a margin of 1/20 of it."""
        budget = self._budgets.get(device)
        if budget is None:
            if self.device_budget is not None:
                budget = self.device_budget
            else:
                free, total = torch.cuda.mem_get_info(device)
                budget = max(0, min(total // DEVICE_SHARE, free - total // 20))
            self._budgets[device] = budget
        return budget

    def _alloc(
        self, pool: dict[str, torch.Tensor], key: str, src: torch.Tensor, device: Any, st: Any
    ) -> torch.Tensor:
        pinned = device == "cpu" and src.device.type == "cuda"
        buf = pool.get(key)
        if (
            buf is not None
            and buf.shape == src.shape
            and buf.dtype == src.dtype
            and buf.device == torch.device(device)
            and (device != "cpu" or buf.is_pinned() == pinned)
        ):
            return buf
        t0 = time.perf_counter()
        buf = torch.empty(src.shape, dtype=src.dtype, device=device, pin_memory=pinned)
        st.alloc_s += time.perf_counter() - t0
        st.alloc_bytes += _nbytes(buf)
        pool[key] = buf
        return buf

    def _to_device_buffer(
        self,
        fqn: str,
        src: torch.Tensor,
        used: dict[torch.device, int],
        st: StagingStats,
        bad: str | None = None,
    ) -> torch.Tensor | None:
        """Copy ``src`` into its device buffer on the training stream, if the budget allows;
        None if not (or if the GPU has no room left: the budget shrinks to what is held)."""
        dev = src.device
        if used.get(dev, 0) + _nbytes(src) > self._budget(dev):
            return None
        try:
            buf = self._alloc(self._device, fqn, src, dev, st)
        except torch.cuda.OutOfMemoryError:
            self._budgets[dev] = used.get(dev, 0)
            log.warning(
                "dckpt: no GPU memory for more staging buffers on %s; the rest of each save "
                "is copied device-to-host (device_staging_bytes is now %s)",
                dev,
                human_bytes(self._budgets[dev]),
            )
            return None
        staged_copy(buf, src, bad)  # on the training stream: ordered before anything after save()
        used[dev] = used.get(dev, 0) + _nbytes(buf)
        st.device_bytes += _nbytes(buf)
        return buf

    def live(
        self,
        state_dict: dict[str, Any],
        inspection: Inspection | None = None,
        trace: Trace | None = None,
    ) -> Snapshot:
        """A synchronous save writes the live state: every queued kernel on its devices must
        have finished first (the save thread reads on another stream). The capture digests
        are taken now, of every tensor (which ones this rank writes is DCP's to plan)."""
        flat = flatten_state_dict(state_dict)[0]
        checks = inspection if inspection is not None and inspection.active else None
        if checks is not None:
            for fqn, value in flat.items():
                if not isinstance(value, torch.Tensor):
                    continue
                src = _local(value).detach()
                key = replica_key(fqn, value)
                if src.is_cuda:  # its NaN scan too: findings() reads it after the write
                    checks.device(fqn, src, replica=key, finite=True, capture=True)
                else:
                    checks.take_host(fqn, src, replica=key)
        for device in _cuda_devices(flat):
            torch.cuda.synchronize(device)
        tamper = trace.tamper(Phase.PREPARE) if trace is not None else None
        if tamper is not None:  # the tensor it hits, named once
            sizes = (
                (k, _nbytes(_local(v))) for k, v in flat.items() if isinstance(v, torch.Tensor)
            )
            tamper = Tamper(tamper.action, pick(tamper.item, sizes))
        return Snapshot(state_dict=state_dict, live=True, inspection=inspection, tamper=tamper)

    def snapshot(
        self,
        state_dict: dict[str, Any],
        deferred: Watch,
        inspection: Inspection | None = None,
        trace: Trace | None = None,
    ) -> Snapshot:
        """Copy (or queue the copy of) this rank's tensors; see the module docstring.

        ``deferred`` holds the storages the caller allows to be copied after ``save()``
        returned (the hooked optimizer's, with ``overlap_staging``); it is empty otherwise.
        The returned state dict keeps the live tensors, for DCP's planning (shapes, dtypes,
        sharding); their bytes are served from the buffers by ``StagingSavePlanner``.
        """
        flat, mapping = flatten_state_dict(state_dict)
        signature = _signature(flat)
        mine = self._plan[1] if self._plan is not None and self._plan[0] == signature else None
        snap = Snapshot(state_dict={}, signature=signature, inspection=inspection)
        snap.replicas = {
            k: key
            for k, v in flat.items()
            if isinstance(v, torch.Tensor) and (key := replica_key(k, v)) is not None
        }
        checks = inspection if inspection is not None and inspection.active else None
        tamper = trace.tamper(Phase.PREPARE) if trace is not None else None
        target = (
            pick(
                tamper.item,
                ((k, _nbytes(_local(v))) for k, v in flat.items()
                 if isinstance(v, torch.Tensor) and (mine is None or k in mine)
                 and not (_local(v).numel() and _ptr(v) in deferred)),
            )
            if tamper is not None
            else ""
        )  # fmt: skip
        st = snap.stats
        for device in _cuda_devices(flat):
            started = torch.cuda.Event(enable_timing=True)
            started.record(torch.cuda.current_stream(device))
            snap.marks[device] = (started, None)
        used: dict[torch.device, int] = {}
        deferred_fqns: set[str] = set()
        out: dict[str, Any] = {}
        for fqn, value in flat.items():
            if not isinstance(value, torch.Tensor):
                out[fqn] = _host_copy(value)
                if checks is not None:
                    checks.value(fqn, out[fqn])
                continue
            out[fqn] = value
            src = _local(value).detach()
            elsewhere = mine is not None and fqn not in mine
            replica = snap.replicas.get(fqn)
            if checks is not None and src.is_cuda:  # queued on the training stream, too
                checks.device(
                    fqn, src, replica=replica, finite=not elsewhere, capture=not elsewhere
                )
            if elsewhere:  # another rank writes it: never copied here, only its digest taken
                if checks is not None and not src.is_cuda and replica is not None:
                    checks.host(fqn, src, replica=replica, finite=False)
                continue
            bad = tamper.action if tamper is not None and fqn == target else None
            buf = self._to_device_buffer(fqn, src, used, st, bad) if src.is_cuda else None
            if buf is not None:
                snap.staged[fqn] = ("device", buf)
            elif src.numel() > 0 and _ptr(src) in deferred:
                watch_versions([value], into=deferred)  # the alias DCP will read, too
                snap.deferred[_ptr(src)] = deferred[_ptr(src)]
                deferred_fqns.add(fqn)
                if checks is not None and not src.is_cuda:  # its state now, copied later
                    checks.take_host(fqn, src, replica=replica)
            elif src.is_cuda:
                buf = self._alloc(self._host, fqn, src, "cpu", st)
                staged_copy(buf, src, bad, non_blocking=True)  # on the training stream, too
                st.pinned_bytes += _nbytes(buf)
                snap.staged[fqn] = ("pinned", buf)
            else:
                buf = self._alloc(self._host, fqn, src, "cpu", st)
                digest: str | None = None
                if bad is not None:
                    digest = host_digest(src)
                    tampered_copy(buf, src, bad)
                elif checks is not None and checks.capture:
                    digest = _copy_captured(buf, src, fqn, checks)
                else:
                    buf.copy_(src)
                if checks is not None and digest is not None:
                    checks.captured_host(fqn, digest, replica=replica)
                st.host_bytes += _nbytes(buf)
                snap.staged[fqn] = ("host", buf)
        for device, (started, _) in snap.marks.items():
            ready = torch.cuda.Event(enable_timing=True)
            ready.record(torch.cuda.current_stream(device))
            snap.marks[device] = (started, ready)
        # Buffers this save does not use go (the last save is done with them): a tensor that
        # left this rank's share, changed shape, or moved between device and host staging.
        on_device = {f for f, (kind, _) in snap.staged.items() if kind == "device"}
        for pool, keep in ((self._device, on_device), (self._host, {*snap.staged, *deferred_fqns})):
            for key in [k for k in pool if k not in keep]:
                del pool[key]
        snap.state_dict = unflatten_state_dict(out, mapping)
        return snap

    def remember_plan(self, signature: tuple[Any, ...], written: Iterable[str]) -> None:
        """The tensors DCP's final plan had this rank write; the next save copies only those."""
        self._plan = (signature, frozenset(written))

    def forget_plan(self) -> None:
        self._plan = None

    def to_host(
        self, key: str, src: torch.Tensor, after: Any, st: StagingStats, bad: str | None = None
    ) -> torch.Tensor:
        """Copy ``src`` into its reused host buffer (pinned for CUDA, on the side stream of
        ``src``'s device, after the event ``after``); ``synchronize`` before reading it.
        ``bad``: the fault hook's way of getting that copy wrong (dckpt.storage.tamper)."""
        buf = self._alloc(self._host, key, src, "cpu", st)
        if src.is_cuda:
            stream = self._streams.get(src.device)
            if stream is None:
                stream = self._streams[src.device] = torch.cuda.Stream(device=src.device)
            with torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)
                staged_copy(buf, src, bad, non_blocking=True)
        else:
            staged_copy(buf, src, bad)
        return buf

    def synchronize(self) -> None:
        """Wait until every copy issued on the side streams has landed in its buffer."""
        for stream in self._streams.values():
            stream.synchronize()


class StagingSavePlanner(DefaultSavePlanner):
    """DCP's save planner that finishes staging once the de-duplicated plan is final.

    ``finish_plan`` runs on every rank after DCP de-duplicated the global plan. For each item
    this rank writes it waits for the copies queued in ``save()``, drains device buffers to
    pinned host buffers, takes deferred copies (after checking their version counters), then
    sets ``staged`` and remembers the plan. ``resolve_data`` hands DCP the host copies.
    """

    def __init__(
        self,
        stager: Stager,
        snapshot: Snapshot,
        staged: threading.Event,
        cancelled: threading.Event,
        trace: Trace | None = None,
        cache_key: str | None = None,
        writes: ItemWrites | None = None,
    ) -> None:
        # DCP's plan cache only under a key dckpt.save.plan_cache agreed on: DCP's own
        # comparison of plans ignores dtypes, so its cache alone could commit stale metadata.
        if cache_key is not None:
            super().__init__(enable_plan_caching=True)
            self._cached_plans_key = cache_key
        else:
            super().__init__()
        self.plan_s = 0.0
        """Seconds from DCP's set-up to the final plan: local plan, rank 0's global plan and
        the collectives between them."""
        self._planning_from: float | None = None
        self._stager = stager
        self._snap = snapshot
        self._staged = staged
        self._cancelled = cancelled
        self._trace = trace
        self._copies: dict[MetadataIndex, torch.Tensor] = {}
        self.written: set[str] = set()
        """The tensors DCP's final plan has this rank write."""
        self.deferred_host: dict[str, torch.Tensor] = {}
        """The copies of host tensors taken in the background (``overlap_staging``)."""
        self.deferred: set[str] = set()
        """Every tensor whose copy was taken in the background (``overlap_staging``)."""
        self._writes = writes
        """Where the writer digests the bytes it writes for each tensor (the capture check):
        told, in ``resolve_data``, which tensor DCP is about to write for each item."""

    @property
    def stats(self) -> StagingStats:
        return self._snap.stats

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        # A copy for DCP to write and broadcast: the writer empties it once written
        # (``slim_return``), and the one DCP's plan cache keeps must stay whole.
        return plans, dataclasses.replace(metadata)

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        # DCP's current signature: with ``*args`` DCP warned on every rank and passed the
        # coordinator flag positionally, where the base class takes ``storage_meta``.
        self._planning_from = time.perf_counter()
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        if self._planning_from is not None:
            self.plan_s = time.perf_counter() - self._planning_from
        self.written = {i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO}
        try:
            if self._cancelled.is_set():
                raise SaveError("the save was cancelled: its staging took longer than allowed")
            if self._trace is not None:  # inside DCP's plan step: an error fails every rank
                self._trace.at(Phase.STAGE)
            if not self._snap.live:
                self._stage(plan)
        except BaseException:
            self._stager.forget_plan()
            raise
        finally:
            self._staged.set()  # also on failure: nobody may wait forever on a failed save
        return plan

    def _stage(self, plan: SavePlan) -> None:
        snap, st = self._snap, self._snap.stats
        snap.wait_ready()
        written: list[str] = []
        t0, drained = time.perf_counter(), False
        tamper = self._trace.tamper(Phase.STAGE) if self._trace is not None else None
        late = [  # the copies taken now: a GPU buffer's drain, a deferred copy
            (i.index.fqn, _nbytes(self.lookup_object(i.index)))
            for i in plan.items
            if i.type != WriteItemType.BYTE_IO
            and snap.staged.get(i.index.fqn, ("", None))[0] in ("device", "")
        ]
        target = pick(tamper.item, late) if tamper is not None else ""
        try:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                fqn = item.index.fqn
                written.append(fqn)
                bad = tamper.action if tamper is not None and fqn == target else None
                kind, buf = snap.staged.get(fqn, ("", None))
                if buf is not None:
                    if kind == "device":
                        ready = snap.ready(buf.device)
                        buf = self._stager.to_host(fqn, buf, ready, st, bad)
                        drained = True
                    self._copies[item.index] = buf
                    continue
                self._copies[item.index] = self._deferred_copy(fqn, item, bad)
                self.deferred.add(fqn)
                if not self.lookup_object(item.index).is_cuda:
                    self.deferred_host[fqn] = self._copies[item.index]
        finally:
            self._stager.synchronize()  # no copy may still run once staged is set
        if drained:
            st.drain_s = time.perf_counter() - t0
        self._stager.remember_plan(snap.signature, written)

    def _deferred_copy(self, fqn: str, item: WriteItem, bad: str | None) -> torch.Tensor:
        """The copy ``save()`` left to now (``overlap_staging``), if nothing changed since."""
        snap = self._snap
        live = self.lookup_object(item.index)
        watched = snap.deferred.get(_ptr(live)) if live.numel() > 0 else None
        if watched is None:
            raise SaveError(
                f"DCP's plan has this rank write {fqn}, which save() did not copy (the plan "
                "changed between saves with the same state layout). This save is abandoned; "
                "the next save copies everything."
            )
        if any(obj._version != version for obj, version in watched):
            raise SaveError(
                f"{fqn} changed in place after save() returned and before its copy was taken, "
                "so this save would not be a consistent snapshot; it is abandoned. With "
                "overlap_staging=True, call manager.before_optimizer_step() before changing "
                "parameters or optimizer state outside optimizer.step(), or keep "
                "overlap_staging=False (the default), which copies everything in save()."
            )
        buf = self._stager.to_host(fqn, live.detach(), snap.ready(live.device), snap.stats, bad)
        snap.stats.deferred_bytes += _nbytes(buf)
        return buf

    def resolve_data(self, write_item: WriteItem) -> Any:
        staged = self._copies.get(write_item.index)
        data = staged if staged is not None else super().resolve_data(write_item)
        checks = self._snap.inspection
        if self._writes is None or checks is None or not isinstance(data, torch.Tensor):
            return data
        fqn = write_item.index.fqn
        kind = checks.capture_kind(fqn)
        if kind is None:  # not captured (the checks could not read it): nothing to compare
            return data
        data = _as_written(data)
        tamper = self._snap.tamper
        if self._snap.live and tamper is not None and fqn == tamper.item:
            bad = torch.empty_like(data)  # a synchronous save's copy is what the writer gets
            tampered_copy(bad, data, tamper.action)
            data = bad
        self._writes.expect(fqn, data, kind)
        return data


def _copy_captured(
    buf: torch.Tensor, src: torch.Tensor, fqn: str, checks: Inspection
) -> str | None:
    """Copy ``src`` into ``buf`` and return the source's digest, taken in the copy's pass
    (``copy_hashed``); a tensor whose bytes cannot be read so (a conjugate view) is copied
    plainly and saved unchecked, named in the findings."""
    try:
        return copy_hashed(buf, src)  # the source's digest, in the copy's pass
    except Exception as exc:
        buf.copy_(src)
        checks.cannot_read(fqn, exc)
        return None


def _as_written(t: torch.Tensor) -> torch.Tensor:
    """``t`` as DCP's writer serializes it (its serial loader: detached, on the CPU, a storage
    of exactly its bytes), made here so the writer's digest can find those bytes by address
    (dckpt.storage.item_writes): DCP then clones nothing. A tensor stored in another order
    (``channels_last``, a transposed view) is made row-major first: torch.save writes a
    storage in its own order, and the capture digest is of the values in row-major order."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.untyped_storage().size() != t.nbytes or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def inspect_staged(
    snapshot: Snapshot, planner: StagingSavePlanner, writes: Mapping[str, str] | None = None
) -> Findings | None:
    """The value checks of one save, finished in the background once DCP wrote it: each
    host tensor checked for NaN and Inf on its staged copy (or, for a synchronous save,
    live: the caller waits), what the GPU kernels queued in save() found, and each tensor's
    capture compared with ``writes``, the digests of the bytes written (None: not compared).
    None when no check is on."""
    checks = snapshot.inspection
    if checks is None or not checks.active:
        return None
    if snapshot.live:
        flat, _ = flatten_state_dict(snapshot.state_dict)
        for fqn, value in flat.items():
            if not isinstance(value, torch.Tensor):
                checks.value(fqn, value)
            elif not value.is_cuda:  # a GPU tensor's checks were queued in save()
                key = checks.staged_replica(replica_key(fqn, value))
                checks.host(fqn, _local(value).detach(), replica=key, finite=True)
        copies = dict.fromkeys(planner.written, "live")
    else:
        host = {f: b for f, (kind, b) in snapshot.staged.items() if kind == "host"}
        for fqn, buf in {**host, **planner.deferred_host}.items():
            key = checks.staged_replica(snapshot.replicas.get(fqn))  # None: it was captured
            checks.host(fqn, buf, replica=key, finite=True)
        copies = {f: "deferred" if f in planner.deferred else "staged" for f in planner.written}
    return checks.findings(planner.written, writes, copies)
