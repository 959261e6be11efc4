"""Hostile checkpoints (fault 11): crafted by someone who can write the checkpoint root.

The attacker knows the format: the manifest's ``self_digest`` is not a MAC, so every crafted
manifest here is re-sealed with dckpt.root.manifest's own functions (files re-hashed,
``files_digest`` and ``self_digest`` recomputed) and the test reaches the checks behind the
digests. Each trial crafts step 2 (the newest) of a private copy of a root where 2 real ranks
saved steps 1 and 2, or a record beside it, then checks:

- ``dckpt ls``, ``dckpt inspect`` and ``dckpt verify`` (real processes) finish within a timeout
  with the expected exit code, naming the file where they fail;
- the offline loader (``load_flat``) rejects the crafted step within seconds, with modest
  memory (RSS sampled while it runs), or loads it when only a record beside it was crafted;
- a pickle payload never runs (its marker file never appears), in any of these or the resume;
- no file outside the root is opened or created: decoys outside the root (a copy of the real
  shard, a FIFO without a writer, a manifest, a verification record) are watched with inotify,
  so any process that opens one is seen;

then one restart resumes every trial's root in a single spawn: it falls back to step 1 and
quarantines step 2 with a reason saying what was wrong, or, where only something beside the
checkpoints was crafted, resumes step 2; either way bit-exact, and ``fault_kit.check`` holds.

A second test crafts the run lock (a FIFO, a symlink out of the root) for ``dckpt gc``, which
reads it; the training job's own lock (dckpt.root.lock) is not covered here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from dist_harness import run_world
from fault_kit import Trials, capture, check, failed, fresh_root, resume_world, saving_world
from hang_guard import run_watched
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata

from dckpt.errors import CheckpointError
from dckpt.load.offline import load_flat
from dckpt.root.layout import LATEST_FILE, LOCK_FILE, QUARANTINE_DIR, committed_steps, step_dir_name
from dckpt.root.manifest import MANIFEST_FILE, read_manifest, write_manifest
from dckpt.root.verify import VERIFIED_DIR
from dckpt.storage.digest import hash_file
from dckpt.storage.safe_unpickle import load_dcp_metadata

pytestmark = [
    pytest.mark.faults,
    pytest.mark.multiproc,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify, FIFOs"),
]

FAULT = "hostile checkpoint"
STEP = 2
CLI_QUIET_S = 30.0
"""A CLI that used no CPU this long without exiting hung (blocked in an open or a read);
one that is merely slow, on a busy machine, is waited for (tests/hang_guard.py)."""
LOAD_TIMES = 20.0
"""load_flat of a crafted step may take this many times what the untouched step took, in the
same test, plus 5 s: a reader that spins on crafted metadata takes far longer."""
LOAD_LIMIT_RSS = 256 << 20


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "root"
    results = run_world(saving_world, 2, str(root), [1, 2])
    assert results == ["ok", "ok"], results
    assert committed_steps(root) == [1, 2]
    return root


# --- instruments ------------------------------------------------------------------------------


class OpenWatch:
    """Every entry of the watched directories that any process opens, reads, writes, creates,
    moves away or deletes (Linux inotify: the kernel reports it, whichever process did it).

    Opening a directory itself is not counted: ``shutil.rmtree`` given a symlink to a
    directory opens the target before it sees the link and refuses (Python 3.11), which
    reads nothing there; reading anything in it would show as a file event.
    """

    # IN_ACCESS | IN_MODIFY | IN_OPEN | IN_MOVED_FROM | IN_CREATE | IN_DELETE
    _MASK = 0x1 | 0x2 | 0x20 | 0x40 | 0x100 | 0x200
    _IN_ISDIR, _IN_OPEN = 0x40000000, 0x20

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._dirs: dict[int, Path] = {}

    def add(self, directory: Path) -> None:
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(directory), self._MASK)
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")
        self._dirs[wd] = directory

    def touched(self) -> set[Path]:
        """What was touched since the last call (a directory itself: an entry of it was
        created, moved or deleted, or it was read)."""
        out: set[Path] = set()
        while True:
            try:
                buf = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return out
            pos = 0
            while pos < len(buf):
                wd, mask, _cookie, length = struct.unpack_from("iIII", buf, pos)
                name = buf[pos + 16 : pos + 16 + length].rstrip(b"\0").decode()
                pos += 16 + length
                if mask & self._IN_ISDIR and mask & self._IN_OPEN:
                    continue
                out.add(self._dirs[wd] / name if name else self._dirs[wd])

    def close(self) -> None:
        os.close(self._fd)


@contextmanager
def measured() -> Iterator[dict[str, float]]:
    """Seconds taken and how far this process's RSS rose above where it started."""
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        yield out
    finally:
        stop.set()
        sampler.join()
        peak[0] = max(peak[0], proc.memory_info().rss)
        out["seconds"] = time.monotonic() - t0
        out["rss_rise"] = peak[0] - base


