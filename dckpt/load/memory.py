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
   that holds it); all ranks must hold the same bytes; the manifest must name this root (its
   id) and a durable step the root still holds (``mesh.after``), this world and these nodes;
4. each node proves the files its ranks read (their own; every rank's when the save shares
   replicated tensors, ``mesh.shared``), each file once, split among the node's ranks: a
   copy in the node's memory (its own, or the replica it keeps of another node) is hashed
   where it lies; if it is missing or does not match the writer's digest, it is fetched from
   another node's keeper into ``fetched/``, hashed as it arrives, and named only if it
   matched; a copy that does not match is never read further;
5. if any file has no proven copy, the candidate is dropped on every rank (its reasons are
   kept for the report); otherwise the config, precision, state kinds and GradScaler are
   checked exactly as for a durable checkpoint (a refusal there refuses the resume: the
   durable tier holds the same run), and each rank copies its tensors into the live state
   by name, shape and dtype, from whichever proven file holds them, then restores its RNG.

Invariants: no byte of a memory file is interpreted before its digest matched the manifest
the ranks agreed on; ranks never mix steps or tiers (every choice is an all-gather).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..dist.comm import Comm
from ..errors import CheckpointError
from ..root.layout import step_dir_name
from ..root.manifest import MANIFEST_FILE, Manifest, parse_manifest
from ..storage.digest import format_digest, new_hasher
from ..storage.memory_file import FlatFile, StateFill, map_for_reading
from ..storage.records import FileRecord
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


Proof = tuple[str, str, tuple[int, int, int]]
"""A proven file: a path every rank of the node can map, how it was proven, its identity."""


class _UnusableError(Exception):
    """This candidate cannot be restored on this rank (the reason says why)."""


class _ForeignError(_UnusableError):
    """This candidate belongs to another root or another branch of the run: not this run's
    to lose (a fresh start past it is right)."""


