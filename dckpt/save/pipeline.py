"""The background half of CheckpointManager's save: runs on the writer thread.

``SavingMixin._write`` is the job a ``BackgroundWriter`` runs for one save: agreement, DCP's
save through the staging planner and the hashing writer, the coordinator's commit, the log
line and retention. Everything here uses dckpt's *io* group; nothing touches the training
group. See the module docstring of dckpt.manager for the whole protocol.
"""

from __future__ import annotations

import logging
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .. import __version__
from ..config import CheckpointConfig
from ..dist.comm import DECIDED, Comm, Progress
from ..errors import SaveError, describe_os_error, unwrap_dcp_error
from ..faults import fault_point
from ..root.commit import new_tmp_dir
from ..root.manifest import Manifest
from ..root.upkeep import apply_retention
from ..storage.hashing_writer import HashingWriter
from ..train.precision import PrecisionPolicy
from ..train.state import TrainState
from ..units import describe_staging, human_bytes
from .background import SaveHandle, SaveResult
from .coordinator import Coordinator, RankReport
from .mode import SaveMode
from .stager import Snapshot, Stager, StagingSavePlanner
from .step_clock import LoopCost, StepClock

__all__ = ["SaveJob", "SavingMixin"]

log = logging.getLogger("dckpt")


@dataclass(frozen=True, kw_only=True)
class SaveJob:
    """What the foreground hands the writer thread for one save."""

    save_id: str
    snapshot: Snapshot | None
    error: str | None
    epoch: int
    milestone: bool
    extra: dict[str, Any]
    asynchronous: bool


