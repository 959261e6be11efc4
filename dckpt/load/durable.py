"""Loading a durable candidate (a directory root, or an s3:// root through its mirror):
``DurableReader``, steps 2-5 of the resume protocol (dckpt.load.resumer) for one step.

1. the source's fetcher brings the step to where it is read (``checks.fetch_candidate``; a
   directory is read in place, without one): for an object store, ``.metadata`` first, then,
   once the load plan is made (step 4), the files this rank reads, each object hashed as it
   arrives into the mirror: a node holds what its ranks read, not the whole step;
2. the manifest and the verified ``.metadata`` on every rank, the layout split over the
   ranks (each stats its share), then the ranks compare the manifest's digest of digests
   (one all-reduce of its hash);
3. the config, precision, state kinds and GradScaler (``CandidateChecks``), then every
   tensor's shape and dtype against the metadata, before any tensor is read;
4. DCP loads through the ``VerifyingReader`` (each file hashed whole and matched before a
   tensor is filled from it); each rank hashes the rest of its share of the files (the ones
   its rank wrote; an object store's where they live, streamed), so every file is hashed by
   some rank, and each rank checks what it hashed against the manifest all agreed on (one
   flag for all: no rank receives another's digests);
5. the RNG last: restored per rank, or reseeded from (seed, step, rank) when the world size
   changed.

A checkpoint another torch release wrote is read as any other; if its ``.metadata`` cannot
be read or used by this torch (unpickled, checked, planned, loaded by DCP), the failure is
``IncompatibleCheckpointError`` naming both versions (storage.safe_unpickle), never a bare
error from DCP and never damage (the resume stops there, nothing quarantined).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ..collective.comm import Comm
from ..errors import CheckpointError, unwrap_dcp_error
from ..root.manifest import Manifest
from ..root.source import CheckpointSource
from ..storage.records import METADATA_FILE
from ..storage.safe_unpickle import incompatible_torch
from ..storage.verifying_reader import READ_THREADS, SafeLoadPlanner, VerifyingReader
from ..train import rng
from ..train.state import TrainState
from ..units import human_bytes, plural
from . import checks
from .report import CandidateReport, LoadResult

__all__ = ["DurableReader"]


class DurableReader:
    """Loads a durable candidate into the state; see the module docstring."""

    def __init__(
        self,
        *,
        ctl: Comm,
        source: CheckpointSource,
        state: TrainState,
        checks: checks.CandidateChecks,
        read_threads: int = READ_THREADS,
    ) -> None:
        self.ctl = ctl
        self.source = source
        self.state = state
        self.checks = checks
        self.read_threads = read_threads
        """Reads in flight per file (``CheckpointConfig.read_threads``)."""
        self.rank, self.world_size = ctl.rank, ctl.world_size

    def load(self, step: int, report: CandidateReport, *, with_config: bool) -> LoadResult:
        t0 = time.perf_counter()
        path, name, state = report.path, report.path.name, self.state
        # A source that can bring only what a rank reads (an object store) brings the
        # metadata first: the load plan made from it names the rest (step 4).
        fetcher = self.source.fetcher
        first = frozenset({METADATA_FILE}) if fetcher is not None else None
        mark = self.ctl.mark  # what this rank is doing, for the others to name if it stalls
        if fetcher is not None:
            mark(f"fetching step {step}")
            checks.fetch_candidate(self.ctl, fetcher, self.source.local, step, None, first)
        mark(f"reading step {step}'s manifest, layout and metadata")
        manifest, reader = checks.read_candidate(
            self.ctl,
            path,
            step,
            report,
            first,
            read_threads=self.read_threads,
            provenance=self.checks.provenance,
        )
        checks.agree_on_manifest(self.ctl, manifest, path, report)
        mark(f"checking step {step}'s config and state")
        self.checks.run(manifest, report, with_config=with_config)
        state_dict = state.state_dict()
        refused: CheckpointError | None = None
        try:
            if manifest.world_size != self.world_size:  # a PerRank may refuse on one rank
                checks.resolve_per_rank(state, state_dict, manifest.world_size, name, report)
            checks.check_shapes(state_dict, reader, name)
        except CheckpointError as exc:
            refused = exc
        except Exception as exc:  # metadata objects of another torch, short of a field
            refused = incompatible_torch(manifest.versions, str(path / METADATA_FILE), exc)
            if refused is None:
                raise
            refused.__cause__ = exc
        # Each rank checks its own tensors and per-rank values, and they need not be alike (a
        # PerRank built to refuse a new world on one rank only, a rank whose model was built
        # differently): a refusal on one rank is raised on every rank here, before DCP's
        # load, whose collectives the refusing rank would never join.
        # One int all-reduced when no rank refused, whatever the world's size.
        failed = self.ctl.first_failure(refused)
        if failed is not None:
            raise failed.error
        saved = set(manifest.state)
        same_world = manifest.world_size == self.world_size and "rng" in saved
        if same_world:
            state_dict["rng"] = {f"rank_{self.rank}": rng.capture()}
        if fetcher is not None:  # this rank's files, as DCP's own plan for its state names them
            reads = self._planned(reader, state_dict, name)  # .metadata: here, verified
            mark(f"fetching the files of step {step} it reads")
            checks.fetch_candidate(self.ctl, fetcher, self.source.local, step, report, reads)
        mark(f"loading step {step} (reading and hashing its share of the files)")
        # a rank that read its share says so: one still reading is then named as behind
        reader.read_done = lambda: mark(f"step {step}: its share read, waiting for the others")
        try:
            dcp_load(
                state_dict,
                storage_reader=reader,
                planner=SafeLoadPlanner(),
                process_group=self.ctl.group,
                no_dist=not self.ctl.distributed,
            )
        except CheckpointException as exc:
            inner = unwrap_dcp_error(exc)
            if inner is not exc:
                raise inner from None
            source = str(path / METADATA_FILE)
            raise incompatible_torch(
                manifest.versions, source, exc, format_errors_only=True
            ) or CheckpointError(f"loading {path} failed: {exc}") from None
        elsewhere = None if fetcher is None else functools.partial(fetcher.digest_remote, step)
        mark(f"agreeing on step {step}'s digests")
        files_verified, ranks_checked = checks.verify_rest(
            self.ctl, path, manifest, reader, elsewhere
        )
        report.check(
            "digests",
            files_verified == len(manifest.files),
            f"{files_verified} of {plural(len(manifest.files), 'file')} hashed and matched "
            f"({manifest.digest_algorithm}); "
            + (
                "the one rank checked its digests"
                if ranks_checked == 1
                else f"split over all {ranks_checked} ranks, each matching what it hashed "
                "against the one manifest"
            )
            + f"; rank {self.rank} hashed {human_bytes(reader.hashed_bytes)} of "
            + human_bytes(manifest.total_bytes)
            + (
                f" ({plural(reader.items_checked, 'item')} of other ranks' files by item digest)"
                if reader.items_checked
                else ""
            ),
        )
        report.hashed_bytes = reader.hashed_bytes
        refused = None
        try:
            state.load_state_dict(state_dict)
        except CheckpointError as exc:  # a sampler or scheduler that does not fit
            refused = exc
        failed = self.ctl.first_failure(refused)  # every rank refuses, in the REFUSED block
        if failed is not None:
            raise failed.error
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
            times={
                "read": reader.times.read_wait_s,
                "hash": reader.times.hash_s,
                "fill": reader.times.fill_s,
            },
        )

    def _planned(
        self, reader: VerifyingReader, state_dict: dict[str, Any], name: str
    ) -> frozenset[str]:
        """The files this rank's load reads; a rank whose planning fails fails every rank
        (the others would wait for it at the fetch's agreement)."""
        failure: BaseException | None = None
        reads: frozenset[str] = frozenset()
        try:
            reads = frozenset(reader.files_for(state_dict))
        except CheckpointError as exc:
            failure = exc
        except Exception as exc:  # DCP's planner refusing the state: still every rank's error
            failure = incompatible_torch(
                reader.versions,
                os.path.join(str(reader.path), METADATA_FILE),
                exc,
                format_errors_only=True,
            ) or CheckpointError(f"planning the load of {name}: {type(exc).__name__}: {exc}")
        failed = self.ctl.first_failure(failure)
        if failed is not None:
            raise failed.error
        return reads

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
        rng.reseed(self.state.seed, step, self.rank)
        report.rng = (
            f"reseeded from (seed {self.state.seed}, step {step}, rank): the world size "
            f"changed from {manifest.world_size} to {self.world_size}, so saved per-rank "
            "generator states do not map"
        )
        report.warn(
            "RNG reseeded, not restored: dropout and sampling differ from an uninterrupted run"
        )
