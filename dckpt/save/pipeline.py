"""The save, in protocol order: ``SavePipeline``. This docstring is the save protocol.

``save(step)`` is called by every rank with the same step, in the same order.

In the foreground (``dckpt.save.saver.Saver.save``, on the caller's thread):

1. the previous save, if still writing, is waited for (or, with ``if_busy="skip"``, all ranks
   agree to skip this one); its error, if it failed, is raised here;
2. with ``async_save="auto"``, while undecided (the first few saves), rank 0's plan (background
   or synchronous) is broadcast on dckpt's control group;
3. ``SavePipeline.prepare``: the state dict is taken and the ``Stager`` takes this rank's
   snapshot: CPU tensors copied now, CUDA tensors copied on the training stream (queued, so
   ordered before whatever the loop queues next), non-tensor values deep-copied; no collective
   runs on the training group, and none at all in the foreground after step 2. The result is
   an immutable ``SaveJob``.

In the background (``SavePipeline.run``, on the save thread, on dckpt's *io* group; steps
4-10 below are its body, in this order; nothing calls back up into the manager):

4. **agree**: rank 0 lets the strategy make room (``CommitStrategy.begin``: an object store
   uncommits a step saved again), every rank makes the tmp location
   (``CommitStrategy.tmp_location``) and all ranks learn whether any rank failed to prepare
   (``Coordinator.agree``);
5. **DCP save**: ``dcp.save`` plans; the ``StagingSavePlanner`` drains device buffers to pinned
   host memory (and, with ``overlap_staging``, takes the copies it deferred), then sets the
   ticket's ``staged``; the ``HashingWriter`` writes each shard file with its digest computed
   as the bytes go out (for an object store, ``CommitStrategy.tee`` also sends them to the
   store as they are written, and ``publish`` then checks that each file arrived whole);
6. **gather**: every rank's ``RankReport`` (files and digests, or its error) on every rank;
7. **commit**, rank 0 only: any report's error refuses the save (the tmp location removed);
   else rank 0 reads what the save cost the training loop (``StepClock``), builds the manifest
   from every report, writes it and runs the commit strategy (``RenameCommit``: fsync, rename,
   ``latest``; ``ObjectCommit``: every object present, the lock still held, the manifest PUT
   last, ``latest``), unless the ticket was cancelled;
8. **mark decided**: rank 0's progress marker (past ``rename``: committed, or refused), so a
   rank that loses rank 0 now can say whether a commit may have happened;
9. **broadcast**: rank 0's outcome; every rank returns the committed path or raises the same
   ``SaveError`` (nothing committed, older checkpoints intact);
10. **retention**, rank 0 only, after its one-line log: a failure here is logged, never fails
    the committed save.

A memory save (``save(step, tier="memory")``) takes the same steps with other means: in step
3 the state is copied into the node's memory (dckpt.save.memory.stage; no stager), and steps
4-10 are ``_memory_steps``, in the order dckpt.tiers.memory_node's docstring gives (agree,
digests, gather and the layout agreement, rank 0's manifest broadcast, each node's commit,
the replicas). Its agreed failure fails its handle only, logged by rank 0.

``save()`` returns after step 3, or after step 10 for a synchronous save. A failure in 4-9 on
any rank fails the save on every rank and commits nothing; a failed collective also marks
dckpt's group as lost (``group_lost``): the next ``save()`` asks for a restart. The fault hook
(dckpt.faults) names the points of this protocol with ``dckpt.phases.Phase``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from .. import __version__
from ..config import CheckpointConfig
from ..dist.comm import Comm
from ..dist.progress import DECIDED, Progress, SaveTrace
from ..errors import SaveError, StorageError, describe_os_error, unwrap_dcp_error
from ..phases import Phase
from ..robust import same_level_margin
from ..root.commit import CommitStrategy
from ..root.layout import step_dir_name
from ..root.manifest import Manifest, manifest_bytes
from ..storage.hashing_writer import HashingWriter
from ..storage.records import FileRecord
from ..tiers.memory_node import MemoryNode
from ..train import rng
from ..train.precision import PrecisionPolicy
from ..train.state import TrainState
from ..units import describe_staging, human_bytes
from .coordinator import Coordinator, RankReport, SaveOutcome
from .handle import SaveResult, SaveTicket
from .memory import Staged, agree_on_layout, stage
from .mode import SaveMode
from .stager import Snapshot, Stager, StagingSavePlanner, Watch, watch_versions
from .step_clock import LoopCost, StepClock

__all__ = ["SaveJob", "SavePipeline"]

log = logging.getLogger("dckpt")


class _PreparingError(Exception):
    """The commit strategy could not make room for a save (its message says where)."""


@dataclass(frozen=True, kw_only=True)
class SaveJob:
    """What the foreground hands the save thread for one save; never changed after."""

    step: int
    save_id: str
    started: float
    """``time.perf_counter()`` when ``save()`` was called."""
    snapshot: Snapshot | None
    error: str | None
    """Why this rank could not take its snapshot (reported to every rank in step 4)."""
    epoch: int
    milestone: bool
    asynchronous: bool
    loss: dict[str, Any]
    metric: dict[str, float]
    scaler: dict[str, Any] | None
    tier: str = "durable"
    memory_file: Staged | None = None
    """A memory save: this rank's file, written in ``save()`` (dckpt.save.memory)."""


