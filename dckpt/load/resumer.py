"""The resume, in protocol order: ``Resumer``. This docstring is the resume protocol.

``resume()`` (and ``load()``, which is steps 2-5 for one durable step, without the config
check and without fallback) runs in the foreground on dckpt's *control* group, after any save
in flight is drained; never on the training group, except the warmup all-reduce, whose
purpose is to test that group. Every rank runs every step; a failure on any rank is raised on
every rank.

A checkpoint may live in more than one tier, under one lineage of steps. Each tier is one
value (``LoadTier``; dckpt.tier builds them): a ``CheckpointSource`` (where its candidates
are, and how their files are brought to where they are proven) with a reader (how a proven
candidate gets into the state), its name (the id its resume records carry) and its words
(how the report names it). The resumer never asks which tier it holds:

- the memory tier, when on (``MemorySource``, ``MemoryReader``: dckpt.load.memory): the steps
  of the root's ledger, proven in the nodes' memory, a lost node's files sent by the node that
  keeps its replica;
- the root (``LocalSource`` for a directory, ``ObjectSource`` for an s3:// root through its
  mirror, with ``DurableReader``: dckpt.load.durable).

1. **candidates**: rank 0 lists every tier's committed steps (``CheckpointSource.steps``);
   all ranks take its list, newest step first, the memory tier first on a tie (each tier's
   ``survey`` adds what the report says beyond them: steps in memory without a record). In
   the same broadcast, rank 0's reading of the root's resume records
   (dckpt.root.resume_record): a candidate whose newest records, for its very save, are
   failed loss watches from two different starts with no pass since is a *restart loop*.
   For each candidate, a fresh ``CandidateReport``; then its reader runs steps 2-5 (a
   restart loop: step 6 at once, nothing of it fetched or loaded);
2. **fetch and proof**: the durable tier's files are brought into the mirror (an s3:// root:
   each object hashed as it arrives, each cached copy re-verified); the manifest (schema,
   safe paths, self-digest), the layout and the verified ``.metadata``, then the ranks
   compare the manifest's digest of digests. A memory candidate's manifest comes from the
   root's ledger, its durable anchor is checked, each node proves its files in place and any
   it lacks arrive from the node that holds them, hashed as they arrive;
3. **config and precision** (``checks.CandidateChecks``): a readable diff, judged by the
   ``ConfigPolicy`` (dckpt.load.config_check): keys that shape the run raise
   ``ConfigMismatchError`` on every rank at once, the rest pass with warnings grouped by why;
   a precision change warns, or raises where fp16 would start loss scaling from scratch;
   then the kinds of state, the GradScaler record, and every tensor's shape and dtype, before
   any tensor is read;
4. **the load**: DCP loads model, optimizer, schedulers, scaler, data position and counters
   through the ``VerifyingReader`` (each file hashed whole and matched before a tensor is
   filled from it), and every rank checks every rank's digests against the manifest; a
   memory candidate is copied in by name, shape and dtype once every rank matched every
   tensor;
5. **RNG** last: restored per rank, or reseeded from (seed, step, rank) when the world size
   changed;
6. a candidate that fails 2-4 with evidence of damage is quarantined by its source (moved to
   ``quarantine/``; a memory step's record to ``memory/quarantine/``) and the next candidate
   is tried (``fallback=False``, ranks that disagree, and an incompatible checkpoint raise:
   a newer schema, or a ``.metadata`` another torch release wrote that this one cannot
   read); a file the storage fails to read with a media error (EIO) is read once more,
   afresh, and the same file failing again (``UnreadableError``) is damage for this start
   once an older step loads (the storage serves the others): then it is set aside with the
   command that restores it; a second such step, or no older step loading, stops the start
   with nothing set aside (the storage fails, not a step); one its tier cannot restore here
   (``CheckpointNotFoundError``: a memory copy lost with its replica, another world) is
   passed over, and the report says why; a restart
   loop is quarantined the same way, before it is loaded, with the reason ("resumed twice
   (attempts 3, 4) and the loss watch failed both times: ..."), on a line of its own in the
   report, and the next candidate is tried (``fallback=False`` raises instead;
   ``loss_watch="off"`` looks for none); a restart loop right after another was set aside,
   with no resume passing in between, is refused instead (a cause outside the checkpoints:
   quarantining the next would only walk the run back);
7. **warmup**: an all-reduce on the training group, whose result each rank checks; one
   all-reduce on dckpt's group says whether any sum was wrong, and only then does rank 0
   gather the results and word the error every rank raises;
8. **replay and loss watch**, handed to ``ResumeWatch`` (dckpt.load.watch), which the
   manager calls from then on: rank 0 reads the replay journal of the step resumed from
   (dckpt.root.replay_journal), and its ``observe()`` compares the steps the resumed run
   replays with the run that stopped (dckpt.load.replay; no collective); the loss watch is
   armed with the loss recorded at save time (a checkpoint without one: only
   a non-finite loss fails); ``observe()`` compares the next losses with it, and rank 0
   records the verdict, passed or failed, in the root (``.dckpt-resumes/step-N.json``; the
   bucket for an s3:// root; a memory step's beside the root's, with its tier) before it is
   logged or raised. A record that cannot be written is logged, never raised. With
   ``loss_watch="raise"`` the ranks agree on the verdicts on the control group before any is
   raised or recorded: every rank raises, or none;
9. the ``ResumeReport`` (the chosen candidate's checks and warnings, plus what was skipped) is
   logged as one block on rank 0 and returned. It names each config change that passed but
   that the restored state overrides (the optimizer's learning rate: dckpt.load.overrides),
   checked again at the first optimizer step; a fresh start names what the root holds that
   is not dckpt's (another checkpointer's files). Nothing loaded while a tier held this run's
   newer work it could not restore, or while quarantine holds checkpoints, is refused rather
   than a fresh start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ..collective.comm import Comm
from ..collective.world import WarmupResult, check_warmup, warmup_collective
from ..config import CheckpointConfig
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ForeignStepError,
    IncompatibleCheckpointError,
    IntegrityError,
    ManifestError,
    StorageError,
    UnreadableError,
    WorldError,
)
from ..faults import fault_point
from ..phases import Phase
from ..root.layout import step_dir_name
from ..root.resume_record import (
    REPLAY,
    ResumeRecord,
    ResumeRecords,
    failed_in_a_row,
    restart_loop,
)
from ..root.source import CheckpointSource
from ..tiers.memory_commit import Lineage
from ..train.state import TrainState
from ..units import human_bytes, plural
from .report import CandidateReport, LoadResult, ResumeReport
from .watch import ResumeWatch

__all__ = ["LoadResult", "LoadTier", "Reader", "Resumer"]

log = logging.getLogger("dckpt")

REREAD_PAUSE_S = 1.0
"""Between a media read error and the second read of that step: a blip passes in it."""


def _versions(state: TrainState) -> tuple[int, ...]:
    """The version counters of the model's parameters and buffers (a DTensor's local
    shard's): every in-place change bumps one."""
    tensors = [*state.model.parameters(), *state.model.buffers()]
    return tuple(getattr(t, "_local_tensor", t)._version for t in tensors)


