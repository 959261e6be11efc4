"""A memory save's own steps: ``MemoryRoute``, the save pipeline's route to the memory tier.

The pipeline (dckpt.save.pipeline) runs a memory save through the same protocol as a durable
one; this route is what differs, step by step:

- step 3, in ``save()`` (``snapshot``): this rank's state dict is copied into its file in
  its node's memory, ``own/step-N/.rank-<r>.mem.part-<id>`` (dckpt.tiers.memory_layout),
  one memcpy per tensor into pages mapped since the save before last
  (dckpt.storage.memory_file's flat format): that copy is the snapshot. Replicated tensors
  (DCP's rule: plain tensors every rank holds alike) go into one owner rank's file each, as
  the ranks agreed at the previous memory save, so under DDP each rank copies about 1/world;
- step 5 (``write``): the file is hashed through the mapping ``save()`` copied into (the
  writer's digest: the bytes written, whatever a name points to by then), then renamed to
  ``rank-<r>.mem`` relative to its directory's descriptor, checked to be that very file (a
  file swapped in under the name fails the save); its report carries the layout this rank
  wrote (``settle`` reads it);
- step 6 (``settle``, every rank): the layout the ranks' files were written with must be one
  (else no rank could restore the save: refused), and the next save's owners are agreed on;
- step 7: rank 0's manifest records the nodes, the replica ring, the layout and the durable
  step this run follows (``mesh``), and ``MemoryCommit`` puts it into the root's ledger;
- step 10 (``finish``, once committed): every rank sends its file to its partner node's rank
  and receives the files it keeps for the ranks of the node before it on the ring
  (dckpt.collective.transfer, over dckpt's gloo group: no socket of dckpt's own), each renamed in
  only once it hashed to the writer's digest as it arrived; rank 0 gathers the outcomes for
  its log line; then each rank retires its older files to spares. A failed replica is
  logged, never fails the committed save (the node's own copy and the durable tier stand);
  a peer that stops answering within ``timeout_s`` loses dckpt's group (the next ``save()``
  asks for a restart), as a failed collective does.

A memory save always runs in the background, and a failure every rank agreed on fails its
handle only (logged by rank 0): training goes on, and the durable tier is never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from ..collective.comm import Comm
from ..collective.transfer import Incoming, Outgoing, move
from ..errors import CheckpointError, StorageError, describe_os_error
from ..phases import Phase, Trace
from ..root.commit import CommitStrategy
from ..root.layout import STEP_RE, step_dir_name
from ..storage.digest import format_digest, new_hasher
from ..storage.memory_file import (
    FlatPlan,
    MemoryFileError,
    plan_flat,
    share_out,
    signature,
    write_into,
)
from ..storage.records import FileRecord
from ..storage.tamper import pick
from ..storage.tensor_digest import fingerprint, fingerprint_digest, host_digest, shape_prefix
from ..tiers import memory_layout as layout
from ..tiers.memory_commit import Lineage
from ..tiers.memory_layout import Topology
from ..units import human_bytes
from .capture import CaptureHistory
from .coordinator import RankReport
from .findings import Findings
from .handle import SaveTicket
from .route import Finished, SaveJob, Settled
from .value_checks import Inspection, replica_key

__all__ = ["MemoryRoute", "sharing_scope"]

log = logging.getLogger("dckpt")


_Held = tuple[str, torch.dtype, tuple[int, ...], int, int, bool, str | None]


@dataclass
class Staged:
    """A memory save's file as ``save()`` wrote it, and the layout it was written with: the
    route's state for one save, from its snapshot to its end (the route keeps none)."""

    part: Path
    final: Path
    key: tuple[int, int]
    """The file's (device, inode): its bytes are read back only through this rank's mapping
    of it (``Slots.mapping``), never by opening a name again."""
    size: int
    signature: str
    """Digest of this rank's replicated-looking tensors (dckpt.storage.memory_file)."""
    shared: str | None
    """The signature whose owners this file followed (it holds only the replicated tensors
    it owns), or None (it holds every tensor)."""
    checks: Inspection
    """The value checks begun in save() (GPU kernels, the digests of tensors left to other
    ranks' files, the capture digests), finished on the file's own bytes in the background."""
    held: tuple[_Held, ...] = ()
    """The tensors in the file: key, dtype, shape, offset, bytes, whether it is a GPU's, and
    its replica key."""
    trainable: frozenset[str] = frozenset()
    """The keys of the parameters that require grad (the progress note)."""
    sizes: dict[str, int] = field(default_factory=dict)
    """The bytes of each replicated-looking tensor (how step 6 shares them out)."""
    named: bool = False
    """Whether step 5 gave the file its final name (a failed save retires it by that name)."""


