"""CheckpointManager: the one object a training script holds.

Save protocol (``save``), run by every rank with the same step:
1. rank 0 picks a save id and broadcasts it; the tmp dir is ``step-XXXXXXXX.tmp-<id>/``;
2. every rank takes its state dict; the ranks agree that all of them could (or all raise);
3. every rank writes its shard through ``HashingWriter`` (DCP, on dckpt's own gloo group),
   so each file's digest is computed as its bytes go out;
4. ``Coordinator.finish_save``: digests gathered to rank 0, manifest written, atomic commit,
   outcome broadcast. An error on any rank fails the save on all ranks and commits nothing.

Load protocol (``load``):
1. rank 0 chooses the step (newest committed, or the one asked for) and broadcasts it;
2. every rank reads and validates the manifest (schema, safe paths, self-digest), checks the
   layout (regular files of the recorded sizes), and the ranks compare manifest digests;
3. DCP loads through ``VerifyingReader``: each file this rank reads is hashed as it is read and
   must match the manifest, before any tensor is filled from it.
"""

from __future__ import annotations

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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from . import __version__
from .comm import Comm
from .commit import new_tmp_dir, recover
from .config import CheckpointConfig
from .coordinator import Coordinator, RankReport
from .errors import CheckpointError, CheckpointNotFoundError, IntegrityError, ManifestError
from .faults import fault_point
from .layout import committed_steps, step_dir_name
from .manifest import Manifest, check_layout, read_manifest
from .state import TrainState
from .storage.hashing_writer import HashingWriter
from .storage.verifying_reader import SafeLoadPlanner, VerifyingReader

__all__ = ["CheckpointManager", "LoadResult", "SaveResult"]

log = logging.getLogger("dckpt")


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    step: int
    path: Path
    bytes: int
    files: int
    stall_s: float
    commit_s: float


