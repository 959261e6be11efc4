"""The loading half of CheckpointManager: verified load, resume with fallback, loss watch.

``LoadingMixin`` holds ``load``, ``resume``, ``latest_step`` and ``observe`` and their checks;
the protocol is described in dckpt.resume and docs/ARCHITECTURE.md. It runs in the foreground
on dckpt's *control* group (after draining any save in flight), never on the training group,
except the warmup all-reduce, whose purpose is to test that group.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from . import rng
from .comm import Comm
from .commit import quarantine
from .config import CheckpointConfig
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigMismatchError,
    IncompatibleCheckpointError,
    IntegrityError,
    ManifestError,
    StateMismatchError,
    StorageError,
    unwrap_dcp_error,
)
from .layout import committed_steps, list_checkpoints, step_dir_name
from .manifest import Manifest, check_layout, read_manifest
from .precision import PrecisionPolicy, check_scaler
from .resume import LossWatch, ResumeReport, check_config
from .state import TrainState
from .storage.verified_files import open_verified
from .storage.verifying_reader import SafeLoadPlanner, VerifyingReader
from .units import human_bytes
from .world import warmup_collective
from .writer import SaveResult

__all__ = ["LoadResult", "LoadingMixin"]

log = logging.getLogger("dckpt")


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """A verified load: which step, from where, how much was checked and how long it took."""

    step: int
    path: Path
    bytes: int
    files_verified: int
    seconds: float
    manifest: Manifest


class LoadingMixin:
    """Loading and resuming; mixed into CheckpointManager, which provides these attributes."""

    root: Path
    config: CheckpointConfig
    state: TrainState
    rank: int
    world_size: int
    precision: PrecisionPolicy | None
    run_config: dict[str, Any]
    _ctl: Comm
    _loss_watch: LossWatch
    _allowed_changes: frozenset[str]

    def wait(self) -> SaveResult | None:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

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
                human_bytes(result.bytes),
                result.files_verified,
                len(result.manifest.files),
                result.manifest.digest_algorithm,
                result.seconds,
                human_bytes(result.bytes / max(result.seconds, 1e-9)),
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

        self._check_scaler(manifest, path.name, report)
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
            inner = unwrap_dcp_error(exc)
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

    def _check_scaler(self, manifest: Manifest, name: str, report: ResumeReport) -> None:
        """The GradScaler state as recorded at save time, checked before anything is loaded."""
        recorded = manifest.precision.get("scaler")
        if self.state.scaler is None or not isinstance(recorded, dict):
            return
        try:
            concern = check_scaler({"scale": float(recorded.get("scale", 1.0))})
        except (TypeError, ValueError) as exc:
            raise StateMismatchError(f"{name}: {exc}") from None
        report.check("grad scaler", True, f"scale {recorded.get('scale')}")
        if concern:
            report.warnings.append(concern)

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
        fresh_scaler = self.precision.mode == "fp16" and not manifest.precision.get("grad_scaler")
        if fresh_scaler and "precision" not in self._allowed_changes:
            raise ConfigMismatchError(
                f"{name} was saved under {saved_mode} without GradScaler state; resuming it "
                "under fp16 would start loss scaling from scratch. Resume with the saved "
                "precision, or pass allow_config_changes=['precision'] to accept that (e.g. "
                "a GPU without bf16)."
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

    def _raise_first(self, failure: CheckpointError | None) -> None:
        """All ranks raise the first rank's failure (so every rank names the same file)."""
        failures = self._ctl.all_gather(failure)
        for rank, exc in enumerate(failures):
            if exc is not None:
                if rank != self.rank:
                    exc.add_note(f"(raised on rank {rank})")
                raise exc
