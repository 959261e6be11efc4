"""CheckpointManager: the one object a training script holds.

Save protocol (``save``), called by every rank with the same step, in the same order:
1. the previous save, if still writing, is waited for (or, with ``if_busy="skip"``, all ranks
   agree to skip this one); its error, if it failed, is raised here;
2. foreground: the state dict is taken and the ``Stager`` takes this rank's snapshot: CPU
   tensors copied now, CUDA tensors copied on the training stream (queued, so ordered before
   whatever the loop queues next), non-tensor values deep-copied (see stager.py); no
   collective runs on the training group, and none at all in the foreground;
3. background (``writer.BackgroundWriter``), on dckpt's own gloo group: all ranks agree that
   step 2 succeeded everywhere; ``dcp.save`` plans, drains device buffers to pinned host
   memory (and, with ``overlap_staging``, takes the copies it deferred), and writes through
   ``HashingWriter`` (a digest per file, computed as bytes go out);
4. ``Coordinator.finish_save``: digests gathered to rank 0, manifest written, atomic commit,
   outcome broadcast. An error on any rank fails the save on all ranks and commits nothing.
``save()`` returns after step 2, or after the commit (a synchronous save). With
``overlap_staging`` the deferred copies are complete before the next ``optimizer.step()``
runs: an optimizer step pre-hook calls ``before_optimizer_step()``. The same hook times every
step (``step_clock.StepClock``): rank 0 reads from the step times what each save cost the
loop, beyond its stall, for the save line and the manifest. With ``async_save="auto"``
(``save_mode.SaveMode``), rank 0 decides from those costs whether saves run in the
background; while it is undecided (the first few saves), ``save()`` broadcasts rank 0's plan
on dckpt's control group before step 2.

Load protocol (``load``), after draining any save in flight:
1. rank 0 chooses the step (newest committed, or the one asked for) and broadcasts it;
2. every rank reads and validates the manifest (schema, safe paths, self-digest), checks the
   layout (regular files of the recorded sizes) and verifies ``.metadata``; a failure on any
   rank is raised on every rank; the ranks compare manifest digests;
3. DCP loads through ``VerifyingReader``: each file this rank reads is hashed as it is read and
   must match the manifest, before any tensor is filled from it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor

from .config import CheckpointConfig
from .dist.comm import Comm, Progress
from .errors import CheckpointError, SaveError, WorldError
from .faults import fault_point
from .load.config_check import SAFE_CONFIG_KEYS
from .load.loss_watch import LossWatch
from .load.report import ResumeReport
from .load.resumer import LoadingMixin, LoadResult
from .preemption import Preemption
from .root.commit import recover
from .root.lock import LockError, RunLock
from .save.background import BackgroundWriter, SaveHandle, SaveResult
from .save.coordinator import Coordinator
from .save.mode import SaveMode
from .save.pipeline import SaveJob, SavingMixin
from .save.stager import Snapshot, Stager, Watch, watch_versions
from .save.step_clock import StepClock
from .stopping import StoppingMixin
from .train import rng
from .train.precision import PrecisionPolicy
from .train.state import TrainState
from .units import human_bytes

__all__ = ["CheckpointManager", "LoadResult", "ResumeReport", "SaveHandle", "SaveResult"]

log = logging.getLogger("dckpt")


def _ensure_visible_logging() -> None:
    # Users must see one line per save and per load even when their script configured nothing.
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


class CheckpointManager(SavingMixin, LoadingMixin, StoppingMixin):
    """Saves and loads one run's checkpoints under a root; see the module docstring.

    Args:
        config: a CheckpointConfig, or just the root directory.
        state: the TrainState to save and to load into.
        run_config: the training configuration (JSON-able), stored in every manifest and
            compared on resume.
        run_id: names the run in manifests and in the run lock (a restart of the same run
            may take over its lock at once). Defaults to ``$DCKPT_RUN_ID``, then torchrun's
            run id (``--rdzv-id``), then a new uuid. Set ``DCKPT_RUN_ID`` to a value that
            survives a requeue (e.g. ``$SLURM_JOB_ID``) when each requeue gets a new
            rendezvous id.
        precision: the PrecisionPolicy in use, recorded in every manifest, compared on resume.
        allow_config_changes: config keys that may change across a resume (beyond
            ``dckpt.resume.SAFE_CONFIG_KEYS``) with a warning instead of an error.

    Use it as a context manager, or call ``close()``: it drains the save in flight.
    """

    def __init__(
        self,
        config: CheckpointConfig | str | os.PathLike[str],
        state: TrainState,
        *,
        run_config: dict[str, Any] | None = None,
        run_id: str | None = None,
        precision: PrecisionPolicy | None = None,
        allow_config_changes: tuple[str, ...] | list[str] = (),
    ) -> None:
        if not isinstance(config, CheckpointConfig):
            config = CheckpointConfig(root=Path(config))
        self.config = config
        self.root = config.root
        self.state = state
        try:  # stored as JSON in every manifest and compared on resume: normalise it once
            self.run_config: dict[str, Any] = json.loads(
                json.dumps(dict(run_config or {}), allow_nan=False, default=str)
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"run_config must be JSON-serialisable (finite numbers): {exc}"
            ) from None
        self.precision = precision
        if precision is not None:
            precision.check_model(state.model)
            scaler_on = state.scaler is not None and getattr(state.scaler, "is_enabled", bool)()
            if precision.needs_scaler and not scaler_on:
                raise ValueError(
                    "precision fp16 needs a GradScaler in the TrainState (its state is part of "
                    "every checkpoint): TrainState(..., scaler=policy.make_scaler(device_type))"
                )
        self._allowed_changes = SAFE_CONFIG_KEYS | frozenset(allow_config_changes)
        self._loss_watch = LossWatch()
        _ensure_visible_logging()
        # Two groups, created in the same order on every rank: foreground calls (load, skip
        # decisions) never interleave with the background save's collectives.
        self._ctl = Comm(config.timeout_s)
        self._io = Comm(config.timeout_s)
        self.rank = self._ctl.rank
        self.world_size = self._ctl.world_size
        self._coordinator = Coordinator(self._io, self.root)
        self._progress = Progress(self._io)
        self._stager = Stager(config.device_staging_bytes)
        self._writer = BackgroundWriter()
        self._clock = StepClock()
        self._mode = SaveMode(config.async_save)
        self._saves = 0
        self._closed = False
        self._broken: str | None = None
        self._last_save_bytes = 0
        self._last_committed_step: int | None = None
        self._preemption: Preemption | None = None
        self._device: int | None = None
        # The background save bounds each of its own waits by timeout_s and names a late rank
        # when one expires; joining it waits for that to happen, with a margin, never forever.
        self._join_timeout = config.watchdog_s
        self.run_id = str(
            self._ctl.broadcast(
                run_id
                or os.environ.get("DCKPT_RUN_ID")
                or os.environ.get("TORCHELASTIC_RUN_ID")
                or uuid.uuid4().hex
            )
        )
        failure: CheckpointError | None = None
        self._lock: RunLock | None = None
        if self.rank == 0:
            try:
                if self.root.exists() and not self.root.is_dir():
                    raise CheckpointError(f"{self.root} exists and is not a directory")
                self.root.mkdir(parents=True, exist_ok=True)
                if config.lock:
                    self._lock = RunLock(self.root, self.run_id, config.lock_lease_s)
                    self._lock.acquire()
                recover(self.root)
            except LockError as exc:
                failure = exc
            except (OSError, CheckpointError) as exc:
                failure = CheckpointError(f"cannot use checkpoint root {self.root}: {exc}")
        failure = self._ctl.broadcast(failure)
        if failure is not None:
            self._ctl.close()
            self._io.close()
            raise failure
        self._hook: Any = None
        if state.optimizer is not None:
            self._hook = state.optimizer.register_step_pre_hook(
                lambda _opt, _args, _kwargs: self._on_optimizer_step()
            )

    # --- saving -----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        epoch: int | None = None,
        milestone: bool = False,
        metric: float | None = None,
    ) -> SaveHandle:
        """Save the state as ``step`` on every rank; returns once training may go on.

        ``milestone=True`` (or a step that is a multiple of ``milestone_every``) keeps this
        checkpoint through retention; ``metric`` ranks it for ``best_k``.

        The returned handle's ``result()`` blocks until the checkpoint is committed. An error
        of this save is raised by the next ``save()``, ``wait()`` or ``close()`` on every rank.
        """
        self._check_open()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if metric is not None and not math.isfinite(metric):
            raise ValueError(f"metric must be a finite number (best-k ranks by it), got {metric}")
        self._raise_if_stuck()
        if self._broken is not None:
            self._writer.raise_if_failed()  # the detailed error first, naming the late rank
            raise WorldError(
                f"an earlier save failed inside a collective ({self._broken}); dckpt's process "
                "group cannot recover from that. Restart the job: it resumes from the last "
                "committed checkpoint."
            )
        t0 = time.perf_counter()
        self._writer.raise_if_failed()
        in_flight = self._writer.current
        if self.config.if_busy == "skip" and self._mode.asynchronous:
            busy = self._ctl.all_gather(in_flight is not None)
            if any(busy):
                return self._skip(step, busy)
        if in_flight is not None:
            self._writer.join(self._join_timeout)
            if self.rank == 0:
                log.info(
                    "dckpt: save of step %d waits for step %d to finish writing "
                    "(saving faster than the disk; see if_busy='skip')",
                    step,
                    in_flight.step,
                )
            self._writer.raise_if_failed()
        if self._mode.deciding:  # async_save="auto", first saves: rank 0 measured, all follow
            mine = self._mode.plan() if self.rank == 0 else None
            plan = self._ctl.broadcast(mine)
            assert plan is not None  # rank 0 always sends one
            self._mode.apply(plan)
            if self.rank == 0 and plan.message:
                log.info("dckpt: %s", plan.message)
        asynchronous = self._mode.asynchronous

        self._saves += 1
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._device = torch.cuda.current_device()
        save_id = xxhash.xxh3_128_hexdigest(f"{self.run_id}:{step}:{self._saves}".encode())
        handle = SaveHandle(step, t0)
        self.state.step = step
        if epoch is not None:
            self.state.epoch = epoch
        epoch = self.state.epoch
        loss = self._loss_watch.summary()
        every = self.config.milestone_every
        milestone = milestone or (every is not None and step % every == 0)
        extra: dict[str, Any] = {
            "loss": loss,
            "metric": {} if metric is None else {"value": float(metric)},
        }
        snapshot: Snapshot | None = None
        error: str | None = None
        try:
            state_dict = self.state.state_dict()
            # Taken now, at the point the training loop will continue from after a resume.
            state_dict["rng"] = {f"rank_{self.rank}": rng.capture()}
            if state_dict.get("scaler"):  # recorded in the manifest: readable without torch
                scale = float(state_dict["scaler"]["scale"])
                extra["scaler"] = {
                    "scale": scale if math.isfinite(scale) else str(scale),  # JSON has no NaN
                    "growth_tracker": int(state_dict["scaler"].get("_growth_tracker", 0)),
                }
            if self.rank == 0:
                self._check_free_space(step, state_dict)
            if asynchronous:
                snapshot = self._stager.snapshot(state_dict, self._deferred_storages())
            else:  # the caller waits for the commit: write the live state
                snapshot = self._stager.live(state_dict)
            fault_point("prepare", self.rank, step)
        except Exception as exc:
            error = f"taking the state dict failed: {exc!r}"

        job = SaveJob(
            save_id=save_id,
            snapshot=snapshot,
            error=error,
            epoch=epoch,
            milestone=milestone,
            extra=extra,
            asynchronous=asynchronous,
        )
        self._clock.save_started(t0)
        self._writer.submit(
            handle,
            lambda h: self._write(h, job),
            deadline_s=self.config.watchdog_s,
            describe_stuck=lambda: self._progress.lagging(save_id),
        )
        if not asynchronous:
            try:
                handle.result()
            except BaseException:
                self._writer.clear_failed()  # delivered here; the next save() starts clean
                raise
        now = time.perf_counter()
        handle.stall_s = now - t0
        self._clock.save_returned(t0, now)
        return handle

    def _check_free_space(self, step: int, state_dict: dict[str, Any]) -> None:
        """Warn before staging when the root's file system cannot hold this save.

        The estimate is the previous save's size, or (first save) the bytes of the tensors in
        this state dict, with each sharded tensor counted for the whole world.
        """
        need = self._last_save_bytes or _tensor_bytes(state_dict, self.world_size)
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

    def _on_optimizer_step(self) -> None:
        self._clock.tick()
        if self.config.overlap_staging:
            self.before_optimizer_step()

    def before_optimizer_step(self) -> None:
        """Block until the save in flight has its copy of the state (with ``overlap_staging``,
        called by a step pre-hook; without it, the copy is always taken in ``save()``).

        With ``overlap_staging``, call it yourself before any in-place change of parameters or
        optimizer state that does not happen inside ``optimizer.step()``.
        """
        handle = self._writer.current
        if handle is not None:
            handle.wait_staged(self._join_timeout)

    def wait(self) -> SaveResult | None:
        """Block until the save in flight is committed; raise if any earlier save failed."""
        self._raise_if_stuck()
        if self._broken is not None:
            self._writer.raise_if_failed()
            raise SaveError(f"{self._broken}; restart the job")
        handle = self._writer.current
        self._writer.join(self._join_timeout)
        self._writer.raise_if_failed()
        return handle.result() if handle is not None else None

    def _raise_if_stuck(self) -> None:
        """After the watchdog gave up on a save: raise its error once, then refuse to save
        (the stuck thread may still hold dckpt's group and its files)."""
        stuck = self._writer.stuck
        if stuck is not None and self._broken is None:
            self._broken = f"the save of step {stuck.step} got stuck and never finished"
            self._writer.raise_if_failed()

    def _skip(self, step: int, busy: list[bool]) -> SaveHandle:
        handle = SaveHandle(step, time.perf_counter())
        handle.skipped = True
        handle._finish(None, None)
        if self.rank == 0:
            ranks = [r for r, b in enumerate(busy) if b]
            log.warning(
                "dckpt: skipped the save of step %d: the previous save is still writing on "
                "rank(s) %s (if_busy='skip')",
                step,
                ranks,
            )
        return handle

    def _deferred_storages(self) -> Watch:
        """Tensors whose copy may wait until the next optimizer step (``overlap_staging``):
        only what the hooked optimizer changes, its parameters and its state."""
        opt = self.state.optimizer
        if opt is None or not self.config.overlap_staging:
            return {}
        tensors = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        for per_param in opt.state.values():
            tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
        return watch_versions(tensors)

    # --- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Drain the save in flight, release dckpt's groups, then raise any save's error.

        Idempotent. Call it before ``destroy_process_group``.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._writer.stuck is not None:
                log.error(
                    "dckpt: closing with the save of step %d still stuck in the background; "
                    "this process may not exit until its storage answers",
                    self._writer.stuck.step,
                )
            else:
                self._writer.join(self._join_timeout)
        finally:
            if self._hook is not None:
                self._hook.remove()
            if self._preemption is not None:
                self._preemption.uninstall()
            if self._lock is not None:
                if self._writer.stuck is not None:
                    self._lock.abandon()  # the stuck write may still land: keep others out
                else:
                    self._lock.release()
            self._io.close()
            self._ctl.close()
        self._writer.raise_if_failed()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_exc:  # the error already in flight matters more
            log.error("dckpt: while closing after an error: %r", close_exc)

    # --- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")


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