@dataclass
class Outcome:
    """What the memory tier's part of a resume found, when it loaded nothing."""

    skipped: list[tuple[int, str]]
    """Candidates not used, and why."""
    lost: list[tuple[int, str]]
    """Of those, the ones that were this run's (not another root's or branch's): a fresh
    start past them would throw work away."""
    dirty: bool = False
    """A restore failed after it began copying into the state: the state is mixed."""


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
    ) -> tuple[MemoryLoad, CandidateReport] | Outcome:
        """Load the newest usable memory checkpoint at least as new as the newest of the
        ``durable`` steps (the root's committed ones), or say why each candidate was not
        used. ``check(manifest, report)`` runs the durable tier's config and state checks
        (raising refuses). Every rank makes the same collective calls in every branch: a
        failure on one rank is all-gathered, never raised past the others."""
        copies = self.holders()
        outcome = Outcome([], [])
        self._durable = set(durable)
        for step in sorted(copies, reverse=True):
            if durable and step < max(durable):
                break
            try:
                got = self._candidate(state, step, copies[step], check, outcome)
            finally:
                self._tidy_fetched()
            if got is not None:
                return got
            if outcome.dirty:
                break
        return outcome

    def _candidate(
        self,
        state: TrainState,
        step: int,
        copies: dict[int, list[int]],
        check: Any,
        outcome: Outcome,
    ) -> tuple[MemoryLoad, CandidateReport] | None:
        report = CandidateReport(step, self.tier.own / step_dir_name(step))
        t0 = time.perf_counter()
        raw: bytes | None = None
        failure: tuple[str, bool] | None = None  # (why, foreign)
        try:  # every rank reaches the all-gather below, whatever failed before it
            raw = self._manifest_raw(step, copies[self.tier.node])
        except _UnusableError as exc:
            failure = (str(exc), False)
        shas = self.ctl.all_gather(None if raw is None else hashlib.sha256(raw).hexdigest())
        if raw is not None and failure is None and len(set(shas)) != 1:
            failure = ("the ranks did not all read the same manifest bytes", False)
        proofs: dict[str, Proof] = {}
        manifest: Manifest | None = None
        if raw is not None and failure is None:
            try:
                manifest, needed = self._check_manifest(step, raw)
                proofs = self._prove(step, manifest, needed, copies)
            except _UnusableError as exc:
                failure = (str(exc), isinstance(exc, _ForeignError))
            except Exception as exc:  # anything else: a reason, not a hang of the others
                failure = (f"rank {self.rank}: {exc!r}", False)
        told_all = self.ctl.all_gather((failure, proofs))
        if self._skip(step, [f for f, _ in told_all], outcome):
            return None
        assert manifest is not None
        mine = [r for r, n in enumerate(self.tier.topology.node_of) if n == self.tier.node]
        proven = {name: proof for r in mine for name, proof in told_all[r][1].items()}
        if not manifest.mesh.get("shared"):  # this rank's own file holds all it needs
            own = memory_file_name(self.rank)
            proven = {own: proven[own]}
        hows = [_summary(proved) for _, proved in told_all]
        check(manifest, report)  # a refusal here refuses the resume, on every rank
        prepared: tuple[StateFill, list[mmap.mmap]] | None = None
        failure = None
        try:
            prepared = self._prepare(state, step, proven)
        except Exception as exc:
            failure = (f"rank {self.rank}: {exc}", False)
        if self._skip(step, self.ctl.all_gather(failure), outcome):
            _close(prepared[1] if prepared else [])
            return None
        assert prepared is not None
        fill, maps = prepared
        try:  # from here on the live state changes
            rng_line = self._apply(state, fill)
        except Exception as exc:
            failure = (f"rank {self.rank}: restoring into the state failed: {exc!r}", False)
        finally:
            del fill
            _close(maps)
        if self._skip(step, self.ctl.all_gather(failure), outcome):
            outcome.dirty = True
            return None
        report.origin = self._origin(step, hows)
        for r, (_, proved) in enumerate(told_all):
            for name, (_, how, _) in sorted(proved.items()):
                if "; local copy: " in how:
                    report.warn(
                        f"rank {r}: the copy of {name} in its node's memory did not match "
                        "the writer's digest, another node's was used: "
                        + how.split("; local copy: ", 1)[1]
                    )
        report.check("memory", True, "; ".join(f"rank {r}: {h}" for r, h in enumerate(hows)))
        report.check("state", True, ", ".join(state.categories()))
        report.rng = rng_line
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
            f"({manifest.digest_algorithm}) on every node that reads them, before a byte "
            "of them was read; every rank read the same manifest",
        )
        return result, report

    @staticmethod
    def _skip(step: int, told: list[tuple[str, bool] | None], outcome: Outcome) -> bool:
        """Record why ``step`` is not used, when any rank said so (every rank decides alike)."""
        failures = [f for f in told if f is not None]
        if not failures:
            return False
        why = "; ".join(dict.fromkeys(w for w, _ in failures))
        outcome.skipped.append((step, why))
        if not all(foreign for _, foreign in failures):
            outcome.lost.append((step, why))
        return True

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
        where = "local memory" if not remote else f"memory, ranks {remote} from other nodes"
        return f"the memory tier ({where}; {self.tier.dir.parent}, {step_dir_name(step)})"

    def _check_manifest(self, step: int, raw: bytes) -> tuple[Manifest, list[str]]:
        """Step 3 on this rank, no collective: the manifest every rank read (``raw``), checked
        against this root and this world; returns it and the files this node must prove."""
        try:
            manifest = parse_manifest(raw, f"memory manifest of step {step}")
        except CheckpointError as exc:
            raise _UnusableError(f"rank {self.rank}: {exc}") from None
        if manifest.mesh.get("root_id") != self.tier.root_id:
            raise _ForeignError(
                "it was saved beside another checkpoint root (root id "
                f"{manifest.mesh.get('root_id')}, this root's is {self.tier.root_id}): the "
                "root was removed and made again, or another run shares the memory directory"
            )
        after = manifest.mesh.get("after")
        if after is not None and after not in self._durable:
            raise _ForeignError(
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
        names = {memory_file_name(r) for r in range(len(world))}
        if {f.path for f in manifest.files} != names:
            raise _UnusableError(f"its manifest does not list one file per rank ({sorted(names)})")
        if manifest.mesh.get("shared") == "world":  # each rank reads from every rank's file
            return manifest, sorted(names)
        return manifest, sorted(
            memory_file_name(r) for r, n in enumerate(world) if n == self.tier.node
        )

    def _prove(
        self, step: int, manifest: Manifest, needed: list[str], copies: dict[int, list[int]]
    ) -> dict[str, Proof]:
        """Step 4, this rank's share of its node's files (no collective): each proven where it
        lies, or fetched from a node that holds it and proven as it arrives. Returns file ->
        (a path every rank of this node can map, how it was proven)."""
        node_of = self.tier.topology.node_of
        mates = [r for r, n in enumerate(node_of) if n == self.tier.node]
        records = manifest.file_map()
        proofs: dict[str, Proof] = {}
        for i, name in enumerate(needed):
            owner = int(name.removeprefix("rank-").removesuffix(".mem"))
            duty = owner if not manifest.mesh.get("shared") else mates[i % len(mates)]
            if duty != self.rank:
                continue
            proofs[name] = self._prove_one(step, records[name], node_of[owner], copies)
        return proofs

    def _prove_one(
        self, step: int, record: FileRecord, of_node: int, copies: dict[int, list[int]]
    ) -> Proof:
        me, name = self.tier.node, record.path
        holders = copies.get(of_node, [])
        failures: list[str] = []
        if me in holders:  # this node's own copy, or the replica it keeps of another node
            if of_node == me:
                path = self.tier.own / step_dir_name(step) / name
            else:
                path = layout.replica_dir(self.tier.dir, of_node) / step_dir_name(step) / name
            try:
                identity = _hash_in_place(path, record.bytes, record.digest)
                return str(path), "local memory", identity
            except (CheckpointError, OSError, ValueError) as exc:
                failures.append(str(exc))
        for holder in holders:
            if holder == me:
                continue
            try:
                path = self._fetch(holder, step, of_node, record)
                identity = _identity(os.stat(path))
            except (CheckpointError, OSError, KeyError, ValueError) as exc:
                failures.append(f"node {holder}'s copy: {exc}")
                continue
            why = f"; local copy: {failures[0]}" if failures else ""
            how = f"from node {holder} ({human_bytes(record.bytes)}{why})"
            return str(path), how, identity
        raise _UnusableError(
            f"rank {self.rank}: no copy of {name} matched the writer's digest "
            f"({'; '.join(failures) or 'no node holds one'})"
        )

    def _fetch(self, holder: int, step: int, of_node: int, record: FileRecord) -> Path:
        """``record``'s file from ``holder``'s keeper, hashed as it arrives, into this node's
        ``fetched/step-N/`` (where every rank of the node can map it), written through a
        mapping with its pages already in place (faulting a fresh buffer in page by page took
        longer than the transfer); a spare slot of that name is reused when the node has one.
        The file gets its name only once every byte matched the writer's digest."""
        target = self.tier.dir / FETCHED_DIR / step_dir_name(step)
        target.mkdir(parents=True, exist_ok=True)
        name, size = record.path, record.bytes
        part = target / f".{name}.part-{os.getpid()}"
        if not layout.take_spare(layout.spare_dir(self.tier.dir, "own"), name, part):
            part.unlink(missing_ok=True)
        fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, max(size, 1))
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        try:
            client = KeeperClient(self.tier.topology.keepers[holder])
            client.read(of_node, step, name, size, record.digest, into=memoryview(mm))
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        finally:
            with contextlib.suppress(BufferError):
                mm.close()
        os.rename(part, target / name)
        return target / name

    def _tidy_fetched(self) -> None:
        """After every rank of the node mapped its files: fetched files of this node's ranks
        become spare slots (the next memory save reuses their pages); the rest go."""
        if not self.tier.first:
            return
        fetched = self.tier.dir / FETCHED_DIR
        spares = layout.spare_dir(self.tier.dir, "own")
        mine = {
            memory_file_name(r)
            for r, n in enumerate(self.tier.topology.node_of)
            if n == self.tier.node
        }
        for path in sorted(fetched.glob("step-*/*")):
            taken = spares.is_dir() and any(
                p.name.split("@", 1)[0] == path.name for p in spares.iterdir()
            )
            if path.name in mine and not taken:
                with contextlib.suppress(OSError):
                    spares.mkdir(parents=True, exist_ok=True)
                    os.rename(path, spares / f"{path.name}@fetched")
                    continue
            path.unlink(missing_ok=True)
        shutil.rmtree(fetched, ignore_errors=True)

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

    def _prepare(
        self, state: TrainState, step: int, proven: dict[str, Proof]
    ) -> tuple[StateFill, list[mmap.mmap]]:
        """Map the proven files (each must still be the file that was proven: same inode,
        size and change time) and match every live tensor to its bytes; writes nothing."""
        own = memory_file_name(self.rank)
        maps: dict[str, mmap.mmap] = {}
        try:
            for name, (path, _, identity) in proven.items():
                maps[name] = _map(path, identity)
            state_dict = state.state_dict()
            state_dict["rng"] = {f"rank_{self.rank}": rng.capture()}
            mine = FlatFile(maps[own], f"rank {self.rank}'s memory file of step {step}")
            others = [
                FlatFile(mm, f"{name} of memory step {step}")
                for name, mm in maps.items()
                if name != own
            ]
            return StateFill(state_dict, mine, others), list(maps.values())
        except BaseException:
            _close(list(maps.values()))
            raise

    def _apply(self, state: TrainState, fill: StateFill) -> str:
        """Step 5's copy, once every rank prepared: returns the RNG line."""
        filled = fill.apply()
        saved_rng = filled.pop("rng")[f"rank_{self.rank}"]
        state.load_state_dict(filled)
        rng.restore(saved_rng)
        return "restored on every rank (python, numpy, torch" + (
            ", CUDA)" if "cuda" in saved_rng else ")"
        )


