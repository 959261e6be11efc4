"""The collectives dckpt itself runs, on a group of its own, with a timeout.

dckpt never runs collectives on the training process group: it creates a dedicated gloo group
(CPU, works beside NCCL) at construction, on the main thread, and every collective it issues
goes there. The group connects lazily (a pair of ranks on its first message), so building it
costs each rank the same few store calls at any world size. With no process group
initialised, the same calls work for a single process.

``first_failure`` is how ranks agree on whether a step failed anywhere, and on which error
they all raise: one reduction of two ints when nothing failed (the common case costs every
rank the same at 2 ranks or 4096), and only on failure the lowest failing rank's error,
sent from that rank alone. So no rank waits at a later collective for a rank that gave up,
and no rank's message depends on which ranks it happened to hear from.

The agreements (``any``, ``lowest``, ``all_equal``, ``first_failure``) reduce a few ints along
a binomial tree and broadcast the result (``_reduce``): their latency grows with log2 of the
world, not with the world as gloo's ring all-reduce does. ``gather`` is for what rank 0 alone
needs; ``all_gather`` hands every rank N objects and is kept for what every rank must see.

After a failed wait, ``late`` names the ranks to blame, from what each rank keeps in the
job's store while a save or a resume runs (``begin`` to ``end``): a heartbeat every
``beat_s`` that also says where the rank is (how many of this group's collectives it
entered, since when, its host), and a mark per phase. A rank whose beat stood still is
*silent*; one whose beat moves but which has not reached where the others wait is *slow*.
Nothing of it runs in a collective: the beat's thread reads a few fields, and the reading
happens on a failure only.

Every agreement's box has the same size, whatever it carries, plus a tag (the agreement's
number on this ``Comm`` and its width): ranks that reached different agreements, a dckpt bug,
get a ``DivergedError`` on every rank that names both, where boxes of different sizes made
gloo abort the process on its network thread, with no word of where.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import xxhash

from ..errors import CheckpointError
from ..units import plural
from . import sealed
from .store import StoreUnreachableError, call, default_store

__all__ = ["Comm", "DivergedError", "Failed"]

T = TypeVar("T")


@dataclass(frozen=True)
class Failed:
    """What every rank learns from ``Comm.first_failure`` when some rank failed."""

    rank: int
    """The lowest rank that failed."""
    error: BaseException
    """That rank's error (on the other ranks, its unpickled copy)."""
    count: int
    """How many ranks failed."""


RETRY_S = 0.2
"""How soon a meeting claims again after the store did not answer (calls fail at once while
the one that timed out still waits: dckpt.collective.store)."""


