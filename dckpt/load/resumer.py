"""The resume, in protocol order: ``Resumer``. This docstring is the resume protocol.

``resume()`` (and ``load()``, which is steps 2-5 for one step, without the config check and
without fallback) runs in the foreground on dckpt's *control* group, after any save in flight
is drained; never on the training group, except the warmup all-reduce, whose purpose is to
test that group. Every rank runs every step; a failure on any rank is raised on every rank.

1. **candidates**: rank 0 lists the committed checkpoints (``CheckpointSource.steps``: the
   root's directories, or the manifests in an object store), newest first; all ranks take
   its list. For each candidate, a fresh ``CandidateReport``, then its **fetch**
   (``checks.fetch_candidate``): nothing for a directory root; for an s3:// root every rank
   brings its share of the step into the local mirror, each object hashed as it arrives and
   each cached copy re-verified (dckpt.tiers.object_source), any rank's failure raised on
   all;
2. **manifest and layout** (``checks.read_candidate``): schema, safe paths, self-digest, every
   file a regular file of its recorded size, ``.metadata`` hashed and unpickled through the
   allow-list; then the ranks compare the manifest's digest of digests
   (``checks.agree_on_manifest``);
3. **config and precision** (``checks.check_config_and_precision``): a readable diff, judged
   by the ``ConfigPolicy`` (dckpt.load.config_check): keys that shape the run raise
   ``ConfigMismatchError`` on every rank at once, the rest pass with warnings grouped by why;
   a precision change warns, or raises where fp16 would start loss scaling from scratch;
   then the kinds of state, the GradScaler record, and every tensor's shape and dtype against
   the metadata, before any tensor is read;
4. **digests across ranks** and **the load**: DCP loads model, optimizer, schedulers, scaler,
   data position and counters through the ``VerifyingReader`` (each file hashed whole and
   matched before a tensor is filled from it); files no rank read are hashed too; every rank
   checks every rank's digests against the manifest (``checks.verify_rest``);
5. **RNG** last: restored per rank, or reseeded from (seed, step, rank) when the world size
   changed;
6. a candidate that fails 2-4 with evidence of damage is moved to ``quarantine/`` and the next
   older one is tried (``fallback=False``, ranks that disagree, and a newer schema raise);
7. **warmup**: an all-reduce on the training group, whose result every rank checks;
8. **loss watch**: armed with the loss recorded at save time; ``observe()`` compares the next
   losses with it;
9. the ``ResumeReport`` (the chosen candidate's checks and warnings, plus what was skipped) is
   logged as one block on rank 0 and returned.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ..config import CheckpointConfig
from ..dist.comm import Comm
from ..dist.world import check_warmup, warmup_collective
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    IntegrityError,
    ManifestError,
    StorageError,
    unwrap_dcp_error,
)
from ..root.layout import step_dir_name
from ..root.manifest import Manifest
from ..root.source import CheckpointSource
from ..storage.verifying_reader import SafeLoadPlanner
from ..tiers.memory_node import MemoryNode
from ..train import rng
from ..train.precision import PrecisionPolicy
from ..train.state import TrainState
from ..units import human_bytes, plural
from . import checks
from .config_check import ConfigPolicy
from .loss_watch import LossVerdict, LossWatch
from .memory import MemoryRestore, Outcome
from .report import CandidateReport, ResumeReport

__all__ = ["LoadResult", "Resumer"]

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


class Resumer:
    """Loads and resumes for the manager; see the module docstring."""

    def __init__(
        self,
        *,
        ctl: Comm,
        config: CheckpointConfig,
        source: CheckpointSource,
        state: TrainState,
        precision: PrecisionPolicy | None,
        run_config: dict[str, Any],
        config_policy: ConfigPolicy,
        loss_watch: LossWatch,
        memory: MemoryNode | None = None,
    ) -> None:
        self._ctl = ctl
        self._memory = memory
        self._config = config
        self.root = config.directory
        self.source = source
        self._state = state
        self._precision = precision
        self._run_config = run_config
        self._policy = config_policy
        self._loss_watch = loss_watch
        self.rank, self.world_size = ctl.rank, ctl.world_size

    def latest_step(self) -> int | None:
        """The newest committed step under the root (as rank 0 sees it), or None."""
        step = None
        if self.rank == 0:
            steps = self.source.steps()
            step = steps[-1] if steps else None
        return self._ctl.broadcast(step)

    def load(self, step: int | None = None) -> LoadResult:
        """Steps 2-5 for the newest committed step (or ``step``); no fallback, no config
        check. Raises CheckpointNotFoundError when there is nothing to load."""
        chosen: int | str | None = None
        if self.rank == 0:
            steps = self.source.steps()
            if step is None:
                chosen = steps[-1] if steps else "none"
            else:
                chosen = step if step in steps else "none"
        chosen = self._ctl.broadcast(chosen)
        if not isinstance(chosen, int):
            where = "any step" if step is None else f"step {step}"
            raise CheckpointNotFoundError(
                f"no committed checkpoint for {where} under {self.source}; "
                "run `dckpt ls` on it to see what is there"
            )
        result = self._try(chosen, CandidateReport(chosen, self._path(chosen)), with_config=False)
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

    def resume(self, fallback: bool) -> ResumeReport:
        """Steps 1-9; returns the logged report (``report.resumed`` is False on a fresh
        start). A refusal is logged once, as one block, on rank 0, and raised on every rank
        (so a script can exit without a traceback per rank: dckpt already said why)."""
        skipped: list[tuple[int, str]] = []
        try:
            return self._resume(fallback, skipped)
        except CheckpointError as exc:
            if self.rank == 0:
                lines = [f"dckpt resume: REFUSED ({type(exc).__name__})"]
                lines += [f"  {line}" for line in str(exc).splitlines()]
                lines += [f"  skipped step {s} (quarantined): {why}" for s, why in skipped]
                log.error("%s", "\n".join(lines))
            raise

    def _resume(self, fallback: bool, skipped: list[tuple[int, str]]) -> ResumeReport:
        t0 = time.perf_counter()
        steps = self._candidates()  # 1
        chosen: CandidateReport | None = None
        result: LoadResult | None = None
        memory_notes: list[str] = []
        memory_loaded = False
        if self._memory is not None:  # 1b: a newer (or as new) step in host memory first
            got = MemoryRestore(self._ctl, self._memory).restore(
                self._state, steps, self._check_candidate
            )
            if isinstance(got, tuple):
                memory_loaded = True
                loaded, chosen = got
                result = LoadResult(
                    step=loaded.step,
                    path=loaded.path,
                    bytes=loaded.bytes,
                    files_verified=len(loaded.manifest.files),
                    seconds=loaded.seconds,
                    manifest=loaded.manifest,
                )
                after = loaded.manifest.mesh.get("after")
                self._memory.anchor = after if isinstance(after, int) else None
                steps = []
            else:
                memory_notes = [f"memory tier: step {s} not used: {why}" for s, why in got.skipped]
                self._refuse_memory_loss(got, steps)
        for step in steps:
            candidate = CandidateReport(step, self._path(step), self.source.origin(step))
            try:
                result = self._try(step, candidate, with_config=True)  # 2-5
                chosen = candidate
                break
            except (IntegrityError, ManifestError) as exc:  # 6
                # Only evidence of damage moves a checkpoint aside: not a newer schema, and
                # not ranks that disagree (that would quietly pick one rank's view).
                divergent = isinstance(exc, IntegrityError) and exc.divergent
                if not fallback or divergent or isinstance(exc, IncompatibleCheckpointError):
                    raise
                self._quarantine(step, exc)
                # The report keeps the first sentence; quarantine/<step>.reason.txt has it all.
                skipped.append((step, f"{type(exc).__name__}: {str(exc).split('. ')[0]}"))
        report = ResumeReport.of(chosen, skipped, self.world_size)
        report.warnings.extend(memory_notes)
        if self._memory is not None and result is not None and not memory_loaded:
            self._memory.anchor = result.step
        if result is None:
            self._nothing_loaded(report, len(steps))
            return report
        t_loaded = time.perf_counter()
        if self._config.warmup and self._ctl.distributed:  # 7
            mine = warmup_collective(result.manifest.save_id, self._config.timeout_s)
            every = self._ctl.all_gather(mine)  # every rank checks every rank's sum
            report.check("warmup all-reduce", all(r.ok for r in every), check_warmup(every))
        report.timings = {
            "load_and_verify": t_loaded - t0,
            "warmup": time.perf_counter() - t_loaded,
            "total": time.perf_counter() - t0,
        }
        self._arm_loss_watch(result, report)  # 8
        if self.rank == 0:  # 9
            log.info("%s", report.format())
        return report

    def observe(self, loss: float) -> None:
        """Record this step's loss: kept for the manifest, and checked after a resume."""
        self._tell(self._loss_watch.observe(float(loss), self._config.loss_watch))

    def finish(self) -> None:
        """At close: the loss watch's verdict on fewer losses than its window, if any."""
        self._tell(self._loss_watch.finish())

    def _tell(self, verdict: LossVerdict | None) -> None:
        if verdict is None:
            return
        if self.rank == 0:  # one line, not one per rank (each rank judged its own losses)
            (log.info if verdict.ok else log.warning)("%s", verdict.line())

    # --- the steps --------------------------------------------------------------------------

    def _path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def _candidates(self) -> list[int]:
        listing: list[int] | CheckpointError = []
        if self.rank == 0:
            try:
                listing = sorted(self.source.steps(), reverse=True)
            except OSError as exc:
                listing = StorageError(f"cannot list {self.source}: {exc}")
            except CheckpointError as exc:
                listing = exc
        listing = self._ctl.broadcast(listing)
        if isinstance(listing, CheckpointError):
            raise listing
        return listing

    def _try(self, step: int, report: CandidateReport, *, with_config: bool) -> LoadResult:
        """Steps 2-5 for one candidate: validate, verify and load it into the state."""
        t0 = time.perf_counter()
        path, name, state = report.path, report.path.name, self._state
        checks.fetch_candidate(self._ctl, self.source, step, report)
        manifest, reader = checks.read_candidate(self._ctl, path, step, report)
        checks.agree_on_manifest(self._ctl, manifest, path, report)
        self._check_candidate(manifest, report, with_config=with_config)
        state_dict = state.state_dict()
        if manifest.world_size != self.world_size:
            checks.resolve_per_rank(state, state_dict, manifest.world_size, name, report)
        checks.check_shapes(state_dict, reader, name)
        saved = set(manifest.state)
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
        files_verified, ranks_checked = checks.verify_rest(self._ctl, path, manifest, reader)
        report.check(
            "digests",
            files_verified == len(manifest.files),
            f"{files_verified} of {plural(len(manifest.files), 'file')} hashed and matched "
            f"({manifest.digest_algorithm}); "
            + (
                "the one rank checked its digests"
                if ranks_checked == 1
                else f"every rank checked the digests of all {ranks_checked} ranks"
            ),
        )
        state.load_state_dict(state_dict)
        restored = [c for c in state.categories() if c in saved]
        report.check("state", set(restored) == set(state.categories()), ", ".join(restored))
        self._restore_rng(step, manifest, state_dict, same_world, report)
        return LoadResult(
            step=step,
            path=path,
            bytes=manifest.total_bytes,
            files_verified=files_verified,
            seconds=time.perf_counter() - t0,
            manifest=manifest,
        )

    def _refuse_memory_loss(self, got: Outcome, steps: list[int]) -> None:
        """When the memory tier held this run's newer work and none of it could be restored:
        with no durable step to fall back to, refuse rather than start from scratch (that would
        silently throw the run away); a restore that failed halfway left the state mixed."""
        if got.dirty and not steps:
            raise CheckpointError(
                "restoring a memory checkpoint failed after it began writing into the model "
                f"({got.skipped[-1][1]}), and the root has no durable checkpoint to restore "
                "over it: rebuild the model (restart the job) before training."
            )
        if got.lost and not steps:
            listed = "; ".join(f"step {s}: {why}" for s, why in got.lost)
            raise CheckpointError(
                f"the memory tier holds this run's work ({listed}), none of it could be "
                f"restored, and {self.source} has no durable checkpoint: starting from scratch "
                "would silently throw that run away. Bring the missing node or keeper back, or "
                f"remove the memory directory ({self._memory_root()}) to really start over."
            )

    def _memory_root(self) -> str:
        return str(self._memory.dir.parent) if self._memory is not None else "-"

    def _check_candidate(
        self, manifest: Manifest, report: CandidateReport, *, with_config: bool = True
    ) -> None:
        """The checks before any byte is loaded: config and precision (every rank decides;
        all raise the first refusal together), the kinds of state, the GradScaler."""
        name = report.path.name
        if with_config:
            refused: CheckpointError | None = None
            try:
                checks.check_config_and_precision(
                    manifest, self._run_config, self._precision, self._policy, name, report
                )
            except CheckpointError as exc:
                refused = exc
            checks.raise_first(self._ctl, refused)
        checks.check_state_kinds(manifest, self._state, name, report)
        checks.check_grad_scaler(manifest, self._state, name, report)

    def _restore_rng(
        self,
        step: int,
        manifest: Manifest,
        state_dict: dict[str, Any],
        same_world: bool,
        report: CandidateReport,
    ) -> None:
        if same_world:
            rng.restore(state_dict["rng"][f"rank_{self.rank}"])
            kinds = "python, numpy, torch" + (
                ", CUDA" if "cuda" in state_dict["rng"][f"rank_{self.rank}"] else ""
            )
            report.rng = f"restored on every rank ({kinds})"
            return
        rng.reseed(self._state.seed, step, self.rank)
        report.rng = (
            f"reseeded from (seed {self._state.seed}, step {step}, rank): the world size "
            f"changed from {manifest.world_size} to {self.world_size}, so saved per-rank "
            "generator states do not map"
        )
        report.warn(
            "RNG reseeded, not restored: dropout and sampling differ from an uninterrupted run"
        )

    def _arm_loss_watch(self, result: LoadResult, report: ResumeReport) -> None:
        if not result.manifest.loss or self._config.loss_watch == "off":
            return
        steps = self._config.loss_watch_steps
        self._loss_watch.arm(result.manifest.loss, steps, result.path.name)
        low, high = self._loss_watch.band()
        if not (math.isfinite(low) and math.isfinite(high)):  # a NaN band would pass nothing
            report.warnings.append(f"loss watch {self._loss_watch.describe_armed()}")
            return
        report.check(
            "loss watch armed",
            True,
            self._loss_watch.describe_armed() + "; the verdict follows as its own line",
        )

    def _nothing_loaded(self, report: ResumeReport, candidates: int) -> None:
        """A fresh start, or an error when every candidate failed or only quarantine holds
        checkpoints (starting over would silently throw that run away)."""
        if report.skipped:
            raise CheckpointError(
                f"none of the {candidates} committed checkpoints under {self.source} passed "
                "verification; all were moved to quarantine/ (listed below). "
                "The model may be partly overwritten by the failed attempts: rebuild it "
                "before training. Restore a good copy, or start a new run elsewhere."
            )
        quarantined = self._ctl.broadcast(self._quarantined_count() if self.rank == 0 else 0)
        if quarantined:
            raise CheckpointError(
                f"{self.source} has no committed checkpoint but {quarantined} in quarantine/: "
                "starting from scratch would silently throw that run away. Inspect them "
                "(dckpt ls), restore one, or remove quarantine/ to really start over."
            )
        if self.rank == 0:
            log.info("%s", report.format())

    def _quarantined_count(self) -> int:
        return self.source.quarantined_count()

    def _quarantine(self, step: int, exc: CheckpointError) -> None:
        error: str | None = None
        if self.rank == 0:
            try:
                self.source.confirm_damage(step, exc)  # a local fault raises StorageError
                self.source.quarantine(step, f"{type(exc).__name__}: {exc}")
            except (OSError, ValueError, CheckpointError) as failed:
                error = f"could not quarantine step {step}: {failed}"
        error = self._ctl.broadcast(error)
        if error is not None:
            raise CheckpointError(error)