def sharing_scope(topology: Topology, rank: int) -> tuple[list[int], str | None]:
    """The ranks that share out the replicated tensors, and what a resume must read: with at
    most two nodes, the whole world ("world": each node holds every file, its own and its
    partner's replica); with more, the ranks of each node ("node": each node's files and
    their replica suffice, no node reads another's). None: nothing to share (one rank)."""
    node_of = topology.node_of
    if topology.nodes <= 2:
        scope, kind = list(range(len(node_of))), "world"
    else:
        scope, kind = topology.ranks_of(node_of[rank]), "node"
    if len(scope) < 2 and (kind == "world" or max(node_of.count(n) for n in node_of) < 2):
        return scope, None
    return scope, kind


class MemoryRoute:
    """The memory tier's steps of a save; see the module docstring."""

    noun = "memory save"
    label = " to memory"
    can_block = False
    """A memory save is never synchronous (its copy in ``save()`` is its snapshot), and the
    automatic save mode never learns from it."""
    soft = True
    """A failure every rank agreed on fails the handle only: training goes on."""
    reports_everywhere = True
    """``settle`` and ``finish`` read every rank's report (owners, replica sizes and
    digests): an all-gather per memory save, whose size grows with the world."""

    def __init__(
        self,
        *,
        io: Comm,
        strategy: CommitStrategy,
        memory_dir: Path,
        topology: Topology,
        lineage: Lineage,
        keep: int,
        digest: str,
        timeout_s: float,
        slots: layout.Slots,
        replica_check: bool = True,
        finite_check: bool = True,
        replica_every: int = 1,
        capture_check: bool = True,
        trainable: Callable[[dict[str, Any]], frozenset[str]] | None = None,
    ) -> None:
        self.io = io
        self.strategy = strategy
        self.rank = io.rank
        self.topology = topology
        self.node = topology.node_of[self.rank]
        self.dir = layout.node_dir(memory_dir, self.node)
        self.memory_dir = Path(memory_dir)
        self.lineage = lineage
        self.keep = keep
        self.digest = digest
        self.timeout_s = timeout_s
        self.replica_check = replica_check
        self.finite_check = finite_check
        self.replica_every = replica_every
        self.capture_check = capture_check
        self._trainable = trainable
        self.history = CaptureHistory()
        """This rank's capture digests of its trainable tensors at its previous memory save."""
        self._snapshots = 0
        self.slots = slots
        """This rank's files in its node's memory, mapped once (shared with the resume)."""
        self.name = layout.file_name(self.rank)
        self.owners: tuple[str, frozenset[str], str] | None = None
        """The layout agreed at the last memory save: (signature of the replicated tensors,
        those this rank leaves to others, "world" or "node": who reads whose files)."""

    # --- step 3, in save() --------------------------------------------------------------------

    def snapshot(
        self, state_dict: dict[str, Any], *, step: int, save_id: str, asynchronous: bool,
        trace: Trace,
    ) -> Staged:  # fmt: skip
        """Copy this rank's state into its memory file (the snapshot). A memory file system
        too small for it raises StorageError, and nothing durable is touched."""
        self._snapshots += 1  # first: every rank counts alike, whatever fails below
        final = layout.own_dir(self.dir) / step_dir_name(step) / self.name
        part = final.with_name(layout.part_name(self.name, save_id))
        sig, sizes = signature(state_dict)
        shared = sig if self.owners is not None and self.owners[0] == sig else None
        skip = self.owners[1] if shared is not None and self.owners is not None else frozenset()
        try:
            plan = plan_flat(state_dict, skip)
        except MemoryFileError as exc:
            raise StorageError(f"this state cannot be kept in the memory tier: {exc}") from None
        checks = Inspection(
            replicas=self.replica_check,
            finite=self.finite_check,
            sample=(self._snapshots, self.replica_every),
            capture=self.capture_check,
        )
        keys = _replica_keys(state_dict)
        tamper = trace.tamper(Phase.MEMORY_COPY)
        bad = (
            (tamper.action, pick(tamper.item, ((k, n) for k, _, _, n in plan.tensors)))
            if tamper is not None
            else None
        )
        try:
            claim = self.slots.open(part, plan.size, spare_of=self.name)
            digests = write_into(
                claim.buffer,
                plan,
                capture=checks.capture,
                tamper=bad,
            )
        except BaseException as exc:
            self.slots.drop(part)
            with contextlib.suppress(OSError):
                part.parent.rmdir()  # only if this save made it and left it empty
            if not isinstance(exc, OSError):
                raise
            raise StorageError(
                f"the memory tier at {self.dir} could not hold rank {self.rank}'s "
                f"{human_bytes(plan.size)} for step {step} "
                f"({os.strerror(exc.errno) if exc.errno else exc}): the memory save failed and "
                "the durable checkpoints are untouched. Give the memory file system more room "
                "(memory_dir, or /dev/shm's size) or lower memory_keep."
            ) from None
        trace.at(Phase.MEMORY_COPY)
        held = self._begin_checks(checks, state_dict, plan, skip, keys, digests)
        trainable = self._trainable(state_dict) if self._trainable else frozenset()
        return Staged(
            part, final, claim.key, plan.size, sig, shared, checks, held=held, sizes=sizes,
            trainable=trainable,
        )  # fmt: skip

    def _begin_checks(
        self,
        checks: Inspection,
        state_dict: dict[str, Any],
        plan: FlatPlan,
        skip: frozenset[str],
        keys: dict[str, str],
        digests: dict[str, str],
    ) -> tuple[_Held, ...]:
        """In save(): the value checks that must see the live state (GPU tensors, queued on
        the training stream, their fingerprint the capture of those in this file; host
        tensors another rank's file holds; non-tensor values), the capture digests the copy
        took (``digests``), and the tensors whose written bytes the background reads."""
        flat, _ = flatten_state_dict(state_dict)
        for key, value in flat.items():
            if not isinstance(value, torch.Tensor):
                checks.value(key, value)
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            mine = key not in skip
            if local.is_cuda:
                checks.device(key, local, replica=keys.get(key), finite=mine, capture=mine)
            elif not mine:
                checks.host(key, local, replica=keys.get(key), finite=False)
        for key, digest in digests.items():
            checks.captured_host(key, digest, replica=keys.get(key))
        for key, local, _, _ in plan.tensors:
            if checks.capture and not local.is_cuda and key not in digests:
                checks.cannot_read(key, ValueError("its bytes cannot be read as a host tensor"))
        return tuple(
            (key, local.dtype, tuple(local.shape), offset, nbytes, local.is_cuda, keys.get(key))
            for key, local, offset, nbytes in plan.tensors
        )

    # --- step 5, in the background -------------------------------------------------------------

    def write(
        self, staged: Staged, ticket: SaveTicket, trace: Trace, tmp: Path, report: RankReport
    ) -> RankReport:
        """Hash this rank's file through the mapping it was written through (the bytes
        ``save()`` copied, whatever a name points to now) and give it its name, relative to
        the directory's descriptor, checked to be that file; its report."""
        ticket.staged.set()  # the copy in save() is the snapshot
        t0 = time.perf_counter()
        records: tuple[FileRecord, ...] = ()
        error: str | None = None
        findings: Findings | None = None
        check_s = 0.0
        try:
            hasher = new_hasher(self.digest)
            view = memoryview(self.slots.mapping(staged.key))
            hasher.update(view[: staged.size])
            del view
            t_check = time.perf_counter()
            findings = self._finish_checks(staged)
            check_s = time.perf_counter() - t_check
            trace.at(Phase.MEMORY_HASH)
            if staged.final.exists():  # this step saved again: the old copy stays, aside,
                self.slots.rename(staged.final, _aside(staged))  # until the new one commits
            self.slots.rename(staged.part, staged.final, key=staged.key)
            staged.named = True
            records = (
                FileRecord(
                    path=self.name,
                    bytes=staged.size,
                    digest=format_digest(self.digest, hasher),
                    rank=self.rank,
                ),
            )
            trace.passed(Phase.WRITE_SHARDS)
            trace.passed(Phase.DCP_FINISH)  # "this rank's files are written": no DCP run here
        except Exception as exc:  # reported to every rank by the gather
            error = f"hashing its memory file failed: {describe_os_error(exc, self.dir)}"
        return dataclasses.replace(
            report,
            records=records,
            error=error,
            findings=findings,
            timings={"hash_s": time.perf_counter() - t0 - check_s, "check_s": check_s},
            route={"layout": (staged.signature, staged.shared)},
        )

    def _finish_checks(self, staged: Staged) -> Findings | None:
        """The value checks of the host tensors, on the file's bytes (the snapshot), and each
        tensor's capture compared with the digest of its bytes in the file."""
        checks = staged.checks
        if not checks.active:
            return None
        buf = self.slots.mapping(staged.key)
        writes: dict[str, str] = {}
        for key, dtype, shape, offset, nbytes, on_gpu, replica in staged.held:
            if nbytes:
                raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
            else:
                raw = torch.empty(0, dtype=torch.uint8)
            held = raw.view(dtype).view(shape)
            kind = checks.capture_kind(key)
            if kind == "x":
                writes[key] = host_digest(held)
            elif kind == "g":  # the GPU's fingerprint, computed over the bytes in the file
                writes[key] = fingerprint_digest(shape_prefix(held), fingerprint(held))
            if not on_gpu:  # a GPU tensor's NaN scan ran on its device
                checks.host(key, held, replica=checks.staged_replica(replica), finite=True)
            del raw, held  # the mapping cannot close while a tensor views it
        names = {key for key, *_ in staged.held}
        findings = checks.findings(
            names, writes if checks.capture else None, dict.fromkeys(names, "mapped")
        )
        if checks.capture:
            moved = self.history.moved(checks.captured(), staged.trainable)
            findings = dataclasses.replace(findings, trainable=moved)
        return findings

    # --- step 6, every rank ----------------------------------------------------------------

    def settle(self, reports: list[RankReport], staged: Staged | None) -> Settled:
        """Why this save's files cannot be read together (None when they can), what the
        manifest's ``mesh`` records of them, and the owners the next save follows. Every rank
        computes the same from the same reports."""
        told: list[tuple[str, str | None]] = [
            r.route.get("layout", ("", None)) for r in sorted(reports, key=lambda r: r.rank)
        ]
        signatures = {sig for sig, _ in told}
        used = {shared for _, shared in told}
        # whose files hold each other's replicated tensors ("world": every rank's; "node":
        # each node's), False: none; by the owners this save followed, before they change
        kind: str | bool = self.owners[2] if self.owners is not None and used != {None} else False
        mesh = {
            "tier": "memory",
            "nodes": list(self.topology.node_of),
            "replicas": self.topology.replicas(),
            "shared": kind,
            "after": self.lineage.anchor,
        }
        if used != {None} and (len(used) != 1 or signatures != used):
            self.owners = None
            refused = (
                "the ranks' replicated tensors changed while some ranks wrote only their share "
                "of them (signatures differ), so no rank could restore this save: it is "
                "refused, and the next memory save writes every tensor on every rank"
            )
            return Settled(refused=refused, mesh=mesh)
        scope, scope_kind = sharing_scope(self.topology, self.rank)
        sizes = staged.sizes if staged is not None else {}
        if len(signatures) == 1 and sizes and scope_kind is not None:
            sig = next(iter(signatures))
            if self.owners is None or self.owners[0] != sig:
                owners = share_out(sizes, len(scope))
                skip = frozenset(k for k, i in owners.items() if scope[i] != self.rank)
                self.owners = (sig, skip, scope_kind)
        else:
            self.owners = None
        return Settled(mesh=mesh)

    # --- step 10, once committed ---------------------------------------------------------------

    def finish(
        self,
        job: SaveJob,
        reports: list[RankReport],
        settled: Settled,
        timings: dict[str, float],
        trace: Trace,
        total_bytes: int,
    ) -> Finished:
        """The replicas, their outcomes on every rank, retirement, the spares; never raises
        past the other ranks' waits: every rank takes part in the exchange it was given,
        whatever failed on its side (it sends zeros for a file it cannot read, and drops what
        it cannot hold), and a group that fails is said, not raised."""
        step = job.step
        records = {rep.rank: rec for rep in reports for rec in rep.records}
        holder = self.topology.replica_holder(self.rank)
        kept_for = self.topology.kept_by(self.rank)
        own = layout.own_dir(self.dir) / step_dir_name(step) / self.name
        mine: dict[str, Any] = {"received": [], "seconds": 0.0}
        data: Any = None
        if holder is not None:
            try:  # the bytes this rank wrote and hashed, through its own mapping
                if job.snapshot is None:
                    raise OSError(errno.ENOENT, "no file of this save")
                data = self.slots.mapping(job.snapshot.key)
            except (OSError, ValueError) as exc:  # zeros go instead: the holder refuses them
                mine["error"] = f"rank {self.rank} could not read {own}: {exc}"
        outgoing = [Outgoing(data, holder, records[self.rank].bytes)] if holder is not None else []
        incoming = [
            Incoming(
                src=r,
                into=self._replica_path(r, step),
                size=records[r].bytes,
                digest=records[r].digest,
                spare_of=layout.file_name(r),
            )
            for r in kept_for
        ]
        t0 = time.perf_counter()
        try:
            got = move(
                self.io, outgoing, incoming, self.slots, timeout_s=self.timeout_s, trace=trace
            )
        except Exception as exc:  # a peer that stopped answering: the group is gone
            return self._lost(step, exc)
        mine["seconds"] = time.perf_counter() - t0
        for item, result in zip(incoming, got, strict=True):
            mine["received"].append((item.src, result.error, result.seconds))
            if result.error is not None:
                self.slots.drop(item.into)  # an older copy there is not this step's
        try:
            told = self.io.all_gather(mine)
        except RuntimeError as exc:
            return self._lost(step, exc)
        if job.snapshot is not None:  # the copy this save replaced, if it saved a step again
            aside = _aside(job.snapshot)
            if aside.exists():
                self.slots.retire(aside, "replaced")
        self._retire(step, kept_for, ok=self._replicated(told, holder))
        self._reserve(records, kept_for)
        seconds = mine["seconds"] if holder is not None else None
        line = self._describe(told) if self.rank == 0 else Finished(None)
        return dataclasses.replace(line, replicas_s=seconds)

    def _replicated(self, told: list[dict[str, Any]], holder: int | None) -> bool:
        """Whether this rank's file reached its holder verified and every file it keeps
        arrived verified: only then may the step before this one be retired here."""
        if any(error for _src, error, _t in told[self.rank]["received"]):
            return False
        if holder is None:
            return True
        return any(src == self.rank and not error for src, error, _t in told[holder]["received"])

    def _lost(self, step: int, exc: BaseException) -> Finished:
        """A peer stopped answering while the replicas moved: the step stays committed (the
        nodes' own copies and the durable tier stand), dckpt's group is gone."""
        log.error(
            "dckpt: memory step %d is committed, but its replicas failed on rank %d: %s. "
            "dckpt's group cannot be used again: the next save() asks for a restart (it "
            "resumes from this step in memory).",
            step,
            self.rank,
            str(exc)[:300],
        )
        why = f"the replicas of memory step {step}: {str(exc)[:200]}"
        return Finished(f"replicas FAILED on rank {self.rank}: {why}", why, ok=False)

    def _replica_path(self, rank: int, step: int) -> Path:
        of_node = self.topology.node_of[rank]
        return layout.replica_dir(self.dir, of_node) / step_dir_name(step) / layout.file_name(rank)

    def _describe(self, told: list[dict[str, Any]]) -> Finished:
        """Rank 0's line: each node's files at its partner, verified, or why not."""
        topology = self.topology
        if topology.nodes < 2:
            return Finished("replicas: none (one node): local copies only")
        parts, ok = [], True
        for node in sorted(set(topology.node_of)):
            errors: list[str] = []
            seconds = 0.0
            for rank in topology.ranks_of(node):
                keeper = topology.replica_holder(rank)
                assert keeper is not None
                got = {src: (e, t) for src, e, t in told[keeper].get("received", [])}
                errors += [str(told[r]["error"]) for r in (rank, keeper) if told[r].get("error")]
                if rank in got:
                    error, took = got[rank]
                    errors += [f"rank {keeper}: {error}"] if error else []
                    seconds = max(seconds, float(took))
                elif not told[keeper].get("error"):
                    errors.append(f"rank {keeper} did not receive rank {rank}'s file")
            partner = topology.partner(node)
            if errors:
                ok = False
                parts.append(
                    f"node {node} -> node {partner} FAILED: {'; '.join(dict.fromkeys(errors))}"
                )
            else:
                parts.append(f"node {node} -> node {partner} verified in {seconds:.3f} s")
        return Finished("replicas: " + "; ".join(parts), ok=ok)

    def _retire(self, step: int, kept_for: list[int], *, ok: bool) -> None:
        """Keep this rank's ``keep`` newest files up to ``step`` in ``own/`` and of each node
        it keeps replicas for; older ones (and any above ``step``: a branch rolled back from)
        become spares. After a failed replica, the older ones stay too: the step before this
        one may still be the newest every node can restore."""
        places = [(layout.own_dir(self.dir), {self.name})]
        for node in sorted({self.topology.node_of[r] for r in kept_for}):
            names = {layout.file_name(r) for r in kept_for if self.topology.node_of[r] == node}
            places.append((layout.replica_dir(self.dir, node), names))
        for parent, names in places:
            steps = _steps_under(parent)
            keep = (
                [s for s in steps if s <= step][-self.keep :]
                if ok
                else [s for s in steps if s <= step]
            )
            for s in steps:
                if s in keep:
                    continue
                for name in names:
                    path = parent / step_dir_name(s) / name
                    if path.exists():
                        self.slots.retire(path, str(s))

    def _reserve(self, records: dict[int, FileRecord], kept_for: list[int]) -> None:
        """A spare of this save's size for this rank's file and for each replica it keeps
        (made by the first save, resized when the size changed: a no-op on a steady run), so
        the footprint after the first save is the steady state and the next save copies into
        pages that are allocated and mapped already."""
        try:
            self.slots.reserve(self.name, records[self.rank].bytes)
            for r in kept_for:
                self.slots.reserve(layout.file_name(r), records[r].bytes)
        except OSError as exc:
            log.warning(
                "dckpt: could not reserve a second memory slot on rank %d in %s (%s): the next "
                "memory save allocates it, and may find the memory full",
                self.rank,
                self.dir,
                exc,
            )

    # --- after a failed save -------------------------------------------------------------------

    def abandon(self, staged: Staged | None, step: int) -> None:
        """A save every rank agreed failed: this rank's file of it becomes a spare again, and
        the committed copy a save of the same step set aside takes its place back."""
        if staged is None:
            return
        named = staged.final if staged.named else None
        for path in (staged.part, named):
            if path is not None and path.exists():
                self.slots.retire(path, "failed")
        aside = _aside(staged)
        if aside.exists():
            with contextlib.suppress(OSError, CheckpointError):
                self.slots.rename(aside, staged.final)

    def release(self) -> int:
        """Free this rank's files of this run in its node's memory (own, the replicas it
        keeps, their spares); returns the bytes freed. For a run that ended with its last
        checkpoint in the root."""
        self.slots.close()
        return layout.remove_node_files(self.dir, self.topology.names_of(self.rank))

    def close(self) -> None:
        self.slots.close()


def _replica_keys(state_dict: dict[str, Any]) -> dict[str, str]:
    """Each tensor's replica key (dckpt.save.value_checks.replica_key), by its key."""
    flat, _ = flatten_state_dict(state_dict)
    return {
        k: key
        for k, v in flat.items()
        if isinstance(v, torch.Tensor) and (key := replica_key(k, v)) is not None
    }


def _aside(staged: Staged) -> Path:
    """Where a save of a step saved before keeps the committed copy until it commits."""
    return staged.final.with_name(f".{staged.final.name}.part-was{staged.part.name[-32:]}")


def _steps_under(parent: Path) -> list[int]:
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := STEP_RE.fullmatch(n)))
