"""Loading a proven memory candidate into the state: ``MemoryReader`` (a resume's ``Reader``).

The steps of a memory resume are in dckpt.load.memory's docstring; this module is step 4 and
the hand-off of step 5: the record and the config checks (on the manifest alone, so a refusal
moves no byte), the live state flattened once (the tensors a file arriving from another node
is routed into: ``StreamFill``), the proof and the exchange (``MemorySource.fetch``), then
every live tensor matched to its bytes (``StateFill``, writing nothing), the ranks agreed, and
only then the copy (of the tensors not already in place), the non-tensor values and the RNG;
the files that arrived into the state go back into the node's memory behind the resume
(dckpt.load.memory_refill).

Invariants: a rank copies nothing until every rank matched every tensor (``raise_first``); a
failure after bytes arrived into some ranks' tensors names those ranks (``taken_in``).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import time
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from ..collective.comm import Comm
from ..errors import CheckpointError, ManifestError, StateMismatchError
from ..owned import write_atomic
from ..root.layout import step_dir_name
from ..root.manifest import Manifest
from ..storage.memory_file import FlatFile, MemoryFileError, StateFill, StreamFill, row_fits
from ..tiers import memory_layout as layout
from ..train import rng
from ..train.state import TrainState
from .checks import CandidateChecks, raise_first
from .memory import MemoryFetched, MemorySource, close_behind, map_proven, taken_in
from .memory_refill import refill
from .report import CandidateReport, LoadResult

__all__ = ["MemoryReader"]


class MemoryReader:
    """Loads a memory candidate into the state; see the module docstring (step 4)."""

    def __init__(
        self, *, ctl: Comm, source: MemorySource, state: TrainState, checks: CandidateChecks
    ) -> None:
        self.ctl = ctl
        self.source = source
        self.state = state
        self.checks = checks
        self.rank = ctl.rank

    def load(self, step: int, report: CandidateReport, *, with_config: bool) -> LoadResult:
        t0 = time.perf_counter()
        # The same bytes on every rank, claimed with the same key (the start compared the
        # ranks' keys): every rank reaches the same verdict without a collective.
        manifest = self.source.record(step)
        report.world_size_saved = manifest.world_size
        # Config and state kinds first, on the manifest alone: a refusal moves no byte.
        self.ctl.mark(f"checking memory step {step}'s config and state")
        self.checks.run(manifest, report, with_config=with_config)
        state_dict = self.state.state_dict()
        state_dict["rng"] = {f"rank_{self.rank}": rng.capture()}
        flat, _ = flatten_state_dict(state_dict)
        live = {k: _local(v) for k, v in flat.items() if isinstance(v, torch.Tensor)}
        taken: dict[str, StreamFill] = {}
        own = layout.file_name(self.rank)

        def into(name: str, size: int) -> StreamFill:
            source = f"{name} of memory step {step} (arriving)"
            return StreamFill(size, source, live, taken, own=name == own)

        self.ctl.mark(f"proving memory step {step}'s files (and moving those a node lacks)")
        fetched = self.source.fetch(step, manifest, into)
        try:
            return self._load(step, report, fetched, t0, state_dict)
        finally:
            close_behind(list(fetched.maps.values()))

    def _load(
        self,
        step: int,
        report: CandidateReport,
        fetched: MemoryFetched,
        t0: float,
        state_dict: dict[str, Any],
    ) -> LoadResult:
        manifest = fetched.manifest
        remote = fetched.remote
        where = "local memory" if not remote else f"ranks {remote} from other nodes' memory"
        report.origin = (
            f"the memory tier ({where}; {self.source.memory_dir}, {step_dir_name(step)})"
        )
        self.ctl.mark(f"filling memory step {step} into the state")
        maps = {**fetched.maps, **fetched.held}
        own = layout.file_name(self.rank)
        shared = manifest.mesh.get("shared")
        wanted = fetched.proofs if shared else {own: fetched.proofs.get(own)}
        failure: CheckpointError | None = None
        fill: StateFill | None = None
        try:
            for name, proof in wanted.items():
                if name not in maps and name not in fetched.streamed:  # another rank proved it
                    assert proof is not None
                    maps[name] = map_proven(*proof)
            fill = self._prepare(step, manifest, maps, fetched.streamed, state_dict)
        except ManifestError as exc:  # a header that does not describe its file: damage
            failure = exc
        except (MemoryFileError, CheckpointError, OSError) as exc:
            failure = StateMismatchError(f"rank {self.rank}: {exc}")
        if failure is not None:
            failure = type(failure)(str(failure) + taken_in(fetched.wrote))
        try:
            raise_first(self.ctl, failure)  # every rank matched every tensor, or none copies
            assert fill is not None
            filled = fill.apply()  # from here on the live state changes
            saved_rng = filled.pop("rng")[f"rank_{self.rank}"]
            refused: CheckpointError | None = None
            try:
                self.state.load_state_dict(filled)
            except CheckpointError as exc:  # a sampler or scheduler that does not fit
                refused = exc
            raise_first(self.ctl, refused)  # every rank refuses, in the REFUSED block
            rng.restore(saved_rng)
        finally:
            del fill
            close_behind(
                [m for n, m in maps.items() if n not in fetched.maps and n not in fetched.held]
            )
        for warning in fetched.warnings:
            report.warn(warning)
        report.check("memory", True, fetched.line())
        report.check("state", True, ", ".join(self.state.categories()))
        report.rng = "restored on every rank (python, numpy, torch" + (
            ", CUDA)" if "cuda" in saved_rng else ")"
        )
        n = len(manifest.files)
        into = (
            f"; ranks {fetched.wrote} took the files they received into their state as they "
            "arrived, and used them only once every file had matched"
            if fetched.wrote
            else ""
        )
        report.check(
            "digests",
            True,
            f"{n} of {n} files hashed and matched ({manifest.digest_algorithm}) on every node "
            "that reads them, before a byte of them was used, against the manifest in "
            f"{self.source.ledger.where(step)}{into}",
        )
        seconds = time.perf_counter() - t0
        self._record_restore(step, manifest, seconds, report.origin)
        behind = refill(self.source, step, manifest, fetched.streamed) if fetched.streamed else None
        return LoadResult(
            step=step,
            path=report.path,
            bytes=manifest.total_bytes,
            files_verified=n,
            seconds=seconds,
            manifest=manifest,
            behind=behind,
        )

    def _prepare(
        self,
        step: int,
        manifest: Manifest,
        maps: dict[str, mmap.mmap],
        streamed: dict[str, StreamFill],
        state_dict: dict[str, Any],
    ) -> StateFill:
        """Match every live tensor to its bytes (this rank's own file first); writes nothing
        (a streamed file's tensors are in place already)."""
        own = layout.file_name(self.rank)
        files: dict[str, FlatFile | StreamFill] = {}
        for name, mm in maps.items():
            where = f"rank {self.rank}'s memory file" if name == own else name
            files[name] = _flat_file(mm, f"{where} of memory step {step}", self.rank)
        for name, sink in streamed.items():
            if sink.problem is None and not sink.complete:
                sink.problem, sink.damaged = f"{sink.source}: its header is cut short", True
            if sink.problem is not None:
                if sink.damaged:  # it hashed right: every copy is this same wrong file
                    raise ManifestError(
                        f"rank {self.rank}: {sink.problem}: its bytes match the writer's "
                        "digest, but its header does not describe them"
                    )
                raise MemoryFileError(sink.problem)
            files[name] = sink
        if not manifest.mesh.get("shared"):  # this rank's own file holds all it needs
            files = {own: files[own]}
        mine = files[own]
        return StateFill(state_dict, mine, [f for n, f in files.items() if n != own])

    def _record_restore(self, step: int, manifest: Manifest, seconds: float, origin: str) -> None:
        """The node's first rank notes what this restore cost (``dckpt plan`` reads it)."""
        if self.source.mates[0] != self.rank:
            return
        record = {
            "step": step,
            "seconds": seconds,
            "bytes": manifest.total_bytes,
            "origin": origin,
            "at": time.time(),
        }
        with contextlib.suppress(OSError):  # never through a link planted at either name
            write_atomic(
                self.source.dir, layout.RESTORE_FILE, json.dumps(record).encode(), sync=False
            )


def _flat_file(buf: mmap.mmap, source: str, rank: int) -> FlatFile:
    """The header of a file proven against the writer's digest, checked to describe its
    bytes: every span inside the file (FlatFile's own check) and every tensor's length that
    of its shape and dtype. A header that fails is damage (ManifestError: the record is
    quarantined and the resume falls back), not a state that changed: the file hashed right,
    so every copy of it is the same wrong file (written wrong, or re-sealed by other hands).
    Before this, such a file refused the whole resume (StateMismatchError), or, for a length
    that disagreed with its shape, crashed in the copy after the ranks had agreed."""
    try:
        flat = FlatFile(buf, source)
    except MemoryFileError as exc:
        raise ManifestError(
            f"rank {rank}: {exc}: its bytes match the writer's digest, but its header does not "
            "describe them"
        ) from None
    for key, dtype, shape, _offset, nbytes in flat.rows:
        if not row_fits(dtype, shape, nbytes):
            raise ManifestError(
                f"rank {rank}: {source}: {key} is recorded as {nbytes} bytes of "
                f"{dtype}{shape}: its bytes match the writer's digest, but its header does not "
                "describe them"
            )
    return flat


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value
