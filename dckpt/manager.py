"""CheckpointManager: the one object a training script holds.

Save protocol (``save``), called by every rank with the same step, in the same order:
1. the previous save, if still writing, is waited for (or, with ``if_busy="skip"``, all ranks
   agree to skip this one); its error, if it failed, is raised here;
2. foreground: the state dict is taken and handed to the ``Stager`` (buffers and non-tensor
   values copied now; parameters and optimizer state copied later, see stager.py); no
   collective runs on the training group, and none at all in the foreground;
3. background (``writer.BackgroundWriter``), on dckpt's own gloo group: all ranks agree that
   step 2 succeeded everywhere; ``dcp.save`` plans, stages this rank's deferred items,
   and writes them through ``HashingWriter`` (a digest per file, computed as bytes go out);
4. ``Coordinator.finish_save``: digests gathered to rank 0, manifest written, atomic commit,
   outcome broadcast. An error on any rank fails the save on all ranks and commits nothing.
``save()`` returns after step 2 (with ``overlap_staging``) or once staging is complete
(``async_save``), or after the commit (neither). The copy is always complete before the next
``optimizer.step()`` runs: an optimizer step pre-hook calls ``before_optimizer_step()``.

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
import os
import platform
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from . import __version__, rng
from .comm import Comm, Progress
from .commit import new_tmp_dir, quarantine, recover
from .config import CheckpointConfig
from .coordinator import Coordinator, RankReport
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigMismatchError,
    IncompatibleCheckpointError,
    IntegrityError,
    ManifestError,
    SaveError,
    StateMismatchError,
    StorageError,
    WorldError,
)
from .faults import fault_point
from .housekeeping import apply_retention
from .layout import committed_steps, list_checkpoints, step_dir_name
from .lock import LockError, RunLock
from .manifest import Manifest, check_layout, read_manifest
from .precision import PrecisionPolicy
from .resume import SAFE_CONFIG_KEYS, LossWatch, ResumeReport, check_config
from .stager import Stager, StagingSavePlanner, storage_versions
from .state import TrainState
from .storage.hashing_writer import HashingWriter
from .storage.verifying_reader import SafeLoadPlanner, VerifyingReader, open_verified
from .world import warmup_collective
from .writer import BackgroundWriter, SaveHandle, SaveResult

__all__ = ["CheckpointManager", "LoadResult", "ResumeReport", "SaveHandle", "SaveResult"]

log = logging.getLogger("dckpt")


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What the foreground hands the writer thread for one save."""

    save_id: str
    snapshot: dict[str, Any] | None
    deferred: dict[int, int]
    error: str | None
    epoch: int
    milestone: bool
    extra: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """A verified load: which step, from where, how much was checked and how long it took."""

    step: int
    path: Path
    bytes: int
    files_verified: int
    seconds: float
    manifest: Manifest


def _ensure_visible_logging() -> None:
    # Users must see one line per save and per load even when their script configured nothing.
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _unwrap(exc: BaseException) -> BaseException:
    """The first dckpt error inside DCP's CheckpointException, if any."""
    if isinstance(exc, CheckpointException):
        for _rank, (inner, _trace) in sorted(exc.failures.items()):
            if isinstance(inner, CheckpointError):
                return inner
    return exc


