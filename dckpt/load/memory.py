"""Resuming from the memory tier: ``MemorySource`` (a ``CheckpointSource``) and ``MemoryReader``.

The resume protocol (dckpt.load.resumer) tries every candidate of every source newest first;
a memory candidate is a step in the root's ledger (dckpt.root.memory_ledger), and trying it
takes these steps, on every rank, each failure said on every rank:

1. **the record** (``MemorySource.fetch``): rank 0 reads the step's manifest from the root's
   ledger (where only the job writes: a step found in memory without a record there is
   never read) and lists the root's durable steps; every rank gets both (one broadcast) and
   checks the manifest: its self-digest, a memory manifest of this world on these nodes, and
   its durable anchor (``mesh["after"]``, required): the newest durable step at or before it
   must be the one it followed, else it belongs to a branch the run left;
2. **proof in place**: each node proves the files its ranks read (their own; every rank's
   when the save shares replicated tensors, ``mesh["shared"]``), each once, split among the
   node's ranks: a copy in the node's memory (its own, or the replica it keeps for the node
   before it on the ring) is hashed where it lies against the manifest's digest;
3. **exchange**: one all-reduce says whether every rank proved its own file; then nothing
   moves (a save whose ranks share replicated tensors excepted: each rank reads its mates'
   files too, so learns their proofs). Otherwise every rank learns every proof (an
   all-gather, with what each node holds);
   each file no copy of which proved on a node that needs it is sent by a rank of a node
   that holds one, over dckpt's gloo group (dckpt.collective.transfer), into the node's memory
   (its ``own/`` or ``replica/`` place, so a replaced node gets its memory back), hashed as
   it arrives and renamed in only if it matched; a node that holds no copy makes the step
   unavailable (``CheckpointNotFoundError``: the resume goes on with the next candidate and
   says why), a copy that arrives damaged is damage (``IntegrityError``: every copy failed);
4. **config and state** (``MemoryReader.load``): the same checks as a durable checkpoint's
   (dckpt.load.checks), then each rank matches every live tensor to its bytes by name, shape
   and dtype (``StateFill``, writing nothing), the ranks agree, and only then does each copy
   its tensors in, restore its non-tensor values and its RNG. A proven file whose header
   does not describe it (a span past its end, a length its shape does not have) is damage
   (``ManifestError``), not a changed state.

Invariants: no byte of a memory file is interpreted before its digest matched the manifest
from the root's ledger; ranks never mix steps or tiers (every choice is a collective).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..collective.comm import Comm
from ..collective.transfer import CHUNK, Incoming, Outgoing, TransferError, move
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    StateMismatchError,
    WorldError,
)
from ..owned import owner_name, write_atomic
from ..root.layout import step_dir_name
from ..root.manifest import Manifest, parse_manifest
from ..root.memory_ledger import MemoryLedger
from ..storage.digest import format_digest, new_hasher
from ..storage.memory_file import FlatFile, MemoryFileError, StateFill
from ..storage.records import FileRecord
from ..storage.verified_files import NotRegularFileError, open_regular
from ..tiers import memory_layout as layout
from ..tiers.memory_layout import Claim
from ..train import rng
from ..train.state import TrainState
from ..units import human_bytes
from .checks import CandidateChecks, raise_first
from .report import CandidateReport, LoadResult

__all__ = ["MemoryFetched", "MemoryReader", "MemorySource"]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_TROUBLE = {"damaged": "did not match the writer's digest", "unreadable": "could not be read"}
_LOCAL = "local memory"
_LISTED = 16  # ranks the report's memory line lists one by one when all came alike


@dataclass
class MemoryFetched:
    """A memory candidate proven on every node: its manifest, and this node's files."""

    manifest: Manifest
    proofs: dict[str, tuple[str, tuple[int, int, int]]]
    """File name -> (its path on this node, its identity when proven), for this node's ranks."""
    hows: list[str]
    """Per rank: where the files it proved came from (the report's ``memory`` line)."""
    remote: list[int] = field(default_factory=list)
    """The ranks that received files from another node."""
    warnings: list[str] = field(default_factory=list)
    maps: dict[str, mmap.mmap] = field(default_factory=dict)
    """The mappings this rank made to prove its files, kept for its reads (closed after)."""
    held: dict[str, mmap.mmap] = field(default_factory=dict)
    """The files this rank received, mapped by its ``Slots`` (which keep them mapped)."""
    reread: tuple[str, ...] = ()  # a damaged memory copy is replaced from another, not re-read

    def line(self) -> str:
        if len(self.hows) > _LISTED and len(set(self.hows)) == 1:  # one line, not thousands
            return f"all {len(self.hows)} ranks: {self.hows[0]}"
        return "; ".join(f"rank {r}: {h}" for r, h in enumerate(self.hows))


