"""Resume records: how each resume of a checkpoint went, kept in the root beside it.

A checkpoint can be whole and verified and still not reproduce the run that saved it: a
resume from it that diverges, restarted by the scheduler, picks the same step again, and the
job loops (Megatron#5281: 44 identical restarts). So each resume's checks are recorded: when
its replay (dckpt.load.replay: the steps after the checkpoint compared with the run that
stopped) and its loss watch give their verdicts, rank 0 appends a ``ResumeRecord`` for each
to ``ROOT/.dckpt-resumes/step-N.json`` (an s3:// root: the same object in the bucket,
dckpt.tiers.object_root): which check (``kind``), the step, the tier, the manifest's
``save_id`` (a later save of the same step is another checkpoint, with records of its own),
ok or failed, the verdict's text, the run id, torchrun's attempt
(``TORCHELASTIC_RESTART_COUNT``) and job (``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR:MASTER_PORT``),
this start (host, pid and a nonce: each process is one start) and the time. A file keeps the
last ``KEEP`` records of its step, written atomically (a fresh temp name, fsync, rename,
fsync of the directory).

``restart_loop`` is the rule a resume applies before it loads a candidate, and it rests on
proof only: when the newest *replay* records of that checkpoint are differences from two
different starts, with no replay that matched after them, the checkpoint is quarantined with
the reason and the resume falls back to the step before. A replay that matched breaks the
row; differences within one start count once. A loss-watch verdict is a statistical
judgement: it is recorded and shown (``summary``), and never counts toward a loop, whatever
it says (a loss that falls faster than its trend is not a bad checkpoint). Records written
before ``kind`` existed were loss-watch verdicts. ``.dckpt-resumes`` is never a step name,
so no directory scan mistakes it for a checkpoint. No torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from ..owned import make_dir, write_atomic
from .durable import fsync_dir
from .layout import read_small_file, step_dir_name

__all__ = [
    "KEEP",
    "LOSS_WATCH",
    "MAX_RECORDS_BYTES",
    "REPLAY",
    "RESUMES_DIR",
    "DirectoryRecords",
    "ResumeRecord",
    "ResumeRecords",
    "decode",
    "encode",
    "failed_in_a_row",
    "record_name",
    "restart_loop",
    "step_of_record_name",
    "summary",
    "this_start",
]

RESUMES_DIR = ".dckpt-resumes"
KEEP = 8
"""Records kept per step: enough to see a loop, small enough to read at every resume."""
MAX_RECORDS_BYTES = 64 * 1024
MAX_VERDICT_CHARS = 2000
SCHEMA = 1
REPLAY = "replay"
"""The kind of record the restart-loop rule counts: a replay's verdict (proof)."""
LOSS_WATCH = "loss watch"
"""A loss watch's verdict: shown, never counted toward a loop."""
_NAME_RE = re.compile(r"(step-[0-9]{8,})\.json")
_OLD_TIER_NAMES = {"root": "durable", "memory tier": "memory"}
"""The report's words once stored as the tier's id, read as the tier's name."""