FETCHED_DIR = "fetched"
"""Under a node's memory: files fetched from other nodes for a resume, until it is done."""


def _map(path: str, identity: tuple[int, int, int]) -> mmap.mmap:
    """Map ``path`` if it is still the file that was proven (the proof and the read may be on
    two ranks, so the file is opened twice)."""
    with open(path, "rb") as f:
        if _identity(os.fstat(f.fileno())) != identity:
            raise CheckpointError(f"{path} changed after it was proven: not read")
        return map_for_reading(f.fileno())


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _close(maps: list[mmap.mmap]) -> None:
    for mm in maps:
        with contextlib.suppress(BufferError):  # a view still alive: the GC closes it
            mm.close()


def _hash_in_place(path: Path, size: int, digest: str) -> tuple[int, int, int]:
    """Hash the file where it lies; CheckpointError unless it is exactly the writer's bytes.
    Returns the file's identity (inode, size, change time), for the read that follows."""
    algorithm = digest.split(":", 1)[0]
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size != size:
            raise CheckpointError(
                f"{path}: {st.st_size} bytes, the writer recorded {size} bytes, {digest}"
            )
        with map_for_reading(f.fileno()) as mm:
            hasher = new_hasher(algorithm)
            hasher.update(memoryview(mm))
            actual, length = format_digest(algorithm, hasher), len(mm)
    if length != size or actual != digest:
        raise CheckpointError(
            f"{path}: {length} bytes hashing to {actual}, the writer recorded {size} bytes, "
            f"{digest}"
        )
    return _identity(st)


def _summary(proved: dict[str, Proof]) -> str:
    """One rank's part of the proof, for the report: ``local memory`` when every file it
    proved was in its node's memory."""
    hows = [how for _, how, _ in proved.values()]
    if not hows:
        return "local memory (proved by another rank of its node)"
    if all(h == "local memory" for h in hows):
        return "local memory"
    return "; ".join(h for h in hows if h != "local memory")