class MemorySource:
    """The memory tier's candidates and their proof; see the module docstring."""

    def __init__(
        self,
        *,
        ctl: Comm,
        ledger: MemoryLedger,
        topology: layout.Topology,
        memory_dir: Path,
        durable_steps: Callable[[], list[int]],
        timeout_s: float,
        slots: layout.Slots,
    ) -> None:
        self.ctl = ctl
        self.ledger = ledger
        self.topology = topology
        self.node_of = node_of = topology.node_of
        self.rank = ctl.rank
        self.node = node_of[self.rank]
        self.memory_dir = Path(memory_dir)
        self.dir = layout.node_dir(memory_dir, self.node)
        self.local = layout.own_dir(self.dir)
        self.durable_steps = durable_steps
        self.timeout_s = timeout_s
        self.mates = [r for r, n in enumerate(node_of) if n == self.node]
        self.slots = slots
        """This rank's mappings of its node's files (shared with the memory save)."""
        self.names = topology.names_of(self.rank)
        """The files whose spares are this rank's to reuse (its own, the replicas it keeps)."""

    def __str__(self) -> str:
        return f"the memory tier ({self.memory_dir})"

    def steps(self) -> list[int]:
        return self.ledger.steps()

    def origin(self, step: int) -> str:
        return f"the memory tier ({self.memory_dir}, {step_dir_name(step)})"

    fetcher = None
    """The memory reader proves and moves a step itself (``fetch`` below): a node proves
    what it holds and receives what it lacks, whole."""

    def quarantine(self, step: int, reason: str, damage: CheckpointError | None = None) -> None:
        """Every copy was tried before a memory step is called damaged: no damage to
        confirm (``damage`` is the proof the resume already has)."""
        self.ledger.quarantine(step, reason)

    def quarantined_count(self) -> int:
        return self.ledger.quarantined()

    def save_id(self, step: int) -> str:
        """Rank 0: the save id of the ledger's manifest of ``step``."""
        return parse_manifest(self.ledger.read(step), self.ledger.where(step)).save_id

    # --- step 1: the record ---------------------------------------------------------------------

    def fetch(self, step: int, files: frozenset[str] | None = None) -> MemoryFetched:
        manifest = self._record(step)
        needed = self._needed(manifest)
        records = manifest.file_map()
        duty = [n for i, n in enumerate(needed) if self.mates[i % len(self.mates)] == self.rank]
        fetched = MemoryFetched(manifest, {}, [])
        bad: dict[str, tuple[str, str]] = {}  # name -> (missing|damaged|unreadable, why)
        # The files this node lacks will arrive from another: allocate their memory now, while
        # the ranks prove what they hold and as the bytes arrive (fresh pages are what a
        # replaced node waits on: 0.13 s for 256 MiB here, longer than the transfer).
        ahead = {
            n: self._claim_ahead(step, n, records[n].bytes)
            for n in duty
            if not self._place(step, n).exists()
        }
        room = threading.Thread(target=_allocate, args=(list(ahead.values()),), daemon=True)
        room.start()
        for name in duty:  # 2: this rank's share of its node's files, where they lie
            path = self._place(step, name)
            try:
                fetched.maps[name], identity = _prove(path, records[name])
                fetched.proofs[name] = (str(path), identity)
            except FileNotFoundError:
                bad[name] = ("missing", "")
            except IntegrityError as exc:  # evidence: other bytes than the writer's
                bad[name] = ("damaged", str(exc))
            except (OSError, ValueError) as exc:  # this node could not read it: no evidence
                bad[name] = ("unreadable", f"{path}: {exc}")
        try:
            if not manifest.mesh.get("shared") and not self.ctl.any(bool(bad)):
                # Each rank proved its own file in place (its node's files are split by
                # rank, the i-th to the i-th rank), the one it reads, and one all-reduce
                # says every rank did: nothing moves, and no rank needs another's proofs
                # (whatever the world's size). A node that lacks a copy, or a save whose
                # replicated tensors its ranks share (each reads its mates' files, so
                # learns their proofs), goes through the exchange.
                fetched.hows = [_LOCAL] * len(self.node_of)
                return fetched
            listing = layout.held(self.dir, step) if self.mates[0] == self.rank else None
            told = self.ctl.all_gather((listing, fetched.proofs, bad))
            self._exchange(step, manifest, told, fetched, ahead, room)  # 3
        finally:
            room.join()
            for name, claim in ahead.items():  # claimed, and never received into
                if claim is not None and name not in fetched.held:
                    self.slots.drop(self._place(step, name).with_name(f".{name}.part-in"))
        return fetched

    def _claim_ahead(self, step: int, name: str, size: int) -> Claim | None:
        """The part file ``name`` will arrive into, made and mapped now (``move`` receives
        into it); None when this node's memory cannot even make it (said at the receive)."""
        part = self._place(step, name).with_name(f".{name}.part-in")
        try:
            return self.slots.claim(part, size, spare_of=name if name in self.names else None)
        except OSError:
            return None

    def _record(self, step: int) -> Manifest:
        raw: bytes | None = None
        durable: list[int] = []
        why: CheckpointError | None = None
        if self.rank == 0:
            try:
                raw = self.ledger.read(step)
                durable = self.durable_steps()
            except CheckpointError as exc:
                why = exc
            except OSError as exc:
                why = CheckpointNotFoundError(f"cannot read {self.ledger.where(step)}: {exc}")
        raw, durable, why = self.ctl.broadcast((raw, durable, why))
        if why is not None:
            raise why
        assert raw is not None
        manifest = parse_manifest(raw, self.ledger.where(step))  # the same on every rank
        if manifest.step != step or manifest.mesh.get("tier") != "memory":
            raise ManifestError(
                f"{self.ledger.where(step)} is not the memory manifest of step {step}"
            )
        world = list(self.node_of)
        if manifest.world_size != len(world) or manifest.mesh.get("nodes") != world:
            raise CheckpointNotFoundError(
                f"saved by {manifest.world_size} ranks on nodes {manifest.mesh.get('nodes')}, "
                f"now {len(world)} ranks on nodes {world}: a memory checkpoint is restored by "
                "the same ranks on the same nodes only"
            )
        names = {layout.file_name(r) for r in range(len(world))}
        if {f.path for f in manifest.files} != names:
            raise ManifestError(f"{self.ledger.where(step)} does not list one file per rank")
        if "after" not in manifest.mesh:
            raise CheckpointNotFoundError(
                "its manifest names no durable anchor (mesh.after): it cannot be placed in this "
                "run's history"
            )
        after = manifest.mesh["after"]
        before = max((d for d in durable if d <= step), default=None)
        if after != before:
            raise CheckpointNotFoundError(
                f"it follows durable step {after}, but the newest durable step at or before it "
                f"is {before}: it belongs to a branch the run left (rolled back, or its durable "
                "step was removed)"
            )
        return manifest

    def _needed(self, manifest: Manifest) -> list[str]:
        """The files this node's ranks read: every rank's for a save that shares replicated
        tensors across the world, else this node's ranks' own."""
        if manifest.mesh.get("shared") == "world":
            ranks = list(range(len(self.node_of)))
        else:
            ranks = list(self.mates)
        return [layout.file_name(r) for r in ranks]

    def _place(self, step: int, name: str, node: int | None = None) -> Path:
        """Where ``node`` (this one) keeps ``name`` of ``step``: its own ranks' files under
        ``own/``, the files of the node before it on the ring under ``replica/``, any other
        under ``replica/`` too (a world-shared save on a changed ring)."""
        node = self.node if node is None else node
        of_node = self.node_of[layout.rank_of(name)]
        base = layout.node_dir(self.memory_dir, node)
        parent = layout.own_dir(base) if of_node == node else layout.replica_dir(base, of_node)
        return parent / step_dir_name(step) / name

    # --- step 3: the exchange ---------------------------------------------------------------

    def _exchange(
        self,
        step: int,
        manifest: Manifest,
        told: list[tuple[dict[str, int] | None, dict[str, Any], dict[str, tuple[str, str]]]],
        fetched: MemoryFetched,
        ahead: dict[str, Claim | None],
        room: threading.Thread,
    ) -> None:
        records = manifest.file_map()
        plan = self._plan(step, records, told)
        if not plan:  # the same on every rank: nothing moves, so there is nothing to tell
            room.join()
            self._describe(plan, records, told, [([], [], [], {}, 0.0)] * len(told), fetched)
            return
        outgoing: list[Outgoing] = []
        incoming: list[Incoming] = []
        borrowed: list[mmap.mmap] = []  # mappings of files this rank sends but does not keep
        pairs: dict[tuple[int, int], int] = {}
        sent_bad: list[str] = []
        for sender, receiver, holder, name in plan:
            tag = pairs.setdefault((sender, receiver), 0)
            pairs[sender, receiver] = tag + 1
            if sender == self.rank:
                path = self._place(step, name, holder)
                data: Any = None
                try:
                    if fetched.proofs.get(name, ("", None))[0] == str(path):
                        data = fetched.maps[name]  # proven by this rank: that mapping
                    else:
                        data, _ = _map_sized(path, records[name].bytes)  # the receiver hashes it
                        borrowed.append(data)
                except (OSError, ValueError) as exc:  # zeros go: the receiver refuses them
                    sent_bad.append(f"rank {self.rank} could not read {path}: {exc}")
                outgoing.append(Outgoing(data, receiver, records[name].bytes, tag))
            if receiver == self.rank:
                into = self._place(step, name)
                spare = name if name in self.names else None
                size, digest = records[name].bytes, records[name].digest
                incoming.append(Incoming(sender, into, size, digest, tag, spare, ahead.get(name)))
        t0 = time.perf_counter()
        try:
            got = move(self.ctl, outgoing, incoming, self.slots, timeout_s=self.timeout_s)
        except TransferError as exc:  # the group is gone: nothing more can be agreed
            raise WorldError(f"moving memory step {step} between the nodes failed: {exc}") from exc
        finally:
            _close(borrowed)
            room.join()  # no allocation runs on a file past this point
        damaged: list[str] = []
        refused: list[str] = []
        arrived: dict[str, tuple[str, tuple[int, int, int]]] = {}
        for item, result in zip(incoming, got, strict=True):
            if result.error is not None:
                (refused if result.refused else damaged).append(f"rank {self.rank}: {result.error}")
                continue
            held = self.slots.mapped_at(item.into)  # the mapping it arrived into, hashed
            arrived[item.into.name] = (str(item.into), _identity(os.lstat(item.into)))
            fetched.held[item.into.name] = held
        outcomes = self.ctl.all_gather(
            (damaged, refused, sent_bad, arrived, time.perf_counter() - t0)
        )
        if any(o[2] for o in outcomes) or any(o[1] for o in outcomes):
            # A sender that could not read its copy, or a receiver that could not hold it:
            # the step cannot be restored here, and nothing says its bytes are bad.
            why = [w for o in outcomes for w in (*o[2], *o[1])]
            raise CheckpointNotFoundError(f"its files could not be moved: {'; '.join(why)}")
        if any(o[0] for o in outcomes):
            raise IntegrityError(
                str(self.memory_dir),
                "a copy that hashes to the writer's digest",
                "; ".join(w for o in outcomes for w in o[0]),
                detail=f"no copy of memory step {step} that a node needs arrived intact",
            )
        self._describe(plan, records, told, outcomes, fetched)

    def _plan(
        self,
        step: int,
        records: dict[str, FileRecord],
        told: list[tuple[dict[str, int] | None, dict[str, Any], dict[str, tuple[str, str]]]],
    ) -> list[tuple[int, int, int, str]]:
        """Who sends which file to whom: (sender, receiver, holder node, name), the same on
        every rank; raises when some file has no copy a node could send (the evidence, when
        every copy seen was damaged; else that it is missing)."""
        holds = {self.node_of[r]: listing for r, (listing, _, _) in enumerate(told) if listing}
        nodes = sorted(set(self.node_of))
        plan: list[tuple[int, int, int, str]] = []
        missing: list[str] = []
        damaged: list[str] = []
        for receiver, (_, _, bad) in enumerate(told):
            for name in sorted(bad):
                mine = self.node_of[receiver]
                owner = self.node_of[layout.rank_of(name)]
                holders = [
                    n
                    for n in dict.fromkeys([owner, *nodes])
                    if n != mine and holds.get(n, {}).get(name) == records[name].bytes
                ]
                kind, why = bad[name]
                if holders:
                    ranks = [r for r, n in enumerate(self.node_of) if n == holders[0]]
                    plan.append((ranks[len(plan) % len(ranks)], receiver, holders[0], name))
                elif kind == "damaged":  # its one copy is other bytes, and no node holds another
                    damaged.append(f"{name} on node {mine}: {why}")
                else:
                    missing.append(f"{name} (for rank {receiver}{': ' + why if why else ''})")
        if damaged:
            raise IntegrityError(
                str(self.memory_dir),
                "a copy that hashes to the writer's digest",
                "; ".join(damaged),
                detail=f"no copy of memory step {step} in any node's memory is intact",
            )
        if missing:
            raise CheckpointNotFoundError(
                f"no node holds {', '.join(missing)} in memory (a node lost its memory, and "
                "the replica of it is gone too)"
            )
        return plan

    def _describe(
        self,
        plan: list[tuple[int, int, int, str]],
        records: dict[str, FileRecord],
        told: list[tuple[dict[str, int] | None, dict[str, Any], dict[str, tuple[str, str]]]],
        outcomes: list[tuple[list[str], list[str], list[str], dict[str, Any], float]],
        fetched: MemoryFetched,
    ) -> None:
        """Each rank's part for the report, and this node's proofs for its reads."""
        for r, (_, _, _, got_here, seconds) in enumerate(outcomes):
            _, proofs, bad = told[r]
            parts = []
            if proofs:
                parts.append(_LOCAL)
            if got_here:
                fetched.remote.append(r)
                size = sum(records[n].bytes for n in got_here)
                origin = sorted({h for _s, rcv, h, _n in plan if rcv == r})
                parts.append(
                    f"from node {', '.join(map(str, origin))} ({human_bytes(size)} in "
                    f"{seconds:.3f} s, hashed as it arrived)"
                )
                for name in sorted(got_here):
                    kind, why = bad.get(name, ("missing", ""))
                    if kind != "missing":
                        what = _TROUBLE[kind]
                        fetched.warnings.append(
                            f"rank {r}: the copy of {name} in its node's memory {what}, "
                            f"another node's was used: {why}"
                        )
            fetched.hows.append(
                " and ".join(parts) or "local memory (proved by another rank of its node)"
            )
            if self.node_of[r] == self.node:
                fetched.proofs.update(told[r][1])
                fetched.proofs.update(got_here)

    def unrecorded(self) -> list[str]:
        """Steps some node holds in memory that the root's ledger has no record of (a save
        that never committed, or files put there by other hands): never restored, said.

        Rank 0's reading of the ledger goes to every rank (one broadcast, its size the
        ledger's, not the world's); each node's first rank compares its node's memory with
        it, and one all-reduce says whether any found something. Only then are the notes
        gathered to rank 0 and broadcast, in node order, so every rank reports the same."""
        recorded: list[int] | None = None
        if self.rank == 0:
            try:
                recorded = self.ledger.steps()
            except (OSError, CheckpointError):
                recorded = None
        known = self.ctl.broadcast(recorded)
        notes: list[str] = []
        if known is not None and self.mates[0] == self.rank:
            held = {step for step, _, _, _ in layout.held_steps(self.dir)}
            for step in sorted(held - set(known)):
                notes.append(
                    f"memory tier: step {step} in node {self.node}'s memory has no record in "
                    f"{self.ledger}: never restored (a save that did not commit, or files "
                    "put there by other hands)"
                )
        if not self.ctl.any(bool(notes)):
            return []
        told = self.ctl.gather(notes)
        every = [note for some in told or [] for note in some]
        return self.ctl.broadcast(every if told is not None else None) or []


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
        self.ctl.mark(f"proving memory step {step}'s files (and moving those a node lacks)")
        fetched = self.source.fetch(step)
        try:
            return self._load(step, report, fetched, t0, with_config)
        finally:
            _close(list(fetched.maps.values()))

    def _load(
        self,
        step: int,
        report: CandidateReport,
        fetched: MemoryFetched,
        t0: float,
        with_config: bool,
    ) -> LoadResult:
        manifest = fetched.manifest
        report.world_size_saved = manifest.world_size
        remote = fetched.remote
        where = "local memory" if not remote else f"ranks {remote} from other nodes' memory"
        report.origin = (
            f"the memory tier ({where}; {self.source.memory_dir}, {step_dir_name(step)})"
        )
        self.ctl.mark(f"checking memory step {step}'s config and state, then filling it")
        self.checks.run(manifest, report, with_config=with_config)
        maps = {**fetched.maps, **fetched.held}
        own = layout.file_name(self.rank)
        wanted = fetched.proofs if manifest.mesh.get("shared") else {own: fetched.proofs[own]}
        failure: CheckpointError | None = None
        fill: StateFill | None = None
        try:
            for name, (path, identity) in wanted.items():
                if name not in maps:  # proven by another rank of this node
                    maps[name] = _map(path, identity)
            fill = self._prepare(step, manifest, maps)
        except ManifestError as exc:  # a header that does not describe its file: damage
            failure = exc
        except (MemoryFileError, CheckpointError, OSError) as exc:
            failure = StateMismatchError(f"rank {self.rank}: {exc}")
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
            _close([m for n, m in maps.items() if n not in fetched.maps and n not in fetched.held])
        for warning in fetched.warnings:
            report.warn(warning)
        report.check("memory", True, fetched.line())
        report.check("state", True, ", ".join(self.state.categories()))
        report.rng = "restored on every rank (python, numpy, torch" + (
            ", CUDA)" if "cuda" in saved_rng else ")"
        )
        n = len(manifest.files)
        report.check(
            "digests",
            True,
            f"{n} of {n} files hashed and matched ({manifest.digest_algorithm}) on every node "
            "that reads them, before a byte of them was read, against the manifest in "
            f"{self.source.ledger.where(step)}",
        )
        seconds = time.perf_counter() - t0
        self._record_restore(step, manifest, seconds, report.origin)
        return LoadResult(
            step=step,
            path=report.path,
            bytes=manifest.total_bytes,
            files_verified=n,
            seconds=seconds,
            manifest=manifest,
        )

    def _prepare(self, step: int, manifest: Manifest, maps: dict[str, mmap.mmap]) -> StateFill:
        """Match every live tensor to its bytes (this rank's own file first); writes nothing."""
        own = layout.file_name(self.rank)
        if not manifest.mesh.get("shared"):  # this rank's own file holds all it needs
            maps = {own: maps[own]}
        state_dict = self.state.state_dict()
        state_dict["rng"] = {f"rank_{self.rank}": rng.capture()}
        mine = _flat_file(maps[own], f"rank {self.rank}'s memory file of step {step}", self.rank)
        others = [
            _flat_file(mm, f"{n} of memory step {step}", self.rank)
            for n, mm in maps.items()
            if n != own
        ]
        return StateFill(state_dict, mine, others)

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
        if any(d < 0 for d in shape) or nbytes != math.prod(shape) * dtype.itemsize:
            raise ManifestError(
                f"rank {rank}: {source}: {key} is recorded as {nbytes} bytes of "
                f"{dtype}{shape}: its bytes match the writer's digest, but its header does not "
                "describe them"
            )
    return flat