def cli(*args: str) -> subprocess.CompletedProcess[str] | None:
    """Run the `dckpt` command; None if it hung (no CPU used for CLI_QUIET_S, not exited)."""
    return run_watched([sys.executable, "-m", "dckpt.cli", *args], quiet_s=CLI_QUIET_S)


# --- crafting, as an attacker with write access would -----------------------------------------


def reseal(step: Path, edit: Callable[[list[Any]], None] | None = None) -> None:
    """Re-hash every file of ``step`` the manifest lists that is still a regular file, let
    ``edit`` change the file records, and write the manifest back, sealed."""
    manifest = read_manifest(step)
    records: list[Any] = []
    for rec in manifest.files:
        path = step / rec.path
        if path.is_file() and not path.is_symlink():
            digest, size = hash_file(path, manifest.digest_algorithm)
            records.append(dataclasses.replace(rec, bytes=size, digest=digest))
        else:
            records.append(rec)
    if edit is not None:
        edit(records)
    write_manifest(step, dataclasses.replace(manifest, files=tuple(records)))


def set_record(records: list[Any], name: str, **changes: Any) -> None:
    i = next(i for i, r in enumerate(records) if r.path == name)
    records[i] = dataclasses.replace(records[i], **changes)


def rewrite_metadata(step: Path, edit: Callable[[Metadata], None]) -> None:
    meta = load_dcp_metadata((step / ".metadata").read_bytes(), "template")
    edit(meta)
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    reseal(step)