@dataclass(frozen=True, kw_only=True)
class LoadResult:
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
        run_config: the training configuration (JSON-able), stored in every manifest.
        run_id: names the run in manifests; defaults to torchrun's run id or a new uuid.
    """

    def __init__(
        self,
        config: CheckpointConfig | str | os.PathLike[str],
        state: TrainState,
        *,
        run_config: dict[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        if not isinstance(config, CheckpointConfig):
            config = CheckpointConfig(root=Path(config))
        self.config = config
        self.root = config.root
        self.state = state
        self.run_config = dict(run_config or {})
        _ensure_visible_logging()
        self._comm = Comm(config.timeout_s)
        self.rank = self._comm.rank
        self.world_size = self._comm.world_size
        self._coordinator = Coordinator(self._comm, self.root)
        self.run_id = self._comm.broadcast(
            run_id or os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex
        )
        error: str | None = None
        if self.rank == 0:
            try:
                if self.root.exists() and not self.root.is_dir():
                    raise CheckpointError(f"{self.root} exists and is not a directory")
                self.root.mkdir(parents=True, exist_ok=True)
                recover(self.root)
            except (OSError, CheckpointError) as exc:
                error = f"cannot use checkpoint root {self.root}: {exc}"
        error = self._comm.broadcast(error)
        if error is not None:
            raise CheckpointError(error)
        self._closed = False

    # --- public API -----------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest committed step under the root (as rank 0 sees it), or None."""
        step = None
        if self.rank == 0:
            steps = committed_steps(self.root)
            step = steps[-1] if steps else None
        return self._comm.broadcast(step)

    def save(self, step: int, *, epoch: int = 0, milestone: bool = False) -> SaveResult:
        """Save the state as ``step`` on every rank and commit it atomically; blocks until done."""
        self._check_open()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        save_id = str(self._comm.broadcast(uuid.uuid4().hex if self.rank == 0 else ""))
        tmp_dir = new_tmp_dir(self.root, step, save_id)
        self.state.step = step

        state_dict: dict[str, Any] | None = None
        error: str | None = None
        try:
            state_dict = self.state.state_dict()
            fault_point("prepare", self.rank, step)
        except Exception as exc:
            error = f"state_dict() failed: {exc!r}"
        self._coordinator.agree(error, f"preparing the save of step {step}")
        assert state_dict is not None
        t_prepared = time.perf_counter()

        writer = HashingWriter(
            tmp_dir,
            algorithm=self.config.digest,
            rank=self.rank,
            thread_count=self.config.io_threads,
            on_written=lambda: fault_point("write_shards", self.rank, step),
        )
        try:
            with self._comm.quiet():
                dcp_save(
                    state_dict,
                    storage_writer=writer,
                    process_group=self._comm.group,
                    no_dist=not self._comm.distributed,
                )
            fault_point("dcp_finish", self.rank, step)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            error = f"writing shards failed: {_unwrap(exc)!r}"
        t_written = time.perf_counter()
        report = RankReport(
            rank=self.rank,
            records=tuple(writer.records()),
            error=error,
            timings={"prepare_s": t_prepared - t0, "write_s": t_written - t_prepared},
        )

        def build(reports: list[RankReport]) -> Manifest:
            return self._manifest(
                step=step, epoch=epoch, milestone=milestone, save_id=save_id, reports=reports, t0=t0
            )

        outcome = self._coordinator.finish_save(tmp_dir, step, report, build)
        t_done = time.perf_counter()
        assert outcome.path is not None
        result = SaveResult(
            step=step,
            path=Path(outcome.path),
            bytes=outcome.total_bytes,
            files=outcome.files,
            stall_s=t_done - t0,
            commit_s=t_done - t0,
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
        return result

    def load(self, step: int | None = None) -> LoadResult:
        """Load the newest committed checkpoint (or ``step``) into the state, fully verified.

        Raises CheckpointNotFoundError when there is nothing to load, ManifestError or
        IntegrityError when the checkpoint must not be trusted (nothing is loaded silently).
        """
        self._check_open()
        t0 = time.perf_counter()
        chosen: int | str | None = None
        if self.rank == 0:
            steps = committed_steps(self.root) if self.root.is_dir() else []
            if step is None:
                chosen = steps[-1] if steps else "none"
            else:
                chosen = step if step in steps else "none"
        chosen = self._comm.broadcast(chosen)
        if not isinstance(chosen, int):
            where = "any step" if step is None else f"step {step}"
            raise CheckpointNotFoundError(
                f"no committed checkpoint for {where} under {self.root}; "
                "run `dckpt ls` on it to see what is there"
            )
        path = self.root / step_dir_name(chosen)

        manifest: Manifest | None = None
        reader: VerifyingReader | None = None
        failure: CheckpointError | None = None
        try:
            manifest = read_manifest(path)
            check_layout(path, manifest)
            reader = VerifyingReader(path, manifest.file_map())
            reader.load_metadata()
        except (ManifestError, IntegrityError) as exc:
            failure = exc
        self._raise_first(failure)
        assert manifest is not None and reader is not None
        digests = self._comm.all_gather(manifest.files_digest)
        if len(set(digests)) != 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise IntegrityError(
                str(path / "manifest.json"),
                digests[0],
                ", ".join(f"rank {r}: {digests[r]}" for r in odd),
                detail="ranks read different manifests",
            )

        state_dict = self.state.state_dict()
        try:
            with self._comm.quiet():
                dcp_load(
                    state_dict,
                    storage_reader=reader,
                    planner=SafeLoadPlanner(),
                    process_group=self._comm.group,
                    no_dist=not self._comm.distributed,
                )
        except CheckpointException as exc:
            inner = _unwrap(exc)
            if inner is not exc:
                raise inner from None
            raise CheckpointError(f"loading {path} failed: {exc}") from None
        self.state.load_state_dict(state_dict)
        verified = self._comm.all_gather(sorted(reader.verified))
        files_verified = len({p for paths in verified for p in paths})
        seconds = time.perf_counter() - t0
        result = LoadResult(
            step=chosen,
            path=path,
            bytes=manifest.total_bytes,
            files_verified=files_verified,
            seconds=seconds,
            manifest=manifest,
        )
        if self.rank == 0:
            log.info(
                "dckpt: loaded step %d | %s | %d of %d files verified (%s), ranks agree on "
                "manifest | %.3f s | %s/s | %s",
                chosen,
                _human(manifest.total_bytes),
                files_verified,
                len(manifest.files),
                manifest.digest_algorithm,
                seconds,
                _human(manifest.total_bytes / max(seconds, 1e-9)),
                path,
            )
        return result

    def close(self) -> None:
        """Release dckpt's process group. Idempotent."""
        if not self._closed:
            self._closed = True
            self._comm.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------------

    def _raise_first(self, failure: CheckpointError | None) -> None:
        """All ranks raise the first rank's failure (so every rank names the same file)."""
        failures = self._comm.all_gather(failure)
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
            state=tuple(self.state.categories()),
            versions={
                "dckpt": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            mesh={"world_size": self.world_size},
            config=self.run_config,
            timings={
                "prepare_s": max(r.timings.get("prepare_s", 0.0) for r in reports),
                "write_s": max(r.timings.get("write_s", 0.0) for r in reports),
                "to_commit_s": time.perf_counter() - t0,
            },
            bytes_per_rank=tuple(
                sum(rec.bytes for rec in r.records) for r in sorted(reports, key=lambda r: r.rank)
            ),
            milestone=milestone,
        )
