"""Resuming from the memory tier: ``MemorySource`` (a ``CheckpointSource``); the protocol.

The resume protocol (dckpt.load.resumer) tries every candidate of every source newest first;
a memory candidate is a step in the root's ledger (dckpt.root.memory_ledger), and trying it
takes these steps, on every rank, each failure said on every rank:

1. **the record** (``MemorySource.record``): rank 0 reads the step's manifest from the root's
   ledger (where only the job writes: a step found in memory without a record there is
   never read) and lists the root's durable steps; every rank gets both (one broadcast) and
   checks the manifest: its self-digest, a memory manifest of this world on these nodes, and
   its durable anchor (``mesh["after"]``, required): the newest durable step at or before it
   must be the one it followed, else it belongs to a branch the run left. The config and the
   state's kinds are checked on it next (dckpt.load.checks): a refusal moves no byte;
2. **proof in place** (``MemorySource.fetch``): each node proves the files its ranks read
   (their own; every rank's when the save shares replicated tensors, ``mesh["shared"]``),
   each once, split among the node's ranks: a copy in the node's memory (its own, or the
   replica it keeps for the node before it on the ring) is hashed where it lies against the
   manifest's digest;
3. **exchange**: one all-reduce says whether any rank's node lacks a file it needs (a
   replaced node lacks them all). If one does, the files lacking move first, while every rank
   proves what its node holds (step 2, in a thread): every rank learns what each node lacks
   and holds (an all-gather), and each file lacking is sent by a rank of a node that holds
   it, over dckpt's gloo group (dckpt.collective.transfer), hashed as it arrives. A file that
   only the receiving rank reads (its own, unshared; any, on a node of one rank) arrives
   straight into that rank's live tensors (``StreamFill``: no page of the node's memory, no
   copy after; a tensor of 1 MiB or more received in place, the rest through the transfer's
   staging buffers, both ends cutting the file alike, ``_cut``); any other arrives into the
   node's memory (its ``own/`` or ``replica/`` place), renamed in only if it matched. Then,
   or when nothing was lacking, one all-reduce says whether every rank proved its files;
   if so, and nothing moved and nothing is shared, nothing more happens. Otherwise every
   rank learns every proof (an all-gather) and a second round moves the files whose copy
   was damaged or unreadable where it lies. A node that holds no copy makes the step
   unavailable (``CheckpointNotFoundError``: the resume goes on with the next candidate and
   says why); a copy that arrives damaged is damage (``IntegrityError``: every copy failed);
4. **state** (dckpt.load.memory_reader, ``MemoryReader``): each rank matches every live
   tensor to its bytes by name, shape and dtype (``StateFill``, writing nothing), the ranks
   agree, and only then does each copy its tensors in (but those that arrived in place),
   restore its non-tensor values and its RNG. A proven file whose header does not describe
   it (a span past its end, a length its shape does not have) is damage (``ManifestError``),
   not a changed state;
5. **the node's memory back** (dckpt.load.memory_refill): a rank that took files into its
   state writes them back into its node's memory in a thread, behind the resume, from the
   bytes the transfer kept (header, non-tensor values, padding) and its live tensors, hashed
   through the mapping it wrote and named only if that matched; the first optimizer step, a
   save, a resume and ``close`` wait for it first (``LoadResult.behind``). A state that
   changed before (a write through ``.data``, a buffer a forward pass updates) hashes
   otherwise: that copy is not kept, and said; the next memory save writes it.

Invariants: no byte of a memory file is used before its digest matched the manifest from
the root's ledger, and no byte of a file in the node's memory is interpreted before then.
The one exception is the header of a file arriving into the state, which routes its bytes
as they arrive (into the live tensor of each name, checked first to have its shape and dtype:
a header that does not fit writes nothing). Those tensors hold bytes not yet proven until
the last chunk hashed: nothing reads them before, and a file that did not match fails the
candidate on every rank, naming the ranks whose tensors took bytes in; the next
candidate's load replaces every tensor, and if none loads the resume stops ("the model may
be partly overwritten"), never a fresh start from them. Ranks never mix steps or tiers
(every choice is a collective).
"""

from __future__ import annotations

import contextlib
import errno
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
    WorldError,
)
from ..owned import owner_name
from ..root.layout import step_dir_name
from ..root.manifest import Manifest, parse_manifest
from ..root.memory_ledger import MemoryLedger
from ..root.provenance import Provenance
from ..storage.digest import READ_CHUNK, format_digest, new_hasher
from ..storage.memory_file import (
    StreamFill,
    cut_at_tensors,
)
from ..storage.records import FileRecord
from ..storage.verified_files import NotRegularFileError, open_regular
from ..tiers import memory_layout as layout
from ..tiers.memory_layout import Claim
from ..units import human_bytes