class CheckpointManager:
    """Saves and loads one run's checkpoints under a root; see the module docstring.

    Args:
        config: a CheckpointConfig, or just the root directory.
        state: the TrainState to save and to load into.
        run_config: the training configuration (JSON-able), stored in every manifest and
            compared on resume.
        run_id: names the run in manifests; defaults to torchrun's run id or a new uuid.
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
        self._stager = Stager()
        self._writer = BackgroundWriter()
        self._saves = 0
        self._closed = False
        self._broken: str | None = None
        self._device: int | None = None
        # The background save bounds each of its own waits by timeout_s and names a late rank
        # when one expires; joining it waits for that to happen, with a margin, never forever.
        self._join_timeout = 4 * config.timeout_s + 30
        self.run_id = str(
            self._ctl.broadcast(run_id or os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex)
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
        if config.overlap_staging and state.optimizer is not None:
            self._hook = state.optimizer.register_step_pre_hook(
                lambda _opt, _args, _kwargs: self.before_optimizer_step()
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
        if self._broken is not None:
            raise WorldError(
                f"an earlier save failed inside a collective ({self._broken}); dckpt's process "
                "group cannot recover from that. Restart the job: it resumes from the last "
                "committed checkpoint."
            )
        t0 = time.perf_counter()
        self._writer.raise_if_failed()
        in_flight = self._writer.current
        if self.config.if_busy == "skip" and self.config.async_save:
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
        extra = {"loss": loss, "metric": {} if metric is None else {"value": float(metric)}}
        snapshot: dict[str, Any] | None = None
        deferred: dict[int, int] = {}
        error: str | None = None
        try:
            state_dict = self.state.state_dict()
            # Taken now, at the point the training loop will continue from after a resume.
            state_dict["rng"] = {f"rank_{self.rank}": rng.capture()}
            if self.config.async_save:
                # Parameters and optimizer state are staged by the planner, once DCP's
                # de-duplicated plan is known: each rank copies only what it writes.
                deferred = self._deferred_storages()
                snapshot = self._stager.snapshot(state_dict, deferred)
            else:
                snapshot = state_dict  # the caller waits for the commit: write the live state
            fault_point("prepare", self.rank, step)
        except Exception as exc:
            error = f"taking the state dict failed: {exc!r}"

        job = _Job(
            save_id=save_id,
            snapshot=snapshot,
            deferred=deferred,
            error=error,
            epoch=epoch,
            milestone=milestone,
            extra=extra,
        )
        self._writer.submit(handle, lambda h: self._write(h, job))
        if not self.config.async_save:
            try:
                handle.result()
            except BaseException:
                self._writer.clear_failed()  # delivered here; the next save() starts clean
                raise
        elif not self.config.overlap_staging:
            handle.wait_staged(self._join_timeout)
        handle.stall_s = time.perf_counter() - t0
        return handle

    def before_optimizer_step(self) -> None:
        """Block until the save in flight has its copy of the state (called by a step pre-hook).

        Call it yourself before any in-place change of parameters or optimizer state that does
        not happen inside ``optimizer.step()``.
        """
        handle = self._writer.current
        if handle is not None:
            handle.wait_staged(self._join_timeout)

    def wait(self) -> SaveResult | None:
        """Block until the save in flight is committed; raise if any earlier save failed."""
        handle = self._writer.current
        self._writer.join(self._join_timeout)
        self._writer.raise_if_failed()
        return handle.result() if handle is not None else None

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

    def _deferred_storages(self) -> dict[int, int]:
        """Tensors whose copy may wait for the background: only what the hooked optimizer
        changes (its parameters and its state); with overlap, nothing else may wait."""
        opt = self.state.optimizer
        if opt is None or (self.config.overlap_staging and self._hook is None):
            return {}
        tensors = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        for per_param in opt.state.values():
            tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
        return storage_versions(tensors)

    def _write(
        self,
        handle: SaveHandle,
        job: _Job,
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
            lag = self._progress.lagging(job.save_id)
            if isinstance(exc, SaveError) and not lag:
                raise
            raise SaveError(
                f"save of step {handle.step} failed (seen from rank {self.rank}), nothing was "
                "committed" + (f": {lag}" if lag else "") + f" ({exc})"
            ) from exc
        finally:
            handle.staged.set()
        self._progress.clear(job.save_id)
        return result

    def _write_steps(
        self,
        handle: SaveHandle,
        job: _Job,
    ) -> SaveResult:
        step, t0 = handle.step, handle.started
        save_id, snapshot, extra = job.save_id, job.snapshot, job.extra
        if self._device is not None:
            torch.cuda.set_device(self._device)  # a new thread starts on device 0
        tmp_dir = new_tmp_dir(self.root, step, save_id)
        self._progress.mark(save_id, "started")
        self._coordinator.agree(job.error, f"preparing the save of step {step}")
        assert snapshot is not None
        fault_point("stage", self.rank, step)
        t_staging = time.perf_counter()
        writer = HashingWriter(
            tmp_dir,
            algorithm=self.config.digest,
            rank=self.rank,
            thread_count=self.config.io_threads,
            on_written=lambda: self._written(save_id, step),
        )
        error: str | None = None
        planner = StagingSavePlanner(
            self._stager, job.deferred, handle.staged, cancelled=lambda: handle.cancelled
        )
        try:
            with self._io.quiet():
                dcp_save(
                    snapshot,
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
            error = f"writing shards failed: {_unwrap(exc)!r}"
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
                "staged_bytes": float(planner.staged_bytes),
            },
        )

        def build(reports: list[RankReport]) -> Manifest:
            # rank 0's stall as known at commit time
            sync = not self.config.async_save
            extra["stall_s"] = time.perf_counter() - t0 if sync else handle.stall_s
            return self._manifest(
                step=step,
                epoch=job.epoch,
                milestone=job.milestone,
                save_id=save_id,
                reports=reports,
                t0=t0,
                extra=extra,
            )

        self._progress.mark(save_id, "reported")
        outcome = self._coordinator.finish_save(tmp_dir, step, report, build)
        assert outcome.path is not None
        commit_s = time.perf_counter() - t0
        stall_s = commit_s if not self.config.async_save else handle.stall_s
        result = SaveResult(
            step=step,
            path=Path(outcome.path),
            bytes=outcome.total_bytes,
            files=outcome.files,
            stall_s=stall_s,
            commit_s=commit_s,
        )
        if self.rank == 0:
            log.info(
                "dckpt: saved step %d | %s in %d files | stall %.3f s | committed in %.3f s | "
                "%s/s | %s digests | %s",
                step,
                _human(result.bytes),
                result.files,
                result.stall_s,
                result.commit_s,
                _human(result.bytes / max(result.commit_s, 1e-9)),
                self.config.digest,
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

    # --- loading ----------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest committed step under the root (as rank 0 sees it), or None."""
        self._check_open()
        self.wait()
        step = None
        if self.rank == 0:
            steps = committed_steps(self.root)
            step = steps[-1] if steps else None
        return self._ctl.broadcast(step)

    def load(self, step: int | None = None) -> LoadResult:
        """Load the newest committed checkpoint (or ``step``) into the state, fully verified.

        No fallback and no config check: that is ``resume()``. Raises CheckpointNotFoundError
        when there is nothing to load, ManifestError or IntegrityError when the checkpoint must
        not be trusted (nothing is loaded silently).
        """
        self._check_open()
        self.wait()
        chosen: int | str | None = None
        if self.rank == 0:
            steps = committed_steps(self.root) if self.root.is_dir() else []
            if step is None:
                chosen = steps[-1] if steps else "none"
            else:
                chosen = step if step in steps else "none"
        chosen = self._ctl.broadcast(chosen)
        if not isinstance(chosen, int):
            where = "any step" if step is None else f"step {step}"
            raise CheckpointNotFoundError(
                f"no committed checkpoint for {where} under {self.root}; "
                "run `dckpt ls` on it to see what is there"
            )
        result = self._load_step(chosen, ResumeReport(world_size_now=self.world_size), False)
        if self.rank == 0:
            log.info(
                "dckpt: loaded step %d | %s | %d of %d files verified (%s), ranks agree | "
                "%.3f s | %s/s | %s",
                result.step,
                _human(result.bytes),
                result.files_verified,
                len(result.manifest.files),
                result.manifest.digest_algorithm,
                result.seconds,
                _human(result.bytes / max(result.seconds, 1e-9)),
                result.path,
            )
        return result

    def resume(self, *, fallback: bool | None = None) -> ResumeReport:
        """Resume from the newest checkpoint that passes every check; see dckpt.resume.

        Returns the ResumeReport (``report.resumed`` is False on a fresh start) after logging it
        as one block. A checkpoint whose bytes or manifest are bad is quarantined and the next
        older one is tried, unless ``fallback`` is False (default: the config's). Raises
        ConfigMismatchError on an unsafe config change, StateMismatchError when the model does
        not fit the checkpoint, WorldError when the warmup collective fails.
        """
        self._check_open()
        self.wait()
        t0 = time.perf_counter()
        fallback = self.config.fallback if fallback is None else fallback
        listing: list[int] | CheckpointError = []
        if self.rank == 0:
            try:
                listing = sorted(committed_steps(self.root), reverse=True)
            except OSError as exc:
                listing = StorageError(f"cannot list {self.root}: {exc}")
        listing = self._ctl.broadcast(listing)
        if isinstance(listing, CheckpointError):
            raise listing
        steps = listing
        report = ResumeReport(world_size_now=self.world_size)
        result: LoadResult | None = None
        for step in steps:
            report.checks = []
            try:
                result = self._load_step(step, report, True)
                break
            except (IntegrityError, ManifestError) as exc:
                # Only evidence of damage moves a checkpoint aside; a newer schema does not.
                if not fallback or isinstance(exc, IncompatibleCheckpointError):
                    raise
                self._quarantine(step, f"{type(exc).__name__}: {exc}")
                # The report keeps the first sentence; quarantine/<step>.reason.txt has it all.
                report.skipped.append((step, f"{type(exc).__name__}: {str(exc).split('. ')[0]}"))
        if result is None:
            if report.skipped:
                if self.rank == 0:
                    log.error("%s", report.format())
                raise CheckpointError(
                    f"none of the {len(steps)} committed checkpoints under {self.root} passed "
                    "verification; all were moved to quarantine/ (see the report above). "
                    "The model may be partly overwritten by the failed attempts: rebuild it "
                    "before training. Restore a good copy, or start a new run elsewhere."
                )
            quarantined = self._ctl.broadcast(self._quarantined_count() if self.rank == 0 else 0)
            if quarantined:
                raise CheckpointError(
                    f"{self.root} has no committed checkpoint but {quarantined} in quarantine/: "
                    "starting from scratch would silently throw that run away. Inspect them "
                    "(dckpt ls), restore one, or remove quarantine/ to really start over."
                )
            if self.rank == 0:
                log.info("%s", report.format())
            return report
        t_loaded = time.perf_counter()
        if self.config.warmup and self._ctl.distributed:
            latency = warmup_collective(result.manifest.save_id, self.config.timeout_s)
            report.check(
                "warmup all-reduce",
                True,
                f"{self.world_size} ranks answered, sum correct, {latency * 1000:.1f} ms",
            )
        report.timings = {
            "load_and_verify": t_loaded - t0,
            "warmup": time.perf_counter() - t_loaded,
            "total": time.perf_counter() - t0,
        }
        if result.manifest.loss and self.config.loss_watch != "off":
            self._loss_watch.arm(
                result.manifest.loss, self.config.loss_watch_steps, result.path.name
            )
            report.check(
                "loss watch armed",
                True,
                f"next {self.config.loss_watch_steps} losses vs saved mean "
                f"{result.manifest.loss['mean']:.4f} (bound {self._loss_watch.bound():.4f})",
            )
        if self.rank == 0:
            log.info("%s", report.format())
        return report

    def observe(self, loss: float) -> None:
        """Record this step's loss: kept for the manifest, and checked after a resume."""
        message = self._loss_watch.observe(float(loss), self.config.loss_watch)
        if message is not None and self.rank == 0:
            (log.warning if "WARNING" in message else log.info)("%s", message)

    def _quarantined_count(self) -> int:
        return sum(1 for e in list_checkpoints(self.root) if e.status == "quarantined")

    def _quarantine(self, step: int, reason: str) -> None:
        error: str | None = None
        if self.rank == 0:
            try:
                quarantine(self.root, self.root / step_dir_name(step), reason)
            except (OSError, ValueError) as exc:
                error = f"could not quarantine step {step}: {exc}"
        error = self._ctl.broadcast(error)
        if error is not None:
            raise CheckpointError(error)

    def _load_step(self, step: int, report: ResumeReport, check_cfg: bool) -> LoadResult:
        """Validate, verify and load one committed step into the state (RNG last)."""
        t0 = time.perf_counter()
        path = self.root / step_dir_name(step)
        report.step, report.path = None, None
        manifest: Manifest | None = None
        reader: VerifyingReader | None = None
        failure: CheckpointError | None = None
        try:
            manifest = read_manifest(path)
            check_layout(path, manifest)
            reader = VerifyingReader(path, manifest.file_map())
            reader.load_metadata()
            if manifest.step != step:
                raise ManifestError(
                    f"{path}/manifest.json says step {manifest.step}, its directory says {step}"
                )
        except CheckpointError as exc:
            failure = exc
        self._raise_first(failure)
        assert manifest is not None and reader is not None
        report.world_size_saved = manifest.world_size
        report.check(
            "manifest",
            True,
            f"schema {manifest.schema_version}, {len(manifest.files)} files, self-digest ok, "
            "layout ok",
        )
        digests = self._ctl.all_gather(manifest.files_digest)
        if len(set(digests)) != 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise IntegrityError(
                str(path / "manifest.json"),
                digests[0],
                ", ".join(f"rank {r}: {digests[r]}" for r in odd),
                detail="ranks read different manifests",
            )
        report.check("one manifest", True, f"all {self.world_size} ranks read {digests[0]}")
        if check_cfg:
            self._check_config(manifest, path.name, report)
        saved = set(manifest.state)
        missing = [c for c in self.state.categories() if c not in saved]
        if missing:
            raise StateMismatchError(
                f"{path.name} holds no {', '.join(missing)} state (it holds "
                f"{', '.join(manifest.state)}): it was saved by a run set up differently"
            )
        unused = sorted(saved - set(self.state.categories()) - {"rng"})
        if unused:
            report.warnings.append(f"checkpoint state not restored (no such object now): {unused}")

        state_dict = self.state.state_dict()
        self._check_shapes(state_dict, reader, path.name)
        same_world = manifest.world_size == self.world_size and "rng" in saved
        if same_world:
            state_dict["rng"] = {f"rank_{self.rank}": rng.capture()}
        try:
            with self._ctl.quiet():
                dcp_load(
                    state_dict,
                    storage_reader=reader,
                    planner=SafeLoadPlanner(),
                    process_group=self._ctl.group,
                    no_dist=not self._ctl.distributed,
                )
        except CheckpointException as exc:
            inner = _unwrap(exc)
            if inner is not exc:
                raise inner from None
            raise CheckpointError(f"loading {path} failed: {exc}") from None
        files_verified = self._verify_rest(path, manifest, reader)
        report.check(
            "digests",
            True,
            f"{files_verified} of {len(manifest.files)} files hashed and matched "
            f"({manifest.digest_algorithm}); ranks agree on every digest",
        )
        self.state.load_state_dict(state_dict)
        report.check("state", True, ", ".join(c for c in manifest.state if c != "rng"))
        if same_world:
            rng.restore(state_dict["rng"][f"rank_{self.rank}"])
            kinds = "python, numpy, torch" + (
                ", CUDA" if "cuda" in state_dict["rng"][f"rank_{self.rank}"] else ""
            )
            report.rng = f"restored on every rank ({kinds})"
        else:
            rng.reseed(self.state.seed, step, self.rank)
            report.rng = (
                f"reseeded from (seed {self.state.seed}, step {step}, rank): the world size "
                f"changed from {manifest.world_size} to {self.world_size}, so saved per-rank "
                "generator states do not map"
            )
            report.warnings.append(
                "RNG reseeded, not restored: dropout and sampling differ from an uninterrupted run"
            )
        report.step, report.path = step, path
        return LoadResult(
            step=step,
            path=path,
            bytes=manifest.total_bytes,
            files_verified=files_verified,
            seconds=time.perf_counter() - t0,
            manifest=manifest,
        )

    def _check_shapes(self, state_dict: dict[str, Any], reader: VerifyingReader, name: str) -> None:
        """Every tensor to restore has the shape and dtype the checkpoint's metadata records."""
        saved = reader.load_metadata().state_dict_metadata
        flat, _ = flatten_state_dict(state_dict)
        missing = sorted(k for k in flat if k not in saved)
        if missing:
            raise StateMismatchError(
                f"{name} has no value for {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                + ": the model or optimizer has parts the run that saved it did not have "
                "(check the config); the checkpoint is not damaged."
            )
        for fqn, value in flat.items():
            meta = saved.get(fqn)
            if not isinstance(value, torch.Tensor) or not isinstance(meta, TensorStorageMetadata):
                continue
            if tuple(meta.size) != tuple(value.shape) or meta.properties.dtype != value.dtype:
                raise StateMismatchError(
                    f"tensor {fqn}: {name} holds {tuple(meta.size)} {meta.properties.dtype}, "
                    f"the object being restored has {tuple(value.shape)} {value.dtype}. The "
                    "model or optimizer is built differently from the run that saved it "
                    "(check the config); the checkpoint is not damaged."
                )

    def _check_config(self, manifest: Manifest, name: str, report: ResumeReport) -> None:
        changes = check_config(manifest.config, self.run_config, self._allowed_changes, name)
        if changes:
            report.warnings.append(
                "config changed in safe keys: " + "; ".join(str(c) for c in changes)
            )
        report.check(
            "config",
            True,
            "identical" if not changes else f"{len(changes)} safe change(s)",
        )
        saved_mode = manifest.precision.get("mode")
        if self.precision is None or saved_mode is None or saved_mode == self.precision.mode:
            return
        if self.precision.mode == "fp16" and not manifest.precision.get("grad_scaler"):
            raise ConfigMismatchError(
                f"{name} was saved under {saved_mode} without GradScaler state; resuming it "
                "under fp16 would start loss scaling from scratch. Resume with the saved "
                "precision, or start a new run."
            )
        report.warnings.append(
            f"precision changed from {saved_mode} to {self.precision.mode}: numerics differ "
            "from an uninterrupted run"
        )

    def _verify_rest(self, path: Path, manifest: Manifest, reader: VerifyingReader) -> int:
        """Hash the files no rank read; compare every rank's digests; return files verified."""
        seen = self._ctl.all_gather(dict(reader.verified))
        failure: CheckpointError | None = None
        union: dict[str, str] = {}
        for rank, digests in enumerate(seen):
            for name, digest in digests.items():
                if union.setdefault(name, digest) != digest:
                    failure = IntegrityError(
                        str(path / name), union[name], f"{digest} on rank {rank}",
                        detail="ranks saw different bytes",
                    )  # fmt: skip
        unread = sorted(set(manifest.file_map()) - set(union))
        for name in unread[self.rank :: self.world_size]:
            try:  # hashes the whole file, keeps none of it; no symlink or FIFO is followed
                open_verified(str(path / name), manifest.file_map()[name]).close()
            except CheckpointError as exc:
                failure = failure or exc
        self._raise_first(failure)
        return len(union) + len(unread)

    # --- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Drain the save in flight, release dckpt's groups, then raise any save's error.

        Idempotent. Call it before ``destroy_process_group``.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.join(self._join_timeout)
        finally:
            if self._hook is not None:
                self._hook.remove()
            if self._lock is not None:
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

    def _raise_first(self, failure: CheckpointError | None) -> None:
        """All ranks raise the first rank's failure (so every rank names the same file)."""
        failures = self._ctl.all_gather(failure)
        for rank, exc in enumerate(failures):
            if exc is not None:
                if rank != self.rank:
                    exc.add_note(f"(raised on rank {rank})")
                raise exc

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")

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
            precision=self.precision.describe() if self.precision is not None else {},
            loss=extra["loss"],
            metric=extra["metric"],
            timings={
                "stall_s": extra.get("stall_s", 0.0),
                "prepare_s": max(r.timings.get("prepare_s", 0.0) for r in reports),
                "write_s": max(r.timings.get("write_s", 0.0) for r in reports),
                "to_commit_s": time.perf_counter() - t0,
            },
            bytes_per_rank=tuple(
                sum(rec.bytes for rec in r.records) for r in sorted(reports, key=lambda r: r.rank)
            ),
            milestone=milestone,
        )
