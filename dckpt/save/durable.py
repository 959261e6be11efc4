"""A durable save's own steps: ``DurableRoute``, the save pipeline's route to the root.

The pipeline (dckpt.save.pipeline) states the protocol; this route is what a save to the
root (a directory, or an s3:// root through its mirror) does in it:

- step 3 (``snapshot``): the ``Stager`` takes this rank's snapshot (CPU tensors copied now,
  CUDA tensors queued on the training stream, non-tensor values deep-copied), or, for a
  synchronous save, hands over the live state; rank 0 first warns when the root's file system
  cannot hold the save;
- step 5 (``write``): ``dcp.save`` plans on dckpt's *io* group, reusing the last save's plan
  while no rank's layout changed (``PlanCache``: one all-reduce says so); the ``StagingSavePlanner``
  drains device buffers to pinned host memory (and takes deferred copies), then sets the
  ticket's ``staged``; the ``HashingWriter`` writes each shard file with its digest computed
  as the bytes go out (for an object store, the commit strategy's ``tee`` also sends them to
  the store, and ``publish`` checks each arrived whole). An upload that fails for good sets
  the save's ``StopFlag`` (dckpt.collective.progress), and the other ranks' uploads stop at their
  next look at it, so every rank reaches DCP's gather soon after the failure rather than
  after sending a whole shard that cannot commit; each rank then reports its own error, or
  the failing rank's under that rank (``RankReport.error_rank``), so the save's one error
  names the rank and the object that failed;
- steps 6-10 need nothing of it beyond the commit strategy (rename, or manifest-last),
  except that after a commit each rank remembers its stable file (below).

Incremental saves (``CheckpointConfig.incremental``, on a root whose commit strategy can
link a committed file: a directory, or an s3:// root's mirror on rank 0's node): the frozen
parameters of each rank go to a file of their own (dckpt.storage.stable_file), and a save
whose frozen items all hash the same as those of the base links it instead of writing it. The
base is this rank's stable file in the save ``copies`` saves back (``incremental_copies``
where a link shares the bytes; 1 in a bucket, where a reused file is copied), remembered after
each commit (its inode, at its committed path), kept across a failed save, and forgotten for
a step at or below the one being saved (a rollback, a re-save); ``full_every`` bounds how many
steps one written copy serves. A rank decides alone (its file is its own), so no collective
is added and none can diverge.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from ..collective.comm import Comm
from ..collective.progress import Progress, StopFlag
from ..config import CheckpointConfig
from ..errors import CheckpointError, StorageError, describe_os_error
from ..phases import Phase, Trace
from ..root.commit import FileCommit
from ..storage.hashing_writer import HashingWriter
from ..storage.item_writes import ItemWrites
from ..storage.sink import Sink, Tee
from ..storage.stable_file import StableBase
from ..train.state import TrainState
from ..units import describe_staging, human_bytes
from .capture import CaptureHistory
from .coordinator import RankReport
from .findings import Findings
from .handle import SaveTicket
from .plan_cache import PlanCache
from .route import Finished, SaveJob, Settled
from .stager import (
    Snapshot,
    Stager,
    StagingSavePlanner,
    Watch,
    inspect_staged,
    watch_versions,
)
from .value_checks import Inspection

__all__ = ["DurableRoute"]

log = logging.getLogger("dckpt")


class DurableRoute:
    """The durable tier's steps of a save; see the module docstring."""

    noun = "save"
    label = ""
    can_block = True
    """A durable save may be synchronous (``async_save``), and the automatic mode learns from
    what its saves cost the loop."""
    soft = False
    """A failed durable save is raised by the next ``save()``, ``wait()`` or ``close()``."""
    reports_everywhere = False
    """``settle`` reads the reports on rank 0 only (the incremental record), ``finish`` only
    the committed size: rank 0 gathers."""

    def __init__(
        self,
        *,
        io: Comm,
        strategy: FileCommit,
        config: CheckpointConfig,
        state: TrainState,
        stager: Stager,
    ) -> None:
        self.io = io
        self.strategy = strategy
        self.config = config
        self.root = config.directory
        self.state = state
        self.stager = stager
        self.rank, self.world_size = io.rank, io.world_size
        self.progress = Progress(io)
        """The job's store, for a save's ``StopFlag``."""
        self.plans = PlanCache(io)
        """The key of DCP's plan cache, agreed by every rank at each save."""
        self.last_bytes = 0
        """The previous committed save's size: the next one's estimate."""
        self._snapshots = 0
        """Saves this route took a snapshot for (which replicas ``replica_sample`` compares)."""
        self.links = config.incremental
        """Whether saves split off and link frozen parameters (module docstring)."""
        self.copies = config.incremental_copies if strategy.shares_reused else 1
        """How many saves back a save links from: ``incremental_copies`` where a link shares
        the bytes (a directory); 1 where a reused file is a copy of its own (a bucket)."""
        self.history = CaptureHistory()
        """This rank's capture digests of its trainable tensors at its previous save."""
        self._bases: deque[_Base] = deque(maxlen=self.copies)
        """This rank's stable files in its last committed saves, the newest last; a save links
        the oldest (``copies`` saves back): consecutive steps never share it when there are
        two."""

    def snapshot(
        self, state_dict: dict[str, Any], *, step: int, save_id: str, asynchronous: bool,
        trace: Trace,
    ) -> Snapshot:  # fmt: skip
        if self.rank == 0:
            self._check_free_space(step, state_dict)
        on = self.config.value_checks  # allow_nonfinite decides at the commit, not here
        self._snapshots += 1  # every rank counts alike: save() is called in one order
        checks = Inspection(
            replicas=on and self.config.replica_check != "off",
            finite=on,
            sample=(self._snapshots, self.config.replica_every),
            capture=self.config.capture_check,
        )
        if asynchronous:
            snap = self.stager.snapshot(state_dict, self._deferred(), checks, trace)
        else:
            snap = self.stager.live(state_dict, checks, trace)  # the caller waits for the commit
        if self.config.incremental or self.config.capture_check:
            trainable, frozen = self.state.param_keys(state_dict)
            # the manifest's record of them (``incremental``, rank 0), the progress note's
            snap.trainable = tuple(sorted(trainable))
            if self.links:
                snap.stable = frozen
        return snap

    def _base(self) -> _Base | None:
        """The stable file a save may link: ``copies`` saves back."""
        if len(self._bases) < self.copies:
            return None
        return self._bases[0]

    def _reusable(self, step: int) -> StableBase | None:
        """The base the save of ``step`` may link, unless ``full_every`` wants a fresh copy.
        Bases of this step or later are forgotten first: after a rollback (a load, a lower
        step) or in a re-save of a step they are not history but the branch being replaced
        (linking one would record an origin after the step, and a re-save of N would share
        N-1's copy)."""
        while self._bases and self._bases[-1].step >= step:
            self._bases.pop()
        base, every = self._base(), self.config.full_every
        if base is None or (every and base.shared >= every):
            return None
        return base.file

    def _deferred(self) -> Watch:
        """Tensors whose copy may wait until the next optimizer step (``overlap_staging``):
        only what the hooked optimizer changes, its parameters and its state. Their version
        counters are read now, after the state dict was taken (taking it moves some)."""
        opt = self.state.optimizer
        if opt is None or not self.config.overlap_staging:
            return {}
        tensors = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        for per_param in opt.state.values():
            tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
        return watch_versions(tensors)

    def _check_free_space(self, step: int, state_dict: dict[str, Any]) -> None:
        """Warn before staging when the root's file system cannot hold this save.

        The estimate is the previous save's size, or (first save) the bytes of the tensors in
        this state dict, with each sharded tensor counted for the whole world.
        """
        need = self.last_bytes or _tensor_bytes(state_dict, self.world_size)
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return
        if need > free:
            log.warning(
                "dckpt: step %d needs about %s but only %s is free on %s: the save will "
                "likely fail with 'no space left on device' (older checkpoints stay intact). "
                "Free space or lower keep_last.",
                step,
                human_bytes(need),
                human_bytes(free),
                self.root,
            )

    def write(
        self, snapshot: Snapshot, ticket: SaveTicket, trace: Trace, tmp: Path, report: RankReport
    ) -> RankReport:
        """Step 5 on this rank: DCP's save through the hashing writer; its report."""
        t_staging = time.perf_counter()
        uploads = _Uploads(self.progress.stop_flag(tmp.name))
        opens = self.strategy.uploads  # an object store: this save's uploads, on this rank
        upload = opens(tmp, ticket.step, trace) if opens is not None else None
        writes = ItemWrites() if self.config.capture_check else None
        writer = HashingWriter(
            tmp,
            algorithm=self.config.digest,
            rank=self.rank,
            thread_count=self.config.io_threads,
            direct=self.config.direct_io,
            trace=trace,
            tee=uploads.tee(upload.tee if upload is not None else None),
            slim_return=True,  # the planner hands it a copy; dckpt never reads dcp.save's return
            stable_keys=snapshot.stable,
            base=self._reusable(ticket.step),
            writes=writes,
        )
        snapshot.frozen = None
        error: str | None = None
        try:  # one all-reduce: whether any rank's layout changed since DCP last planned
            key, cached = self.plans.key_for(snapshot.state_dict)
        except Exception as exc:  # the group failed: this save cannot go on anywhere
            ticket.staged.set()
            self.plans.forget()
            return dataclasses.replace(report, error=f"agreeing on the save plan failed: {exc}")
        planner = StagingSavePlanner(
            self.stager,
            snapshot,
            ticket.staged,
            cancelled=ticket.cancelled,
            trace=trace,
            cache_key=key,
            writes=writes,
        )
        error_rank: int | None = None
        findings: Findings | None = None
        check_s = 0.0
        try:
            dcp_save(
                snapshot.state_dict,
                storage_writer=writer,
                planner=planner,
                process_group=self.io.group,
                no_dist=not self.io.distributed,
            )
            trace.at(Phase.DCP_FINISH)
            t_check = time.perf_counter()
            findings = inspect_staged(
                snapshot, planner, writes.written() if writes is not None else None
            )
            findings = self._progress_note(findings, snapshot)
            check_s = time.perf_counter() - t_check
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            error_rank, failed = self._whose(exc, uploads)
            error = f"writing shards failed: {self._describe(failed)}"
        finally:
            ticket.staged.set()
        if error is not None:  # what DCP cached may be half made: every rank re-plans next
            self.plans.forget()
        stable, base = writer.stable, self._base()
        linked: dict[str, int] = {}  # file -> the committed step it was linked from
        origins: dict[str, int] = {}  # file -> the step whose save wrote its bytes
        if error is None and stable is not None:
            origin, shared = ticket.step, 1
            if stable.reused and base is not None:
                origin, shared = base.origin, base.shared + 1
                linked = {r.path: base.step for r in stable.records}
                origins = {r.path: origin for r in stable.records}
            snapshot.frozen = (stable, origin, shared)
        publish_s = 0.0
        if error is None:
            try:  # an object store: every file this rank wrote must be complete there
                if upload is not None:
                    publish_s = upload.publish(writer.records(), reused=linked)
                trace.passed(Phase.DCP_FINISH)
            except Exception as exc:
                error = f"uploading shards failed: {self._describe(exc)}"
                snapshot.frozen = None
        return dataclasses.replace(
            report,
            route={"reused": origins} if origins else {},
            records=tuple(writer.records()),
            error=error,
            error_rank=error_rank,
            findings=findings,
            timings={
                "prepare_s": t_staging - ticket.started,
                "write_s": time.perf_counter() - t_staging - publish_s - check_s,
                "check_s": check_s,
                "plan_s": planner.plan_s,
                "plan_cached": float(cached),
                **({"prehash_s": writer.prehash_s} if stable is not None else {}),
                **({"reused_bytes": float(stable.bytes)} if stable and stable.reused else {}),
                **({"upload_s": publish_s} if publish_s else {}),
                **planner.stats.as_timings(),
            },
        )

    def _progress_note(self, findings: Findings | None, snapshot: Snapshot) -> Findings | None:
        """``findings`` with how many of this rank's trainable tensors changed since its
        previous save (dckpt.save.capture.CaptureHistory), for the progress note."""
        checks = snapshot.inspection
        if findings is None or checks is None or not checks.capture:
            return findings
        moved = self.history.moved(checks.captured(), frozenset(snapshot.trainable))
        return dataclasses.replace(findings, trainable=moved)

    def _whose(self, exc: BaseException, uploads: _Uploads) -> tuple[int | None, BaseException]:
        """What this rank reports of a failed ``dcp.save``: its own error (rank None), or
        the rank and error of the failure that stopped it.

        DCP gathers every rank's failure and raises them all, as one CheckpointException,
        on every rank: a rank whose upload was refused fails the ranks whose bytes all went
        up too, and the ranks it stopped (``StopFlag``) fail with a stop. Each rank reports
        its own error if it had one (an upload's, kept by ``uploads``, first: DCP's may be
        torch.save's), and a rank that had none reports the other's, under that rank, so
        the save's error names the rank that failed and not every rank it stopped."""
        failures = (
            {r: f[0] for r, f in exc.failures.items()}
            if isinstance(exc, CheckpointException)
            else {}
        )
        own = uploads.failure
        if own is None and not isinstance(exc, CheckpointException):
            own = exc
        if own is None and not uploads.stopped and self.rank in failures:
            own = failures[self.rank]
        if own is not None:
            return None, own
        others = {r: f for r, f in failures.items() if r != self.rank}
        return _other_failure(others) if others else (None, exc)

    def _describe(self, exc: BaseException) -> str:
        """A dckpt error's own words (it names the object and what to check); any other
        error as ``describe_os_error`` words it (a full disk says so)."""
        return str(exc) if isinstance(exc, CheckpointError) else describe_os_error(exc, self.root)

    def finish(
        self,
        job: SaveJob,
        reports: list[RankReport],
        settled: Settled,
        timings: dict[str, float],
        trace: Trace,
        total_bytes: int,
    ) -> Finished:
        """Every rank remembers its stable file as committed; the save line says which path
        the bytes took, and what was linked instead of written."""
        self.last_bytes = total_bytes
        self._remember(job.step, job.snapshot)
        line = describe_staging(timings) if job.asynchronous else "live state written"
        reused = timings.get("reused_bytes", 0.0)
        if reused:
            line += f", {human_bytes(reused)} of frozen parameters linked, not written"
        return Finished(line)

    def _remember(self, step: int, snapshot: Snapshot) -> None:
        pending, snapshot.frozen = snapshot.frozen, None
        if pending is None:
            return
        stable, origin, shared = pending
        path = self.strategy.committed_file(self.root, step, stable.name)
        try:
            st: os.stat_result | None = os.stat(path)
        except OSError:  # seen moved already (a rollback): the next save writes afresh
            st = None
        if st is None:
            self._bases.clear()
            return
        file = StableBase(stable, path, (st.st_dev, st.st_ino), st.st_size, st.st_mtime_ns)
        self._bases.append(_Base(file, step, origin, shared))

    def settle(self, reports: list[RankReport], snapshot: Snapshot | None) -> Settled:
        """Nothing to refuse (DCP's own plan agreed who wrote what); rank 0 records what an
        incremental save is: the parameters that require grad, and each linked file's step
        of origin."""
        if self.rank != 0 or not self.config.incremental or snapshot is None:
            return Settled()
        reused = {p: s for r in reports for p, s in r.route.get("reused", {}).items()}
        return Settled(
            incremental={
                "trainable": list(snapshot.trainable),
                **({"reused": reused} if reused else {}),
            }
        )

    def abandon(self, snapshot: Snapshot | None, step: int) -> None:
        """The tmp location, removed by rank 0, held all of this save's files: its frozen
        file is let go of, never remembered as a base; the committed bases stay."""
        if snapshot is not None:
            snapshot.frozen = None