@dataclass(frozen=True, kw_only=True)
class ResumeRecord:
    """One resume of one checkpoint and its loss-watch verdict."""

    step: int
    tier: str
    """The tier it was resumed from, by its one name ("durable", "memory"); an older dckpt's
    records named them "root" and "memory tier", and are read with today's names."""
    save_id: str
    """The manifest's save id: which checkpoint of that step it was."""
    ok: bool
    verdict: str
    """The verdict's text (the loss-watch line without its prefix)."""
    run_id: str
    attempt: int | None
    """torchrun's ``TORCHELASTIC_RESTART_COUNT`` (None outside torchrun)."""
    job: str
    """Which job: torchrun's run id and rendezvous address ("" outside torchrun)."""
    start: str
    """This start: the host, rank 0's pid and a nonce (each process is one start)."""
    time: float
    kind: str = LOSS_WATCH
    """Which check gave the verdict: ``REPLAY`` (proof) or ``LOSS_WATCH`` (a judgement)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: object) -> ResumeRecord | None:
        """A record read back, or None when it is not one (a hand edit, another version)."""
        if not isinstance(obj, dict):
            return None
        try:
            attempt = obj.get("attempt")
            record = cls(
                step=obj["step"],
                tier=_OLD_TIER_NAMES[t] if (t := obj["tier"]) in _OLD_TIER_NAMES else t,
                save_id=obj["save_id"],
                ok=obj["ok"],
                verdict=obj["verdict"],
                run_id=obj["run_id"],
                attempt=attempt,
                job=obj["job"],
                start=obj["start"],
                time=float(obj["time"]),
                kind=obj.get("kind", LOSS_WATCH),
            )
        except (KeyError, TypeError, ValueError):
            return None
        strings = (record.tier, record.save_id, record.verdict, record.run_id, record.job)
        if record.kind not in (REPLAY, LOSS_WATCH):
            return None
        if (
            type(record.step) is not int
            or type(record.ok) is not bool
            or not all(isinstance(s, str) for s in (*strings, record.start))
            or not (attempt is None or type(attempt) is int)
        ):
            return None
        return record

    def label(self, *, when: bool = False) -> str:
        """How the report names the start this record came from (``when``: with its time,
        for two starts of one attempt number, in two jobs)."""
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.time))
        if self.attempt is None:
            return f"the start at {at}"
        return f"attempt {self.attempt} at {at}" if when else f"attempt {self.attempt}"


_STARTS: dict[int, str] = {}
"""This process's start, by pid: a process forked from one that imported this module (a
fork server) is a start of its own."""


def this_start() -> tuple[int | None, str, str]:
    """(attempt, job, start) of this process, read where ``ObjectSource`` reads its session:
    torchrun's variables. ``start`` is new in every process (a fork included)."""
    pid = os.getpid()
    if pid not in _STARTS:
        _STARTS.clear()
        _STARTS[pid] = f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex[:12]}"
    try:
        attempt: int | None = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    except (KeyError, ValueError):
        attempt = None
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    job = ":".join(p for p in (run, f"{addr}:{port}" if addr or port else "") if p)
    return attempt, job, _STARTS[pid]


# --- the rule -------------------------------------------------------------------------------


def failed_in_a_row(records: Sequence[ResumeRecord]) -> list[ResumeRecord]:
    """The newest replay difference of each start since the last replay that matched, oldest
    first: a start that failed twice (one process, two resumes) counts once. Loss-watch
    records are not looked at (a judgement is no proof). ``records`` in the order they were
    written (a file's order: one writer appends), not by their clocks, which are hosts'."""
    row: list[ResumeRecord] = []
    starts: set[str] = set()
    for record in reversed(records):
        if record.kind != REPLAY:
            continue
        if record.ok:
            break
        if record.start not in starts:
            starts.add(record.start)
            row.append(record)
    return row[::-1]


def restart_loop(records: Sequence[ResumeRecord]) -> str | None:
    """The reason to quarantine the checkpoint ``records`` are about (all of one save id),
    or None: unless its last two starts each resumed it and failed, none passing since."""
    row = failed_in_a_row(records)
    if len(row) < 2:
        return None
    last = row[-2:]
    attempts = [r.attempt for r in last]
    if None not in attempts and attempts[0] != attempts[1]:
        which = "attempts " + ", ".join(str(a) for a in attempts)
    else:
        which = ", ".join(r.label(when=True) for r in last)
    return (
        f"resumed twice ({which}) and its replay differed from the run that stopped both "
        f"times: {last[-1].verdict}"
    )


def summary(records: Sequence[ResumeRecord]) -> str:
    """``ls``'s column: "2 replays differed" (starts since the last replay that matched:
    the only verdict that counts toward a restart loop), "replay ok", or, with no replay
    record, the loss watch's last word: "ok", "loss watch warned" (a judgement, never a
    failure of the checkpoint); "" with no record."""
    replays = [r for r in records if r.kind == REPLAY]
    if replays:
        row = failed_in_a_row(records)
        return f"{len(row)} replays differed" if row else "replay ok"
    if not records:
        return ""
    return "ok" if records[-1].ok else "loss watch warned"