__all__ = ["Into", "MemoryFetched", "MemorySource", "close_behind", "map_proven", "taken_in"]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
Told = tuple[dict[str, int] | None, dict[str, Any], dict[str, tuple[str, str]]]
"""What a rank tells the others before a round of moves: what its node holds (its first
rank), the files it proved (name -> path and identity), and those it lacks and why."""
Into = Callable[[str, int], StreamFill]
"""Makes the taker a file (by name, of its size) arrives into: this rank's live state."""
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
    streamed: dict[str, StreamFill] = field(default_factory=dict)
    """The files this rank received straight into its state (proven as they arrived)."""
    wrote: list[int] = field(default_factory=list)
    """The ranks whose live tensors took arriving bytes (the same on every rank)."""
    reread: tuple[str, ...] = ()  # a damaged memory copy is replaced from another, not re-read

    def line(self) -> str:
        if len(self.hows) > _LISTED and len(set(self.hows)) == 1:  # one line, not thousands
            return f"all {len(self.hows)} ranks: {self.hows[0]}"
        return "; ".join(f"rank {r}: {h}" for r, h in enumerate(self.hows))


@dataclass(frozen=True)
class _Round:
    """One round of moves: its plan, and per rank what arrived (name -> path and identity,
    None for a file that went into the state), in how many seconds, and whether into the
    state."""

    plan: list[tuple[int, int, int, str]]
    outcomes: list[tuple[dict[str, Any], float, bool]]


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
        provenance: Provenance | None = None,
    ) -> None:
        self.ctl = ctl
        self.ledger = ledger
        self.provenance = provenance or Provenance()
        """With the job's key, a memory manifest it does not sign is foreign, as a root's."""
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

    def fetch(self, step: int, manifest: Manifest, into: Into) -> MemoryFetched:
        """Steps 2 and 3 for ``manifest`` (``record``'s): this node's files proven, those it
        lacks moved in. ``into``: the files only this rank reads arrive straight into its
        state (``StreamFill``s it makes), not into the node's memory (every rank knows which
        those are, ``_streams``: both ends of a transfer cut it alike)."""
        needed = self._needed(manifest)
        records = manifest.file_map()
        duty = [n for i, n in enumerate(needed) if self.mates[i % len(self.mates)] == self.rank]
        fetched = MemoryFetched(manifest, {}, [])
        shared = manifest.mesh.get("shared")
        # The files this rank's node lacks (a replaced node's, all of them): they move
        # first, while every rank proves the copies its node holds (a sender's copy needs
        # no proof of its own: the receiver hashes every byte as it arrives).
        early = {n: ("missing", "") for n in duty if not self.place(step, n).exists()}
        # Those that arrive into memory, not into the state: their memory is allocated now,
        # while the ranks prove what they hold and as the bytes arrive (fresh pages are what
        # a replaced node waits on: 0.13 s for 256 MiB here, longer than the transfer).
        streams = self._streams(self.rank, manifest)
        ahead = {n: self._claim_ahead(step, n, records[n].bytes) for n in early if n not in streams}
        room = threading.Thread(target=_allocate, args=(list(ahead.values()),), daemon=True)
        room.start()
        bad: dict[str, tuple[str, str]] = {}  # name -> (missing|damaged|unreadable, why)
        present = [n for n in duty if n not in early]
        rounds: list[_Round] = []
        first_told: list[Told] = []
        try:
            if self.ctl.any(bool(early)):  # 3, first round: what is missing, beside 2
                proving = threading.Thread(
                    target=self._prove_all,
                    args=(step, records, present, fetched, bad, False),
                    name="dckpt-memory-proof",
                    daemon=True,
                )
                proving.start()
                try:
                    first_told = self.ctl.all_gather((self._listing(step), {}, early))
                    rounds.append(
                        self._move(step, manifest, first_told, {}, fetched, ahead, room, into)
                    )
                finally:
                    proving.join()
            else:
                self._prove_all(step, records, present, fetched, bad)  # 2
            if not rounds and not shared and not self.ctl.any(bool(bad)):
                # Each rank proved its own file in place (its node's files are split by
                # rank, the i-th to the i-th rank), the one it reads, and one all-reduce
                # says every rank did: nothing moves, and no rank needs another's proofs
                # (whatever the world's size). A node that lacks a copy, or a save whose
                # replicated tensors its ranks share (each reads its mates' files, so
                # learns their proofs), goes through the exchange.
                fetched.hows = [_LOCAL] * len(self.node_of)
                return fetched
            told = self.ctl.all_gather((self._listing(step), fetched.proofs, bad))
            # 3, (second) round: the copies found damaged or unreadable where they lie
            rounds.append(
                self._move(step, manifest, told, fetched.proofs, fetched, ahead, room, into)
            )
            if first_told:  # what each rank lacked at first, for the report
                told = [
                    (listing, proofs, {**first[2], **why})
                    for (listing, proofs, why), first in zip(told, first_told, strict=True)
                ]
            self._describe(rounds, manifest.file_map(), told, fetched)
        finally:
            room.join()
            for name, claim in ahead.items():  # claimed, and never received into
                if claim is not None and name not in fetched.held:
                    self.slots.drop(self.place(step, name).with_name(f".{name}.part-in"))
        return fetched

    def _listing(self, step: int) -> dict[str, int] | None:
        """What this node holds of ``step`` (its first rank says, for the plan)."""
        return layout.held(self.dir, step) if self.mates[0] == self.rank else None

    def _prove_all(
        self,
        step: int,
        records: dict[str, FileRecord],
        names: list[str],
        fetched: MemoryFetched,
        bad: dict[str, tuple[str, str]],
        populate: bool = True,
    ) -> None:
        """Step 2: this rank's share of its node's files, hashed where they lie."""
        for name in names:
            path = self.place(step, name)
            try:
                fetched.maps[name], identity = _prove(path, records[name], populate=populate)
                fetched.proofs[name] = (str(path), identity)
            except FileNotFoundError:
                bad[name] = ("missing", "")
            except IntegrityError as exc:  # evidence: other bytes than the writer's
                bad[name] = ("damaged", str(exc))
            except (OSError, ValueError) as exc:  # this node could not read it: no evidence
                bad[name] = ("unreadable", f"{path}: {exc}")
            except Exception as exc:  # in a thread: never lost, never evidence
                bad[name] = ("unreadable", f"{path}: {exc!r}")

    def _claim_ahead(self, step: int, name: str, size: int) -> Claim | None:
        """The part file ``name`` will arrive into, made and mapped now (``move`` receives
        into it); None when this node's memory cannot even make it (said at the receive)."""
        part = self.place(step, name).with_name(f".{name}.part-in")
        try:
            return self.slots.claim(part, size, spare_of=name if name in self.names else None)
        except OSError:
            return None

    def _streams(self, rank: int, manifest: Manifest) -> frozenset[str]:
        """The files whose bytes only ``rank`` reads (its own, unshared; every file it
        reads, when its node has no other rank): those arrive straight into its state."""
        mates = [r for r, n in enumerate(self.node_of) if n == self.node_of[rank]]
        if len(mates) == 1:
            return frozenset(self._needed(manifest, mates))
        return frozenset() if manifest.mesh.get("shared") else frozenset({layout.file_name(rank)})

    def record(self, step: int) -> Manifest:
        """Step 1: the manifest of ``step`` from the root's ledger, checked, on every rank."""
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
        self.provenance.signed(manifest, self.ledger.where(step))
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

    def _needed(self, manifest: Manifest, mates: list[int] | None = None) -> list[str]:
        """The files the ranks of a node (``mates``; this one's) read: every rank's for a
        save that shares replicated tensors across the world, else the node's ranks' own."""
        if manifest.mesh.get("shared") == "world":
            ranks = list(range(len(self.node_of)))
        else:
            ranks = list(self.mates if mates is None else mates)
        return [layout.file_name(r) for r in ranks]

    def place(self, step: int, name: str, node: int | None = None) -> Path:
        """Where ``node`` (this one) keeps ``name`` of ``step``: its own ranks' files under
        ``own/``, the files of the node before it on the ring under ``replica/``, any other
        under ``replica/`` too (a world-shared save on a changed ring)."""
        node = self.node if node is None else node
        of_node = self.node_of[layout.rank_of(name)]
        base = layout.node_dir(self.memory_dir, node)
        parent = layout.own_dir(base) if of_node == node else layout.replica_dir(base, of_node)
        return parent / step_dir_name(step) / name

    # --- step 3: the exchange ---------------------------------------------------------------

    def _move(
        self,
        step: int,
        manifest: Manifest,
        told: list[Told],
        proven: dict[str, tuple[str, tuple[int, int, int]]],
        fetched: MemoryFetched,
        ahead: dict[str, Claim | None],
        room: threading.Thread,
        into: Into,
    ) -> _Round:
        """One round of step 3: who sends which file to whom (from what each rank lacks),
        the transfer, and its outcome on every rank; raises, on every rank, when a file
        could not be moved or no copy of it arrived intact. ``proven``: the files this rank
        proved by now (it sends those through the mapping it hashed)."""
        records = manifest.file_map()
        plan = self._plan(step, records, told)
        if not plan:  # the same on every rank: nothing moves, so there is nothing to tell
            return _Round(plan, [({}, 0.0, False)] * len(told))
        outgoing: list[Outgoing] = []
        incoming: list[Incoming] = []
        copies: list[Path] = []  # where each incoming file was sent from (for the words)
        borrowed: list[mmap.mmap] = []  # mappings of files this rank sends but does not keep
        pairs: dict[tuple[int, int], int] = {}
        sent_bad: list[str] = []
        for sender, receiver, holder, name in plan:
            tag = pairs.setdefault((sender, receiver), 0)
            pairs[sender, receiver] = tag + 1
            if sender == self.rank:
                path = self.place(step, name, holder)
                data: Any = None
                try:
                    if proven.get(name, ("", None))[0] == str(path):
                        data = fetched.maps[name]  # proven by this rank: that mapping
                    else:
                        # the receiver hashes it; its pages are mapped as gloo reads them
                        # (populating 128 MiB of page tables first took 17 ms here)
                        data, _ = _map_sized(path, records[name].bytes, populate=False)
                        borrowed.append(data)
                except (OSError, ValueError) as exc:  # zeros go: the receiver refuses them
                    sent_bad.append(f"rank {self.rank} could not read {path}: {exc}")
                split = _cut if name in self._streams(receiver, manifest) else None
                outgoing.append(Outgoing(data, receiver, records[name].bytes, tag, split))
            if receiver == self.rank:
                place = self.place(step, name)
                spare = name if name in self.names else None
                size, digest = records[name].bytes, records[name].digest
                direct = name in self._streams(self.rank, manifest)
                taker, split = (into(name, size), _cut) if direct else (None, None)
                claim = ahead.get(name)
                incoming.append(
                    Incoming(sender, place, size, digest, tag, spare, claim, taker, split)
                )
                copies.append(self.place(step, name, holder))
        t0 = time.perf_counter()
        try:
            got = move(self.ctl, outgoing, incoming, self.slots, timeout_s=self.timeout_s)
        except TransferError as exc:  # the group is gone: nothing more can be agreed
            raise WorldError(f"moving memory step {step} between the nodes failed: {exc}") from exc
        finally:
            close_behind(borrowed)
            room.join()  # no allocation runs on a file past this point
        damaged: list[str] = []
        refused: list[str] = []
        arrived: dict[str, tuple[str, tuple[int, int, int] | None]] = {}
        wrote = any(isinstance(i.taker, StreamFill) and i.taker.wrote for i in incoming)
        for item, result, copy in zip(incoming, got, copies, strict=True):
            if result.refused:
                refused.append(f"rank {self.rank}: {result.error}")
                continue
            if result.error is not None:  # the copy it came from, named: that is the damage
                holder = self.node_of[item.src]
                damaged.append(f"rank {self.rank}: {result.error}; node {holder}'s copy, {copy}")
                continue
            if isinstance(item.taker, StreamFill):  # in this rank's state, proven: no file
                fetched.streamed[item.into.name] = item.taker
                arrived[item.into.name] = (str(item.into), None)
                continue
            held = self.slots.mapped_at(item.into)  # the mapping it arrived into, hashed
            arrived[item.into.name] = (str(item.into), _identity(os.lstat(item.into)))
            fetched.held[item.into.name] = held
        outcomes = self.ctl.all_gather(
            (damaged, refused, sent_bad, arrived, time.perf_counter() - t0, wrote)
        )
        fetched.wrote = sorted({*fetched.wrote, *(r for r, o in enumerate(outcomes) if o[5])})
        if any(o[2] for o in outcomes) or any(o[1] for o in outcomes):
            # A sender that could not read its copy, or a receiver that could not hold it:
            # the step cannot be restored here, and nothing says its bytes are bad.
            why = [w for o in outcomes for w in (*o[2], *o[1])]
            raise CheckpointNotFoundError(
                f"its files could not be moved: {'; '.join(why)}{taken_in(fetched.wrote)}"
            )
        if any(o[0] for o in outcomes):
            raise IntegrityError(
                str(self.memory_dir),
                "a copy that hashes to the writer's digest",
                "; ".join(w for o in outcomes for w in o[0]),
                detail=f"no copy of memory step {step} that a node needs arrived intact"
                + taken_in(fetched.wrote),
            )
        return _Round(plan, [(o[3], o[4], o[5]) for o in outcomes])

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
        rounds: list[_Round],
        records: dict[str, FileRecord],
        told: list[Told],
        fetched: MemoryFetched,
    ) -> None:
        """Each rank's part for the report, and this node's proofs for its reads."""
        plan = [p for r in rounds for p in r.plan]
        for r in range(len(told)):
            got_here: dict[str, Any] = {}
            seconds, into_state = 0.0, False
            for one in rounds:
                arrived, took, wrote = one.outcomes[r]
                got_here.update(arrived)
                seconds += took
                into_state = into_state or wrote
            _, proofs, bad = told[r]
            parts = []
            if proofs:
                parts.append(_LOCAL)
            if got_here:
                fetched.remote.append(r)
                size = sum(records[n].bytes for n in got_here)
                origin = sorted({h for _s, rcv, h, _n in plan if rcv == r})
                how = "hashed as it arrived" + (" into the state" if into_state else "")
                parts.append(
                    f"from node {', '.join(map(str, origin))} ({human_bytes(size)} in "
                    f"{seconds:.3f} s, {how})"
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
                fetched.proofs.update({n: v for n, v in got_here.items() if v[1] is not None})

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


def _cut(first: memoryview, size: int) -> list[tuple[int, int]]:
    """How a memory file moves into a state: each tensor of 1 MiB or more in segments of its
    own (received straight into the live tensor), the rest in chunks (``transfer.Split``)."""
    return cut_at_tensors(first, size, CHUNK)


def taken_in(ranks: list[int]) -> str:
    """What a failed candidate left in the state of the ranks that took bytes in as they
    arrived (empty when none did)."""
    if not ranks:
        return ""
    return (
        f"; rank(s) {ranks} had taken the arriving bytes into their tensors (hashed as they "
        "came, the digest only known at the end): the next checkpoint's load replaces every "
        "tensor, and if none loads the resume stops, never trains from them"
    )


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


def _map_sized(path: Path, size: int, *, populate: bool = True) -> tuple[mmap.mmap, os.stat_result]:
    """A read-only mapping of ``path``, opened as every checkpoint file is
    (``storage.verified_files.open_regular``: ``NotRegularFileError`` unless a regular file
    of ``size`` bytes, before anything is mapped), owned by the job's user
    (``PermissionError`` otherwise: not this job's file, so no evidence about the step), and
    its ``fstat``; the caller hashes through this very mapping."""
    fd, st = open_regular(str(path), size)
    try:
        _check_owner(path, st)
        flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
        return mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ), st
    finally:
        os.close(fd)