@dataclasses.dataclass(frozen=True)
class _Base:
    """One of this rank's stable files, as a committed save left it."""

    file: StableBase
    step: int
    """The step it was committed in (where a later save links it from)."""
    origin: int
    """The step whose save wrote its bytes (``step``, or earlier when that save linked it)."""
    shared: int
    """How many committed steps share these bytes (``full_every`` bounds it)."""


_PIECE = 8 << 20
"""The most bytes sent to an upload between two looks at the save's stop flag."""


class StoppedError(StorageError):
    """Raised in a rank's upload once another rank's upload failed for good: the save cannot
    commit, so the bytes still to send would be sent for nothing (and the error every rank
    raises is the failing rank's, not this)."""


class _Uploads:
    """This rank's uploads of one save: the save's ``StopFlag``, and the first error one of
    them raised here.

    That error must be kept here because torch.save's writer does not pass on an exception
    its file raised: it fails later with a RuntimeError of its own ("unexpected pos ..."),
    which names no object, and that is what DCP reports. A rank reports the error kept here
    instead."""

    def __init__(self, stop: StopFlag) -> None:
        self.stop = stop
        self.failure: BaseException | None = None
        self.stopped = False
        """Set when an upload of this rank stopped because another upload failed (this
        rank's own failure, if any, is still what it reports)."""
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = exc
        self.stop.set()

    def tee(self, tee: Tee | None) -> Tee | None:
        """``tee``, each of its uploads stopping once another rank's failed."""
        if tee is None:
            return None
        return lambda relative: _StoppingSink(tee(relative), self)