def _until(end: float, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (store calls), made again while the store does not answer and the
    monotonic ``end`` is ahead; the last ``StoreUnreachableError`` once it is not."""
    while True:
        try:
            return fn(*args)
        except StoreUnreachableError:
            left = end - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(RETRY_S, left))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling both ways, else a CheckpointError carrying its text.
    An exception the sender can pickle but the receivers cannot rebuild (an ``__init__``
    with other arguments than its ``args``) would fail on the receivers only."""
    try:  # a deep copy rebuilds it as unpickling would (``__reduce_ex__``), locally
        copy.deepcopy(exc)
    except Exception:
        return CheckpointError(f"{type(exc).__name__}: {exc}")
    return exc


def _beat(key: str, every_s: float, stop: threading.Event, say: Callable[[], str]) -> None:
    """A rank's heartbeat: a counter in the job's store, moved every ``every_s``, with where
    this rank is (``say``: ``Comm._position``), so a survivor tells a rank that moves but
    lags from one that waits like itself."""
    store = default_store()
    n = 0
    while not stop.is_set():
        n += 1
        with contextlib.suppress(Exception):  # a hint: a store that fails is ignored
            sealed.put(store, key, f"{n}|{say()}")
        stop.wait(every_s)


@dataclass(frozen=True)
class _Heard:
    """A rank's heartbeat as ``Comm.late`` reads it (``Comm._position`` wrote it): the
    durations are on that rank's own clock, so no two hosts' clocks are compared."""

    entered: int
    """The collectives of this group it entered so far (every rank enters the same ones,
    in the same order: one that entered fewer has not reached where the others wait)."""
    since_entered: float
    """Seconds since it entered the last of them."""
    since_mark: float
    """Seconds since its last mark (``Comm.mark``)."""
    host: str
    op: str
    """The operation it was beating for (another than the observer's: it has not begun
    that one)."""

    @staticmethod
    def parse(value: str | None) -> _Heard | None:
        try:
            _, entered, since_entered, since_mark, host, op = (value or "").split("|", 5)
            return _Heard(int(entered), float(since_entered), float(since_mark), host, op)
        except ValueError:  # absent, or written by an older dckpt: nothing to say
            return None


_HOST = socket.gethostname()
LAZY_INIT_ENV = "TORCH_GLOO_LAZY_INIT"
_GONE = "gone"  # a meeting the first to arrive gave up on (``Comm.meet``)
_WIDTH = 4  # ints in every agreement's box (the widest carries 2), then the tag and its negation


@contextlib.contextmanager
def _lazy_gloo() -> Iterator[None]:
    """Build gloo groups that connect a pair of ranks on its first message, not all pairs at
    construction: an eager group costs each rank N address exchanges through the job's store
    (minutes at thousands of ranks), a lazy one a few store calls at any N, and each rank then
    connects only to the peers its collectives use. gloo reads the variable when the group is
    made; a value the user set is left as it is."""
    if LAZY_INIT_ENV in os.environ:
        yield
        return
    os.environ[LAZY_INIT_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_INIT_ENV, None)


class DivergedError(CheckpointError):
    """The ranks reached different agreements: a bug in dckpt, never the user's."""

    def __init__(self, tag: int, lowest: int, highest: int) -> None:
        def name(t: int) -> str:
            return f"agreement #{t // 8} (of {t % 8} ints)"

        super().__init__(
            f"dckpt's ranks took different paths: this rank reached {name(tag)}, the ranks "
            f"ranged from {name(lowest)} to {name(highest)}. This is a bug in dckpt: please "
            "report it with every rank's log. No rank can go on with dckpt's collectives; the "
            "newest committed checkpoint is intact."
        )
        self.tag, self.lowest, self.highest = tag, lowest, highest


class Comm:
    """Object collectives on dckpt's own gloo group (or a single process)."""

    def __init__(self, timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self._op = ""  # what this rank is doing on this group (``begin``, ``mark``)
        self._phase = 0
        self._t0 = self._marked_at = self._entered_at = time.monotonic()
        self._entered = 0  # collectives entered on this group (``_enter``), read by the beat
        self._beating: threading.Event | None = None
        if not self.distributed:
            self.group: dist.ProcessGroup | None = None
            self.rank, self.world_size = 0, 1
            self.keys = "dckpt"
            return
        if group is None:
            # Same ranks as the default group; gloo so it carries CPU objects beside NCCL.
            with _lazy_gloo():
                group = dist.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
                )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.keys = "dckpt"
        """The prefix of every key dckpt puts in the job's store for this group (meetings,
        progress markers, stop flags, the gate): ``dckpt/<name>`` once the manager agreed on
        a random token (``use_token``), whose values are sealed with it (``sealed``)."""
        self._met: dict[int, int] = {}  # meetings with each peer so far (``meet``)
        self._agreements = 0  # ``_reduce`` calls so far: the same count on every rank

    def use_token(self, token: str) -> None:
        """Seal this group's store values with ``token``, and put its keys under a name
        derived from it (``sealed.register``): a secret rank 0 drew at random and sent over
        dckpt's own group (never through the store), the same on every rank. The job's store
        (torch's TCPStore) shows its keys to, and takes writes from, anyone who reaches its
        port: the name keeps two jobs' (two managers') keys apart, and the seal makes a value
        planted under them read as absent, named in a warning (``dckpt.collective.sealed``)."""
        self.keys = sealed.register(token)

    @property
    def op(self) -> str:
        """The operation ``begin`` last started on this group ("" before any)."""
        return self._op

    def begin(self, op: str) -> None:
        """This rank starts ``op`` (a resume, a save) on this group: its phase marks
        (``mark``) count from here, and a heartbeat thread sets this rank's beat in the job's
        store every ``beat_s`` until ``end``, with where the rank is (``_position``), so
        ``late`` can tell a frozen or gone rank (its beat stands still) and a slow one (its
        beat moves, its position lags) from one that waits like this one."""
        self._op, self._phase, self._t0 = op, 0, time.monotonic()
        self.mark("started")
        if self.distributed and self._beating is None:
            stop = threading.Event()
            self._beating = stop
            key = self._beat_key(self.rank)
            threading.Thread(
                target=_beat,
                args=(key, self.beat_s, stop, self._position),
                name="dckpt-beat",
                daemon=True,
            ).start()

    def end(self) -> None:
        """``op`` ended on this rank: its heartbeat stops (its marks stay until the next)."""
        if self._beating is not None:
            self._beating.set()
            self._beating = None

    @property
    def beat_s(self) -> float:
        """The heartbeat's interval: 0.5 s up to 1000 ranks, longer beyond (at most 5 s), so
        the store takes about 2000 beats a second whatever the world's size, and a survivor
        tells a silent rank within about a second of the failure."""
        return min(5.0, max(0.5, self.world_size / 2000))

    def mark(self, phase: str) -> None:
        """This rank reached ``phase`` of the operation ``begin`` started: one store key per
        rank, overwritten (its number, its name, seconds into the operation). A hint only:
        a store that fails is ignored."""
        if not self.distributed:
            return
        self._phase += 1
        self._marked_at = now = time.monotonic()
        value = f"{self._phase}|{now - self._t0:.1f}|{phase}"
        with contextlib.suppress(Exception):
            sealed.put(default_store(), f"{self.keys}/at/{self._op}/{self.rank}", value)

    def _beat_key(self, rank: int) -> str:
        """``rank``'s heartbeat on this group: dckpt's two groups beat apart (a save in
        flight on one says nothing of where a rank is on the other)."""
        assert self.group is not None
        return f"{self.keys}/beat/{self.group.group_name}/{rank}"

    def _position(self) -> str:
        """Where this rank is, for its heartbeat (``_Heard`` reads it back): the collectives
        of this group it entered, seconds since the last of them and since its last mark,
        its host, its operation. A few plain reads, on the beat's thread, every ``beat_s``:
        nothing is added to a collective or to a mark."""
        now = time.monotonic()
        return (
            f"{self._entered}|{now - self._entered_at:.1f}|{now - self._marked_at:.1f}|"
            f"{_HOST}|{self._op}"
        )

    def _enter(self) -> None:
        """This rank enters a collective of this group: counted, for ``late`` (every rank
        enters the same ones in the same order, so the counts of ranks that reached the
        same point are equal). Only the calls every rank makes count (not ``meet``, whose
        pairs differ)."""
        self._entered_at = time.monotonic()
        self._entered += 1

    def late(self) -> str:
        """After a wait on this group failed: the ranks that stopped answering or fell
        behind, each with its host, what it was doing and for how long ("" when none is
        known). Words only: nothing is decided on them.

        *Silent*: its heartbeat did not move over two of its intervals, watched here (no
        clock of another host is read): frozen, or gone. *Slow*: its heartbeat moves, but it
        has not reached where the furthest rank is: it entered fewer of this group's
        collectives (or as many, and passed fewer of the operation's marks). Alive, and
        still at its own phase: storage slower than ``timeout_s`` allows, or a rank held up.
        A rank that waits like this one is neither. Silent ranks are named first. A rank
        that never began this operation (it is elsewhere in its loop: the loss watch's
        agreement begins its own) reads as silent, "it never began" it.

        Reads every rank's mark and heartbeat (twice, ``2 * beat_s`` apart), on a failure
        only: a few store calls when every rank's keys exist, the usual case."""
        if not self.distributed or not self._op:
            return ""
        ranks = list(self._ranks())
        beats = [self._beat_key(r) for r in ranks]
        try:
            store = default_store()
            # sealed: a mark or beat planted by a writer outside the job reads as absent
            marks = sealed.get_many(store, [f"{self.keys}/at/{self._op}/{r}" for r in ranks])
            first = sealed.get_many(store, beats)
            time.sleep(2 * self.beat_s + 0.2)
            again = sealed.get_many(store, beats)
        except Exception:
            return ""
        # where each rank was when this wait failed (the first look): a slow rank that
        # arrives during the watch was still behind when it counted
        heard = [_Heard.parse(value) for value in first]
        phases = [int(m.split("|", 1)[0]) if m else 0 for m in marks]
        where = [(h.entered if h is not None else -1, phases[r]) for r, h in enumerate(heard)]
        furthest = max(where)
        silent = [r for r in ranks if r != self.rank and first[r] == again[r]]
        slow = {
            r: h
            for r, h in enumerate(heard[r] or _Heard.parse(again[r]) for r in ranks)
            if r != self.rank and r not in silent and h is not None and where[r] < furthest
        }
        # How long the live ranks furthest on have been there (each on its own clock).
        ahead = [
            h
            for r, h in enumerate(heard)
            if h is not None and where[r] == furthest and r not in silent
        ]
        waited = max((h.since_entered for h in ahead), default=0.0)
        words = [self._silent(r, marks[r], heard[r]) for r in silent]
        for r, h in sorted(slow.items(), key=lambda item: where[item[0]]):  # furthest back first
            short = furthest[0] - where[r][0]
            if heard[r] is None:
                gap = f"it had not begun the {self._op} when this rank's wait failed"
            elif short > 0:
                gap = (
                    f"{plural(short, 'collective')} of dckpt's group short of the furthest "
                    f"rank, which has waited {waited:.1f} s"
                )
            else:
                gap = (
                    f"{plural(furthest[1] - where[r][1], 'phase')} of the {self._op} behind "
                    "the furthest rank"
                )
            words.append(self._slow(r, marks[r], h, gap))
        # silent ranks first (a rank that stopped outranks one that lags), at most 8 named
        more = f" and {len(words) - 8} more" if len(words) > 8 else ""
        return ", ".join(words[:8]) + more

    def _silent(self, rank: int, mark: str | None, heard: _Heard | None) -> str:
        host = f"; on host {heard.host}" if heard is not None else ""
        if heard is not None and heard.op != self._op:
            return (
                f"rank {rank} (silent: its heartbeat stood still{host}; it has not begun the "
                f"{self._op}: its last heartbeat was in the {heard.op})"
            )
        if not mark:
            return (
                f"rank {rank} (silent: its heartbeat stood still{host}; it never began the "
                f"{self._op})"
            )
        _, seconds, phase = mark.split("|", 2)
        return (
            f"rank {rank} (silent: its heartbeat stood still{host}; last heard of {seconds} s "
            f"into the {self._op}: {phase})"
        )

    def _slow(self, rank: int, mark: str | None, heard: _Heard, gap: str) -> str:
        doing = mark.split("|", 2)[2] if mark else f"not yet begun the {self._op}"
        return (
            f"rank {rank} (slow: its heartbeat moves, but it is behind; on host {heard.host}; "
            f'at "{doing}" for {heard.since_mark:.1f} s; {gap})'
        )

    def _ranks(self) -> range:
        return range(self.world_size)

    def connect(self) -> None:
        """Connect the pairs this group's agreements use, now, while every rank is at the same
        point: one agreement, whose tree (``_reduce``) and broadcast touch each of them. A
        lazy pair is connected by its first message, and a first message to a peer that died
        before answering waits in gloo's connect for several times the group's timeout (50 s
        at a 10 s timeout, measured), where a connected pair reports the death at once."""
        if self.distributed:
            self._reduce(torch.zeros(1, dtype=torch.int64), torch.maximum)

    def all_gather(self, obj: T) -> list[T]:
        if not self.distributed:
            return [obj]
        self._enter()
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: T, dst: int = 0) -> list[T] | None:
        """Every rank's ``obj`` on ``dst`` (None elsewhere): what only one rank needs costs the
        others one send each, not the whole world's objects."""
        if not self.distributed:
            return [obj]
        group = self.group
        assert group is not None
        self._enter()
        # Point to point, not ``gather_object``: that one first all-gathers every rank's size,
        # so each rank would still receive N of them (and wait on a ring of N hops).
        if self.rank != dst:
            raw = bytearray(pickle.dumps(obj))
            to = dist.get_global_rank(group, dst)
            dist.send(torch.tensor([len(raw)], dtype=torch.int64), dst=to, group=group)
            dist.send(torch.frombuffer(raw, dtype=torch.uint8), dst=to, group=group)
            return None
        out: list[Any] = [None] * self.world_size
        out[dst] = obj
        for rank in range(self.world_size):
            if rank == dst:
                continue
            src = dist.get_global_rank(group, rank)
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, src=src, group=group)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(buf, src=src, group=group)
            # Not a checkpoint: bytes a rank of this job sent over torch.distributed, trusted
            # as torch's own gather_object trusts them (it unpickles the same way).
            out[rank] = pickle.loads(buf.numpy().tobytes())
        return out

    def broadcast(self, obj: T, src: int = 0) -> T:
        if not self.distributed:
            return obj
        assert self.group is not None
        self._enter()
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        return box[0]  # type: ignore[no-any-return]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (one small all-reduce, no pickling)."""
        if not self.distributed:
            return flag
        box = self._reduce(torch.tensor([int(flag)], dtype=torch.int64), torch.maximum)
        return bool(box.item())

    def lowest(self, flag: bool) -> int | None:
        """The lowest rank whose ``flag`` is true (None when none is): one all-reduce of an
        int, so a caller can name a rank without every rank receiving every rank's flag."""
        if not self.distributed:
            return 0 if flag else None
        box = torch.tensor([self.rank if flag else self.world_size], dtype=torch.int64)
        first = int(self._reduce(box, torch.minimum).item())
        return None if first >= self.world_size else first

    def all_equal(self, value: str | bytes) -> bool:
        """Whether every rank passed the same ``value``: one all-reduce of two ints (the
        value's 64-bit xxh3, and its negation, reduced by MAX give the largest and the
        smallest), whatever its length and the world's size."""
        if not self.distributed:
            return True
        raw = value.encode() if isinstance(value, str) else value
        h = xxhash.xxh3_64_intdigest(raw) - (1 << 63)  # into int64's range
        box = torch.tensor([h, -h - 1], dtype=torch.int64)  # -h-1: no overflow at int64 min
        box = self._reduce(box, torch.maximum)
        return int(box[0].item()) == -int(box[1].item()) - 1

    def first_failure(self, error: BaseException | None) -> Failed | None:
        """Every rank's ``error`` (None: this rank succeeded) agreed on: None on every rank
        when no rank failed, else the same ``Failed`` on every rank.

        The cost of a rank does not grow with the world: one int all-reduced when nothing
        failed; on failure one more (which rank is lowest) and one broadcast of that rank's
        error. Every rank must call it, whatever happened on its side."""
        if not self.distributed:
            return None if error is None else Failed(0, error, 1)
        failed = error is not None
        # one reduction: how many failed (sum) and the lowest that did (max of N - rank)
        box = torch.tensor([int(failed), self.world_size - self.rank if failed else 0])
        box = self._reduce(box, lambda a, b: torch.stack([a[0] + b[0], torch.maximum(a[1], b[1])]))
        count = int(box[0].item())
        if not count:
            return None
        first = self.world_size - int(box[1].item())
        mine = _portable(error) if error is not None and self.rank == first else None
        told = self.broadcast(mine, src=first)
        assert told is not None  # sent by a rank that failed
        return Failed(first, told, count)

    def _reduce(
        self, box: torch.Tensor, combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``box`` combined over every rank, on every rank, for the few ints an agreement
        carries: a binomial tree toward rank 0 (a rank receives from ``rank + 2**k`` for each
        bit k below its lowest set bit, then sends to the rank that bit points at), then
        gloo's broadcast, itself a binomial tree. That is 2 log2(N) hops where gloo's
        all-reduce is a ring of 2(N-1): 28 hops at 16,384 ranks instead of 32,766, and each
        rank talks to log2(N) peers. Every rank must call it, in the same order."""
        n, rank, group = self.world_size, self.rank, self.group
        assert group is not None
        width = box.numel()
        assert width <= _WIDTH
        self._enter()
        self._agreements += 1
        tag = self._agreements * 8 + width
        full = torch.zeros(_WIDTH + 2, dtype=torch.int64)
        full[:width] = box
        full[_WIDTH:] = torch.tensor([tag, -tag])  # reduced by MAX: the largest and smallest

        def both(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            out = torch.maximum(a, b)
            out[:width] = combine(a[:width], b[:width])
            return out

        mask = 1
        while mask < n:
            if rank & mask:
                dist.send(full, dst=dist.get_global_rank(group, rank - mask), group=group)
                break
            if rank + mask < n:
                other = torch.empty_like(full)
                dist.recv(other, src=dist.get_global_rank(group, rank + mask), group=group)
                full = both(full, other)
            mask <<= 1
        dist.broadcast(full, src=dist.get_global_rank(group, 0), group=group)
        highest, lowest = int(full[_WIDTH].item()), -int(full[_WIDTH + 1].item())
        if highest != lowest:
            raise DivergedError(tag, lowest, highest)
        return full[:width]

    def meet(self, peers: Collection[int], timeout_s: float) -> list[int]:
        """Meet each of ``peers`` (each must call ``meet`` naming this rank, as often as this
        rank names it); returns the peers not met within ``timeout_s`` (empty: all met).

        Through the job's store, not the group: dckpt's group connects a pair lazily, and a
        message to a peer that never touched that pair can block in gloo's connect for a
        minute or more, past any deadline of the caller's. A meeting is one store key per
        pair: the first to arrive creates it (``compare_set`` on an absent key) and waits for
        the second's mark; the second sets that mark, unless the first already gave up and
        marked the meeting abandoned, which it does atomically the same way. So the two ends
        agree on whether they met, and neither posts a message to a peer that left. Keys are
        under the group's name (two groups, or a later manager's, never share a meeting) and
        removed once met, under the job's random token (``use_token``). Each rank pays two or
        three store calls per peer, at any N.

        Every value is sealed (``sealed``): one a writer outside the job planted (a meeting
        taken, a mark, "abandoned") reads as absent and is replaced atomically, so it can
        delay a meeting until ``timeout_s``, never make a rank believe it met or was given
        up on. (A writer that deletes or overwrites the ranks' own values can still make a
        meeting fail, as a late peer does: no seal keeps a value in the store.)

        A claim the store did not answer in time is made again until ``timeout_s``: a store
        that stalls and answers again costs the meeting the stall (a claim that landed late
        reads back as this rank's own). One that still does not answer at the deadline
        raises ``StoreUnreachableError``: the store is named, not the peer."""
        if not self.distributed or not peers:
            return []
        store = default_store()
        group = self.group
        assert group is not None
        me = dist.get_global_rank(group, self.rank)
        mine = str(me)
        first: list[tuple[int, str, str]] = []
        missed: list[int] = []
        end = time.monotonic() + timeout_s
        for peer in sorted(set(peers)):
            n = self._met.get(peer, 0) + 1
            self._met[peer] = n
            them = dist.get_global_rank(group, peer)
            key = f"{self.keys}/meet/{group.group_name}/{min(me, them)}-{max(me, them)}/{n}"
            held = _until(end, sealed.claim, store, key, mine)
            if held == mine:
                first.append((peer, key, str(them)))  # the peer is not there yet: wait for it
            elif (
                held != str(them) or _until(end, sealed.claim, store, f"{key}/second", mine) != mine
            ):
                # it came first and gave up on this rank ("gone"), or a writer outside the
                # job kept replacing the keys (None): not met, as at the deadline
                missed.append(peer)
        for peer, key, theirs in first:
            second = f"{key}/second"
            got = sealed.wait(store, second, max(end - time.monotonic(), 0.001))
            if got is None:  # not in time: marked abandoned, atomically; the peer learns so
                got = sealed.claim(store, second, _GONE)
            if got != theirs:  # abandoned (or never sealed ours: an outside writer won)
                missed.append(peer)
                continue
            with contextlib.suppress(RuntimeError, NotImplementedError):
                call(store.delete_key, second)  # the second set it, reads no more
                call(store.delete_key, key)
        return sorted(missed)

    def barrier(self) -> None:
        if self.distributed:
            self._enter()
            dist.barrier(group=self.group)

    def close(self) -> None:
        self.end()
        if self.distributed and self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