class Reader(Protocol):
    def load(self, step: int, report: CandidateReport, *, with_config: bool) -> LoadResult:
        """Steps 2-5 for one candidate: prove it and load it into the state."""
        ...


class LoadTier(Protocol):
    """A tier as the resume sees it (dckpt.tier.Tier is one): where it finds checkpoints
    (``source``) and how it loads one (``reader``)."""

    @property
    def name(self) -> str:
        """Its one id: in ``save(tier=...)``, and in the resume records."""
        ...

    @property
    def words(self) -> str:
        """How the report names it ("root", "memory tier")."""
        ...

    @property
    def anchor(self) -> bool:
        """Whether the run's lineage rests on it (the root's tier): ``load()`` reads it."""
        ...

    @property
    def source(self) -> CheckpointSource: ...

    @property
    def reader(self) -> Reader: ...

    @property
    def survey(self) -> Callable[[], list[str]] | None:
        """Every rank, once per resume, before the candidates: what the report says about
        this tier beyond them (the memory tier: steps held in memory the root has no record
        of, never restored); None: nothing."""
        ...


class Resumer:
    """Loads and resumes for the manager; see the module docstring."""

    def __init__(
        self,
        *,
        ctl: Comm,
        config: CheckpointConfig,
        tiers: Sequence[LoadTier],
        records: ResumeRecords | None,
        foreign: Callable[[], list[str]],
        watch: ResumeWatch,
        lineage: Lineage,
        state: TrainState,
        notes: list[str] | None = None,
    ) -> None:
        self._ctl = ctl
        self._notes = list(notes or [])
        self._lost_peers: list[WorldError] = []
        """Said in every resume's report (the same on every rank): a tier off this start."""
        self._config = config
        self.tiers = list(tiers)
        """In the order a tie is broken (the memory tier before the root)."""
        self.anchor = next(t for t in tiers if t.anchor)
        """The tier the run's lineage rests on (the root's): what ``load()`` reads."""
        self.source = self.anchor.source
        self.watch = watch
        """What follows the resume (the replay, the loss watch, the overrides): armed at
        step 8, then the manager's (dckpt.load.watch)."""
        self._lineage = lineage
        self.rank, self.world_size = ctl.rank, ctl.world_size
        self.records = records
        self._foreign = foreign
        """What the root holds that dckpt did not write (a fresh start's report lists it)."""
        """Where every tier's resumes are recorded: the root's (dckpt.root.resume_record)."""
        self._state = state
        self._loaded: tuple[int, ...] = ()
        self._behind: Callable[[float], None] | None = None
        """What the last load left running (``LoadResult.behind``), until it is waited for."""
        self._untouched: tuple[int, str] | None = None
        """The step just loaded and its tier's name ("durable", "memory"), until the
        first optimizer step after it (or, for a state without an optimizer, ``observe()``):
        the same on every rank, so the re-save it skips is skipped on every rank."""

    def unchanged_since(self, step: int, tier: str) -> bool:
        """Whether ``step`` is the step just loaded from ``tier`` and nothing trained since:
        no optimizer step, and no in-place change of a parameter or buffer (version
        counters, the same on every rank for the same code; a write through ``.data`` is not
        seen)."""
        return self._untouched == (step, tier) and _versions(self._state) == self._loaded

    def _mark_loaded(self, step: int, tier: str, behind: Callable[[float], None] | None) -> None:
        self._untouched = (step, tier)
        self._loaded = _versions(self._state)
        self._behind = behind

    def settle(self) -> None:
        """Wait (within ``timeout_s``) for what the last load left running: before the state
        changes (``touched``), before a save, another resume, and at close."""
        behind, self._behind = self._behind, None
        if behind is not None:
            behind(self._config.timeout_s)

    def touched(self) -> None:
        """A step of training (the optimizer's step pre-hook), or, for a state without an
        optimizer, an ``observe()``: the loaded state is changing."""
        self.settle()
        self._untouched = None

    def latest_step(self) -> int | None:
        """The newest committed step under the root (as rank 0 sees it), or None."""
        step = None
        if self.rank == 0:
            steps = self.source.steps()
            step = steps[-1] if steps else None
        return self._ctl.broadcast(step)

    def load(self, step: int | None = None) -> LoadResult:
        """Steps 2-5 for the newest committed step of the root (or ``step``); no fallback,
        no config check. Raises CheckpointNotFoundError when there is nothing to load."""
        self.settle()
        self._ctl.begin("load")
        try:
            return self._load(step)
        except CheckpointError:
            raise
        except RuntimeError as exc:  # a wait on dckpt's group failed: name who is late
            lost = self._lost(exc)
            log.error("dckpt load: %s", lost)
            raise lost from exc
        finally:
            self._ctl.end()

    def _lost(self, exc: BaseException) -> WorldError:
        """A wait of this resume on dckpt's group failed (a gloo timeout after
        ``timeout_s``, or a peer whose connection closed): the error every surviving rank
        raises, naming the ranks behind and what each was doing when last heard of."""
        late = self._ctl.late()
        who = (
            f"{late} did not keep up"
            if late
            else "no rank is known to be behind (the failure may be this rank's own link)"
        )
        error = WorldError(
            f"the {self._ctl.op or 'resume'} stopped on rank {self.rank}: a wait on dckpt's "
            f"group failed ({str(exc).splitlines()[0][:200]}). {who}: frozen, on storage "
            f"slower than timeout_s ({self._config.timeout_s:.0f} s) allows, or gone. The "
            "state may be partly loaded: restart the job once that rank's host is healthy; "
            "it resumes from the newest checkpoint that passes every check."
        )
        self._lost_peers.append(error)  # each rank's own view: every rank logs it
        return error

    def _load(self, step: int | None) -> LoadResult:
        chosen: int | str | None = None
        if self.rank == 0:
            steps = self.source.steps()
            if step is None:
                chosen = steps[-1] if steps else "none"
            else:
                chosen = step if step in steps else "none"
        chosen = self._ctl.broadcast(chosen)
        if not isinstance(chosen, int):
            where = "any step" if step is None else f"step {step}"
            raise CheckpointNotFoundError(
                f"no committed checkpoint for {where} under {self.source}; "
                "run `dckpt ls` on it to see what is there"
            )
        report = CandidateReport(chosen, self._path(self.anchor, chosen))
        result = self.anchor.reader.load(chosen, report, with_config=False)
        self._lineage.resumed(result.manifest)
        self._mark_loaded(result.step, self.anchor.name, result.behind)
        self.watch.reset()
        if self.rank == 0:
            log.info(
                "dckpt: loaded step %d | %s | %d of %d files verified (%s), ranks agree | "
                "%.3f s%s | %s/s | %s",
                result.step,
                human_bytes(result.bytes),
                result.files_verified,
                len(result.manifest.files),
                result.manifest.digest_algorithm,
                result.seconds,
                "".join(f", {k} {v:.3f} s" for k, v in result.times.items()),
                human_bytes(result.bytes / max(result.seconds, 1e-9)),
                result.path,
            )
        return result

    def resume(self, fallback: bool, *, allow_fresh: bool = False) -> ResumeReport:
        """Steps 1-9; returns the logged report (``report.resumed`` is False on a fresh
        start). A refusal is logged once, as one block, on rank 0, and raised on every rank
        (so a script can exit without a traceback per rank: dckpt already said why).
        ``allow_fresh``: where nothing of this run's work could be restored, start from
        scratch with a warning instead of refusing (``_nothing_loaded``)."""
        skipped: list[tuple[int, str]] = []
        looped: list[tuple[int, str]] = []
        self.settle()
        self._ctl.begin("resume")
        try:
            try:
                return self._resume(fallback, skipped, looped, allow_fresh)
            except CheckpointError:
                raise
            except RuntimeError as exc:  # a wait on dckpt's group failed: name who is late
                raise self._lost(exc) from exc
            finally:
                self._ctl.end()
        except CheckpointError as exc:
            if self.rank == 0 or exc in self._lost_peers:  # rank 0 may be the one lost
                lines = [f"dckpt resume: REFUSED ({type(exc).__name__})"]
                lines += [f"  {line}" for line in str(exc).splitlines()]
                lines += [f"  restart loop: step {s} quarantined, {why}" for s, why in looped]
                lines += [f"  skipped step {s} (quarantined): {why}" for s, why in skipped]
                log.error("%s", "\n".join(lines))
            raise

    def _resume(
        self,
        fallback: bool,
        skipped: list[tuple[int, str]],
        looped: list[tuple[int, str]],
        allow_fresh: bool = False,
    ) -> ResumeReport:
        t0 = time.perf_counter()
        self._ctl.mark("listing the candidates")
        candidates, loops, cascades = self._candidates()  # 1
        chosen: CandidateReport | None = None
        result: LoadResult | None = None
        passed: list[str] = []
        foreign: list[int] = []
        surveyed = [note for tier in self.tiers if tier.survey for note in tier.survey()]
        self.watch.forget()
        # A step with a file read twice in vain: set aside only once an older step loads
        # (the storage serves the others), else nothing moves.
        unreadable: tuple[LoadTier, int, UnreadableError] | None = None
        for step, index in candidates:
            tier = self.tiers[index]
            loop = loops.get((step, index))
            if loop is not None:  # 6: a restart loop, set aside before any of it is read
                if (step, index) in cascades:
                    self._refuse_cascade(tier, step, loop, cascades[(step, index)])
                self._restart_loop(tier, step, loop, fallback)
                looped.append((step, loop))
                continue
            self._ctl.mark(f"step {step} from the {tier.words}")
            try:
                result, candidate = self._load_twice(tier, step)  # 2-5
                if unreadable is not None:
                    gone_tier, gone, why = unreadable
                    line = f"UnreadableError: {str(why).split(': the storage')[0]}"
                    if gone_tier.name == tier.name:  # proof now: its storage serves an older step
                        reason = self._unreadable_reason(why, gone)
                        self._quarantine(gone_tier, gone, reason, why)
                        skipped.append((gone, line))
                    else:  # another tier's storage proves nothing of that one's: left alone
                        passed.append(
                            f"{gone_tier.words}: step {gone} not used: {line} (not set aside: "
                            "no older step of that tier loaded)"
                        )
                chosen = candidate
                self._mark_loaded(step, tier.name, result.behind)
                self.watch.loaded(step, tier.name, result.manifest.save_id)
                break
            except CheckpointNotFoundError as exc:  # 6: this tier cannot restore it here
                passed.append(f"{tier.words}: step {step} not used: {exc}")
                if isinstance(exc, ForeignStepError):  # another user's: never moved
                    foreign.append(step)
            except UnreadableError as exc:  # 6: a file the storage failed twice
                if not fallback or unreadable is not None:
                    before = None if unreadable is None else unreadable[1]
                    raise self._unreadable_refusal(exc, step, before) from exc
                unreadable = (tier, step, exc)  # set aside (and reported) once one loads
            except (IntegrityError, ManifestError) as exc:  # 6
                # Only evidence of damage moves a checkpoint aside: not a newer schema, and
                # not ranks that disagree (that would quietly pick one rank's view).
                divergent = isinstance(exc, IntegrityError) and exc.divergent
                if not fallback or divergent or isinstance(exc, IncompatibleCheckpointError):
                    raise
                self._quarantine(tier, step, f"{type(exc).__name__}: {exc}", exc)
                # The report keeps the first sentence; the reason file has it all.
                skipped.append((step, f"{type(exc).__name__}: {str(exc).split('. ')[0]}"))
        if result is None and unreadable is not None:  # no proof that the storage serves
            _, gone, why = unreadable
            raise self._unreadable_refusal(why, gone, None, alone=True)
        report = ResumeReport.of(chosen, skipped, self.world_size, looped)
        report.warnings.extend([*self._notes, *passed, *surveyed])
        if result is None:
            self._nothing_loaded(report, len(candidates), passed, allow_fresh, foreign)
            return report
        self._lineage.resumed(result.manifest)
        self.watch.overrides(report)
        t_loaded = time.perf_counter()
        if self._config.warmup and self._ctl.distributed:  # 7
            self._ctl.mark("the warmup all-reduce")
            nonce = f"{self._ctl.keys}/{result.manifest.save_id}"  # the job's token first
            mine = warmup_collective(nonce, self._config.timeout_s)
            report.check("warmup all-reduce", True, self._agree_on_warmup(mine))
        report.timings = {
            "load_and_verify": t_loaded - t0,
            **result.times,  # of it, rank 0's reading: the rest is checks and agreements
            "warmup": time.perf_counter() - t_loaded,
            "total": time.perf_counter() - t0,
        }
        self.watch.arm(result, report, self._ctl)  # 8
        if self.rank == 0:  # 9
            log.info("%s", report.format())
        return report

    def _load_twice(self, tier: LoadTier, step: int) -> tuple[LoadResult, CandidateReport]:
        """Steps 2-5 for one candidate, and its report. A read the storage failed with a
        media error (EIO: ``StorageError.media``; every rank raises the same, naming the rank
        and the file) is read once more, afresh (after ``REREAD_PAUSE_S``, any local copy of
        the file dropped: ``Fetcher.forget``): a transient fault passes. The same
        file failing again is ``UnreadableError``, evidence of damage that ``_resume`` acts
        on only once an older step loads; any other failure is raised as it is."""
        candidate = CandidateReport(step, self._path(tier, step), tier.source.origin(step))
        try:
            return tier.reader.load(step, candidate, with_config=True), candidate
        except StorageError as exc:
            if not exc.media or not exc.path:
                raise
            first = exc
        if self.rank == 0:
            log.warning(
                "dckpt resume: %s; reading step %d again, afresh, before it counts",
                str(first).split(": the storage")[0],
                step,
            )
        self._ctl.mark(f"step {step} from the {tier.words}, read again")
        fetcher = tier.source.fetcher  # a source read in place has no copy to drop
        if fetcher is not None:
            try:
                fetcher.forget(step, first.path)  # every rank: its node's copy, if any
            except OSError as exc:
                log.warning("dckpt: could not drop the local copy of %s: %s", first.path, exc)
        time.sleep(REREAD_PAUSE_S)  # every rank alike: the same collectives follow
        candidate = CandidateReport(step, self._path(tier, step), tier.source.origin(step))
        candidate.warnings.append(
            f"{str(first).split(': the storage')[0]}; read again, afresh, and it served it"
        )
        try:
            return tier.reader.load(step, candidate, with_config=True), candidate
        except StorageError as exc:
            if not exc.media or exc.path != first.path:
                raise
            again = UnreadableError(
                f"{str(exc).split(': the storage')[0]}, twice (the second time afresh, "
                f"{REREAD_PAUSE_S:g} s later): the storage cannot serve this file (a lost "
                "sector, a file system's checksum)"
            )
            again.path, again.media = exc.path, True
            raise again from exc

    def _unreadable_reason(self, exc: UnreadableError, step: int) -> str:
        """Why a step is set aside for a file the storage failed twice while it served an
        older step, and how to put it back (the bytes may come back with the storage)."""
        return (
            f"{exc}, while it served an older step. Set aside so the run resumes the step "
            "before; the bytes may still be there: once the storage serves the file again "
            f"(check the disk and the file system: dmesg, a scrub), put it back with: dckpt "
            f"restore {self.source} {step}"
        )

    def _unreadable_refusal(
        self, exc: UnreadableError, step: int, before: int | None, *, alone: bool = False
    ) -> UnreadableError:
        """The error every rank raises when a step's file cannot be read twice and nothing
        is set aside: fallback is off; or an older step failed so too (the storage fails
        beyond one checkpoint: setting more aside would walk the run back through good
        steps); or (``alone``) no older step loaded to show that the storage serves."""
        if before is not None:
            then = (
                f"step {before}'s file failed the same way, so the storage fails beyond one "
                "checkpoint and nothing was set aside: check the storage (dmesg, the file "
                "system), then start again"
            )
        elif alone:
            then = (
                "no older step loaded to show that the storage serves the others, so nothing "
                "was set aside: check the storage, then start again; to resume without it, set "
                f"it aside by hand: dckpt set-aside {self.source} {step}"
            )
        else:
            then = (
                f"fallback is off, so step {step} is not set aside: set it aside by hand "
                f"(dckpt set-aside {self.source} {step}) or start with fallback on, to resume "
                "the step before"
            )
        refusal = UnreadableError(f"{exc}; {then}")
        refusal.path, refusal.media = exc.path, True
        return refusal

    def _agree_on_warmup(self, mine: WarmupResult) -> str:
        """Step 7's verdict, the same on every rank: the report line, or the WorldError
        naming each rank whose sum was wrong, raised on every rank. Each rank checks its own
        sum, and one all-reduce (``Comm.lowest``) says whether any was wrong, whatever the
        world's size; only then do the results go to rank 0, which words the error
        (``check_warmup``) for every rank."""
        if self._ctl.lowest(not mine.ok) is None:
            return (
                f"{plural(self.world_size, 'rank')} answered, sum {mine.value:g} = "
                f"{mine.expected:g} on every rank, {mine.latency_s * 1000:.1f} ms on rank "
                f"{self.rank}"
            )
        every = self._ctl.gather(mine)
        words: str | None = None
        if every is not None:
            try:
                check_warmup(every)
            except WorldError as exc:
                words = str(exc)
        raise WorldError(self._ctl.broadcast(words) or "the warmup all-reduce summed wrong")

    # --- the steps --------------------------------------------------------------------------

    def _path(self, tier: LoadTier, step: int) -> Path:
        return tier.source.local / step_dir_name(step)

    def _candidates(
        self,
    ) -> tuple[list[tuple[int, int]], dict[tuple[int, int], str], dict[tuple[int, int], int]]:
        """Every tier's committed steps as (step, tier index), newest first, ties to the
        tier listed first; the restart loops among them, with their reasons, and those that
        continue a loop set aside before, by the step it set aside (one broadcast)."""
        listing: list[tuple[int, int]] | CheckpointError = []
        loops: dict[tuple[int, int], str] = {}
        cascades: dict[tuple[int, int], int] = {}
        if self.rank == 0:
            try:
                fault_point(Phase.LIST_STEPS, 0)
                listing = sorted(
                    ((step, i) for i, t in enumerate(self.tiers) for step in t.source.steps()),
                    key=lambda c: (-c[0], c[1]),
                )
            except OSError as exc:
                listing = StorageError(f"cannot list {self.source}: {exc}")
            except CheckpointError as exc:
                listing = exc
            else:
                loops, cascades = self._restart_loops(listing)
        listing, loops, cascades = self._ctl.broadcast((listing, loops, cascades))
        if isinstance(listing, CheckpointError):
            raise listing
        return listing, loops, cascades

    def _restart_loops(
        self, listing: list[tuple[int, int]]
    ) -> tuple[dict[tuple[int, int], str], dict[tuple[int, int], int]]:
        """Rank 0: the candidates whose own records (their tier, their save id) end in
        replays that differed, from two starts; see dckpt.root.resume_record. One listing of
        the records, one read per candidate that has any, a manifest read per suspect.
        Records that cannot be read are logged and looked past: they guard, never block.
        Also the loops that continue one set aside before (``_continued``), by the step it
        set aside: those are refused, not quarantined."""
        if self.records is None or self._config.replay_check == "off" or not listing:
            return {}, {}
        loops: dict[tuple[int, int], str] = {}
        cascades: dict[tuple[int, int], int] = {}
        try:
            recorded = set(self.records.steps())
            for step, index in listing:
                if step not in recorded:
                    continue
                tier = self.tiers[index]
                mine = [r for r in self.records.read(step) if r.tier == tier.name]
                if restart_loop(mine) is None:
                    continue
                try:  # the records are about one save of this step: is it this one?
                    save_id = tier.source.save_id(step)
                except (OSError, ValueError, CheckpointError):
                    continue  # its manifest is unreadable: the load says why
                same = [r for r in mine if r.save_id == save_id]
                reason = restart_loop(same)
                if reason is not None:
                    loops[(step, index)] = reason
                    listed = {s for s, _ in listing}
                    before = self._continued(step, failed_in_a_row(same), recorded, listed)
                    if before is not None:
                        cascades[(step, index)] = before
        except (OSError, ValueError, CheckpointError) as exc:
            log.warning(
                "dckpt resume: cannot read the resume records in %s (%s); no restart loop is "
                "looked for in this resume",
                self.records,
                exc,
            )
        return loops, cascades

    def _continued(
        self, step: int, row: list[ResumeRecord], recorded: set[int], listed: set[int]
    ) -> int | None:
        """Rank 0: the newer step a restart loop set aside (its records end in one, and it
        is no longer a candidate) whose last failure came before every failure of ``step``'s
        row, with no resume of any step passing in between; None if there is none. Then
        ``step``'s failures continue that loop: checkpoint after checkpoint failing alike
        points at a cause outside them, and quarantining the next would only walk the run
        back. Reads every step's records, but only here, once a loop was found."""
        newer = sorted((s for s in recorded if s > step and s not in listed), reverse=True)
        if not newer or not row:
            return None
        first = min(r.time for r in row)
        kept = {s: self.records.read(s) for s in recorded} if self.records is not None else {}
        for later in newer:
            groups: dict[tuple[str, str], list[ResumeRecord]] = {}
            for record in kept.get(later, []):
                groups.setdefault((record.tier, record.save_id), []).append(record)
            for group in groups.values():
                if restart_loop(group) is None:
                    continue
                aside = max(r.time for r in group if not r.ok and r.kind == REPLAY)
                recovered = any(
                    r.ok and aside < r.time < first for records in kept.values() for r in records
                )
                if aside <= first and not recovered:
                    return later
        return None

    def _forget(self, step: int) -> str:
        """The one command that removes ``step``'s resume records (a refusal says it)."""
        return "" if self.records is None else self.records.forget(step)

    def _refuse_cascade(self, tier: LoadTier, step: int, loop: str, before: int) -> None:
        """A restart loop right after another was set aside: refused on every rank."""
        raise CheckpointError(
            f"step {step} ({tier.words}) is a restart loop too ({loop}), right after step "
            f"{before} was set aside as one, with no replay matching in between. Checkpoint "
            "after checkpoint differing alike points at a cause outside them (a faulty node "
            "or GPU, the data, a change to the code or the config), so nothing more is "
            "quarantined and this resume is refused. Fix the cause, then start again after "
            f"this command, which lets step {step} be resumed again: {self._forget(step)} "
            f"(step {before} is in quarantine/ with its reason)"
        )

    def _restart_loop(self, tier: LoadTier, step: int, loop: str, fallback: bool) -> None:
        """Step 6 for a restart loop: quarantined with its reason (or, without fallback, the
        resume refused), on every rank."""
        where = "" if self.records is None else self.records.where(step)
        if not fallback:
            raise CheckpointError(
                f"step {step} ({tier.words}) is a restart loop: {loop}. With fallback=False it "
                "is neither resumed a third time nor fallen back past. Resume with fallback, "
                f"or fix the cause and run: {self._forget(step)}"
            )
        self._quarantine(
            tier,
            step,
            f"restart loop: {loop}. Resuming it again would fail the same way; to try it "
            f"anyway once the cause is fixed, restore it (dckpt restore {self.source} {step}) "
            f"and remove its resume records ({where})",
        )

    def _nothing_loaded(
        self,
        report: ResumeReport,
        candidates: int,
        passed: list[str],
        allow_fresh: bool,
        foreign: Sequence[int] = (),
    ) -> None:
        """A fresh start, or an error when every candidate failed, when a tier holds this
        run's work it could not restore, or when only quarantine holds checkpoints (starting
        over would silently throw that run away). Each error names every step's verdict and
        how to start over on purpose; ``allow_fresh`` starts over, saying so, instead."""
        refusal = self._why_not_fresh(report, candidates, passed, foreign)
        if refusal is not None and report.skipped:
            # The failed loads may have filled tensors: no fresh start trains on that state.
            # The steps are in quarantine/ now, so the next start reads nothing of them.
            again = "start again with manager.resume(allow_fresh=True) to train from scratch"
            raise CheckpointError(
                f"{refusal} To train from scratch here anyway: rebuild the model and the "
                f"optimizer (the failed loads may have written into them), then {again}."
                if allow_fresh
                else f"{refusal} To train from scratch here anyway, on purpose: rebuild the "
                f"model and {again} (the steps set aside stay where they are)."
            )
        if refusal is not None and not allow_fresh:
            raise CheckpointError(
                f"{refusal} To train from scratch here anyway, on purpose: "
                "manager.resume(allow_fresh=True) (the steps set aside stay where they are)."
            )
        if self.rank == 0:
            report.foreign = self._foreign()
            if refusal is not None:
                log.warning(
                    "dckpt: starting from scratch (allow_fresh=True) although %s",
                    refusal[0].lower() + refusal[1:],
                )
            log.info("%s", report.format())

    def _why_not_fresh(
        self,
        report: ResumeReport,
        candidates: int,
        passed: list[str],
        foreign: Sequence[int] = (),
    ) -> str | None:
        """Why a fresh start would throw this run's work away, with each step's verdict;
        None when nothing of it is known (an empty root). The same on every rank."""
        verdicts = [
            *(f"step {s}: restart loop ({why})" for s, why in report.restart_loops),
            *(f"step {s}: {why}" for s, why in report.skipped),
        ]
        listed = "; ".join(verdicts[:8]) + (
            f"; and {len(verdicts) - 8} more" if len(verdicts) > 8 else ""
        )
        if report.restart_loops:
            newest = max(s for s, _ in report.restart_loops)
            return (
                f"no checkpoint under {self.source} could be resumed: {listed}. The restart "
                "loops were quarantined (their last two replays differed from the run that "
                "stopped) and no older step loaded; starting from scratch would silently throw "
                f"that run away. Fix the cause, then put step {newest} back "
                f"(dckpt restore {self.source} {newest}) and run: {self._forget(newest)}."
            )
        if report.skipped:
            return (
                f"none of the {candidates} committed checkpoints under {self.source} passed "
                f"verification: {listed}. All were moved to quarantine/, where they stay. The "
                "model may be partly overwritten by the failed attempts: rebuild it before "
                "training. Restore a good copy, or start a new run elsewhere."
            )
        if passed and len(foreign) == len(passed):
            return (
                f"every committed step under {self.source} that could be resumed is another "
                f"user's or not signed by this job ({'; '.join(passed[:4])}"
                f"{f'; and {len(passed) - 4} more' if len(passed) > 4 else ''}): dckpt "
                "resumes only the job's own, and saving beside them would mix two runs in "
                "one root. Give this run a root of its own (a new --ckpt-dir), or remove "
                f"step(s) {', '.join(map(str, foreign))} if you know where they came from."
            )
        if passed:
            return (
                f"this run's work is recorded ({'; '.join(passed)}), none of it could be "
                f"restored, and {self.source} has no durable checkpoint: starting from scratch "
                "would silently throw that run away. Bring the lost node back, or remove the "
                "records (dckpt memory clear ROOT --records) to really start over."
            )
        quarantined = self._ctl.broadcast(self._quarantined_count() if self.rank == 0 else 0)
        if quarantined:
            return (
                f"{self.source} has no committed checkpoint but {quarantined} in quarantine/: "
                "starting from scratch would silently throw that run away. Inspect them "
                f"(dckpt ls {self.source}), restore one (dckpt restore {self.source} STEP), or "
                "remove quarantine/ to really start over."
            )
        return None

    def _quarantined_count(self) -> int:
        return sum(t.source.quarantined_count() for t in self.tiers)

    def _quarantine(
        self, tier: LoadTier, step: int, reason: str, exc: CheckpointError | None = None
    ) -> None:
        error: tuple[bool, str] | None = None  # (a storage's failure?, its words)
        if self.rank == 0:
            try:
                # with the damage as proof: a local fault raises StorageError
                tier.source.quarantine(step, reason, exc)
            except (OSError, ValueError, CheckpointError) as failed:
                local = isinstance(failed, (OSError, StorageError))
                error = (local, f"could not quarantine step {step}: {failed}")
        error = self._ctl.broadcast(error)
        if error is not None:
            local, words = error
            raise StorageError(words) if local else CheckpointError(words)
