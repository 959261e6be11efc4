"""The loading half of CheckpointManager: verified load, resume with fallback, loss watch.

``LoadingMixin`` holds ``load``, ``resume``, ``latest_step`` and ``observe`` and their checks;
the protocol is described in dckpt.resume and docs/ARCHITECTURE.md. It runs in the foreground
on dckpt's *control* group (after draining any save in flight), never on the training group,
except the warmup all-reduce, whose purpose is to test that group.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ..config import CheckpointConfig
from ..dist.comm import Comm
from ..dist.world import check_warmup, warmup_collective
from ..errors import (
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
from ..faults import fault_point
from ..root.commit import quarantine
from ..root.layout import committed_steps, list_checkpoints, step_dir_name
from ..root.manifest import Manifest, check_layout, read_manifest
from ..save.background import SaveResult
from ..storage.verified_files import open_verified
from ..storage.verifying_reader import SafeLoadPlanner, VerifyingReader
from ..train import rng
from ..train.precision import PrecisionPolicy, check_scaler
from ..train.state import TrainState
from ..units import human_bytes
from .config_check import check_config, is_allowed
from .loss_watch import LossWatch
from .report import ResumeReport

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
            report.checks, report.warnings = [], []  # this candidate's, not a skipped one's
            try:
                result = self._load_step(step, report, True)
                break
            except (IntegrityError, ManifestError) as exc:
                # Only evidence of damage moves a checkpoint aside: not a newer schema, and
                # not ranks that disagree (that would quietly pick one rank's view).
                divergent = isinstance(exc, IntegrityError) and exc.divergent
                if not fallback or divergent or isinstance(exc, IncompatibleCheckpointError):
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
            mine = warmup_collective(result.manifest.save_id, self.config.timeout_s)
            every = self._ctl.all_gather(mine)  # every rank checks every rank's sum
            report.check("warmup all-reduce", all(r.ok for r in every), check_warmup(every))
        report.timings = {
            "load_and_verify": t_loaded - t0,
            "warmup": time.perf_counter() - t_loaded,
            "total": time.perf_counter() - t0,
        }
        if result.manifest.loss and self.config.loss_watch != "off":
            self._loss_watch.arm(
                result.manifest.loss, self.config.loss_watch_steps, result.path.name
            )
            bound = self._loss_watch.bound()
            report.check(
                "loss watch armed",
                math.isfinite(bound),  # a NaN bound would pass nothing
                f"next {self.config.loss_watch_steps} losses vs saved mean "
                f"{result.manifest.loss['mean']:.4f} (bound {bound:.4f})",
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
        laid_out = 0
        try:
            manifest = read_manifest(path)
            laid_out = check_layout(path, manifest)
            reader = VerifyingReader(path, manifest.file_map())
            reader.load_metadata()
            if manifest.step != step:
                raise ManifestError(
                    f"{path}/manifest.json says step {manifest.step}, its directory says {step}"
                )
        except CheckpointError as exc:
            failure = exc
        self._raise_first(failure, path / "manifest.json")
        assert manifest is not None and reader is not None
        report.world_size_saved = manifest.world_size
        report.check(
            "manifest",
            laid_out == len(manifest.files),
            f"schema {manifest.schema_version}, self-digest ok, {laid_out} of "
            f"{len(manifest.files)} files laid out at their recorded sizes",
        )
        digests = self._ctl.all_gather(manifest.files_digest)
        agree = len(set(digests)) == 1
        if not agree:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise IntegrityError(
                str(path / "manifest.json"),
                digests[0],
                ", ".join(f"rank {r}: {digests[r]}" for r in odd),
                detail="ranks read different manifests",
                divergent=True,
            )
        report.check("one manifest", agree, f"all {len(digests)} ranks read {digests[0]}")
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
        files_verified, ranks_checked = self._verify_rest(path, manifest, reader)
        report.check(
            "digests",
            files_verified == len(manifest.files),
            f"{files_verified} of {len(manifest.files)} files hashed and matched "
            f"({manifest.digest_algorithm}); every rank checked the digests of all "
            f"{ranks_checked} ranks",
        )
        self.state.load_state_dict(state_dict)
        restored = [c for c in self.state.categories() if c in saved]
        report.check("state", set(restored) == set(self.state.categories()), ", ".join(restored))
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
            scale = float(recorded.get("scale", 1.0))
            concern = check_scaler({"scale": scale})
        except (TypeError, ValueError) as exc:
            raise StateMismatchError(f"{name}: {exc}") from None
        report.check("grad scaler", math.isfinite(scale) and scale > 0, f"scale {scale:g}")
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
            all(is_allowed(c, self._allowed_changes) for c in changes),
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

    def _verify_rest(
        self, path: Path, manifest: Manifest, reader: VerifyingReader
    ) -> tuple[int, int]:
        """Hash the files no rank read, split over the ranks; then every rank checks every
        rank's digests (what each one's bytes hashed to) against the manifest. Returns the
        files hashed and matched, and the ranks whose digests were checked."""
        records = manifest.file_map()
        read = self._ctl.all_gather(dict(reader.verified))
        unread = sorted(set(records).difference(*read))
        hashed: dict[str, str] = {}
        failure: CheckpointError | None = None
        for name in unread[self.rank :: self.world_size]:
            try:  # hashes the whole file, keeps none of it; no symlink or FIFO is followed
                with open_verified(str(path / name), records[name]) as f:
                    hashed[name] = f.digest
            except CheckpointError as exc:
                failure = failure or exc
        self._raise_first(failure)
        mine = {**reader.verified, **hashed}
        if fault_point("verify", self.rank) and mine:  # act as a rank that read other bytes
            name = min(mine)
            mine[name] = mine[name][:-1] + ("0" if mine[name][-1] != "0" else "1")
        matched: set[str] = set()
        for rank, digests in enumerate(self._ctl.all_gather(mine)):
            for name, digest in sorted(digests.items()):
                record = records.get(name)
                if record is None or digest != record.digest:
                    raise IntegrityError(
                        str(path / name),
                        record.digest if record is not None else "a file the manifest lists",
                        f"{digest} on rank {rank}",
                        detail=f"rank {rank} hashed different bytes",
                        divergent=True,
                    )
                matched.add(name)
        if matched != set(records):
            missing = sorted(set(records) - matched)
            raise IntegrityError(
                str(path / missing[0]),
                "hashed by some rank",
                f"{len(missing)} file(s) hashed by none",
                detail="file not verified",
            )
        return len(matched), self.world_size

    def _raise_first(self, failure: CheckpointError | None, what: Path | None = None) -> None:
        """All ranks raise the first rank's failure (so every rank names the same file).

        With ``what`` (the file every rank just read): when only some ranks failed with
        evidence of damage, the ranks do not see the same checkpoint, and they all raise a
        divergent ``IntegrityError`` naming both sides instead (never quarantined).
        """
        failures = self._ctl.all_gather(failure)
        failed = [r for r, exc in enumerate(failures) if exc is not None]
        damage = (IntegrityError, ManifestError)
        if what is not None and 0 < len(failed) < len(failures):
            first = failures[failed[0]]
            if isinstance(first, damage) and not isinstance(first, IncompatibleCheckpointError):
                fine = [r for r, exc in enumerate(failures) if exc is None]
                raise IntegrityError(
                    str(what),
                    f"the same checkpoint on every rank (rank(s) {fine} read it)",
                    f"rank(s) {failed}: {type(first).__name__}: {str(first).split('. ')[0]}",
                    detail="ranks see different checkpoints",
                    divergent=True,
                )
        for rank, exc in enumerate(failures):
            if exc is not None:
                if rank != self.rank:
                    exc.add_note(f"(raised on rank {rank})")
                raise exc
