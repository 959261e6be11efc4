"""The memory tier's factory: ``memory_tier`` builds it as one ``Tier`` (dckpt.tier), or says
why it is off for this start (``Off``).

What the factory does, on every rank, before the first save (the tier's own steps are in
dckpt.save.memory and dckpt.load.memory):

1. every rank learns the topology (which node each rank is on: torchrun's ``GROUP_RANK``,
   else the host names);
2. rank 0 reads (or makes, at the root's first memory start) the root's memory identity;
3. each node's first rank proves the node's memory directory the job's own and this root's
   (dckpt.tiers.memory_layout.claim_memory_dir) and removes what the last workers left
   half-written; rank 0 tidies the ledger's saves in flight.

Nothing listens: replicas move over dckpt's gloo groups (dckpt.collective.transfer). A
directory that is not provably the job's (another user's, writable by others, a link,
another root's) or that cannot be made, on any node, turns the memory tier off for this start
on every rank: the durable tier goes on, and nothing is written into, read from or freed in
that directory. Nodes that cannot be told apart are an error (``CheckpointError``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass

from .collective.comm import Comm
from .config import CheckpointConfig
from .errors import CheckpointError, describe_os_error
from .load.checks import CandidateChecks
from .load.memory import MemorySource
from .load.memory_reader import MemoryReader
from .owned import NotOwnedError, private_tree
from .root.memory_ledger import MemoryLedger
from .root.protocol import Root
from .root.source import CheckpointSource
from .save.memory import MemoryRoute
from .tier import MEMORY, Tier
from .tiers import memory_layout
from .tiers.memory_commit import Lineage, MemoryCommit
from .train.state import TrainState
from .units import human_bytes

__all__ = ["Off", "memory_tier", "node_indices"]

log = logging.getLogger("dckpt")


@dataclass(frozen=True)
class Off:
    """The memory tier is off for this start."""

    why: str
    """Why (a node's directory that is not the job's, and which node)."""
    note: str
    """What every resume's report says of it (rank 0 logged it once already)."""


def node_indices(told: list[tuple[str | None, str]]) -> tuple[int, ...] | str:
    """Each rank's node from every rank's (``GROUP_RANK``, host name): torchrun's node rank
    where every rank has one, else the host names in sorted order (srun, mpirun). A node
    index spanning two hosts, or indices with gaps (the partner ring needs 0..n-1), is why
    the memory tier cannot start (a string)."""
    if all(group is not None and group.isdigit() for group, _ in told):
        nodes = tuple(int(group) for group, _ in told if group is not None)
    else:
        hosts = sorted({host for _, host in told})
        nodes = tuple(hosts.index(host) for _, host in told)
    for n in set(nodes):
        hosts_of = sorted({host for (_, host), m in zip(told, nodes, strict=True) if m == n})
        if len(hosts_of) > 1:
            return f"node {n} (GROUP_RANK) spans several hosts: {', '.join(hosts_of)}"
    if sorted(set(nodes)) != list(range(len(set(nodes)))):
        return f"node indices {sorted(set(nodes))} are not 0..n-1"
    return nodes


def memory_tier(
    *,
    ctl: Comm,
    io: Comm,
    root: Root,
    config: CheckpointConfig,
    state: TrainState,
    checks: CandidateChecks,
    lineage: Lineage,
    durable: CheckpointSource,
) -> Tier | Off:
    """The memory tier over ``root``'s ledger, or why it is off; see the module docstring."""
    rank = ctl.rank
    found = node_indices(ctl.all_gather((os.environ.get("GROUP_RANK"), socket.gethostname())))
    if isinstance(found, str):
        raise CheckpointError(f"the memory tier cannot tell the nodes apart: {found}")
    topology = memory_layout.Topology(found)
    node = topology.node_of[rank]
    memory_dir = config.memory_root
    ledger = root.memory_ledger()
    commit = MemoryCommit(ledger, config.memory_keep, str(memory_dir))
    identity = ctl.broadcast(_identity(ledger) if rank == 0 else None)
    failure: CheckpointError | None = None
    try:
        if not isinstance(identity, str):
            raise identity if identity is not None else CheckpointError("no identity")
        if topology.ranks_of(node)[0] == rank:
            base = config.memory_base
            memory_layout.claim_memory_dir(memory_dir, base, identity, str(root))
            node_dir = private_tree(memory_layout.node_dir(memory_dir, node), base)
            memory_layout.clean_abandoned(node_dir)
    except (NotOwnedError, CheckpointError) as exc:
        failure = exc
    except OSError as exc:
        failure = CheckpointError(f"{describe_os_error(exc, memory_dir)}")
    failed = ctl.first_failure(failure)
    if failed is not None:
        return _off(f"node {topology.node_of[failed.rank]}: {failed.error}", ledger, rank)
    if rank == 0:
        commit.recover(config.directory)
    slots = memory_layout.Slots(memory_layout.node_dir(memory_dir, node))
    route = MemoryRoute(
        io=io,
        strategy=commit,
        memory_dir=memory_dir,
        topology=topology,
        lineage=lineage,
        keep=config.memory_keep,
        digest=config.digest,
        timeout_s=config.timeout_s,
        slots=slots,
        replica_check=config.value_checks and config.replica_check != "off",
        finite_check=config.value_checks,
        replica_every=config.replica_every,
        capture_check=config.capture_check,
        trainable=lambda state_dict: state.param_keys(state_dict)[0],
    )
    source = MemorySource(
        ctl=ctl,
        ledger=ledger,
        topology=topology,
        memory_dir=memory_dir,
        durable_steps=durable.steps,
        timeout_s=config.timeout_s,
        slots=slots,
        provenance=checks.provenance,
    )
    reader = MemoryReader(ctl=ctl, source=source, state=state, checks=checks)

    def close(last_was_anchor: bool) -> None:
        """A run whose last save was durable leaves nothing in memory the root lacks: each
        rank frees its files of this run in its node's memory (a run that ends with a memory
        save, or a crash, keeps them for the next start to resume from)."""
        if last_was_anchor:
            freed = route.release()
            if rank == 0 and freed:
                log.info(
                    "dckpt: the last checkpoint is in the root (step %s): the memory tier's "
                    "copies of this run were freed (%s on rank 0's node)",
                    lineage.anchor,
                    human_bytes(freed),
                )
        route.close()

    return Tier(MEMORY, "memory tier", route, source, reader, survey=source.unrecorded, close=close)


def _identity(ledger: MemoryLedger) -> str | CheckpointError:
    """Rank 0: the root's memory identity, made at its first memory start (or why not)."""
    try:
        found = ledger.identity(create=True)
    except (OSError, CheckpointError) as exc:
        return CheckpointError(f"cannot read or make the memory identity in {ledger}: {exc}")
    return found or CheckpointError(f"{ledger} holds no readable memory identity (root-id)")


def _off(why: str, ledger: MemoryLedger, rank: int) -> Off:
    """The memory tier is off for this start: rank 0 says so once, with the memory steps the
    root's ledger records (not considered by this start's resume)."""
    recorded: list[int] = []
    if rank == 0:
        with contextlib.suppress(OSError, CheckpointError):
            recorded = ledger.steps()
    note = (
        f"the memory tier is off for this start: {why}. Memory saves are skipped and durable "
        "saves go on"
        + (
            f"; memory steps {recorded} recorded in the root were not considered"
            if recorded
            else ""
        )
    )
    if rank == 0:
        log.error("dckpt: %s", note)
    return Off(why, note)