def _prove(
    path: Path, record: FileRecord, *, populate: bool = True
) -> tuple[mmap.mmap, tuple[int, int, int]]:
    """Map ``path`` and hash it where it lies; IntegrityError unless it is exactly the
    writer's bytes. Returns the mapping (kept for the reads) and the file's identity.
    ``populate`` False: the pages are mapped as the hash reads them (a little slower, but
    the mapping call does not hold the GIL for the whole file, as a transfer runs beside)."""
    try:
        mm, st = _map_sized(path, record.bytes, populate=populate)
    except NotRegularFileError as exc:
        raise IntegrityError(
            str(path), f"{record.bytes} bytes", exc.actual, "size mismatch"
        ) from None
    algorithm = record.digest.split(":", 1)[0]
    hasher = new_hasher(algorithm)
    view = memoryview(mm)
    for start in range(0, len(view), READ_CHUNK):  # pieces: the hasher holds the GIL, and a
        hasher.update(view[start : start + READ_CHUNK])  # transfer may be running beside
    del view
    actual = format_digest(algorithm, hasher)
    if actual != record.digest:
        mm.close()
        raise IntegrityError(str(path), record.digest, actual)
    return mm, _identity(st)


def map_proven(path: str, identity: tuple[int, int, int]) -> mmap.mmap:
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


def close_behind(maps: list[mmap.mmap]) -> None:
    """Unmap ``maps`` in a thread of their own: unmapping 256 MiB of mapped pages took 14 ms
    here, on the resume's path (the files stay; only this rank's mappings go)."""
    if maps:
        threading.Thread(target=_unmap, args=(maps,), name="dckpt-unmap", daemon=True).start()


def _unmap(maps: list[mmap.mmap]) -> None:
    for mm in maps:
        with contextlib.suppress(BufferError):  # a view still alive: the GC closes it
            mm.close()