@dataclass(frozen=True)
class _Decision:
    outcome: SaveOutcome
    manifest: Manifest | None = None
    cost: LoopCost | None = None


class SavePipeline:
    """Prepares a save in the foreground and runs it in the background; see the docstring."""

    def __init__(
        self,
        *,
        io: Comm,
        progress: Progress,
        strategy: CommitStrategy,
        config: CheckpointConfig,
        state: TrainState,
        precision: PrecisionPolicy | None,
        run_id: str,
        run_config: dict[str, Any],
        stager: Stager,
        clock: StepClock,
        mode: SaveMode,
        memory: MemoryNode | None = None,
    ) -> None:
        self.io = io
        self.memory = memory
        self.progress = progress
        self.strategy = strategy
        self.coordinator = Coordinator(io, config.directory, strategy)
        self.config = config
        self.root = config.directory
        self.state = state
        self.precision = precision
        self.run_id = run_id
        self.run_config = run_config
        self.stager = stager
        self.clock = clock
        self.mode = mode
        self.rank, self.world_size = io.rank, io.world_size
        self.device: int | None = None
        """The CUDA device of the caller (a new thread starts on device 0)."""
        self.group_lost: str | None = None
        """Set when a collective of a save failed: dckpt's group is unusable from then on."""
        self.last_bytes = 0
        self.last_committed_step: int | None = None
        self._saves = 0
        self._warned_losses = False

    # --- foreground ---------------------------------------------------------------------------

    def prepare(
        self,
        step: int,
        *,
        started: float,
        epoch: int | None,
        milestone: bool,
        metric: float | None,
        loss: dict[str, Any],
        asynchronous: bool,
        tier: str = "durable",
    ) -> SaveJob:
        """Step 3: this rank's snapshot of the state as the immutable job (on error, the job
        carries the error, for every rank to learn in step 4)."""
        self._saves += 1
        save_id = xxhash.xxh3_128_hexdigest(f"{self.run_id}:{step}:{self._saves}".encode())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.device = torch.cuda.current_device()
        self.state.step = step
        if epoch is not None:
            self.state.epoch = epoch
        every = self.config.milestone_every
        snapshot: Snapshot | None = None
        scaler: dict[str, Any] | None = None
        error: str | None = None
        memory_file: Staged | None = None
        try:
            state_dict = self.state.state_dict()
            # Taken now, at the point the training loop will continue from after a resume.
            state_dict["rng"] = {f"rank_{self.rank}": rng.capture()}
            if state_dict.get("scaler"):  # recorded in the manifest: readable without torch
                scale = float(state_dict["scaler"]["scale"])
                scaler = {
                    "scale": scale if math.isfinite(scale) else str(scale),  # JSON has no NaN
                    "growth_tracker": int(state_dict["scaler"].get("_growth_tracker", 0)),
                }
            if tier == "memory":  # its file, written now, is the snapshot
                assert self.memory is not None  # the manager refuses the tier without one
                memory_file = stage(self.memory, step, save_id, state_dict)
            else:
                if self.rank == 0:
                    self._check_free_space(step, state_dict)
                if asynchronous:
                    snapshot = self.stager.snapshot(state_dict, self._deferred())
                else:  # the caller waits for the commit: write the live state
                    snapshot = self.stager.live(state_dict)
            self.progress.trace(save_id, step).at(Phase.PREPARE)
        except Exception as exc:
            error = (
                str(exc)
                if isinstance(exc, StorageError)
                else f"taking the state dict failed: {exc!r}"
            )
        return SaveJob(
            step=step,
            save_id=save_id,
            started=started,
            snapshot=snapshot,
            error=error,
            epoch=self.state.epoch,
            milestone=milestone or (every is not None and step % every == 0),
            asynchronous=asynchronous,
            loss=loss,
            metric={} if metric is None else {"value": float(metric)},
            scaler=scaler,
            tier=tier,
            memory_file=memory_file,
        )

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

    # --- background ---------------------------------------------------------------------------

    def run(self, job: SaveJob, ticket: SaveTicket) -> SaveResult:
        """Steps 4-10 on the save thread. Any failure becomes a SaveError that names the ranks
        that were behind (from the progress markers), so a dead or stuck rank is named on
        every rank."""
        memory = self.memory if job.tier == "memory" else None
        if memory is not None:
            tmp = memory.tmp_location(job.step, job.save_id)
        else:
            tmp = self.strategy.tmp_location(self.root, job.step, job.save_id)
        try:
            if memory is not None:
                result = self._memory_steps(job, ticket, tmp, memory)
            else:
                result = self._steps(job, ticket, tmp)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            if not isinstance(exc, SaveError):  # a collective failed: the group is unusable
                self.group_lost = f"{type(exc).__name__}: {str(exc)[:200]}"
            if self.rank == 0 or (memory is not None and memory.first):
                shutil.rmtree(tmp, ignore_errors=True)  # no half-written tmp dir outlives it
            if isinstance(exc, SaveError):  # an outcome every rank agreed on: it says it all
                if memory is not None and self.rank == 0:  # not raised by the next save()
                    log.error("dckpt: %s. Training goes on; the next memory save tries again.", exc)
                raise
            outcome = self._failed_outcome(job.step, job.save_id)
            raise SaveError(
                f"save of step {job.step} failed (seen from rank {self.rank}), {outcome} ({exc})"
            ) from exc
        finally:
            ticket.staged.set()
            self.clock.save_ended(job.started)
        self.progress.clear(job.save_id)
        return result

    def _steps(self, job: SaveJob, ticket: SaveTicket, tmp: Path) -> SaveResult:
        if self.device is not None:
            torch.cuda.set_device(self.device)
        trace = self.progress.trace(job.save_id, job.step)
        self.coordinator.committed = None  # this save's, once rank 0 commits it
        self._agree(job, trace, tmp)  # 4
        report = self._write(job, ticket, trace, tmp)  # 5
        reports = self.coordinator.gather(report)  # 6
        decision = self._decide(job, ticket, tmp, reports) if self.rank == 0 else None  # 7
        if self.rank == 0:
            self.progress.mark(job.save_id, DECIDED)  # 8
        try:
            outcome = self.coordinator.announce(decision.outcome if decision else None, job.step)
        except SaveError:  # decided: nothing of this save is needed here any more
            self._drop_local_copy(tmp)
            raise
        self._drop_local_copy(tmp)  # 9
        ticket.decided = True
        result = self._result(job, ticket, outcome)
        if decision is not None:
            self._log(job, result, decision)
            self._retention()  # 10
        return result

    def _memory_steps(
        self, job: SaveJob, ticket: SaveTicket, tmp: Path, memory: MemoryNode
    ) -> SaveResult:
        """Steps 4-10 for a memory save, in dckpt.save.memory's protocol order."""
        ticket.staged.set()  # the memory file, written in save(), is the snapshot
        self.progress.trace(job.save_id, job.step).passed(Phase.PREPARE)
        what = f"preparing the memory save of step {job.step}"
        self.coordinator.agree(job.error, what, f"{job.step} (memory)")
        t_hash = time.perf_counter()
        error: str | None = None
        records: tuple[FileRecord, ...] = ()
        try:
            assert job.memory_file is not None
            records = (memory.digest(job.memory_file.path, self.config.digest),)
        except Exception as exc:  # reported to every rank by the gather below
            error = f"hashing its memory copy failed: {describe_os_error(exc, memory.dir)}"
        report = RankReport(
            rank=self.rank,
            records=records,
            error=error,
            loss=job.loss,
            metric=job.metric,
            timings={"hash_s": time.perf_counter() - t_hash},
        )
        reports = self.coordinator.gather(report)  # 6
        staged = job.memory_file
        assert staged is not None  # a rank without one failed the agreement
        layouts = self.io.all_gather((staged.signature, staged.shared))
        kind = memory.owners[2] if memory.owners and layouts[0][1] is not None else False
        layout_problem = agree_on_layout(memory, layouts)  # and the next save's layout
        cost: LoopCost | None = None
        told: bytes | str | None = None
        if self.rank == 0:  # 7: the manifest, or why there is none
            failed = [f"rank {r.rank}: {r.error}" for r in reports if r.error is not None]
            if failed or layout_problem:
                told = "; ".join(failed) or layout_problem
            else:
                try:
                    cost = self.clock.cost(job.started, ticket.stall_s, time.perf_counter())
                    manifest = self._manifest(job, reports, ticket.stall_s, cost)
                    mesh = {
                        **manifest.mesh,
                        "tier": "memory",
                        "nodes": list(memory.topology.node_of),
                        "replicas": memory.topology.replicas(),
                        "root_id": memory.root_id,
                        # whose files hold each other's replicated tensors ("world":
                        # every rank's; "node": each node's), False: none
                        "shared": kind,
                        "after": memory.anchor,
                    }
                    told = manifest_bytes(dataclasses.replace(manifest, mesh=mesh))
                except Exception as exc:
                    told = f"rank 0 could not build the manifest: {exc!r}"
        told = self.io.broadcast(told)
        committed_here = False
        mine: str | None = None
        if isinstance(told, bytes) and memory.first:  # the node's commit
            try:
                memory.commit_node(tmp, job.step, told)
                committed_here = True
            except Exception as exc:
                mine = f"node {memory.node}: {describe_os_error(exc, memory.dir)}"
        node_errors = [e for e in self.io.all_gather(mine) if e is not None]
        failure = told if isinstance(told, str) else "; ".join(node_errors) or None
        if failure is not None:
            if committed_here:  # another node failed: no node keeps half a memory save
                memory.uncommit(job.step)
            raise SaveError(
                f"memory save of step {job.step} failed, nothing was committed (the durable "
                f"checkpoints are untouched): {failure}"
            )
        ticket.decided = True
        commit_s = time.perf_counter() - job.started
        result = SaveResult(
            step=job.step,
            path=memory.own / step_dir_name(job.step),
            bytes=sum(r.bytes for rep in reports for r in rep.records),
            files=len(reports),
            stall_s=ticket.stall_s,
            commit_s=commit_s,
        )
        # 10: the replicas, then (first save) a reserved slot; neither fails the save
        replicas = self.io.all_gather(memory.replicate(job.step) if memory.first else None)
        memory.reserve(memory.own / step_dir_name(job.step) / staged.path.name)
        if self.rank == 0:
            assert cost is not None
            self._log_memory(job, result, cost, memory, replicas)
        return result

    def _log_memory(
        self,
        job: SaveJob,
        result: SaveResult,
        cost: LoopCost,
        memory: MemoryNode,
        replicas: list[dict[str, Any] | None],
    ) -> None:
        topology = memory.topology
        parts = []
        for rank, reply in enumerate(replicas):
            if reply is None:
                continue
            node, partner = topology.node_of[rank], topology.partner(topology.node_of[rank])
            if partner is None:
                parts.append("no partner node (one node): local copy only")
            elif reply.get("ok"):
                parts.append(
                    f"node {node} -> node {partner} verified in {float(reply['seconds']):.3f} s"
                )
            else:
                parts.append(f"node {node} -> node {partner} FAILED: {reply.get('error')}")
        line = (
            "dckpt: saved step %d to memory | %s in %d files | %s | committed in %.3f s | "
            "%s/s | %s digests | replicas: %s | %s"
        )
        (log.info if all(r is None or r.get("ok") for r in replicas) else log.warning)(
            line,
            job.step,
            human_bytes(result.bytes),
            result.files,
            cost.phrase(result.commit_s),
            result.commit_s,
            human_bytes(result.bytes / max(result.commit_s, 1e-9)),
            self.config.digest,
            "; ".join(parts),
            result.path,
        )

    def _drop_local_copy(self, tmp: Path) -> None:
        """After the outcome is known on every rank: a rank whose node does not share rank
        0's root (an object store's local mirror) removes its own copy of the tmp dir."""
        if self.rank != 0 and tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)

    def _agree(self, job: SaveJob, trace: SaveTrace, tmp: Path) -> None:
        trace.passed(Phase.PREPARE)
        error = job.error
        if error is None:
            try:
                trace.at(Phase.MAKE_TMP)
                if self.rank == 0:  # e.g. uncommit a step saved again, before any byte lands
                    try:
                        self.strategy.begin(self.root, job.step)
                    except Exception as exc:
                        raise _PreparingError(
                            f"cannot prepare {self.strategy.where(self.root, job.step)}: {exc}"
                        ) from exc
                tmp.mkdir(exist_ok=True)  # every rank (shared or not); DCP's mkdir finds it
            except _PreparingError as exc:
                error = str(exc)
            except Exception as exc:  # reported to every rank by the agreement below
                error = f"cannot make {tmp}: {describe_os_error(exc, self.root)}"
        if error is None:
            trace.passed(Phase.MAKE_TMP)
        self.coordinator.agree(error, f"preparing the save of step {job.step}", str(job.step))

    def _write(self, job: SaveJob, ticket: SaveTicket, trace: SaveTrace, tmp: Path) -> RankReport:
        assert job.snapshot is not None  # a rank without one failed the agreement
        t_staging = time.perf_counter()
        writer = HashingWriter(
            tmp,
            algorithm=self.config.digest,
            rank=self.rank,
            thread_count=self.config.io_threads,
            direct=self.config.direct_io,
            trace=trace,
            tee=self.strategy.tee(tmp, job.step, trace),
        )
        planner = StagingSavePlanner(
            self.stager, job.snapshot, ticket.staged, cancelled=ticket.cancelled, trace=trace
        )
        error: str | None = None
        try:
            with self.io.quiet():
                dcp_save(
                    job.snapshot.state_dict,
                    storage_writer=writer,
                    planner=planner,
                    process_group=self.io.group,
                    no_dist=not self.io.distributed,
                )
            trace.at(Phase.DCP_FINISH)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            error = f"writing shards failed: {describe_os_error(unwrap_dcp_error(exc), self.root)}"
        finally:
            ticket.staged.set()
        publish_s = 0.0
        if error is None:
            try:  # an object store: every file this rank wrote must be complete there
                publish_s = self.strategy.publish(
                    tmp, writer.records(), rank=self.rank, step=job.step, trace=trace
                )
                trace.passed(Phase.DCP_FINISH)
            except Exception as exc:
                error = f"uploading shards failed: {describe_os_error(exc, self.root)}"
        return RankReport(
            rank=self.rank,
            records=tuple(writer.records()),
            error=error,
            loss=job.loss,
            metric=job.metric,
            timings={
                "prepare_s": t_staging - job.started,
                "write_s": time.perf_counter() - t_staging - publish_s,
                **({"upload_s": publish_s} if publish_s else {}),
                **planner.stats.as_timings(),
            },
        )

    def _decide(
        self, job: SaveJob, ticket: SaveTicket, tmp: Path, reports: list[RankReport]
    ) -> _Decision:
        refused = self.coordinator.refusal(tmp, reports)
        if refused is not None:
            return _Decision(refused)
        self._check_agreement(job, reports)
        try:
            # rank 0's stall, and what the save cost its loop, as known at commit time
            now = time.perf_counter()
            stall_s = ticket.stall_s if job.asynchronous else now - job.started
            cost = self.clock.cost(job.started, stall_s, now)
            self.mode.record(job.asynchronous, cost)
            manifest = self._manifest(job, reports, stall_s, cost)
        except Exception as exc:  # nothing may be committed without its manifest
            shutil.rmtree(tmp, ignore_errors=True)
            return _Decision(
                SaveOutcome(
                    path=None,
                    error=f"rank 0 could not commit: {describe_os_error(exc, self.root)}",
                )
            )
        return _Decision(self.coordinator.commit(tmp, manifest, ticket.cancelled), manifest, cost)

    def _check_agreement(self, job: SaveJob, reports: list[RankReport]) -> None:
        """Rank 0's manifest records rank 0's metric and losses: say when another rank passed a
        different metric (every save), or losses unlike rank 0's (once a run)."""
        mine = job.metric.get("value")
        differ = [
            f"rank {r.rank}: {r.metric.get('value')}"
            for r in reports
            if r.rank != self.rank and r.metric and r.metric.get("value") != mine
        ]
        if differ:
            log.warning(
                "dckpt: save(metric=...) differs across ranks (rank 0: %s; %s). Rank 0's value "
                "is recorded and ranks best_k; compute it on every rank alike, or broadcast "
                "rank 0's, so the choice is deliberate.",
                mine,
                "; ".join(differ),
            )
        tail = job.loss.get("tail")
        if self._warned_losses or not isinstance(tail, list) or len(tail) < 3:
            return
        mine_median = job.loss["median"]
        margin = same_level_margin(tail)
        off = [
            f"rank {r.rank}: median {r.loss['median']:.4g}"
            for r in reports
            if r.rank != self.rank
            and isinstance(r.loss.get("median"), float)
            and abs(r.loss["median"] - mine_median) > margin
        ]
        if off:
            self._warned_losses = True
            log.warning(
                "dckpt: the ranks pass observe() different losses (rank 0: median %.4g; %s). "
                "The manifest records rank 0's, and after a resume each rank's first losses "
                "are compared with them: pass the same loss on every rank (all-reduce it) so "
                "the loss watch compares like with like.",
                mine_median,
                "; ".join(off),
            )

    def _result(self, job: SaveJob, ticket: SaveTicket, outcome: SaveOutcome) -> SaveResult:
        assert outcome.path is not None
        commit_s = time.perf_counter() - job.started
        result = SaveResult(
            step=job.step,
            path=Path(outcome.path),
            bytes=outcome.total_bytes,
            files=outcome.files,
            stall_s=ticket.stall_s if job.asynchronous else commit_s,
            commit_s=commit_s,
        )
        self.last_bytes, self.last_committed_step = result.bytes, job.step
        if self.memory is not None:  # later memory saves follow this durable step
            self.memory.anchor = job.step
        return result

    def _log(self, job: SaveJob, result: SaveResult, decision: _Decision) -> None:
        assert decision.manifest is not None and decision.cost is not None
        log.info(
            "dckpt: saved step %d | %s in %d files | %s | committed in %.3f s | "
            "%s/s | %s digests | %s | %s",
            job.step,
            human_bytes(result.bytes),
            result.files,
            decision.cost.phrase(result.commit_s),
            result.commit_s,
            human_bytes(result.bytes / max(result.commit_s, 1e-9)),
            self.config.digest,
            describe_staging(decision.manifest.timings)
            if job.asynchronous
            else "live state written",
            self.strategy.where(self.root, job.step),
        )

    def _retention(self) -> None:
        if not self.config.retention.enabled:
            return
        try:
            self.strategy.retain(self.root, self.config.retention)
        except Exception as exc:  # the save itself is committed; never fail it here
            log.error("dckpt retention failed, nothing more was deleted: %r", exc)

    def _failed_outcome(self, step: int, save_id: str) -> str:
        """What this rank can say about a save whose closing collective failed."""
        committed = self.coordinator.committed
        if self.rank == 0 and committed is not None and committed[0] == step:
            self.last_committed_step = step
            return (
                f"but step {step} IS committed at {committed[1]}: only telling the other ranks "
                "failed"
            )
        lag = self.progress.lagging(save_id)
        reported = self.progress.all_reported(save_id)
        if reported and (lag.startswith("rank 0 did not complete the commit") or not lag):
            # Rank 0 had every report: it may have committed before it stopped answering.
            return (
                "rank 0 stopped answering while it committed, so this rank cannot tell "
                "whether the checkpoint was committed; the next resume verifies and finds out"
            )
        return "nothing was committed" + (f": {lag}" if lag else "")

    def _manifest(
        self, job: SaveJob, reports: list[RankReport], stall_s: float, cost: LoopCost
    ) -> Manifest:
        records = tuple(sorted(rec for r in reports for rec in r.records))
        return Manifest(
            step=job.step,
            epoch=job.epoch,
            world_size=self.world_size,
            files=records,
            run_id=self.run_id,
            save_id=job.save_id,
            created_at=time.time(),
            digest_algorithm=self.config.digest,
            state=(*self.state.categories(), "rng"),
            versions={
                "dckpt": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            mesh={"world_size": self.world_size},
            config=self.run_config,
            precision={
                **(self.precision.describe() if self.precision is not None else {}),
                **({"scaler": job.scaler} if job.scaler is not None else {}),
            },
            loss=job.loss,
            metric=job.metric,
            timings={
                "stall_s": stall_s,
                **cost.timings(),
                **_merge_timings(reports),
                "to_commit_s": time.perf_counter() - job.started,
            },
            bytes_per_rank=tuple(
                sum(rec.bytes for rec in r.records) for r in sorted(reports, key=lambda r: r.rank)
            ),
            milestone=job.milestone,
        )


def _merge_timings(reports: list[RankReport]) -> dict[str, float]:
    """All ranks' timings as one: bytes add up; a phase takes as long as its slowest rank."""
    merged: dict[str, float] = {}
    for report in reports:
        for key, value in report.timings.items():
            if key.endswith("_bytes"):
                merged[key] = merged.get(key, 0.0) + value
            else:
                merged[key] = max(merged.get(key, 0.0), value)
    return merged


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
