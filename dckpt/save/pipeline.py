"""The save, in protocol order: ``SavePipeline``. This docstring is the save protocol.

``save(step, tier=...)`` is called by every rank with the same step and tier, in the same
order. Every tier takes the same steps; what differs is the tier's *route*
(dckpt.save.route: ``DurableRoute`` for the root, ``MemoryRoute`` for the memory tier) and
its commit strategy (``RenameCommit``, ``ObjectCommit``, ``MemoryCommit``), both built by
the tier's factory (dckpt.tier), never chosen by a branch here.

In the foreground (``dckpt.save.saver.Saver.save``, on the caller's thread):

1. the previous save, if still writing, is waited for (or, with ``if_busy="skip"``, all ranks
   agree to skip this one); its error, if it failed, is raised here;
2. with ``async_save="auto"``, while undecided (the first few saves), rank 0's plan (background
   or synchronous) is broadcast on dckpt's control group (a route that cannot block, the
   memory tier's, always runs in the background);
3. ``SavePipeline.prepare``: the state dict is taken, with this rank's RNG state, and the
   route takes this rank's snapshot (``route.snapshot``): the durable route's ``Stager``
   copies CPU tensors now and queues CUDA copies on the training stream; the memory route
   copies the state into this rank's file in its node's memory. No collective runs on the
   training group, and none at all in the foreground after step 2. The result is an
   immutable ``SaveJob``.

In the background (``SavePipeline.run``, on the save thread, on dckpt's *io* group; steps
4-10 below are its body, in this order; nothing calls back up into the manager):

4. **agree**: every rank makes the tmp location (``CommitStrategy.tmp_location``,
   ``make_tmp``; rank 0 first lets the strategy make room: an object store uncommits a step
   saved again) and all ranks learn whether any rank failed to prepare, or was given another
   step or tier (``Coordinator.agree``);
5. **write** (``route.write``): this rank's files with their digests, computed as the bytes
   go out (DCP's save through the ``HashingWriter``; the memory file hashed where it lies),
   as its ``RankReport``;
6. **gather**: every rank's report (files and digests, or its error) to rank 0, or to every
   rank for a route whose ``settle`` and ``finish`` need them there
   (``route.reports_everywhere``: the memory tier; an all-gather whose size grows with the
   world); then ``route.settle``, the route's verdict (``Settled``: the memory tier refuses
   files written with two layouts; what the manifest records of the save);
7. **commit**, rank 0 only: any report's error, or a refusal from step 6, refuses the save
   (the tmp location removed); so do the ranks' value checks (``dckpt.save.findings.judge``:
   copies of a replicated value that differ across ranks, unless ``replica_check="warn"``;
   a tensor holding NaN or Inf, unless ``allow_nonfinite``), what they let through being
   marked in the manifest's ``integrity``; else rank 0 reads what the save cost the training
   loop (``StepClock``), builds the manifest from every report (``Settled.mesh`` and
   ``.incremental`` add what the tier records), writes it into the tmp location and runs the
   commit strategy (``RenameCommit``: fsync, rename, ``latest``; ``ObjectCommit``: every
   object present, the lock still held, the manifest PUT last; ``MemoryCommit``: the
   manifest into the root's ledger), unless the ticket was cancelled;
8. **mark decided**: rank 0's progress marker (past ``rename``: committed, or refused), so a
   rank that loses rank 0 now can say whether a commit may have happened;
9. **broadcast**: rank 0's outcome; every rank returns the committed path or raises the same
   ``SaveError`` (nothing committed, older checkpoints intact; ``route.abandon`` tidies);
10. **finish**: ``route.finish`` on every rank, with step 6's verdict (the memory tier's
    replicas to the partner node, over dckpt's group, each verified on arrival; a failed
    replica never fails the committed save), rank 0's one-line log, then retention
    (``CommitStrategy.retain``, rank 0): a failure here is logged, never fails the committed
    save.

``save()`` returns after step 3, or after step 10 for a synchronous save. A failure in 4-9 on
any rank fails the save on every rank and commits nothing; a failed collective also marks
dckpt's group as lost (``group_lost``): the next ``save()`` asks for a restart. A save whose
route is ``soft`` (the memory tier) fails its handle only, logged by rank 0. The fault hook
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

from ..collective.comm import Comm
from ..collective.progress import DECIDED, Progress, SaveTrace
from ..config import CheckpointConfig
from ..errors import CheckpointError, SaveError, StorageError, describe_os_error
from ..phases import Phase
from ..robust import same_level_margin
from ..root.manifest import Manifest
from ..root.provenance import ManifestKey
from ..tiers.memory_commit import Lineage
from ..train import rng
from ..train.precision import PrecisionPolicy
from ..train.state import TrainState, describe_layout
from ..units import human_bytes
from ..version import __version__
from .coordinator import Coordinator, RankReport, SaveOutcome
from .findings import Verdict, judge
from .handle import SaveResult, SaveTicket
from .mode import SaveMode
from .route import Finished, SaveJob, SaveRoute, SaveTier, Settled
from .step_clock import LoopCost, StepClock

__all__ = ["SaveJob", "SavePipeline"]

log = logging.getLogger("dckpt")


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
        config: CheckpointConfig,
        state: TrainState,
        precision: PrecisionPolicy | None,
        run_id: str,
        run_config: dict[str, Any],
        clock: StepClock,
        mode: SaveMode,
        lineage: Lineage,
        key: ManifestKey | None = None,
    ) -> None:
        self.io = io
        self.key = key
        """The job's manifest key (``CheckpointConfig.key_file``): rank 0 signs every
        manifest with it, whatever the tier."""
        self.progress = progress
        self.config = config
        self.root = config.directory
        self.state = state
        self.precision = precision
        self.run_id = run_id
        self.run_config = run_config
        self.clock = clock
        self.mode = mode
        self.lineage = lineage
        self.rank, self.world_size = io.rank, io.world_size
        self.device: int | None = None
        """The CUDA device of the caller (a new thread starts on device 0)."""
        self.group_lost: str | None = None
        self.fenced: str | None = None
        """Why this job commits nothing more (another job holds its root's run lock now):
        set on every rank by the save whose commit found it so."""
        """Set when a collective of a save failed: dckpt's group is unusable from then on."""
        self.last_committed: dict[str, int] = {}
        """The step of each tier's last committed save, by the tier's name."""
        self.last_was_anchor = False
        """Whether the last committed save was to the tier the lineage rests on (a run whose
        last one was leaves nothing in memory that the root lacks)."""
        self.committed: tuple[int, str] | None = None
        """On rank 0: (step, where) of the save it committed last, even if telling the other
        ranks failed afterwards."""
        self._saves = 0
        self._warned_losses = False
        self._warned_unchecked = False
        self._warned_uncompared = False
        self._steps_at: dict[str, int] = {}
        """Per tier: the optimizer steps seen at its previous ``save()`` (``SaveJob.stepped``)."""

    # --- foreground ---------------------------------------------------------------------------

    def prepare(
        self,
        tier: SaveTier,
        step: int,
        *,
        started: float,
        waited_s: float = 0.0,
        epoch: int | None,
        milestone: bool,
        metric: float | None,
        loss: dict[str, Any],
        asynchronous: bool,
    ) -> SaveJob:
        """Step 3: this rank's snapshot of the state as the immutable job (on error, the job
        carries the error, for every rank to learn in step 4)."""
        self._saves += 1
        save_id = xxhash.xxh3_128_hexdigest(f"{self.run_id}:{step}:{self._saves}".encode())
        seen = self.clock.steps_seen
        stepped = seen - self._steps_at.get(tier.name, seen)
        self._steps_at[tier.name] = seen
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.device = torch.cuda.current_device()
        self.state.at(step, epoch)
        every = self.config.milestone_every
        snapshot: Any = None
        scaler: dict[str, Any] | None = None
        layout: dict[str, Any] = {}
        error: str | None = None
        trace = self.progress.trace(save_id, step)
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
            layout = describe_layout(state_dict)  # before the stager copies or drops anything
            snapshot = tier.route.snapshot(
                state_dict, step=step, save_id=save_id, asynchronous=asynchronous, trace=trace
            )
            trace.at(Phase.PREPARE)
        except Exception as exc:
            error = (
                str(exc)
                if isinstance(exc, StorageError)
                else f"taking the state dict failed: {exc!r}"
            )
        return SaveJob(
            tier=tier,
            step=step,
            save_id=save_id,
            started=started,
            waited_s=waited_s,
            snapshot=snapshot,
            error=error,
            epoch=self.state.epoch,
            milestone=milestone or (every is not None and step % every == 0),
            asynchronous=asynchronous,
            loss=loss,
            metric={} if metric is None else {"value": float(metric)},
            scaler=scaler,
            layout=layout,
            stepped=stepped,
        )

    # --- background ---------------------------------------------------------------------------

    def run(self, job: SaveJob, ticket: SaveTicket) -> SaveResult:
        """Steps 4-10 on the save thread. Any failure becomes a SaveError that names the ranks
        that were behind (from the progress markers), so a dead or stuck rank is named on
        every rank."""
        route = job.route
        tmp = route.strategy.tmp_location(self.root, job.step, job.save_id)
        self.io.begin(f"{route.noun} of step {job.step}")  # a heartbeat while it runs
        try:
            result = self._steps(job, ticket, tmp)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            ticket.failing = True  # it ends on its own now: not for the watchdog
            if not isinstance(exc, SaveError):  # a collective failed: the group is unusable
                self.group_lost = f"{type(exc).__name__}: {str(exc)[:200]}"
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # no half-written tmp dir outlives it
            if isinstance(exc, SaveError):  # an outcome every rank agreed on: it says it all
                route.abandon(job.snapshot, job.step)
                if route.soft and self.rank == 0:  # not raised by the next save()
                    log.error(
                        "dckpt: %s. Training goes on; the next %s tries again.", exc, route.noun
                    )
                raise
            outcome = self._failed_outcome(job)
            lost = SaveError(
                f"save of step {job.step} failed (seen from rank {self.rank}), {outcome} ({exc})"
            )
            lost.agreed = False  # kept and raised in the training thread, even for a soft save
            raise lost from exc
        finally:
            self.io.end()
            ticket.staged.set()
            self.clock.save_ended(job.started)
        self.progress.clear(job.save_id)
        return result

    def _steps(self, job: SaveJob, ticket: SaveTicket, tmp: Path) -> SaveResult:
        if self.device is not None:
            torch.cuda.set_device(self.device)
        route = job.route
        trace = self.progress.trace(job.save_id, job.step)
        self.committed = None  # this save's, once rank 0 commits it
        coordinator = Coordinator(self.io, self.root, route.strategy)
        self._agree(job, trace, tmp, coordinator)  # 4
        mine = RankReport(rank=self.rank, loss=job.loss, metric=job.metric)
        report = route.write(job.snapshot, ticket, trace, tmp, mine)  # 5
        reports = coordinator.gather(report, everywhere=route.reports_everywhere)  # 6
        settled = route.settle(reports, job.snapshot)
        decision = None
        if self.rank == 0:  # 7
            decision = self._decide(job, ticket, tmp, reports, settled, coordinator)
            self.progress.mark(job.save_id, DECIDED)  # 8
        try:
            outcome = coordinator.announce(decision.outcome if decision else None, job.step)
        except SaveError:  # decided: nothing of this save is needed here any more
            self._drop_local_copy(tmp)
            self.fenced = self.fenced or coordinator.fenced
            raise
        self._drop_local_copy(tmp)  # 9
        ticket.decided = True
        result = self._result(job, ticket, outcome)  # committed: its time is taken now
        timings = decision.manifest.timings if decision and decision.manifest else {}
        finished = route.finish(job, reports, settled, timings, trace, outcome.total_bytes)  # 10
        if finished.lost is not None:
            self.group_lost = finished.lost
        result = dataclasses.replace(result, replicas_s=finished.replicas_s)
        if decision is not None:
            self._log(job, result, decision, finished)
            self._retention(route)
        return result

    def _drop_local_copy(self, tmp: Path) -> None:
        """After the outcome is known on every rank: a rank whose node does not share rank
        0's root (an object store's local mirror) removes its own copy of the tmp dir."""
        if self.rank != 0 and tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)

    def _agree(self, job: SaveJob, trace: SaveTrace, tmp: Path, coordinator: Coordinator) -> None:
        trace.passed(Phase.PREPARE)
        error = job.error
        strategy = job.route.strategy
        if error is None:
            try:
                trace.at(Phase.MAKE_TMP)
                # every rank (DCP's mkdir finds it); rank 0 first makes room for the step, before
                # any byte lands (an object store uncommits a step saved again)
                strategy.make_tmp(self.root, tmp, job.step, coordinator=self.rank == 0)
            except CheckpointError as exc:  # the strategy's own words
                error = str(exc)
            except Exception as exc:  # reported to every rank by the agreement below
                error = f"cannot make {tmp}: {describe_os_error(exc, self.root)}"
        if error is None:
            trace.passed(Phase.MAKE_TMP)
        what = f"preparing the {job.route.noun} of step {job.step}"
        coordinator.agree(error, what, f"{job.step} ({job.tier.name})")

    def _decide(
        self,
        job: SaveJob,
        ticket: SaveTicket,
        tmp: Path,
        reports: list[RankReport],
        settled: Settled,
        coordinator: Coordinator,
    ) -> _Decision:
        verdict = judge(
            ((r.rank, r.findings) for r in reports),
            step=job.step,
            replica_check=self.config.replica_check,
            allow_nonfinite=self.config.allow_nonfinite,
            stepped=job.stepped,
            capture_on=self.config.capture_check,
        )
        refusal = coordinator.refusal(tmp, reports, settled.refused or verdict.refusal)
        if refusal is not None:
            return _Decision(refusal)
        for warning in verdict.warnings:
            log.warning("%s", warning)
        if verdict.unchecked and not self._warned_unchecked:
            self._warned_unchecked = True  # the same tensors each save: said once a run
            log.warning(
                "dckpt: %d tensor(s) cannot be checked for replica agreement or NaN/Inf and "
                "are saved unchecked (sparse or quantized tensors, or a GPU without memory "
                "left for the check): %s",
                len(verdict.unchecked),
                ", ".join(verdict.unchecked[:5]),
            )
        if verdict.uncompared and not self._warned_uncompared:
            self._warned_uncompared = True  # the same tensors each save: said once a run
            log.warning(
                "dckpt: %d tensor(s) were saved without their written bytes compared with the "
                "state at save(): the writer never saw their bytes go out (a torch that "
                "serializes them differently, or a dckpt bug: please report it with this "
                "line). Their file digests still cover them, and the manifest counts them "
                "(capture.uncompared): %s",
                len(verdict.uncompared),
                ", ".join(verdict.uncompared[:5]),
            )
        self._warn_if_ranks_disagree(job, reports)
        try:
            # rank 0's stall, and what the save cost its loop, as known at commit time
            now = time.perf_counter()
            stall_s = ticket.stall_s if job.asynchronous else now - job.started
            cost = self.clock.cost(job.started, stall_s, now)
            if job.route.can_block:  # the automatic mode learns from saves it may choose
                self.mode.record(job.asynchronous, cost, waited_s=job.waited_s)
            manifest = self._manifest(job, reports, settled, stall_s, cost, verdict)
        except Exception as exc:  # nothing may be committed without its manifest
            shutil.rmtree(tmp, ignore_errors=True)
            return _Decision(
                SaveOutcome(
                    path=None,
                    error=f"rank 0 could not commit: {describe_os_error(exc, self.root)}",
                )
            )
        outcome = coordinator.commit(tmp, manifest, ticket.cancelled)
        if outcome.path is not None:
            self.committed = (job.step, outcome.path)
        return _Decision(outcome, manifest, cost)

    def _warn_if_ranks_disagree(self, job: SaveJob, reports: list[RankReport]) -> None:
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
        self.last_committed[job.tier.name] = job.step
        self.last_was_anchor = job.tier.anchor
        self.lineage.committed(job.step, anchor=job.tier.anchor)  # later memory saves follow
        return result

    def _log(
        self, job: SaveJob, result: SaveResult, decision: _Decision, finished: Finished
    ) -> None:
        assert decision.manifest is not None and decision.cost is not None
        (log.info if finished.ok else log.warning)(
            "dckpt: saved step %d%s | %s in %d files | %s | committed in %.3f s | "
            "%s/s | %s digests | %s | %s",
            job.step,
            job.route.label,
            human_bytes(result.bytes),
            result.files,
            decision.cost.phrase(result.commit_s),
            result.commit_s,
            human_bytes(result.bytes / max(result.commit_s, 1e-9)),
            self.config.digest,
            finished.line,
            job.route.strategy.where(self.root, job.step),
        )

    def _retention(self, route: SaveRoute) -> None:
        try:
            route.strategy.retain(self.root, self.config.retention)
        except Exception as exc:  # the save itself is committed; never fail it here
            log.error("dckpt retention failed, nothing more was deleted: %r", exc)

    def _failed_outcome(self, job: SaveJob) -> str:
        """What this rank can say about a save whose closing collective failed."""
        step, save_id = job.step, job.save_id
        committed = self.committed
        if self.rank == 0 and committed is not None and committed[0] == step:
            self.last_committed[job.tier.name] = step
            return (
                f"but step {step} IS committed at {committed[1]}: only telling the other ranks "
                "failed"
            )
        lag = self.progress.lagging(save_id)
        silent = self.io.late()  # who stopped answering, by their heartbeats
        reported = self.progress.all_reported(save_id)
        if reported and (lag.startswith("rank 0 did not complete the commit") or not lag):
            # Rank 0 had every report: it may have committed before it stopped answering.
            return (
                "rank 0 stopped answering while it committed, so this rank cannot tell "
                "whether the checkpoint was committed; the next resume verifies and finds out"
                + (f" ({silent})" if silent else "")
            )
        lag = "; ".join(x for x in (lag, silent) if x)
        return "nothing was committed" + (f": {lag}" if lag else "")

    def _manifest(
        self,
        job: SaveJob,
        reports: list[RankReport],
        settled: Settled,
        stall_s: float,
        cost: LoopCost,
        verdict: Verdict,
    ) -> Manifest:
        records = tuple(sorted(rec for r in reports for rec in r.records))
        manifest = Manifest(
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
            mesh={
                "world_size": self.world_size,
                **settled.mesh,
                **({"device_mesh": m} if (m := job.layout.get("device_mesh")) else {}),
            },
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
            integrity=verdict.marks,
            capture=verdict.capture,
            incremental=settled.incremental,
            data=job.layout.get("data", {}),
        )
        return manifest if self.key is None else self.key.sign(manifest)


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
