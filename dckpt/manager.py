"""CheckpointManager: the one object a training script holds.

It keeps the guards (a closed manager, bad arguments) and the lifetime (dckpt's two process
groups, the run lock, crash recovery at start, the optimizer step hook) and delegates the rest
to collaborators built here with explicit parts:

- ``save`` -> ``dckpt.save.saver.Saver`` and ``dckpt.save.pipeline.SavePipeline``, whose
  docstring is the save protocol;
- ``load``, ``resume``, ``latest_step``, ``observe`` -> ``dckpt.load.resumer.Resumer``, whose
  docstring is the resume protocol;
- ``watch_preemption``, ``preempted`` -> ``dckpt.preemption.PreemptionStop``.

The manager composes the tiers; it wires none of them. The root is opened once by
``open_root`` and asked only through the ``Root`` protocol (dckpt.root.protocol) for its
locks, recovery, commit strategy, source and resume records; each tier is one value
(``dckpt.tier.Tier``) built by its factory (``durable_tier``; with ``memory=True``,
``dckpt.memory_tier.memory_tier``, or why it is off for this start) and the one list is
handed to the saver and the resumer. Nothing here asks which kind of root it holds or which
tier it runs, beyond checking ``save(tier=...)`` against the tiers this start has.

Two groups, created in the same order on every rank: *ctl* for foreground calls (load, skip
and mode decisions, preemption) and *io* for the background save, so they never interleave
(two threads issuing collectives on one group could pair them differently on two ranks). Both
connect lazily (dckpt.collective.comm): a rank connects only to the peers its collectives
use, and building a group costs it a few store calls at any world size.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import sys
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch

from .collective.comm import Comm
from .collective.gate import Gate
from .collective.progress import Progress
from .config import CheckpointConfig
from .errors import CheckpointError, LockError, WorldError
from .load.checks import CandidateChecks
from .load.config_check import ConfigPolicy
from .load.loss_watch import LossWatch
from .load.replay import Replay, ReplayMode
from .load.report import ResumeReport
from .load.resumer import LoadResult, Resumer
from .load.watch import ResumeWatch
from .memory_tier import Off, memory_tier
from .owned import NotOwnedError
from .preemption import CHECK_EVERY_S, DEFAULT_SIGNALS, Preemption, PreemptionStop
from .root.protocol import Lock, Root
from .root.provenance import ManifestKey, Provenance
from .save.background import FAILING_GRACE_S
from .save.handle import SaveHandle, SaveResult
from .save.mode import SaveMode
from .save.pipeline import SavePipeline
from .save.saver import Saver
from .save.step_clock import StepClock
from .tier import DURABLE, MEMORY, Tier, durable_tier
from .tiers.memory_commit import Lineage
from .tiers.roots import open_root
from .train.precision import PrecisionPolicy
from .train.state import TrainState

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


def _raw_collective(exc: BaseException) -> bool:
    """Whether ``exc`` is what a failed collective raises (gloo's and NCCL's timeouts and
    closed connections are plain RuntimeErrors, or torch.distributed's DistError), not one
    of dckpt's own errors nor another kind (an out-of-memory is a RuntimeError too)."""
    if isinstance(exc, (CheckpointError, torch.OutOfMemoryError)):
        return False
    dist_error = getattr(torch.distributed, "DistError", ())  # absent in a build without it
    return isinstance(exc, dist_error) or type(exc) is RuntimeError


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
        self._key: ManifestKey | None = None
        """The job's manifest key (``key_file``), loaded by ``_open_root`` on every rank."""
        self._locks = self._open_root()
        source = self._root.source()
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
            provenance=Provenance(key=self._key),
        )
        durable = durable_tier(
            ctl=self._ctl,
            io=self._io,
            strategy=self._root.commit_strategy(),
            source=source,
            config=config,
            state=state,
            checks=checks,
        )
        self._tiers: list[Tier] = [durable]
        """Every tier this start saves to and resumes from, the anchor (the root's) last."""
        self._off: dict[str, str] = {}
        """The tiers asked for but off for this start, with why."""
        notes: list[str] = []
        if config.root_access == "group":
            notes.append(
                "root_access=group: the root's directories may be written by their group "
                "(a step another user owns is still never resumed unless the job's key signs it)"
            )
        if config.memory:
            try:
                memory = memory_tier(
                    ctl=self._ctl,
                    io=self._io,
                    root=self._root,
                    config=config,
                    state=state,
                    checks=checks,
                    lineage=lineage,
                    durable=source,
                )
            except CheckpointError:
                self._close_on_failure()
                raise
            if isinstance(memory, Off):
                self._off[MEMORY] = memory.why
                notes.append(memory.note)
            else:
                self._tiers.insert(0, memory)
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
            key=self._key,
        )
        self._saver = Saver(
            ctl=self._ctl,
            pipeline=self._pipeline,
            tiers=self._tiers,
            progress=progress,
            config=config,
            clock=clock,
            mode=mode,
        )
        records = self._root.resume_records()
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
            records=records,
            run_id=self.run_id,
        )
        self._resumer = Resumer(
            ctl=self._ctl,
            config=config,
            tiers=self._tiers,
            records=records,
            foreign=self._root.foreign,
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
        if self.state.in_torch_state_dict:  # DCP initialising a stateless optimizer: no step
            return
        self._resumer.touched()
        self._watch.touched()
        self._saver.on_optimizer_step()

    def _open_root(self) -> list[Lock]:
        """Every rank prepares its local directory (the root, or its node's mirror of an
        s3:// root); rank 0 then takes the run locks and recovers from crashed saves, while
        the other ranks wait for it through a gate (dckpt.collective.gate): taking a lock of
        another host may take its whole lease, longer than ``timeout_s``, and rank 0 says so
        before it waits, so they wait as long. Every rank raises the first failure (after
        releasing dckpt's groups and any lock taken)."""
        failure: CheckpointError | None = None
        locks: list[Lock] = []
        coordinator = self.rank == 0
        gate = Gate(self._ctl, "open-root", timeout_s=self.config.timeout_s)
        try:
            if self.config.key_file is not None:  # every rank: it claims what it reads
                self._key = ManifestKey.load(self.config.key_file)
            self._root.prepare(coordinator=coordinator, access=self.config.root_access)
            if coordinator and self.config.lock:
                for lock in self._root.locks(self.run_id, self.config.lock_lease_s):
                    locks.append(lock)
                    lock.acquire(on_wait=gate.extend)
            if coordinator:
                self._root.recover()
        except (LockError, NotOwnedError) as exc:  # they name the root and what to do
            failure = exc
        except (OSError, CheckpointError) as exc:
            failure = CheckpointError(f"cannot use checkpoint root {self._root}: {exc}")
        try:
            if coordinator:
                gate.open()
            else:
                gate.wait("taking the run lock and recovering the root")
        except CheckpointError as exc:  # the gate: the store, or rank 0 never came
            failure = failure or exc
            for lock in reversed(locks):
                lock.release()
            self._ctl.close()
            self._io.close()
            raise failure from None
        failed = self._ctl.first_failure(failure)  # the lowest failing rank's, on every rank
        if failed is None and self.config.key_file is not None:
            # Every rank claims what it reads with its own copy of the key: a node given
            # another key would pass over the steps the others take. One all-reduce at start.
            mine = self._key.key_id if self._key is not None else ""
            if not self._ctl.all_equal(mine):
                first = self._ctl.broadcast(mine)
                failed = self._ctl.first_failure(
                    None
                    if mine == first
                    else CheckpointError(
                        f"rank {self.rank}'s key file {self.config.key_file} holds another key "
                        f"(id {mine!r}) than rank 0's (id {first!r}): every rank must sign and "
                        "check with the run's one key; give every node the same key file"
                    )
                )
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

    # --- saving -----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        epoch: int | None = None,
        milestone: bool = False,
        metric: float | None = None,
        tier: Literal["durable", "memory"] = DURABLE,
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
        of this save is raised by the next ``save()``, ``wait()`` or ``close()`` on every rank;
        one that lost a rank (a wait of the save on the others failed: a rank frozen, gone, or
        slower than ``timeout_s``) also by the next ``observe()``, naming that rank (see
        ``CheckpointConfig.timeout_s`` for a loop stuck in a collective of its own).
        """
        self._check_open()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if tier not in (DURABLE, MEMORY):
            raise ValueError(f"tier must be 'durable' or 'memory', got {tier!r}")
        if tier in self._off:  # said once at start: the same on every rank, no collective
            return self._saver.skipped(step, f"the {tier} tier is off: {self._off[tier]}")
        if all(t.name != tier for t in self._tiers):
            raise ValueError(
                f"save(tier={tier!r}) needs the {tier} tier: CheckpointConfig({tier}=True)"
            )
        self._raise_if_peer_lost()
        self._resumer.settle()  # a memory copy the resume left running is done first
        try:
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
        except CheckpointError:
            raise
        except RuntimeError as exc:  # a wait of save() on dckpt's control group failed
            raise self._lost_in_save(step, exc) from exc
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
        self._raise_if_peer_lost()
        return self._saver.wait()

    def _raise_if_peer_lost(self) -> None:
        """A wait of the background save on the other ranks failed (dckpt's group is lost:
        this job saves nothing more): that save's verdict, naming the rank that was silent
        or behind, raised here in the training thread, once. Costs one attribute read while
        nothing failed. The verdict is being worded on the save thread (the heartbeat watch,
        a few store calls, each with its deadline): it is waited for, so the error names the
        rank rather than the bare failure."""
        if self._pipeline.group_lost is None:
            return
        ticket = self._saver.latest
        if ticket is not None:
            ticket.wait(FAILING_GRACE_S)  # its verdict is latched before its ticket ends
        self._saver.raise_if_failed()

    def _lost_in_save(self, step: int, exc: BaseException) -> CheckpointError:
        """``save()``'s own wait on dckpt's control group failed (a gloo timeout after
        ``timeout_s``, or a peer whose connection closed). A background save in flight
        waits on the same ranks, with heartbeats that tell which one is late: its verdict,
        within its own deadlines, is the error; else the words of this failure."""
        ticket = self._saver.current
        if ticket is not None:
            ticket.wait(self.config.timeout_s + FAILING_GRACE_S)
        try:
            self._raise_if_peer_lost()
        except CheckpointError as verdict:
            return verdict
        return WorldError(
            f"save({step}) stopped on rank {self.rank}: a wait on dckpt's control group failed "
            f"({str(exc).splitlines()[0][:200]}): a rank did not come to save() within "
            f"timeout_s ({self.config.timeout_s:.0f} s): frozen, gone, or not calling save() "
            "on every rank. dckpt's groups cannot be used after that: restart the job once "
            "every host is healthy; it resumes from the last committed checkpoint."
        )

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

    def resume(self, *, fallback: bool | None = None, allow_fresh: bool = False) -> ResumeReport:
        """Resume from the newest checkpoint that passes every check; see dckpt.load.resumer.

        Returns the ResumeReport (``report.resumed`` is False on a fresh start) after logging it
        as one block. A checkpoint whose bytes or manifest are bad is quarantined and the next
        older one is tried, unless ``fallback`` is False (default: the config's). Raises
        ConfigMismatchError on an unsafe config change, StateMismatchError when the model does
        not fit the checkpoint, WorldError when the warmup collective fails.

        A root that holds this run's work none of which passes (every committed step
        quarantined, or set aside as a restart loop) is never a silent fresh start: it raises
        CheckpointError naming each step's verdict. ``allow_fresh=True`` starts from scratch
        there instead, with a warning that says what was set aside, when this start read
        nothing of those steps into the state (they were set aside before, or are restart
        loops); when it just failed to load them, the state may hold some of their bytes, so
        it still raises: rebuild the model, and the next start may begin afresh.
        """
        self._check_open()
        self.wait()
        fallback = self.config.fallback if fallback is None else fallback
        return self._resumer.resume(fallback, allow_fresh=allow_fresh)

    def observe(self, loss: float, *, step: int | None = None) -> None:
        """Record this step's loss; call it on every rank, every step, with the same value
        (all-reduced). The manifest records rank 0's last losses (a save warns when the ranks'
        differ); after a resume each rank's first losses are compared with them, and rank 0
        logs the verdict (see dckpt.load.loss_watch).

        Rank 0 also journals every loss since the newest save (``ROOT/.dckpt-replay/``), and
        after a resume the steps replayed are compared with the run that stopped, bit for bit
        (``replay_check``; dckpt.load.replay). ``step``: the step this loss is of; without
        it, the first ``observe()`` after ``save(N)`` is step N+1, and so on.

        A background save that lost a rank (see ``save()``) raises its error here, naming
        the rank: no collective, one attribute read while nothing failed."""
        self._raise_if_peer_lost()
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
            self._resumer.settle()
            self._watch.finish()
            self._saver.drain()
        finally:
            # Each part let go on its own: one that fails (a read-only root, a dead link)
            # is logged, and never hides the save's own error raised below, nor the rest.
            if self._hook is not None:
                _tidy("the optimizer hook", self._hook.remove)
            _tidy("the signal handlers", self._stop.uninstall)
            for lock in reversed(self._locks):
                if self._saver.stuck is not None:
                    lock.abandon()  # the stuck write may still land: keep others out
                else:
                    _tidy("the run lock", lock.release)
            settled = self._pipeline.last_was_anchor and self._saver.stuck is None
            for tier in self._tiers:
                if tier.close is not None:
                    _tidy(f"the {tier.name} tier", functools.partial(tier.close, settled))
            _tidy("dckpt's groups", self._io.close)
            _tidy("dckpt's groups", self._ctl.close)
        self._saver.raise_if_failed()

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
        except CheckpointError as verdict:
            if self._pipeline.group_lost is not None and _raw_collective(exc):
                # The loop's own collective failed (gloo's bare timeout) where dckpt's save
                # lost a rank: the same failure, and only dckpt's words name the rank.
                raise verdict from exc
            log.error("dckpt: while closing after an error: %r", verdict)
        except Exception as close_exc:  # the error already in flight matters more
            log.error("dckpt: while closing after an error: %r", close_exc)

    # --- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")