def _allocate(claims: list[Claim | None]) -> None:
    """Allocate the claimed files' pages chunk by chunk, in the order they will arrive (the
    receive allocates each chunk too, just before it: whichever comes first does it)."""
    for claim in claims:
        if claim is None:
            continue
        size = len(claim.buffer)
        for start in range(0, size, CHUNK):
            try:
                claim.allocate(start, min(start + CHUNK, size))
            except OSError:
                break  # the receive meets it again, and says so


def _map_sized(path: Path, size: int) -> tuple[mmap.mmap, os.stat_result]:
    """A read-only mapping of ``path``, opened as every checkpoint file is
    (``storage.verified_files.open_regular``: ``NotRegularFileError`` unless a regular file
    of ``size`` bytes, before anything is mapped), owned by the job's user
    (``PermissionError`` otherwise: not this job's file, so no evidence about the step), and
    its ``fstat``; the caller hashes through this very mapping."""
    fd, st = open_regular(str(path), size)
    try:
        _check_owner(path, st)
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ), st
    finally:
        os.close(fd)


def _prove(path: Path, record: FileRecord) -> tuple[mmap.mmap, tuple[int, int, int]]:
    """Map ``path`` and hash it where it lies; IntegrityError unless it is exactly the
    writer's bytes. Returns the mapping (kept for the reads) and the file's identity."""
    try:
        mm, st = _map_sized(path, record.bytes)
    except NotRegularFileError as exc:
        raise IntegrityError(
            str(path), f"{record.bytes} bytes", exc.actual, "size mismatch"
        ) from None
    algorithm = record.digest.split(":", 1)[0]
    hasher = new_hasher(algorithm)
    view = memoryview(mm)
    hasher.update(view)
    del view
    actual = format_digest(algorithm, hasher)
    if actual != record.digest:
        mm.close()
        raise IntegrityError(str(path), record.digest, actual)
    return mm, _identity(st)


def _map(path: str, identity: tuple[int, int, int]) -> mmap.mmap:
    """Map ``path`` if it is still the file that was proven (the proof and the read may be on
    two ranks of the node, so the file is opened twice: never through a link, and checked
    on the descriptor to be that inode, unchanged, and the job's user's)."""
    try:
        fd, st = open_regular(path, identity[1])
    except NotRegularFileError:
        raise CheckpointError(f"{path} changed after it was proven: not read") from None
    try:
        if _identity(st) != identity:
            raise CheckpointError(f"{path} changed after it was proven: not read")
        _check_owner(Path(path), st)
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _check_owner(path: Path, st: os.stat_result) -> None:
    """A memory file is read only if the job's user owns it (the directory is the job's own,
    proven at start: a file of another user in it was put there by other hands)."""
    if st.st_uid != os.geteuid():
        raise PermissionError(
            errno.EPERM, f"owned by {owner_name(st.st_uid)}, not this job's user", str(path)
        )


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _close(maps: list[mmap.mmap]) -> None:
    for mm in maps:
        with contextlib.suppress(BufferError):  # a view still alive: the GC closes it
            mm.close()