class SavingMixin:
    """The writer-thread half of a save; mixed into CheckpointManager (see its attributes)."""

    root: Path
    config: CheckpointConfig
    state: TrainState
    rank: int
    world_size: int
    run_id: str
    precision: PrecisionPolicy | None
    run_config: dict[str, Any]
    _io: Comm
    _progress: Progress
    _coordinator: Coordinator
    _stager: Stager
    _clock: StepClock
    _mode: SaveMode
    _device: int | None
    _broken: str | None
    _last_save_bytes: int
    _last_committed_step: int | None

    def _write(
        self,
        handle: SaveHandle,
        job: SaveJob,
    ) -> SaveResult:
        """The background half of a save (runs on the writer thread, on the io group).

        Any failure becomes a SaveError that names the ranks that were behind (from the
        progress markers), so a dead or stuck rank is named on every rank.
        """
        try:
            result = self._write_steps(handle, job)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            if not isinstance(exc, SaveError):  # a collective failed: the group is unusable
                self._broken = f"{type(exc).__name__}: {str(exc)[:200]}"
            if self.rank == 0:  # whatever failed, no half-written tmp dir outlives the save
                shutil.rmtree(new_tmp_dir(self.root, handle.step, job.save_id), ignore_errors=True)
            if isinstance(exc, SaveError):  # an outcome every rank agreed on: it says it all
                raise
            outcome = self._failed_outcome(handle.step, job.save_id)
            raise SaveError(
                f"save of step {handle.step} failed (seen from rank {self.rank}), {outcome} ({exc})"
            ) from exc
        finally:
            handle.staged.set()
            self._clock.save_ended(handle.started)
        self._progress.clear(job.save_id)
        return result

    def _failed_outcome(self, step: int, save_id: str) -> str:
        """What this rank can say about a save whose closing collective failed."""
        committed = self._coordinator.committed
        if self.rank == 0 and committed is not None and committed[0] == step:
            self._last_committed_step = step
            return (
                f"but step {step} IS committed at {committed[1]}: only telling the other ranks "
                "failed"
            )
        lag = self._progress.lagging(save_id)
        reported = self._progress.all_reported(save_id)
        if reported and (lag.startswith("rank 0 did not complete the commit") or not lag):
            # Rank 0 had every report: it may have committed before it stopped answering.
            return (
                "rank 0 stopped answering while it committed, so this rank cannot tell "
                "whether the checkpoint was committed; the next resume verifies and finds out"
            )
        return "nothing was committed" + (f": {lag}" if lag else "")

    def _write_steps(
        self,
        handle: SaveHandle,
        job: SaveJob,
    ) -> SaveResult:
        step, t0 = handle.step, handle.started
        save_id, snapshot, extra = job.save_id, job.snapshot, job.extra
        if self._device is not None:
            torch.cuda.set_device(self._device)  # a new thread starts on device 0
        tmp_dir = new_tmp_dir(self.root, step, save_id)
        self._coordinator.committed = None  # this save's, once rank 0 commits it
        self._progress.mark(save_id, "started")
        error = job.error
        if error is None:
            try:
                fault_point("make_tmp", self.rank, step)
                tmp_dir.mkdir(exist_ok=True)  # every rank (shared or not); DCP's mkdir finds it
            except Exception as exc:  # reported to every rank by the agreement below
                error = f"cannot make {tmp_dir}: {describe_os_error(exc, self.root)}"
        if error is None:
            self._progress.mark(save_id, "ready")
        self._coordinator.agree(error, f"preparing the save of step {step}")
        assert snapshot is not None
        t_staging = time.perf_counter()
        writer = HashingWriter(
            tmp_dir,
            algorithm=self.config.digest,
            rank=self.rank,
            thread_count=self.config.io_threads,
            direct=self.config.direct_io,
            on_written=lambda: self._written(save_id, step),
        )
        error = None
        planner = StagingSavePlanner(
            self._stager,
            snapshot,
            handle.staged,
            cancelled=lambda: handle.cancelled,
            on_stage=lambda: fault_point("stage", self.rank, step),
        )
        try:
            with self._io.quiet():
                dcp_save(
                    snapshot.state_dict,
                    storage_writer=writer,
                    planner=planner,
                    process_group=self._io.group,
                    no_dist=not self._io.distributed,
                )
            fault_point("dcp_finish", self.rank, step)
            self._progress.mark(save_id, "dcp_done")
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            error = f"writing shards failed: {describe_os_error(unwrap_dcp_error(exc), self.root)}"
        finally:
            handle.staged.set()
        t_written = time.perf_counter()
        report = RankReport(
            rank=self.rank,
            records=tuple(writer.records()),
            error=error,
            timings={
                "prepare_s": t_staging - t0,
                "write_s": t_written - t_staging,
                **planner.stats.as_timings(),
            },
        )

        def build(reports: list[RankReport]) -> Manifest:
            # rank 0's stall, and what the save cost its loop, as known at commit time
            now = time.perf_counter()
            extra["stall_s"] = handle.stall_s if job.asynchronous else now - t0
            cost = self._clock.cost(t0, extra["stall_s"], now)
            self._mode.record(job.asynchronous, cost)
            extra["cost"] = cost
            manifest = self._manifest(
                step=step,
                epoch=job.epoch,
                milestone=job.milestone,
                save_id=save_id,
                reports=reports,
                t0=t0,
                extra=extra,
            )
            extra["timings"] = manifest.timings  # for rank 0's log line
            return manifest

        self._progress.mark(save_id, "reported")
        outcome = self._coordinator.finish_save(
            tmp_dir,
            step,
            report,
            build,
            on_decided=lambda: self._progress.mark(save_id, DECIDED),
            abandoned=lambda: handle.cancelled,  # the watchdog gave up on it: never land late
        )
        handle.past_commit = True
        assert outcome.path is not None
        commit_s = time.perf_counter() - t0
        stall_s = handle.stall_s if job.asynchronous else commit_s
        result = SaveResult(
            step=step,
            path=Path(outcome.path),
            bytes=outcome.total_bytes,
            files=outcome.files,
            stall_s=stall_s,
            commit_s=commit_s,
        )
        self._last_save_bytes, self._last_committed_step = result.bytes, step
        if self.rank == 0:
            timings = extra.get("timings", {})
            cost: LoopCost = extra["cost"]
            log.info(
                "dckpt: saved step %d | %s in %d files | %s | committed in %.3f s | "
                "%s/s | %s digests | %s | %s",
                step,
                human_bytes(result.bytes),
                result.files,
                cost.phrase(result.commit_s),
                result.commit_s,
                human_bytes(result.bytes / max(result.commit_s, 1e-9)),
                self.config.digest,
                describe_staging(timings) if job.asynchronous else "live state written",
                result.path,
            )
            if self.config.retention.enabled:
                try:
                    apply_retention(self.root, self.config.retention)
                except Exception as exc:  # the save itself is committed; never fail it here
                    log.error("dckpt retention failed, nothing more was deleted: %r", exc)
        return result

    def _written(self, save_id: str, step: int) -> None:
        fault_point("write_shards", self.rank, step)
        self._progress.mark(save_id, "written")

    def _manifest(
        self,
        *,
        step: int,
        epoch: int,
        milestone: bool,
        save_id: str,
        reports: list[RankReport],
        t0: float,
        extra: dict[str, Any],
    ) -> Manifest:
        records = tuple(sorted(rec for r in reports for rec in r.records))
        return Manifest(
            step=step,
            epoch=epoch,
            world_size=self.world_size,
            files=records,
            run_id=self.run_id,
            save_id=save_id,
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
                **({"scaler": extra["scaler"]} if "scaler" in extra else {}),
            },
            loss=extra["loss"],
            metric=extra["metric"],
            timings={
                "stall_s": extra.get("stall_s", 0.0),
                **(extra["cost"].timings() if "cost" in extra else {}),
                **_merge_timings(reports),
                "to_commit_s": time.perf_counter() - t0,
            },
            bytes_per_rank=tuple(
                sum(rec.bytes for rec in r.records) for r in sorted(reports, key=lambda r: r.rank)
            ),
            milestone=milestone,
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