class RunsShell:
    """Unpickling this runs a shell command: the classic pickle exploit."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def _short_unicode(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def dotted_escape(command: str) -> bytes:
    """Protocol 4 resolves a dotted name through a module's globals: "os.system" looked up in
    an allowed module (which imports os) would reach it past a module-level allow-list."""
    return (
        b"\x80\x04"
        + _short_unicode("torch.distributed.checkpoint.metadata")
        + _short_unicode("os.system")
        + b"\x93"  # STACK_GLOBAL
        + _short_unicode(command)
        + b"\x85R."  # TUPLE1, REDUCE, STOP
    )


def huge_tensor(elements: int, chunk_too: bool) -> Callable[[Metadata], None]:
    def edit(meta: Metadata) -> None:
        t = meta.state_dict_metadata["model.0.weight"]
        t.size = torch.Size([elements, 16])  # type: ignore[union-attr]
        if chunk_too:
            t.chunks[0] = ChunkStorageMetadata(  # type: ignore[union-attr]
                offsets=torch.Size([0, 0]), sizes=torch.Size([elements, 16])
            )

    return edit


def duplicated_chunk(meta: Metadata) -> None:
    """model.0.weight ([48, 16]) as its first half listed twice: the sizes add up to the
    tensor, but half of it would never be filled (uninitialised memory handed out)."""
    t = meta.state_dict_metadata["model.0.weight"]
    half = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([24, 16]))
    t.chunks = [half, half]  # type: ignore[union-attr]


def escape_in_metadata(target: str, fqn: str | None = None) -> Callable[[Metadata], None]:
    """Point what ``__0_0.distcp`` stores (or ``fqn``'s entries, wherever they are: the
    fault kit's frozen layer is in a stable file, dckpt.storage.stable_file) at ``target``."""

    def edit(meta: Metadata) -> None:
        for index, info in meta.storage_data.items():
            if (info.relative_path == "__0_0.distcp") if fqn is None else index.fqn == fqn:
                info.relative_path = target

    return edit


def both(*edits: Callable[[Metadata], None]) -> Callable[[Metadata], None]:
    def edit(meta: Metadata) -> None:
        for e in edits:
            e(meta)

    return edit


# --- the trials -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ctx:
    """Where one trial crafts: its root, its step dir, its private decoys outside the root."""

    root: Path
    step: Path
    outside: Path
    marker: Path
    slug: str

    def decoy(self, kind: str) -> Path:
        return self.outside / f"{self.slug}.{kind}"

    def named(self, h: Hostile) -> str:
        """The path the errors about ``h`` must name."""
        return str(self.step / h.names.format(slug=self.slug))


@dataclass(frozen=True)
class Hostile:
    case: str
    craft: Callable[[Ctx], None]
    names: str = ""
    """The file the errors must name (relative to step 2, ``{slug}`` filled in); "" where
    nothing fails."""
    reason: str = ""
    """What the quarantine reason must say; "" where the resume must land on step 2."""
    verify_rc: int = 3
    inspect_rc: int = 0
    offline_fails: bool = True


def _pickle_reduce(c: Ctx) -> None:
    (c.step / ".metadata").write_bytes(pickle.dumps(RunsShell(f"touch {c.marker}")))
    reseal(c.step)


def _pickle_dotted(c: Ctx) -> None:
    (c.step / ".metadata").write_bytes(dotted_escape(f"touch {c.marker}"))
    reseal(c.step)


def _listed_outside(c: Ctx, path: str) -> None:
    # The decoy holds the shard's very bytes: were it opened, its digest would even match.
    reseal(c.step, lambda recs: set_record(recs, "__0_0.distcp", path=path))


def _symlink(c: Ctx, name: str, target: Path) -> None:
    (c.step / name).unlink()
    os.symlink(target, c.step / name)


def _fifo(c: Ctx, name: str) -> None:
    (c.step / name).unlink()
    os.mkfifo(c.step / name)


def _latest_fifo(c: Ctx) -> None:
    (c.root / LATEST_FILE).unlink()
    os.mkfifo(c.root / LATEST_FILE)


def _verified_fifo(c: Ctx) -> None:
    (c.root / VERIFIED_DIR).mkdir()
    os.mkfifo(c.root / VERIFIED_DIR / f"{step_dir_name(STEP)}.json")


def _verified_elsewhere(c: Ctx) -> None:
    # A record that `dckpt ls` would show (same files digest), outside the root.
    records = c.decoy("records")
    records.mkdir()
    digest = read_manifest(c.step).files_digest
    record = {"ok": True, "time": time.time(), "files_digest": digest}
    (records / f"{step_dir_name(STEP)}.json").write_text(json.dumps(record))
    os.symlink(records, c.root / VERIFIED_DIR)


def _step_elsewhere(c: Ctx) -> None:
    # A whole checkpoint outside, linked in under the next step's name.
    shutil.copytree(c.step, c.decoy("stepdir"))
    os.symlink(c.decoy("stepdir"), c.root / step_dir_name(STEP + 1))


HOSTILE = [
    Hostile(
        "pickle payload in .metadata (os.system via __reduce__)",
        _pickle_reduce,
        ".metadata",
        "hostile",
        verify_rc=0,
    ),
    Hostile(
        "pickle payload in .metadata (dotted name through an allowed module)",
        _pickle_dotted,
        ".metadata",
        "hostile",
        verify_rc=0,
    ),
    Hostile(
        "../ path in manifest.json",
        lambda c: _listed_outside(c, f"../../outside/{c.slug}.shard"),
        MANIFEST_FILE,
        "escapes",
        inspect_rc=3,
    ),
    Hostile(
        "absolute path in manifest.json",
        lambda c: _listed_outside(c, str(c.decoy("shard"))),
        MANIFEST_FILE,
        "escapes",
        inspect_rc=3,
    ),
    Hostile(
        "../ path in DCP .metadata",
        lambda c: rewrite_metadata(c.step, escape_in_metadata(f"../../outside/{c.slug}.shard")),
        "../../outside/{slug}.shard",
        "unlisted",
        verify_rc=0,
    ),
    Hostile(
        "shard is a symlink to a copy outside the root",
        lambda c: _symlink(c, "__0_0.distcp", c.decoy("shard")),
        "__0_0.distcp",
        "symlink",
    ),
    Hostile(
        "shard is a symlink to a FIFO outside the root",
        lambda c: _symlink(c, "__1_0.distcp", c.decoy("fifo")),
        "__1_0.distcp",
        "symlink",
    ),
    Hostile(
        "shard is a FIFO",
        lambda c: _fifo(c, "__0_0.distcp"),
        "__0_0.distcp",
        "not a regular file",
    ),
    Hostile(
        ".metadata is a symlink to a copy outside the root",
        lambda c: _symlink(c, ".metadata", c.decoy("metadata")),
        ".metadata",
        "symlink",
    ),
    Hostile(
        "manifest.json is a symlink to a manifest outside the root",
        lambda c: _symlink(c, MANIFEST_FILE, c.decoy("manifest")),
        MANIFEST_FILE,
        "symlink",
        inspect_rc=3,
    ),
    Hostile(
        "manifest claims a 10**15-byte shard",
        lambda c: reseal(c.step, lambda r: set_record(r, "__0_0.distcp", bytes=10**15)),
        MANIFEST_FILE,
        "must be an integer",
        inspect_rc=3,
    ),
    Hostile(
        "manifest claims a 8 TiB shard (within bounds)",
        lambda c: reseal(c.step, lambda r: set_record(r, "__0_0.distcp", bytes=1 << 43)),
        "__0_0.distcp",
        "size mismatch",
    ),
    Hostile(
        "DCP metadata claims a 2**44-element tensor",
        lambda c: rewrite_metadata(c.step, huge_tensor(1 << 40, chunk_too=False)),
        ".metadata",
        "model.0.weight",
        verify_rc=0,
    ),
    Hostile(
        "DCP metadata claims an 8 GiB tensor and chunk",
        lambda c: rewrite_metadata(c.step, huge_tensor(1 << 27, chunk_too=True)),
        ".metadata",
        "model.0.weight",
        verify_rc=0,
    ),
    Hostile(
        "DCP metadata lists one chunk twice (half the tensor never filled)",
        lambda c: rewrite_metadata(c.step, duplicated_chunk),
        ".metadata",
        "model.0.weight",
        verify_rc=0,
    ),
    Hostile(
        "DCP metadata claims a 2**44-element tensor stored outside the root",
        lambda c: rewrite_metadata(
            c.step,
            both(
                huge_tensor(1 << 40, chunk_too=True),
                escape_in_metadata(f"../../outside/{c.slug}.shard", "model.0.weight"),
            ),
        ),
        "../../outside/{slug}.shard",
        "unlisted",
        verify_rc=0,
    ),
    Hostile("latest is a FIFO", _latest_fifo, verify_rc=0, offline_fails=False),
    Hostile("verification record is a FIFO", _verified_fifo, verify_rc=0, offline_fails=False),
    Hostile(
        "verification records are a symlink out of the root",
        _verified_elsewhere,
        verify_rc=0,
        offline_fails=False,
    ),
    Hostile(
        "next step dir is a symlink to a checkpoint outside the root",
        _step_elsewhere,
        verify_rc=0,
        offline_fails=False,
    ),
]


def _decoys(template: Path, c: Ctx) -> None:
    step = template / step_dir_name(STEP)
    shutil.copyfile(step / "__0_0.distcp", c.decoy("shard"))
    shutil.copyfile(step / ".metadata", c.decoy("metadata"))
    shutil.copyfile(step / MANIFEST_FILE, c.decoy("manifest"))
    os.mkfifo(c.decoy("fifo"))


def _owner(path: Path) -> str | None:
    """The trial whose decoy ``path`` is (decoys are named ``<slug>.<kind>``), if any."""
    for part in (path.name, path.parent.name):
        if part.startswith("trial-") and "." in part:
            return part.split(".", 1)[0]
    return None


def check_cli(c: Ctx, h: Hostile) -> list[str]:
    """ls, inspect and verify end in time, with the expected exit codes and file named."""
    why = []
    # ls first: verify replaces a crafted verification record with its own.
    for args, rc in (
        (["ls", str(c.root), "--json"], 0),
        (["inspect", str(c.root), "--step", str(STEP), "--json"], h.inspect_rc),
        (["verify", str(c.root), "--json"], h.verify_rc),
        # --deep reads the metadata as a load would: it must fail whatever a load refuses
        (["verify", str(c.root), "--deep", "--json"], 3 if h.offline_fails else h.verify_rc),
    ):
        proc = cli(*args)
        if proc is None:
            why.append(f"dckpt {args[0]} hung (no exit, no CPU used for {CLI_QUIET_S:.0f} s)")
            continue
        if proc.returncode != rc:
            why.append(f"dckpt {args[0]} exited {proc.returncode}, not {rc}: {proc.stderr[-300:]}")
        elif "Traceback" in proc.stderr:
            why.append(f"dckpt {args[0]} crashed: {proc.stderr[-300:]}")
        elif args[0] == "verify" and rc == 3 and "--deep" not in args:
            bad = [x for x in json.loads(proc.stdout)["checkpoints"] if not x["ok"]]
            named = [p["path"] for x in bad for p in x["problems"]]
            if named != [c.named(h)]:
                why.append(f"dckpt verify names {named}, not {c.named(h)}")
    return why


def check_offline(c: Ctx, h: Hostile, base_s: float) -> list[str]:
    """load_flat rejects the crafted step fast and small (or loads it, if only a record
    beside it was crafted): within LOAD_TIMES the untouched step's ``base_s`` plus 5 s."""
    why = []
    with measured() as cost:
        try:
            load_flat(c.step)
            error = None
        except CheckpointError as exc:
            error = exc
        except (Exception, CheckpointException) as exc:  # not dckpt's own (DCP's: BaseException)
            why.append(f"load_flat raised {type(exc).__name__}: {exc}")
            error = exc
    if h.offline_fails and error is None:
        why.append("load_flat loaded the crafted checkpoint")
    if not h.offline_fails and error is not None:
        why.append(f"load_flat failed: {error}")
    if isinstance(error, CheckpointError) and c.named(h) not in str(error):
        why.append(f"load_flat's error does not name {c.named(h)}: {error}")
    if cost["seconds"] > LOAD_TIMES * base_s + 5 or cost["rss_rise"] > LOAD_LIMIT_RSS:
        why.append(f"load_flat took {cost['seconds']:.1f} s, RSS +{cost['rss_rise'] >> 20} MiB")
    return why


def test_hostile_checkpoints_are_rejected_without_harm(
    template: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    baseline = capture(template)
    outside = tmp_path / "outside"
    outside.mkdir()
    ctxs: list[Ctx] = []
    for i, h in enumerate(HOSTILE):
        slug = f"trial-{i:02d}"
        root = fresh_root(template, tmp_path / slug)
        c = Ctx(root, root / step_dir_name(STEP), outside, tmp_path / f"pwned-{slug}", slug)
        _decoys(template, c)
        h.craft(c)
        ctxs.append(c)
    watch = OpenWatch()
    try:
        watch.add(outside)
        for extra in ("records", "stepdir"):
            for c in ctxs:
                if c.decoy(extra).is_dir():
                    watch.add(c.decoy(extra))
        with ThreadPoolExecutor(4) as pool:
            why = dict(enumerate(pool.map(check_cli, ctxs, HOSTILE)))
        with measured() as untouched:
            load_flat(template / step_dir_name(STEP))
        for i, (c, h) in enumerate(zip(ctxs, HOSTILE, strict=True)):
            why[i] += check_offline(c, h, untouched["seconds"])
        resumed = run_world(
            resume_world, 2, [str(c.root) for c in ctxs], timeout=240, expect_failure=True
        )
        touched = watch.touched()
    finally:
        watch.close()

    for i, (c, h) in enumerate(zip(ctxs, HOSTILE, strict=True)):
        fell_back = bool(h.reason)
        expect = 1 if fell_back else STEP
        for rank in range(2):
            got = resumed[rank][i] if isinstance(resumed[rank], list) else resumed[rank]
            if not isinstance(got, dict) or got.get("error") or got.get("step") != expect:
                why[i].append(f"restart on rank {rank}: {got} (expected step {expect})")
            elif not got.get("exact") or not got.get("saved_next"):
                why[i].append(f"restart on rank {rank} not exact or did not save: {got}")
        reason = c.root / QUARANTINE_DIR / f"{step_dir_name(STEP)}.reason.txt"
        if fell_back and not reason.is_file():
            why[i].append(f"step {STEP} was not quarantined")
        elif fell_back and h.reason not in reason.read_text():
            why[i].append(f"the quarantine reason does not say {h.reason!r}: {reason.read_text()}")
        elif not fell_back and (c.root / QUARANTINE_DIR).exists():
            why[i].append(f"something was quarantined: {os.listdir(c.root / QUARANTINE_DIR)}")
        if c.marker.exists():
            why[i].append("the pickle payload ran")
        opened = sorted(str(p) for p in touched if _owner(p) == c.slug)
        if opened:
            why[i].append(f"opened or created outside the root: {opened}")
        outcome = check(c.root, baseline, may_drop=frozenset({STEP} if fell_back else ()))
        fault_trials.record_check(
            FAULT, h.case, outcome, survived=not why[i], detail="; ".join(why[i])
        )
    stray = sorted(str(p) for p in touched if _owner(p) is None)
    assert not stray, f"opened outside the root, by no trial's craft: {stray}"
    assert all(not w for w in why.values()), failed(fault_trials._sink)


def test_gc_neither_waits_on_nor_follows_the_run_lock(
    template: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    """`dckpt gc` reads the run lock to refuse while a job holds the root: a FIFO in its place
    must not make it wait forever, a symlink must not make it read a file outside the root."""
    baseline = capture(template)
    outside = tmp_path / "outside"
    outside.mkdir()
    decoy = outside / "lock"  # were it read: a live owner (pid 1), so gc would refuse
    decoy.write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "run_id": "decoy"}))
    cases: dict[str, Callable[[Path], None]] = {
        "run lock is a FIFO (dckpt gc)": os.mkfifo,
        "run lock is a symlink out of the root (dckpt gc)": lambda lock: os.symlink(decoy, lock),
    }
    ok = True
    watch = OpenWatch()
    try:
        watch.add(outside)
        for i, (case, craft) in enumerate(cases.items()):
            root = fresh_root(template, tmp_path / f"gc-{i}")
            craft(root / LOCK_FILE)
            watch.touched()
            why = []
            proc = cli("gc", str(root), "--keep-last", "2", "--dry-run", "--json")
            if proc is None:
                why.append(f"dckpt gc hung (no exit, no CPU used for {CLI_QUIET_S:.0f} s)")
            elif proc.returncode != 0 or "Traceback" in proc.stderr:
                why.append(f"dckpt gc exited {proc.returncode}: {proc.stderr[-300:]}")
            if touched := watch.touched():
                why.append(f"opened outside the root: {sorted(map(str, touched))}")
            outcome = check(root, baseline)
            fault_trials.record_check(FAULT, case, outcome, survived=not why, detail="; ".join(why))
            ok = ok and not why and outcome.ok
    finally:
        watch.close()
    assert ok, failed(fault_trials._sink)