# --- the file -------------------------------------------------------------------------------


def record_name(step: int) -> str:
    return f"{step_dir_name(step)}.json"


def step_of_record_name(name: str) -> int | None:
    m = _NAME_RE.fullmatch(name)
    return int(m.group(1)[len("step-") :]) if m else None


def encode(step: int, records: Iterable[ResumeRecord]) -> bytes:
    """The file of ``step``'s records: its last ``KEEP``, verdicts cut to a bounded length."""
    kept = [
        {**r.to_json(), "verdict": r.verdict[:MAX_VERDICT_CHARS]}
        for r in list(records)[-KEEP:]
        if r.step == step
    ]
    data = json.dumps({"schema": SCHEMA, "step": step, "records": kept}, indent=1)
    return (data + "\n").encode("utf-8")


def decode(raw: bytes | None, step: int) -> list[ResumeRecord]:
    """The records of ``step`` in ``raw`` (a file ``encode`` wrote); anything else gives
    none: a damaged record file costs the history, never a resume."""
    if raw is None or len(raw) > MAX_RECORDS_BYTES:
        return []
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return []
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA or obj.get("step") != step:
        return []
    found = obj.get("records")
    if not isinstance(found, list):
        return []
    records = [ResumeRecord.from_json(r) for r in found]
    return [r for r in records if r is not None and r.step == step]


class ResumeRecords(Protocol):
    """Where a root keeps its resume records (a directory, a bucket)."""

    def read(self, step: int) -> list[ResumeRecord]:
        """``step``'s records, oldest first ([] when none or unreadable)."""
        ...

    def add(self, record: ResumeRecord) -> list[ResumeRecord]:
        """Append ``record`` (keeping the last ``KEEP``); returns the step's records now kept.
        Raises OSError or a CheckpointError when it could not be written."""
        ...

    def steps(self) -> list[int]:
        """The steps that have a record file (one listing)."""
        ...

    def where(self, step: int) -> str: ...

    def forget(self, step: int) -> str:
        """The one command that removes ``step``'s records (a refusal says it)."""
        ...


class DirectoryRecords:
    """``ROOT/.dckpt-resumes/step-N.json``: read and written through a descriptor of the
    record directory opened without following a symlink, as ``.dckpt-verified`` is."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.dir = self.root / RESUMES_DIR

    def __str__(self) -> str:
        return str(self.dir)

    def where(self, step: int) -> str:
        return str(self.dir / record_name(step))

    def forget(self, step: int) -> str:
        return f"rm {self.where(step)}"

    def _open(self) -> int | None:
        try:
            return os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return None

    def read(self, step: int) -> list[ResumeRecord]:
        fd = self._open()
        if fd is None:
            return []
        try:
            return decode(
                read_small_file(record_name(step), MAX_RECORDS_BYTES + 1, dir_fd=fd, own=True),
                step,
            )
        finally:
            os.close(fd)

    def steps(self) -> list[int]:
        fd = self._open()
        if fd is None:
            return []
        try:
            names = os.listdir(fd)
        except OSError:
            return []
        finally:
            os.close(fd)
        return sorted(s for n in names if (s := step_of_record_name(n)) is not None)

    def add(self, record: ResumeRecord) -> list[ResumeRecord]:
        if not self.dir.exists():
            make_dir(self.dir)
            fsync_dir(self.root)
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            name = record_name(record.step)
            for debris in os.listdir(fd):  # a write a crash cut short: one writer, rank 0
                if debris.startswith((f".{name}.tmp-", f"{name}.tmp-")):
                    with contextlib.suppress(OSError):
                        os.unlink(debris, dir_fd=fd)
            raw = read_small_file(name, MAX_RECORDS_BYTES + 1, dir_fd=fd)
        finally:
            os.close(fd)
        kept = [*decode(raw, record.step), record][-KEEP:]
        # A fresh name, created exclusively: nothing already there (a link, a FIFO) is ever
        # opened for writing; the rename replaces the old file whole (fsynced, and the dir).
        write_atomic(self.dir, name, encode(record.step, kept))
        return kept