class _StoppingSink:
    """A file's upload that stops when the save's ``StopFlag`` is set, and sets it (keeping
    its error) when the upload itself fails."""

    def __init__(self, sink: Sink, uploads: _Uploads) -> None:
        self.sink, self.uploads = sink, uploads

    def write(self, data: bytes | bytearray | memoryview, /) -> None:
        view = memoryview(data).cast("B")
        # One write may be a whole tensor (gigabytes): the flag is looked at between pieces.
        for at in range(0, len(view), _PIECE) or [0]:
            if self.uploads.stop.is_set():  # another rank's upload failed, or another of ours
                self.uploads.stopped = True
                raise StoppedError(
                    "stopped sending: another upload of this save failed, so nothing can commit"
                )
            try:
                self.sink.write(view[at : at + _PIECE])
            except BaseException as exc:
                self.uploads.failed(exc)
                raise

    def close(self) -> None:
        try:
            self.sink.close()
        except BaseException as exc:
            self.uploads.failed(exc)
            raise

    def abort(self) -> None:
        self.sink.abort()


def _other_failure(failures: dict[int, BaseException]) -> tuple[int, BaseException]:
    """The failure of another rank to report: the first by rank of a dckpt error, then of an
    OS error, then of anything, each before a mere stop (which only echoes another)."""
    ranked = sorted(failures.items(), key=lambda f: f[0])
    for kind in (CheckpointError, OSError, BaseException):
        for rank, failed in ranked:
            if isinstance(failed, kind) and not isinstance(failed, StoppedError):
                return rank, failed
    return ranked[0]


def _tensor_bytes(obj: Any, world_size: int) -> int:
    """Bytes of the tensors in a nested state dict; a DTensor's local shard counts world-wide."""
    if isinstance(obj, DTensor):
        return int(obj.to_local().nbytes) * world_size
    if isinstance(obj, torch.Tensor):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, world_size) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, world_size) for v in obj)
    return 0
