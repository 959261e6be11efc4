"""CheckpointManager: the one object a training script holds.

It keeps the guards (a closed manager, bad arguments) and the lifetime (dckpt's two process
groups, the run lock, crash recovery at start, the optimizer step hook) and delegates the rest
to collaborators built here with explicit parts:

- ``save`` -> ``dckpt.save.saver.Saver`` and ``dckpt.save.pipeline.SavePipeline``, whose
  docstring is the save protocol;
- ``load``, ``resume``, ``latest_step``, ``observe`` -> ``dckpt.load.resumer.Resumer``, whose
  docstring is the resume protocol;
- ``watch_preemption``, ``preempted`` -> ``dckpt.preemption.PreemptionStop``.

Each tier is built here from its parts and handed down, so nothing below asks which tier it
runs: the root, opened once by ``open_root`` and asked only through the ``Root`` protocol
(dckpt.root.protocol) for its locks, recovery, commit strategy and source (a
``DurableRoute`` with the strategy; a ``DurableReader`` over the source), and, with
``memory=True``, the memory tier (a ``MemoryRoute`` with ``MemoryCommit`` over the root's
memory ledger; a ``MemorySource`` with a ``MemoryReader``), with the ``Lineage`` they share.
Nothing here asks which kind of root it holds.

Two groups, created in the same order on every rank: *ctl* for foreground calls (load, skip
and mode decisions, preemption) and *io* for the background save, so they never interleave
(two threads issuing collectives on one group could pair them differently on two ranks). Both
connect lazily (dckpt.collective.comm): a rank connects only to the peers its collectives
use, and building a group costs it a few store calls at any world size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import sys
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch

from .collective.comm import Comm
from .collective.progress import Progress
from .config import CheckpointConfig
from .errors import CheckpointError, LockError, describe_os_error
from .load.checks import CandidateChecks
from .load.config_check import ConfigPolicy
from .load.durable import DurableReader
from .load.loss_watch import LossWatch
from .load.memory import MemoryReader, MemorySource
from .load.replay import Replay, ReplayMode
from .load.report import ResumeReport
from .load.resumer import LoadResult, Resumer, ResumeTier
from .load.watch import ResumeWatch
from .owned import NotOwnedError, private_tree
from .preemption import CHECK_EVERY_S, DEFAULT_SIGNALS, Preemption, PreemptionStop
from .root.memory_ledger import MemoryLedger
from .root.protocol import Lock, Root
from .root.source import CheckpointSource
from .save.durable import DurableRoute
from .save.handle import SaveHandle, SaveResult
from .save.memory import MemoryRoute
from .save.mode import SaveMode
from .save.pipeline import SavePipeline
from .save.route import DURABLE, SaveRoute
from .save.saver import Saver
from .save.stager import Stager
from .save.step_clock import StepClock
from .tiers import memory_layout
from .tiers.memory_commit import Lineage, MemoryCommit
from .tiers.roots import open_root
from .train.precision import PrecisionPolicy
from .train.state import TrainState
from .units import human_bytes

__all__ = ["CheckpointManager", "LoadResult", "ResumeReport", "SaveHandle", "SaveResult"]

log = logging.getLogger("dckpt")


def _ensure_visible_logging() -> None:
    # Users must see one line per save and per load even when their script configured nothing.
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _replay_mode(config: CheckpointConfig, state: TrainState) -> ReplayMode | None:
    """``replay_check`` as the replay runs it: "auto" is exact where the kernels are
    deterministic (every parameter on the CPU, or torch's deterministic algorithms on)."""
    if config.replay_check == "off":
        return None
    if config.replay_check != "auto":
        return config.replay_check
    on_cpu = all(p.device.type == "cpu" for p in state.model.parameters())
    return "exact" if on_cpu or torch.are_deterministic_algorithms_enabled() else "close"


def _node_indices(told: list[tuple[str | None, str]]) -> tuple[int, ...] | str:
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


def _tidy(what: str, action: Callable[[], object]) -> None:
    """One part of ``close()``'s letting go: a failure is said, never raised over another."""
    try:
        action()
    except Exception as exc:
        log.warning("dckpt: closing %s failed (%s); the rest is closed", what, exc)


class CheckpointManager:
    """Saves and loads one run's checkpoints under a root; see the module docstring.

    Args:
        config: a CheckpointConfig, or just the root: a directory, or an ``s3://`` URL as a str.
        state: the TrainState to save and to load into.
        run_config: the training configuration (JSON-able), stored in every manifest and
            compared on resume.
        run_id: names the run in manifests and in the run lock (a restart of the same run
            may take over its lock at once). Defaults to ``$DCKPT_RUN_ID``, then torchrun's
            run id (``--rdzv-id``), then a new uuid. Set ``DCKPT_RUN_ID`` to a value that
            survives a requeue (e.g. ``$SLURM_JOB_ID``) when each requeue gets a new
            rendezvous id.
        precision: the PrecisionPolicy in use, recorded in every manifest, compared on resume.
        allow_config_changes: config keys whose change a resume accepts with a warning, even
            strict ones; ``$DCKPT_ALLOW_CONFIG_CHANGES=key,key`` adds more without a code edit.
        strict_keys: config keys that shape the run, whose change a resume refuses. None:
            ``dckpt.resume.DEFAULT_STRICT_KEYS`` (learning rate and schedule, batch, model
            sizes, data, seed); ``"all"``: every key that is not operational
            (``dckpt.resume.OPERATIONAL_KEYS``) or checked directly. See
            dckpt.load.config_check.

    Use it as a context manager, or call ``close()``: it drains the save in flight.
    """

    def __init__(
        self,
        config: CheckpointConfig | str | os.PathLike[str],
        state: TrainState,
        *,
        run_config: dict[str, Any] | None = None,
        run_id: str | None = None,
        precision: PrecisionPolicy | None = None,
        allow_config_changes: tuple[str, ...] | list[str] = (),
        strict_keys: Iterable[str] | Literal["all"] | None = None,
    ) -> None:
        if not isinstance(config, CheckpointConfig):  # a str stays a str: it may be a URL
            config = CheckpointConfig(root=config if isinstance(config, str) else Path(config))
        self.config = config
        self.root = config.directory
        self.state = state
        try:  # stored as JSON in every manifest and compared on resume: normalise it once
            self.run_config: dict[str, Any] = json.loads(
                json.dumps(dict(run_config or {}), allow_nan=False, default=str)
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"run_config must be JSON-serialisable (finite numbers): {exc}"
            ) from None
        self.precision = precision
        if precision is not None:
            precision.check_model(state.model)
            scaler_on = state.scaler is not None and getattr(state.scaler, "is_enabled", bool)()
            if precision.needs_scaler and not scaler_on:
                raise ValueError(
                    "precision fp16 needs a GradScaler in the TrainState (its state is part of "
                    "every checkpoint): TrainState(..., scaler=policy.make_scaler(device_type))"
                )
        self._loss_watch = LossWatch()
        _ensure_visible_logging()
        self._ctl = Comm(config.timeout_s)
        self._io = Comm(config.timeout_s)
        for comm in (self._ctl, self._io):  # a rank that dies later is then seen at once
            comm.connect()
        self.rank = self._ctl.rank
        self.world_size = self._ctl.world_size
        self._closed = False
        told = self._ctl.broadcast(
            (
                run_id
                or os.environ.get("DCKPT_RUN_ID")
                or os.environ.get("TORCHELASTIC_RUN_ID")
                or uuid.uuid4().hex,
                secrets.token_hex(16),  # rank 0's draw: the job's store keys live under it
            )
        )
        self.run_id = str(told[0])
        for comm in (self._ctl, self._io):
            comm.use_token(told[1])
        try:
            self._root: Root = open_root(config.where, mirror=config.directory)
        except (CheckpointError, ValueError):  # boto3 missing, a bad DCKPT_S3_* setting
            self._ctl.close()
            self._io.close()
            raise
        self._locks = self._open_root()
        strategy, source = self._root.commit_strategy(), self._root.source()
        lineage = Lineage()
        if config.memory and self.rank == 0:  # until a resume says otherwise: the root's newest
            lineage.anchor = max(source.steps(), default=None)
        checks = CandidateChecks(
            comm=self._ctl,
            run_config=self.run_config,
            precision=precision,
            policy=ConfigPolicy.build(
                allow_config_changes, strict_keys, precision_checked=precision is not None
            ),
            state=state,
        )
        durable = DurableRoute(
            io=self._io,
            strategy=strategy,
            config=config,
            state=state,
            stager=Stager(config.device_staging_bytes),
        )
        self._durable = durable
        routes: dict[str, SaveRoute] = {durable.tier: durable}
        tiers = [
            ResumeTier(
                "root",
                source,
                DurableReader(
                    ctl=self._ctl,
                    source=source,
                    state=state,
                    checks=checks,
                    read_threads=config.read_threads,
                ),
            )
        ]
        self._memory: tuple[MemoryRoute, MemorySource] | None = None
        self._memory_off_why: str | None = None
        notes: list[str] = []
        if config.memory:
            opened = self._open_memory(lineage, source)
            if isinstance(opened, str):
                self._memory_off_why = opened
                notes.append(self._memory_off(opened))
            else:
                self._memory = opened
                route, memory_source = opened
                routes[route.tier] = route
                reader = MemoryReader(
                    ctl=self._ctl, source=memory_source, state=state, checks=checks
                )
                tiers.insert(0, ResumeTier("memory tier", memory_source, reader))
        clock, mode, progress = StepClock(), SaveMode(config.async_save), Progress(self._io)
        self._pipeline = SavePipeline(
            io=self._io,
            progress=progress,
            config=config,
            state=state,
            precision=precision,
            run_id=self.run_id,
            run_config=self.run_config,
            clock=clock,
            mode=mode,
            lineage=lineage,
        )
        self._saver = Saver(
            ctl=self._ctl,
            pipeline=self._pipeline,
            routes=routes,
            progress=progress,
            config=config,
            clock=clock,
            mode=mode,
        )
        replay = Replay(
            rank=self.rank,
            root=self.root,
            mode=_replay_mode(config, state),
            rtol=config.replay_rtol,
            run_id=self.run_id,
        )
        self._watch = ResumeWatch(
            rank=self.rank,
            world_size=self.world_size,
            config=config,
            loss_watch=self._loss_watch,
            replay=replay,
            state=state,
            records=tiers[-1].source.resume_records(),
            run_id=self.run_id,
        )
        self._resumer = Resumer(
            ctl=self._ctl,
            config=config,
            tiers=tiers,
            watch=self._watch,
            lineage=lineage,
            state=state,
            notes=notes,
        )
        self._stop = PreemptionStop(self._ctl, self._saver)
        self._hook: Any = None
        if state.optimizer is not None:  # times every step; waits for deferred copies
            self._hook = state.optimizer.register_step_pre_hook(
                lambda _opt, _args, _kwargs: self._on_optimizer_step()
            )

    def _on_optimizer_step(self) -> None:
        self._resumer.touched()
        self._watch.touched()
        self._saver.on_optimizer_step()

    def _open_root(self) -> list[Lock]:
        """Every rank prepares its local directory (the root, or its node's mirror of an
        s3:// root); rank 0 then takes the run locks and recovers from crashed saves. Every
        rank raises the first failure (after releasing dckpt's groups and any lock taken)."""
        failure: CheckpointError | None = None
        locks: list[Lock] = []
        coordinator = self.rank == 0
        try:
            self._root.prepare(coordinator=coordinator)
            if coordinator and self.config.lock:
                for lock in self._root.locks(self.run_id, self.config.lock_lease_s):
                    locks.append(lock)
                    lock.acquire()
            if coordinator:
                self._root.recover()
        except LockError as exc:
            failure = exc
        except (OSError, CheckpointError) as exc:
            failure = CheckpointError(f"cannot use checkpoint root {self._root}: {exc}")
        failed = self._ctl.first_failure(failure)  # the lowest failing rank's, on every rank
        if failed is not None:
            # Released on every failure, another rank's too (its node's mirror). Each lock
            # removes only a record it wrote: one whose acquire was refused (a bucket that
            # does not exist, a live owner) is left alone, without a word.
            for lock in reversed(locks):
                lock.release()
            self._ctl.close()
            self._io.close()
            raise failed.error
        return locks

    def _close_on_failure(self) -> None:
        """A start that fails after the root was opened: release the run locks and groups."""
        for lock in reversed(self._locks):
            lock.release()
        self._ctl.close()
        self._io.close()

    def _open_memory(
        self, lineage: Lineage, durable: CheckpointSource
    ) -> tuple[MemoryRoute, MemorySource] | str:
        """The memory tier: every rank learns the topology (which node each rank is on);
        each node's first rank proves the node's memory directory the job's own and this
        root's (dckpt.tiers.memory_layout.claim_memory_dir) and removes what the last
        workers left half-written; rank 0 tidies the ledger's saves in flight. Nothing
        listens: replicas move over dckpt's gloo groups (dckpt.collective.transfer).

        A directory that is not provably the job's (another user's, writable by others, a
        link, another root's) or that cannot be made, on any node, turns the memory tier off
        for this start on every rank (returns why): the durable tier goes on, and nothing is
        written into, read from or freed in that directory."""
        found = _node_indices(
            self._ctl.all_gather((os.environ.get("GROUP_RANK"), socket.gethostname()))
        )
        if isinstance(found, str):
            self._close_on_failure()
            raise CheckpointError(f"the memory tier cannot tell the nodes apart: {found}")
        topology = memory_layout.Topology(found)
        node = topology.node_of[self.rank]
        memory_dir = self.config.memory_root
        ledger = self._root.memory_ledger()
        commit = MemoryCommit(ledger, self.config.memory_keep, str(memory_dir))
        identity = self._ctl.broadcast(self._memory_identity(ledger) if self.rank == 0 else None)
        failure: CheckpointError | None = None
        try:
            if not isinstance(identity, str):
                raise identity if identity is not None else CheckpointError("no identity")
            if topology.ranks_of(node)[0] == self.rank:
                base = self.config.memory_base
                memory_layout.claim_memory_dir(memory_dir, base, identity, str(self._root))
                node_dir = private_tree(memory_layout.node_dir(memory_dir, node), base)
                memory_layout.clean_abandoned(node_dir)
        except (NotOwnedError, CheckpointError) as exc:
            failure = exc
        except OSError as exc:
            failure = CheckpointError(f"{describe_os_error(exc, memory_dir)}")
        failed = self._ctl.first_failure(failure)
        if failed is not None:
            return f"node {topology.node_of[failed.rank]}: {failed.error}"
        if self.rank == 0:
            commit.recover(self.root)
        slots = memory_layout.Slots(memory_layout.node_dir(memory_dir, node))
        route = MemoryRoute(
            io=self._io,
            strategy=commit,
            memory_dir=memory_dir,
            topology=topology,
            lineage=lineage,
            keep=self.config.memory_keep,
            digest=self.config.digest,
            timeout_s=self.config.timeout_s,
            slots=slots,
            replica_check=self.config.value_checks and self.config.replica_check != "off",
            finite_check=self.config.value_checks,
            replica_every=self.config.replica_every,
        )
        source = MemorySource(
            ctl=self._ctl,
            ledger=ledger,
            topology=topology,
            memory_dir=memory_dir,
            durable_steps=durable.steps,
            timeout_s=self.config.timeout_s,
            slots=slots,
        )
        return route, source

    def _memory_identity(self, ledger: MemoryLedger) -> str | CheckpointError:
        """Rank 0: the root's memory identity, made at its first memory start (or why not)."""
        try:
            found = ledger.identity(create=True)
        except (OSError, CheckpointError) as exc:
            return CheckpointError(f"cannot read or make the memory identity in {ledger}: {exc}")
        return found or CheckpointError(f"{ledger} holds no readable memory identity (root-id)")

    def _memory_off(self, why: str) -> str:
        """The memory tier is off for this start: rank 0 says so once, with the memory steps
        the root's ledger records (not considered by this start's resume); the note every
        resume report carries."""
        recorded: list[int] = []
        if self.rank == 0:
            with contextlib.suppress(OSError, CheckpointError):
                recorded = self._root.memory_ledger().steps()
        note = (
            f"the memory tier is off for this start: {why}. Memory saves are skipped and "
            "durable saves go on"
            + (
                f"; memory steps {recorded} recorded in the root were not considered"
                if recorded
                else ""
            )
        )
        if self.rank == 0:
            log.error("dckpt: %s", note)
        return note

    # --- saving -----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        epoch: int | None = None,
        milestone: bool = False,
        metric: float | None = None,
        tier: Literal["durable", "memory"] = "durable",
        when: object = None,
    ) -> SaveHandle:
        """Save the state as ``step`` on every rank; returns once training may go on.

        Call it on every rank. ``when``: rank 0's value decides for every rank (one small
        broadcast, made at every save), so a condition only rank 0 computes ("val loss
        improved") can gate a save: ``save(step, when=improved)``; the other ranks' values
        are ignored, None included. A false one skips the save (a handle whose ``skipped``
        is True), without a log line; None (the default) saves.

        A ``save(N)`` right after resuming from N (from the same tier), with no optimizer
        step (for a state without an optimizer: no ``observe()``) and no in-place change of a
        parameter or buffer since, is skipped with one log line: it would write the same
        state again under the same step.

        ``tier="memory"`` (with ``CheckpointConfig(memory=True)``) keeps it in host memory
        and on the partner node instead of the durable root (dckpt.save.memory): seconds to
        restore after a crash, gone with both nodes. Save to memory often and to the root
        less often: ``resume()`` takes the newest step of either.

        ``milestone=True`` (or a step that is a multiple of ``milestone_every``) keeps this
        checkpoint through retention; ``metric`` ranks it for ``best_k``.

        The returned handle's ``result()`` blocks until the checkpoint is committed. An error
        of this save is raised by the next ``save()``, ``wait()`` or ``close()`` on every rank.
        """
        self._check_open()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if tier not in ("durable", "memory"):
            raise ValueError(f"tier must be 'durable' or 'memory', got {tier!r}")
        if tier == "memory" and self._memory is None:
            if self._memory_off_why is None:
                raise ValueError(
                    "save(tier='memory') needs the memory tier: CheckpointConfig(memory=True)"
                )
            # off for this start (said once at start): the same on every rank, no collective
            return self._saver.skipped(step, f"the memory tier is off: {self._memory_off_why}")
        handle = self._saver.save(
            step,
            epoch=epoch,
            milestone=milestone,
            metric=metric,
            loss=self._loss_watch.summary(),
            tier=tier,
            when=when,
            resumed_unchanged=self._resumer.unchanged_since(step, tier),
        )
        if not handle.skipped:  # from here on, observe() journals the steps after this save
            self._watch.saved(step, handle.save_id, self._saver.last_committed_step)
        return handle

    def before_optimizer_step(self) -> None:
        """Block until the save in flight has its copy of the state (with ``overlap_staging``,
        called by a step pre-hook; without it, the copy is always taken in ``save()``).

        With ``overlap_staging``, call it yourself before any in-place change of parameters or
        optimizer state that does not happen inside ``optimizer.step()``.
        """
        self._saver.before_optimizer_step()

    def wait(self) -> SaveResult | None:
        """Block until the save in flight is committed; raise if an earlier durable save
        failed, on every rank (a memory save's failure fails only its handle: logged, agreed,
        and the next save goes on). Returns the result of the save that was in flight on this
        rank, if any (None when this rank's had already ended, or a memory save failed)."""
        return self._saver.wait()

    # --- loading ----------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest committed step under the root (as rank 0 sees it), or None."""
        self._check_open()
        self.wait()
        return self._resumer.latest_step()

    def load(self, step: int | None = None) -> LoadResult:
        """Load the newest committed checkpoint (or ``step``) into the state, fully verified.

        No fallback and no config check: that is ``resume()``. Raises CheckpointNotFoundError
        when there is nothing to load, ManifestError or IntegrityError when the checkpoint must
        not be trusted (nothing is loaded silently). A file is read once, its large tensors
        filled as its bytes arrive: a load that fails part way may leave some of them holding
        the refused file's bytes (the error says so): load a checkpoint again before training.
        """
        self._check_open()
        self.wait()
        return self._resumer.load(step)

    def resume(self, *, fallback: bool | None = None) -> ResumeReport:
        """Resume from the newest checkpoint that passes every check; see dckpt.load.resumer.

        Returns the ResumeReport (``report.resumed`` is False on a fresh start) after logging it
        as one block. A checkpoint whose bytes or manifest are bad is quarantined and the next
        older one is tried, unless ``fallback`` is False (default: the config's). Raises
        ConfigMismatchError on an unsafe config change, StateMismatchError when the model does
        not fit the checkpoint, WorldError when the warmup collective fails.
        """
        self._check_open()
        self.wait()
        return self._resumer.resume(self.config.fallback if fallback is None else fallback)

    def observe(self, loss: float, *, step: int | None = None) -> None:
        """Record this step's loss; call it on every rank, every step, with the same value
        (all-reduced). The manifest records rank 0's last losses (a save warns when the ranks'
        differ); after a resume each rank's first losses are compared with them, and rank 0
        logs the verdict (see dckpt.load.loss_watch).

        Rank 0 also journals every loss since the newest save (``ROOT/.dckpt-replay/``), and
        after a resume the steps replayed are compared with the run that stopped, bit for bit
        (``replay_check``; dckpt.load.replay). ``step``: the step this loss is of; without
        it, the first ``observe()`` after ``save(N)`` is step N+1, and so on."""
        if self.state.optimizer is None:  # nothing else tells that the state is training
            self._resumer.touched()
        self._watch.observe(loss, step)

    # --- preemption -------------------------------------------------------------------------

    def watch_preemption(
        self,
        signals: Sequence[str] = DEFAULT_SIGNALS,
        *,
        deadline_s: float = 120.0,
        check_every_s: float = CHECK_EVERY_S,
    ) -> Preemption:
        """Make ``signals`` request a final save instead of killing the process; see
        ``preempted``. ``deadline_s``: by when, counted from the first signal any rank received,
        the final save must have committed (leave it below the scheduler's grace period, e.g.
        SLURM's ``--signal=USR1@120``). ``check_every_s``: about how much training passes
        between two agreements of the ranks (0: at every step); a signal is acted on within
        about two of them. Main thread only."""
        self._check_open()
        return self._stop.watch(signals, deadline_s, check_every_s)

    def preempted(self, step: int) -> bool:
        """True once the ranks agreed that some rank received a preemption signal, after
        ``step`` was saved.

        Every rank calls it after every step, with the same ``step``. Most calls return at
        once; about every ``check_every_s`` one reads the ranks' agreement, which was issued
        at the check before without waiting (dckpt.preemption). When it returns True the step
        is committed (SaveError otherwise) and the script should close the manager and exit 0.
        """
        self._check_open()  # after close() the collective would land on the training group
        return self._stop.preempted(step, self.save)

    # --- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Drain the save in flight, release dckpt's groups, then raise any save's error.

        Idempotent. Call it before ``destroy_process_group``.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._watch.finish()
            self._saver.drain()
        finally:
            # Each part let go on its own: one that fails (a read-only root, a dead link)
            # is logged, and never hides the save's own error raised below, nor the rest.
            if self._hook is not None:
                _tidy("the optimizer hook", self._hook.remove)
            _tidy("the signal handlers", self._stop.uninstall)
            # DCP keeps cached plans in class-level dicts (rank 0's hold every rank's): a
            # closed manager's would stay for the life of the process
            _tidy("DCP's cached plans", self._durable.plans.forget)
            for lock in reversed(self._locks):
                if self._saver.stuck is not None:
                    lock.abandon()  # the stuck write may still land: keep others out
                else:
                    _tidy("the run lock", lock.release)
            if self._memory is not None:
                _tidy("the memory tier", self._close_memory)
            _tidy("dckpt's groups", self._io.close)
            _tidy("dckpt's groups", self._ctl.close)
        self._saver.raise_if_failed()

    def _close_memory(self) -> None:
        """A run whose last save was durable leaves nothing in memory the root lacks: each
        rank frees its files of this run in its node's memory (a run that ends with a memory
        save, or a crash, keeps them for the next start to resume from)."""
        assert self._memory is not None
        route, _source = self._memory
        if self._pipeline.last_committed_tier == DURABLE and self._saver.stuck is None:
            freed = route.release()
            if self.rank == 0 and freed:
                log.info(
                    "dckpt: the last checkpoint is in the root (step %d): the memory tier's "
                    "copies of this run were freed (%s on rank 0's node)",
                    self._pipeline.last_committed[DURABLE],
                    human_bytes(freed),
                )
        route.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_exc:  # the error already in flight matters more
            log.error("dckpt: while closing after an error: %r", close_exc)

    # --- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")
