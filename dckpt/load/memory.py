"""Resuming from the memory tier: the newest memory checkpoint, each byte proven, or a reason.

``MemoryRestore.restore`` runs on every rank at the start of a resume (dckpt.load.resumer,
step 1b), before the durable candidates, and either loads a memory checkpoint or says why
not (the resume then goes on with the durable tier, reporting that reason):

1. each node's first rank asks its keeper what it holds (its own steps, its replicas of
   other nodes); every rank learns every answer (all-gather);
2. a step is a candidate when every node of this world has a copy somewhere: its own memory
   or a replica on another node's keeper; only candidates at least as new as the newest
   durable step are tried, newest first;
3. every rank reads the manifest (its node's own copy, else the replica's, from the keeper
   that holds it); all ranks must hold the same bytes, the same world and the same nodes;
4. every rank proves its file: the node's own copy is hashed where it lies; if it is missing
   or does not match the writer's digest, the replica is fetched from the partner's keeper,
   hashed as it arrives; a copy that does not match is never read further;
5. if any rank has no proven copy, the candidate is dropped on every rank (its reasons are
   kept for the report); otherwise the config, precision, state kinds and GradScaler are
   checked exactly as for a durable checkpoint (a refusal there refuses the resume: the
   durable tier holds the same run), and each rank copies its tensors into the live state
   by name, shape and dtype, then restores its RNG.

Invariants: no byte of a memory file is interpreted before its digest matched the manifest
the ranks agreed on; ranks never mix steps or tiers (every choice is an all-gather).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..dist.comm import Comm
from ..errors import CheckpointError
from ..root.layout import step_dir_name
from ..root.manifest import MANIFEST_FILE, Manifest, parse_manifest
from ..storage.digest import format_digest, new_hasher
from ..storage.memory_file import FlatFile, MemoryFileError, fill_state_dict, map_for_reading
from ..tiers import memory_layout as layout
from ..tiers.keeper_client import KeeperClient
from ..tiers.memory_node import MemoryNode, memory_file_name
from ..train import rng
from ..train.state import TrainState
from ..units import human_bytes
from .report import CandidateReport

__all__ = ["MemoryLoad", "MemoryRestore"]


@dataclass(frozen=True)
class MemoryLoad:
    """A memory checkpoint loaded into the state."""

    step: int
    manifest: Manifest
    path: Path
    bytes: int
    seconds: float


class _UnusableError(Exception):
    """This candidate cannot be restored on this rank (the reason says why)."""


class MemoryRestore:
    """The memory tier's part of a resume; see the module docstring."""

    def __init__(self, ctl: Comm, tier: MemoryNode) -> None:
        self.ctl = ctl
        self.tier = tier
        self.rank = ctl.rank
        self._durable: set[int] = set()

    def holders(self) -> dict[int, dict[int, list[int]]]:
        """step -> node -> the nodes whose keeper holds a copy of it (the node itself
        first), from every node's keeper; steps some node has no copy of are left out."""
        mine: dict[str, Any] | None = None
        if self.tier.first:
            try:
                mine = self.tier.keeper.hello()
            except CheckpointError as exc:
                mine = {"error": str(exc)}
        told = self.ctl.all_gather((self.tier.node, mine))
        copies: dict[int, dict[int, list[int]]] = {}
        for node, hello in told:
            if not hello or "error" in hello:
                continue
            for step in hello.get("own", []):
                copies.setdefault(int(step), {}).setdefault(node, []).insert(0, node)
            for of_node, steps in hello.get("replicas", {}).items():
                for step in steps:
                    copies.setdefault(int(step), {}).setdefault(int(of_node), []).append(node)
        nodes = set(self.tier.topology.node_of)
        return {s: c for s, c in copies.items() if nodes <= set(c)}

    def restore(
        self,
        state: TrainState,
        durable: list[int],
        check: Any,
    ) -> tuple[MemoryLoad, CandidateReport] | list[tuple[int, str]]:
        """Load the newest usable memory checkpoint at least as new as the newest of the
        ``durable`` steps (the root's committed ones), or return why each candidate was not
        used (empty: none existed). ``check(manifest, report)`` runs the durable tier's
        config and state checks (raising refuses)."""
        copies = self.holders()
        skipped: list[tuple[int, str]] = []
        self._durable = set(durable)
        for step in sorted(copies, reverse=True):
            if durable and step < max(durable):
                break
            report = CandidateReport(step, self.tier.own / step_dir_name(step))
            t0 = time.perf_counter()
            raw: bytes | None = None
            failure: str | None = None
            try:  # every rank reaches the all-gather below, whatever failed before it
                raw = self._manifest_raw(step, copies[step][self.tier.node])
            except _UnusableError as exc:
                failure = str(exc)
            shas = self.ctl.all_gather(None if raw is None else hashlib.sha256(raw).hexdigest())
            if raw is not None and len(set(shas)) != 1:
                failure = failure or "the ranks did not all read the same manifest bytes"
            if raw is not None and failure is None:
                try:
                    manifest, buf, how = self._prove(step, raw, copies[step][self.tier.node])
                except _UnusableError as exc:
                    failure = str(exc)
            told = [f for f in self.ctl.all_gather(failure) if f is not None]
            if told:
                skipped.append((step, "; ".join(dict.fromkeys(told))))
                continue
            hows = self.ctl.all_gather(how)
            check(manifest, report)
            try:
                loaded = self._load(state, step, buf, report)
            except (MemoryFileError, CheckpointError) as exc:
                failure = str(exc)
            told = [f for f in self.ctl.all_gather(failure) if f is not None]
            if told:  # the state may be partly written: the durable load overwrites all of it
                skipped.append((step, "; ".join(dict.fromkeys(told))))
                continue
            report.origin = self._origin(step, hows)
            for r, h in enumerate(hows):
                if "its local copy:" in h:
                    report.warn(
                        f"rank {r}'s copy in its node's memory did not match the writer's digest"
                        " (the partner's replica was used): "
                        + h.split("its local copy: ", 1)[1].rstrip(")")
                    )
            report.check("memory", True, "; ".join(f"rank {r}: {h}" for r, h in enumerate(hows)))
            report.rng = loaded
            result = MemoryLoad(
                step=step,
                manifest=manifest,
                path=report.path,
                bytes=manifest.total_bytes,
                seconds=time.perf_counter() - t0,
            )
            self._record_restore(result, report.origin)
            report.check(
                "digests",
                True,
                f"{len(manifest.files)} of {len(manifest.files)} files hashed and matched "
                f"({manifest.digest_algorithm}) on the rank that loads it; every rank read the "
                "same manifest",
            )
            return result, report
        return skipped

    def _record_restore(self, result: MemoryLoad, origin: str) -> None:
        """The node's first rank notes what this restore cost (``dckpt plan`` reads it)."""
        if not self.tier.first:
            return
        record = {
            "step": result.step,
            "seconds": result.seconds,
            "bytes": result.bytes,
            "origin": origin,
            "at": time.time(),
        }
        with contextlib.suppress(OSError):
            part = self.tier.dir / f".{layout.RESTORE_FILE}.part"
            part.write_text(json.dumps(record))
            os.replace(part, self.tier.dir / layout.RESTORE_FILE)

    def _origin(self, step: int, hows: list[str]) -> str:
        remote = [r for r, h in enumerate(hows) if not h.startswith("local")]
        where = (
            "local memory" if not remote else f"memory, ranks {remote} from the partner's replica"
        )
        return f"the memory tier ({where}; {self.tier.dir.parent}, {step_dir_name(step)})"

    def _prove(self, step: int, raw: bytes, holders: list[int]) -> tuple[Manifest, Any, str]:
        """Steps 3-4 on this rank, no collective: the manifest every rank read (``raw``) and
        this rank's verified bytes, from the first of ``holders`` whose copy matches."""
        node = self.tier.node
        try:
            manifest = parse_manifest(raw, f"memory manifest of step {step}")
        except CheckpointError as exc:
            raise _UnusableError(f"rank {self.rank}: {exc}") from None
        if manifest.mesh.get("root_id") != self.tier.root_id:
            raise _UnusableError(
                "it was saved beside another checkpoint root (root id "
                f"{manifest.mesh.get('root_id')}, this root's is {self.tier.root_id}): the "
                "root was removed and made again, or another run shares the memory directory"
            )
        after = manifest.mesh.get("after")
        if after is not None and after not in self._durable:
            raise _UnusableError(
                f"it follows durable step {after}, which the root no longer holds (deleted, "
                "quarantined or rolled back): the run it belongs to is not this root's"
            )
        world = list(self.tier.topology.node_of)
        if manifest.world_size != len(world) or manifest.mesh.get("nodes") != world:
            raise _UnusableError(
                f"saved by {manifest.world_size} ranks on nodes {manifest.mesh.get('nodes')}, "
                f"now {len(world)} ranks on nodes {world}: a memory checkpoint is restored "
                "by the same ranks only"
            )
        name = memory_file_name(self.rank)
        record = manifest.file_map().get(name)
        if record is None:
            raise _UnusableError(f"rank {self.rank}: the manifest lists no {name}")
        failures: list[str] = []
        for holder in holders:
            try:
                if holder == node:
                    return (
                        manifest,
                        self._local(step, name, record.bytes, record.digest),
                        "local memory",
                    )
                buf = self._fetch(holder, step, name, record.bytes, record.digest)
                why = f"; its local copy: {failures[0]}" if failures else ""
                size = human_bytes(record.bytes)
                return manifest, buf, f"replica on node {holder} ({size}{why})"
            except (CheckpointError, OSError, KeyError) as exc:
                where = "local copy" if holder == node else f"replica on node {holder}"
                failures.append(f"{where}: {exc}")
        raise _UnusableError(
            f"rank {self.rank}: no copy matched the writer's digest ({'; '.join(failures)})"
        )

    def _fetch(self, holder: int, step: int, name: str, size: int, digest: str) -> mmap.mmap:
        """This rank's file from ``holder``'s keeper, hashed as it arrives, into a file in this
        node's memory mapped with its pages already in place (a fresh buffer faulted in page
        by page took longer than the transfer): a spare slot when the node has one (its pages
        are reused), else a new file. The file goes back to ``spare/own/`` at once (renamed):
        the mapping keeps its pages, and the next memory save reuses them."""
        spares = layout.spare_dir(self.tier.dir, "own")
        spares.mkdir(parents=True, exist_ok=True)
        path = spares / f".fetch-{name}-{os.getpid()}"
        if not layout.take_spare(spares, name, path):
            path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.rename(path, spares / f"{name}@fetched")  # never read as a checkpoint
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, max(size, 1))
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        try:
            addr = self.tier.topology.keepers[holder]
            KeeperClient(addr).read(self.tier.node, step, name, size, digest, into=memoryview(mm))
        except BaseException:
            with contextlib.suppress(BufferError):
                mm.close()
            raise
        return mm

    def _manifest_raw(self, step: int, holders: list[int]) -> bytes:
        node = self.tier.node
        errors: list[str] = []
        for holder in holders:
            try:
                if holder == node:
                    return (self.tier.own / step_dir_name(step) / MANIFEST_FILE).read_bytes()
                return KeeperClient(self.tier.topology.keepers[holder]).manifest(node, step)
            except (CheckpointError, OSError, KeyError) as exc:
                errors.append(str(exc))
        raise _UnusableError(f"rank {self.rank}: no readable manifest ({'; '.join(errors)})")

    def _local(self, step: int, name: str, size: int, digest: str) -> mmap.mmap:
        path = self.tier.own / step_dir_name(step) / name
        with open(path, "rb") as f:
            mm = map_for_reading(f.fileno())
        hasher = new_hasher(digest.split(":", 1)[0])
        hasher.update(memoryview(mm))
        actual, length = format_digest(digest.split(":", 1)[0], hasher), len(mm)
        if length != size or actual != digest:
            mm.close()
            raise CheckpointError(
                f"{path}: {length} bytes hashing to {actual}, the writer recorded {size} "
                f"bytes, {digest}"
            )
        return mm

    def _load(self, state: TrainState, step: int, buf: Any, report: CandidateReport) -> str:
        """Step 5's copy: the verified bytes into the live state; returns the RNG line."""
        state_dict = state.state_dict()
        state_dict["rng"] = {f"rank_{self.rank}": rng.capture()}
        flat = FlatFile(buf, f"rank {self.rank}'s memory file of step {step}")
        filled = fill_state_dict(state_dict, flat)
        del flat
        if isinstance(buf, mmap.mmap):
            with contextlib.suppress(BufferError):  # a view still alive: the GC closes it
                buf.close()
        saved_rng = filled.pop("rng")[f"rank_{self.rank}"]
        state.load_state_dict(filled)
        rng.restore(saved_rng)
        restored = ", ".join(state.categories())
        report.check("state", True, restored)
        return "restored on every rank (python, numpy, torch" + (
            ", CUDA)" if "cuda" in saved_rng else ")"
        )
