"""Power loss during a save: only what was fsynced survives, and every durable prefix of the
save's operations leaves a consistent root.

How: two real ranks commit steps 1 and 2; that root is copied, and the copy counts as fully
durable. One more save (step 3, keep_last=2, so retention also renames step 1 to trash and
deletes it) then runs under ``strace``; ``crashsim`` turns the log into the ordered create,
write, fsync, rename and delete operations under the root and builds every state a power cut
after any prefix of them can leave (the model and its limits: tests/faults/crashsim.py; its
simulated final tree must equal the real one, so the trace was understood). Each distinct state
is written out, recovered as the next start would (``dckpt.root.upkeep.recover``) and checked:

- the fault kit's invariants: every committed step verifies, ``latest`` names a committed step,
  steps 1 and 2 load bit-exact (step 1 may be gone only when step 3 is committed and verifies);
- step 3 is committed and verifies, or absent: no ``step-00000003`` directory without a commit;
- before recover too, ``latest`` never names an uncommitted step;
- recover leaves nothing of the crashed save behind (tmp, trash or replaced dirs, latest tmps);
- along the cut points, step 3 once committed stays committed, and a cut after the last
  operation (the save had returned) holds it: a save reported done survives the power cut.

Two models: "durable prefixes" (nothing unsynced survives: a directory's entries are what its
last fsync saw, a file's bytes what its last fsync saw), and "ordered metadata" (a journalling
file system that also wrote some pending namespace changes on its own, in order, with unsynced
file tails lost or read as zeros). Each distinct state is one trial. A handful of representative
states then restart for real, in one spawn (``resume_world``): each resumes the newest durable
step bit-exact and saves the next. Two negative controls replay the same log without the shard
files' fsyncs, and without the tmp dir's fsync, and the same check must find broken states;
and synthetic traces check the simulator itself against states worked out by hand.

A re-save ("power loss during a re-save"): on another copy of the same root, step 2 is saved
again under ``strace`` (trained afresh, so its bytes differ); the commit swaps the new tmp dir
with the committed ``step-00000002`` in one ``renameat2(RENAME_EXCHANGE)``, then removes the
old copy, which now has the tmp name. Every state of both models, once recovered: step 1 loads
bit-exact; step 2 is committed (before recover too), verifies, and loads bit-exact as the old
copy or the new one, never a mix; ``latest`` is committed; nothing is left behind; along the
cut points the new copy, once durable, stays, and holds once the save returned. A restart of
one state per kind (old and new copy among them) resumes step 2 exactly. Negative controls:
without the fsyncs of the new copy's files a committed step 2 that does not verify is found;
without the root's fsync after the swap every state is still consistent (the swap is atomic),
but the returned re-save is not durable.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from crashsim import (
    TRACED_SYSCALLS,
    CrashSim,
    CrashState,
    Entry,
    Op,
    SimulationError,
    parse_strace,
)
from dist_harness import run_world
from fault_kit import (
    Baseline,
    Check,
    Trials,
    capture,
    check,
    copy_tree,
    failed,
    resume_world,
    saving_world,
)

from dckpt.load.offline import load_flat
from dckpt.root.commit import exchange
from dckpt.root.layout import (
    LATEST_FILE,
    LOCK_FILE,
    REPLACED_RE,
    TMP_RE,
    TRASH_RE,
    committed_steps,
    list_checkpoints,
    read_latest,
    step_dir_name,
)
from dckpt.root.upkeep import recover
from dckpt.root.verify import verify_checkpoint

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

FAULT = "power loss (durable prefixes)"
FAULT_ORDERED = "power loss (ordered metadata)"
CONFIG = {"keep_last": 2}
NEW_STEP = 3
STRACE = shutil.which("strace") or "/usr/bin/strace"
TESTS = Path(__file__).resolve().parent.parent
MAX_RESTARTS = 10

CHILD = """
import sys
sys.path.insert(0, {tests!r})
from dist_harness import run_world
from fault_kit import saving_world

if __name__ == "__main__":
    results = run_world(saving_world, 2, {root!r}, [{step}], None, None, {config!r})
    print(results)
    sys.exit(0 if results == ["ok", "ok"] else 1)
"""


def _strace_options() -> list[str]:
    """strace's options, or a skip when strace is missing or ptrace is not permitted."""
    if not os.access(STRACE, os.X_OK):
        pytest.skip("strace is not installed: the power-loss test records a save with it")
    base = [STRACE, "-f", "-y", "-qq", "-e", f"trace={TRACED_SYSCALLS}"]
    why = ""
    for extra in (["--seccomp-bpf"], []):  # seccomp-bpf: stop only on the traced calls (fast)
        probe = [*base, *extra, "-o", os.devnull, "/bin/true"]
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
        if proc.returncode == 0:
            return base + extra
        why = proc.stderr.strip()
    pytest.skip(f"strace cannot trace here (ptrace not permitted?): {why}")


@dataclass
class Traced:
    """One traced save, ready to replay."""

    root: Path  # the root the traced run wrote (its final state)
    initial: Path  # the copy taken before it: durable
    ops: list[Op]
    sim: CrashSim
    baseline: Baseline  # the steps committed in ``initial``, as loaded


@pytest.fixture(scope="module")
def strace_options() -> list[str]:
    return _strace_options()


@pytest.fixture(scope="module")
def prepared(strace_options: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root where two real ranks committed steps 1 and 2 (never written to: copied)."""
    root = tmp_path_factory.mktemp("prepared").resolve() / "root"
    # incremental_copies=1: step 2 links step 1's frozen file (fault_kit freezes a layer), so
    # the traced save's retention deletes a name of bytes step 2 still holds
    config = {**CONFIG, "incremental_copies": 1}
    results = run_world(saving_world, 2, str(root), [1, 2], None, None, config)
    assert results == ["ok", "ok"], results
    assert committed_steps(root) == [1, 2]
    return root


def trace_save(options: list[str], prepared: Path, work: Path, step: int) -> Traced:
    """Save ``step`` under strace on a copy of ``prepared``; the log parsed and replayed to
    the end, which must give the tree the run left."""
    root, initial = work / "root", work / "initial"
    work.mkdir(exist_ok=True)
    copy_tree(prepared, root)  # the links of the frozen layer's file stay links
    copy_tree(prepared, initial)
    child = work / "child.py"
    child.write_text(
        CHILD.format(tests=str(TESTS), root=str(root), step=step, config=CONFIG),
        encoding="utf-8",
    )
    log = work / "strace.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*options, "-o", str(log), sys.executable, str(child)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ops = parse_strace(log.read_text(encoding="utf-8", errors="surrogateescape"), root)
    sim = CrashSim(root, initial, ops)
    sim.check_final(root)  # the trace explains the final tree exactly
    return Traced(root, initial, ops, sim, capture(initial))


@pytest.fixture(scope="module")
def traced(
    strace_options: list[str], prepared: Path, tmp_path_factory: pytest.TempPathFactory
) -> Traced:
    """The save of step 3 (keep_last=2: retention deletes step 1)."""
    work = tmp_path_factory.mktemp("power").resolve()
    traced = trace_save(strace_options, prepared, work, NEW_STEP)
    assert committed_steps(traced.root) == [2, NEW_STEP], "the traced save did not retain"
    # Step 2 linked the frozen layer's file of step 1 (fault_kit freezes it), so retention
    # deleted a name of bytes step 2 still holds: every state must keep them for step 2
    linked = [
        p.name for p in (traced.initial / step_dir_name(2)).glob("*stable.distcp")
        if p.stat().st_nlink > 1
    ]  # fmt: skip
    assert linked, "step 2 shares no file with step 1: the trace covers no shared bytes"
    kinds = {op.kind for op in traced.ops}
    assert {"create", "write", "fsync", "rename", "mkdir", "unlink", "rmdir"} <= kinds, kinds
    return traced


# --- the simulator on a trace small enough to work out by hand --------------------------------

SYNTHETIC = """\
100 mkdir("{R}/d", 0777) = 0
100 openat(AT_FDCWD</w>, "{R}/d/f", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0666) = 3<{R}/d/f>
101 write(3<{R}/d/f>, "abcde", 5 <unfinished ...>
100 fsync(4<{R}/nowhere>) = -1 EBADF (Bad file descriptor)
101 <... write resumed>) = 5
100 write(9</elsewhere/log>, "x", 1) = 1
100 fsync(3<{R}/d/f>) = 0
100 write(3<{R}/d/f>, "xy", 2) = 2
100 fsync(5<{R}/d>) = 0
100 rename("{R}/d", "{R}/e") = 0
100 openat(6<{R}/e>, "h", O_WRONLY|O_CREAT|O_CLOEXEC, 0644) = 7<{R}/e/h>
100 fsync(8<{R}>) = 0
100 unlinkat(6<{R}/e>, "h", 0) = -1 ENOENT (No such file or directory)
100 fsync(6<{R}/e>) = 0
"""


def test_crashsim_on_a_synthetic_trace(tmp_path: Path) -> None:
    """Durability by fsync only, directories followed across a rename, unfinished calls
    joined, failed calls and other paths dropped, zero-filled tails, ordered metadata."""
    initial, final = tmp_path / "initial", tmp_path / "R"
    initial.mkdir()
    (initial / "keep").write_bytes(b"K")
    shutil.copytree(initial, final)
    (final / "e").mkdir()
    (final / "e" / "f").write_bytes(b"abcdexy")
    (final / "e" / "h").touch()
    ops = parse_strace(SYNTHETIC.format(R=final), final)
    assert [op.kind for op in ops] == [
        "mkdir", "create", "write", "fsync", "write", "fsync", "rename", "create", "fsync",
        "fsync",
    ]  # fmt: skip
    sim = CrashSim(final, initial, ops)
    sim.check_final(final)

    made = itertools.count()  # id(state) is reused once a state is freed: names collided

    def tree(state: CrashState) -> dict[str, bytes | None]:
        root = sim.materialize(state, tmp_path / f"s-{state.after}-{next(made)}")
        return {
            p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))
        }

    durable = [tree(s) for s in sim.states()]
    assert durable == [
        {"keep": b"K"},
        {"keep": b"K", "e": None, "e/f": b"abcde"},  # the rename, with f's synced bytes only
        {"keep": b"K", "e": None, "e/f": b"abcde", "e/h": b""},
    ]
    assert [s.after for s in sim.states()] == [0, 9, 10]
    zeros = [tree(s) for s in sim.states(unsynced_data="zeros")]
    assert {"keep": b"K", "e": None, "e/f": b"abcde\0\0"} in zeros
    ordered = [tree(s) for s in sim.states(metadata="ordered")]
    assert {"keep": b"K", "d": None} in ordered  # the mkdir reached the disk on its own
    assert {"keep": b"K", "d": None, "d/f": b""} in ordered  # and the create, before any sync
    assert {"keep": b"K", "d": None, "d/f": b"abcde"} in ordered
    assert all("d" not in t or "e" not in t for t in ordered)  # the rename is atomic


SYNTHETIC_EXCHANGE = """\
200 mkdir("{R}/t", 0777) = 0
200 openat(AT_FDCWD</w>, "{R}/t/f", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0666) = 3<{R}/t/f>
200 write(3<{R}/t/f>, "new", 3) = 3
200 fsync(3<{R}/t/f>) = 0
200 fsync(4<{R}/t>) = 0
200 renameat2(AT_FDCWD</w>, "{R}/t", AT_FDCWD</w>, "{R}/s", RENAME_EXCHANGE) = 0
200 fsync(5<{R}>) = 0
200 unlinkat(6<{R}/t>, "f", 0) = 0
200 rmdir("{R}/t") = 0
200 fsync(5<{R}>) = 0
"""


def test_crashsim_models_rename_exchange(tmp_path: Path) -> None:
    """A swap of two entries of one directory: atomic, durable with that directory's fsync,
    each inode keeping its content under its new name (a re-save, worked out by hand)."""
    initial, final = tmp_path / "initial", tmp_path / "R"
    (initial / "s").mkdir(parents=True)
    (initial / "s" / "f").write_bytes(b"old")
    shutil.copytree(initial, final)
    (final / "s" / "f").write_bytes(b"new")
    ops = parse_strace(SYNTHETIC_EXCHANGE.format(R=final), final)
    assert [op.kind for op in ops] == [
        "mkdir", "create", "write", "fsync", "fsync", "exchange", "fsync", "unlink", "rmdir",
        "fsync",
    ]  # fmt: skip
    sim = CrashSim(final, initial, ops)
    sim.check_final(final)

    made = itertools.count()  # id(state) is reused once a state is freed: names collided

    def tree(state: CrashState) -> dict[str, bytes | None]:
        root = sim.materialize(state, tmp_path / f"s-{state.after}-{next(made)}")
        return {
            p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))
        }

    durable = sim.states()
    assert [tree(s) for s in durable] == [
        {"s": None, "s/f": b"old"},
        {"s": None, "s/f": b"new", "t": None, "t/f": b"old"},  # swapped: the old copy is t
        {"s": None, "s/f": b"new"},  # t removed: its unsynced unlink no longer matters
    ]
    assert [s.after for s in durable] == [0, 7, 10]
    ordered = [tree(s) for s in sim.states(metadata="ordered")]
    assert {"s": None, "s/f": b"old", "t": None, "t/f": b""} in ordered
    assert {"s": None, "s/f": b"new", "t": None} in ordered  # the unlink, before the rmdir
    assert all(t.get("s/f") in (b"old", b"new") for t in ordered)  # never missing, never mixed
    assert all(t.get("s/f") != t.get("t/f") for t in ordered)  # no inode under both names

    # Outside what the model covers: a swap across directories, and RENAME_WHITEOUT.
    (initial / "d").mkdir()
    (initial / "d" / "x").touch()
    call = '200 renameat2(AT_FDCWD</w>, "{R}/s/f", AT_FDCWD</w>, "{R}/d/x", {F}) = 0\n'
    across = parse_strace(call.format(R=final, F="RENAME_EXCHANGE"), final)
    with pytest.raises(SimulationError, match="across directories"):
        CrashSim(final, initial, across)
    with pytest.raises(SimulationError, match="RENAME_WHITEOUT"):
        parse_strace(call.format(R=final, F="RENAME_WHITEOUT"), final)


SYNTHETIC_LINK = """\
300 mkdir("{R}/b", 0777) = 0
300 linkat(AT_FDCWD</w>, "{R}/a/f", AT_FDCWD</w>, "{R}/b/f", 0) = 0
300 fsync(3<{R}/b>) = 0
300 fsync(4<{R}>) = 0
300 unlinkat(5<{R}/a>, "f", 0) = 0
300 rmdir("{R}/a") = 0
300 fsync(4<{R}>) = 0
"""


def test_crashsim_models_hard_links(tmp_path: Path) -> None:
    """An incremental save links a committed file into the new step, and retention later
    deletes the step that first wrote it: the inode's bytes are one under both names, the
    link is durable with its directory's fsync, and deleting one name leaves the other
    (worked out by hand)."""
    initial, final = tmp_path / "initial", tmp_path / "R"
    (initial / "a").mkdir(parents=True)
    (initial / "a" / "f").write_bytes(b"frozen")
    (final / "b").mkdir(parents=True)
    (final / "b" / "f").write_bytes(b"frozen")
    ops = parse_strace(SYNTHETIC_LINK.format(R=final), final)
    assert [op.kind for op in ops] == [
        "mkdir", "link", "fsync", "fsync", "unlink", "rmdir", "fsync"
    ]  # fmt: skip
    sim = CrashSim(final, initial, ops)
    sim.check_final(final)
    made = itertools.count()

    def tree(state: CrashState) -> dict[str, bytes | None]:
        root = sim.materialize(state, tmp_path / f"s-{state.after}-{next(made)}")
        inodes = {p.stat().st_ino for p in root.rglob("f")}
        assert len(inodes) <= 1, "the names of one inode were written as two files"
        return {
            p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))
        }

    durable = sim.states()
    assert [tree(s) for s in durable] == [
        {"a": None, "a/f": b"frozen"},
        {"a": None, "a/f": b"frozen", "b": None, "b/f": b"frozen"},  # one inode, two names
        {"b": None, "b/f": b"frozen"},  # the first name gone, the bytes kept
    ]
    assert [s.after for s in durable] == [0, 4, 7]
    ordered = [tree(s) for s in sim.states(metadata="ordered")]
    assert {"a": None, "a/f": b"frozen", "b": None} in ordered  # the mkdir before the link
    assert all(v == b"frozen" for t in ordered for k, v in t.items() if k.endswith("f"))
    # A final tree with the right names and sizes, but two inodes where the trace links one
    (final / "a").mkdir()
    (final / "a" / "f").write_bytes(b"frozen")  # a copy, not a link
    with pytest.raises(SimulationError, match="links other names"):
        CrashSim(final, initial, ops[:4]).check_final(final)
    os.unlink(final / "a" / "f")
    os.link(final / "b" / "f", final / "a" / "f")
    CrashSim(final, initial, ops[:4]).check_final(final)


# --- the check of one crash state -----------------------------------------------------------


@dataclass
class Verdict:
    outcome: Check
    committed: bool  # step 3 committed once recovered
    kind: tuple[object, ...]  # what the raw state looks like, to pick restart candidates


def _leftover(name: str) -> bool:
    """Whether ``name`` is something of a crashed save that recover must remove."""
    crashed = any(r.fullmatch(name) for r in (TMP_RE, TRASH_RE, REPLACED_RE))
    return crashed or name.startswith(f"{LATEST_FILE}.tmp-")


def evaluate(root: Path, baseline: Baseline) -> Verdict:
    """Recover ``root`` as the next start would, then check it (see the module docstring)."""
    problems: list[str] = []
    names = {step_dir_name(s) for s in committed_steps(root)}
    latest = read_latest(root)
    if latest is not None and latest not in names:
        problems.append(f"before recover, latest names {latest!r}, which is not committed")
    kind: tuple[object, ...] = (
        step_dir_name(NEW_STEP) in names,
        latest,
        any(TMP_RE.fullmatch(p.name) for p in root.iterdir()),
        any(TRASH_RE.fullmatch(p.name) for p in root.iterdir()),
        (root / LOCK_FILE).exists(),  # empty or zero-filled: the restart must take it over
    )
    try:
        recover(root)
    except Exception as exc:
        problems.append(f"recover raised {type(exc).__name__}: {exc}")
    committed = NEW_STEP in committed_steps(root)
    new_ok = committed and verify_checkpoint(root / step_dir_name(NEW_STEP)).ok
    outcome = check(root, baseline, may_drop=frozenset({1}) if new_ok else frozenset())
    for entry in list_checkpoints(root):
        if entry.step == NEW_STEP and entry.status != "committed":
            problems.append(f"step {NEW_STEP} is {entry.status} at {entry.path.name}")
    problems += [f"recover left {p.name} behind" for p in root.iterdir() if _leftover(p.name)]
    return Verdict(Check(outcome.lost, problems + outcome.problems), committed, kind)


def replay(
    sim: CrashSim, states: list[CrashState], work: Path, judge: Callable[[Path], Verdict]
) -> dict[tuple[Entry, ...], Verdict]:
    """Write out each state and ``judge`` it (recover, then check); the verdicts, by state."""
    verdicts: dict[tuple[Entry, ...], Verdict] = {}
    for i, state in enumerate(states):
        root = sim.materialize(state, work / f"state-{i}")
        verdicts[state.entries] = judge(root)
        shutil.rmtree(root)
    return verdicts


def history_problems(
    sim: CrashSim, verdicts: dict[tuple[Entry, ...], Verdict], what: str = f"step {NEW_STEP}"
) -> list[str]:
    """Along the cut points (durable prefixes): a commit, once durable, stays; and the cut
    after the last operation (the save had returned) holds the new step (``what``)."""
    problems: list[str] = []
    since: int | None = None
    for cut in range(len(sim.ops) + 1):
        verdict = verdicts[sim.state_at(cut).entries]
        if verdict.committed and since is None:
            since = cut
        elif since is not None and not verdict.committed:
            problems.append(f"{what}, committed after op {since}, is gone after op {cut}")
            break
    if since is None:
        problems.append(f"a power cut after the save returned loses {what}")
    return problems


def _crash_states(sim: CrashSim) -> tuple[list[CrashState], list[CrashState]]:
    """The durable-prefix states, and the ordered-metadata states not among them."""
    durable = sim.states()
    ordered: dict[tuple[Entry, ...], CrashState] = {}
    for data in ("lost", "zeros"):
        for state in sim.states(metadata="ordered", unsynced_data=data):
            ordered.setdefault(state.entries, state)
    known = {s.entries for s in durable}
    return durable, [s for e, s in ordered.items() if e not in known]


def _restart_each_kind(
    sim: CrashSim, verdicts: dict[tuple[Entry, ...], Verdict], states: list[CrashState], work: Path
) -> list[tuple[CrashState, Path, list[dict[str, Any]]]]:
    """The restart, for real: one state per kind of verdict, all in one spawn; for each, its
    root and what every rank's resume returned."""
    picked: dict[tuple[object, ...], CrashState] = {}
    for state in states:
        picked.setdefault(verdicts[state.entries].kind, state)
    chosen = list(picked.values())[:MAX_RESTARTS]
    roots = [sim.materialize(s, work / f"restart-{i}") for i, s in enumerate(chosen)]
    resumed = run_world(resume_world, 2, [str(r) for r in roots], timeout=240)
    return [
        (state, root, [resumed[rank][i] for rank in range(2)])
        for i, (state, root) in enumerate(zip(chosen, roots, strict=True))
    ]


def _restart_problems(got: list[dict[str, Any]], root: Path, expect: int) -> list[str]:
    """Each rank resumed ``expect`` exactly and saved the next step; nothing left behind."""
    why: list[str] = []
    for rank, result in enumerate(got):
        if result.get("error") or result.get("step") != expect or not result.get("exact"):
            why.append(f"restart on rank {rank}: {result} (expected step {expect}, exact)")
        elif not result.get("saved_next"):
            why.append(f"restart on rank {rank} did not save step {expect + 1}")
    leftovers = [p.name for p in root.iterdir() if _leftover(p.name)]
    if leftovers:
        why.append(f"the restart left {leftovers} behind")
    return why


def _record_and_assert(
    fault_trials: Trials,
    sim: CrashSim,
    groups: list[tuple[str, str, list[CrashState]]],
    verdicts: dict[tuple[Entry, ...], Verdict],
    restart: dict[tuple[Entry, ...], list[str]],
    history: list[str],
    notes: Callable[[Verdict], list[str]],
) -> None:
    """One trial per state (its verdict, and its restart where it had one), then fail on any
    inconsistent state or history problem."""
    for fault, label, group in groups:
        for i, state in enumerate(group, 1):
            verdict = verdicts[state.entries]
            detail = [sim.describe(state), *notes(verdict)]
            if state.entries in restart:
                detail += ["restarted", *restart[state.entries]]
            fault_trials.record_check(
                fault,
                f"{label} {i}/{len(group)}",
                verdict.outcome,
                survived=not restart.get(state.entries),
                detail="; ".join(detail),
            )
    bad = [
        f"{sim.describe(s)}: {verdicts[s.entries].outcome.problems + restart.get(s.entries, [])}"
        for _fault, _label, group in groups
        for s in group
        if not verdicts[s.entries].outcome.ok or restart.get(s.entries)
    ]
    assert not bad and not history, "\n".join(history + bad) + "\n" + failed(fault_trials._sink)


# --- the test ----------------------------------------------------------------------------------


def test_every_durable_prefix_leaves_a_consistent_root(
    traced: Traced, tmp_path: Path, fault_trials: Trials
) -> None:
    sim, baseline = traced.sim, traced.baseline
    durable, extra = _crash_states(sim)
    assert len(durable) >= 4, [sim.describe(s) for s in durable]  # before, commit, latest, trash

    verdicts = replay(sim, durable + extra, tmp_path, lambda root: evaluate(root, baseline))
    history = history_problems(sim, verdicts)
    restart: dict[tuple[Entry, ...], list[str]] = {}
    for state, root, got in _restart_each_kind(sim, verdicts, durable + extra, tmp_path):
        committed = verdicts[state.entries].committed
        expect = NEW_STEP if committed else NEW_STEP - 1
        keep = {s: v for s, v in baseline.items() if not (committed and s == 1)}
        restart[state.entries] = _restart_problems(got, root, expect) + check(root, keep).problems

    groups = [(FAULT, "prefix", durable), (FAULT_ORDERED, "prefix", extra)]
    _record_and_assert(fault_trials, sim, groups, verdicts, restart, history, lambda v: [])


# --- negative controls: the same replay must catch a missing fsync -----------------------------


def _is_shard_fsync(op: Op) -> bool:
    return op.kind == "fsync" and op.path.endswith(".distcp")


def _is_tmp_dir_fsync(op: Op) -> bool:
    return op.kind == "fsync" and TMP_RE.fullmatch(os.path.basename(op.path)) is not None


@pytest.mark.parametrize(
    ("dropped", "symptom"),
    [
        (_is_shard_fsync, "does not verify"),
        (_is_tmp_dir_fsync, f"step {NEW_STEP} is incomplete"),
    ],
    ids=["no-shard-fsync", "no-tmp-dir-fsync"],
)
def test_negative_control_a_missing_fsync_is_caught(
    traced: Traced, tmp_path: Path, dropped: Callable[[Op], bool], symptom: str
) -> None:
    kept = [op for op in traced.ops if not dropped(op)]
    assert len(kept) < len(traced.ops), "the log holds no such fsync to drop"
    sim = CrashSim(traced.root, traced.initial, kept)
    sim.check_final(traced.root)
    verdicts = replay(sim, sim.states(), tmp_path, lambda root: evaluate(root, traced.baseline))
    problems = [p for v in verdicts.values() for p in v.outcome.problems]
    problems += history_problems(sim, verdicts)
    assert any(symptom in p for p in problems), problems


# --- a re-save: the same step saved again, swapped in by RENAME_EXCHANGE ------------------------

RESAVE = "power loss during a re-save"
RESAVED = 2


@dataclass
class Resaved:
    """The traced re-save of step 2 over the committed one."""

    traced: Traced
    old: Baseline  # steps 1 and 2 as committed before the re-save
    new: dict[str, Any]  # step 2 as the re-save wrote it


@pytest.fixture(scope="module")
def resaved(
    strace_options: list[str], prepared: Path, tmp_path_factory: pytest.TempPathFactory
) -> Resaved:
    work = tmp_path_factory.mktemp("resave").resolve()
    (work / "probe-a").mkdir()
    (work / "probe-b").mkdir()
    if not exchange(work / "probe-a", work / "probe-b"):
        pytest.skip("this file system cannot RENAME_EXCHANGE: the re-save renames aside")
    traced = trace_save(strace_options, prepared, work / "traced", RESAVED)
    assert committed_steps(traced.root) == [1, RESAVED]
    swaps = [op for op in traced.ops if op.kind == "exchange"]
    final = str(traced.root / step_dir_name(RESAVED))
    assert [op.dest for op in swaps] == [final], [op.describe() for op in swaps]
    new = capture(traced.root)[RESAVED]
    old = traced.baseline
    assert _copy_of(new, {"old": old[RESAVED]}) is None, "the re-save wrote the same bytes"
    return Resaved(traced, old, new)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


def _copy_of(values: dict[str, Any], copies: dict[str, dict[str, Any]]) -> str | None:
    """The name of the copy ``values`` equals bit-exact, if any."""
    for name, copy in copies.items():
        if values.keys() == copy.keys() and all(_same(values[k], copy[k]) for k in copy):
            return name
    return None


def evaluate_resave(root: Path, old: Baseline, new: dict[str, Any]) -> Verdict:
    """Recover ``root`` as the next start would, then check: step 1 bit-exact; step 2
    committed, verified and bit-exact the old copy or the new one (and present before recover
    too: the swap never leaves it missing); ``latest`` committed; nothing left behind.
    ``committed``: step 2 holds the new copy."""
    problems: list[str] = []
    names = {step_dir_name(s) for s in committed_steps(root)}
    latest = read_latest(root)
    if latest is not None and latest not in names:
        problems.append(f"before recover, latest names {latest!r}, which is not committed")
    if step_dir_name(RESAVED) not in names:
        problems.append(f"before recover, step {RESAVED} is not committed: the swap lost it")
    raw = (
        latest,
        any(TMP_RE.fullmatch(p.name) for p in root.iterdir()),
        (root / LOCK_FILE).exists(),
    )
    try:
        recover(root)
    except Exception as exc:
        problems.append(f"recover raised {type(exc).__name__}: {exc}")
    outcome = check(root, {1: old[1]})  # and every committed step verifies, latest committed
    lost = outcome.lost
    copy: str | None = None
    if RESAVED not in committed_steps(root):
        lost += 1
        problems.append(f"step {RESAVED} is gone")
    else:
        try:
            values = load_flat(root / step_dir_name(RESAVED))
        except Exception as exc:
            values = None
            lost += 1
            problems.append(f"step {RESAVED} no longer loads: {exc}")
        if values is not None:
            copy = _copy_of(values, {"old": old[RESAVED], "new": new})
            if copy is None:
                lost += 1
                problems.append(f"step {RESAVED} is neither the old copy nor the new one")
    problems += [f"recover left {p.name} behind" for p in root.iterdir() if _leftover(p.name)]
    outcome = Check(lost, problems + outcome.problems)
    return Verdict(outcome, copy == "new", (copy, *raw))


def test_power_loss_during_a_resave(resaved: Resaved, tmp_path: Path, fault_trials: Trials) -> None:
    """Every state a power cut during a re-save of step 2 can leave recovers to step 2 whole,
    old or new (never missing, never a mix), step 1 untouched; the new copy, once durable,
    stays, and holds once the save returned; a real restart resumes step 2 exactly."""
    sim, old, new = resaved.traced.sim, resaved.old, resaved.new
    durable, extra = _crash_states(sim)

    verdicts = replay(sim, durable + extra, tmp_path, lambda r: evaluate_resave(r, old, new))
    history = history_problems(sim, verdicts, f"the re-saved step {RESAVED}")
    copies = {verdicts[s.entries].kind[0] for s in durable}
    assert {"old", "new"} <= copies, [sim.describe(s) for s in durable]

    # one state per kind (old and new copy among them)
    restart: dict[tuple[Entry, ...], list[str]] = {}
    for state, root, got in _restart_each_kind(sim, verdicts, durable + extra, tmp_path):
        held = new if verdicts[state.entries].committed else old[RESAVED]
        restart[state.entries] = (
            _restart_problems(got, root, RESAVED) + check(root, {1: old[1], RESAVED: held}).problems
        )

    groups = [(RESAVE, "durable prefix", durable), (RESAVE, "ordered metadata", extra)]
    _record_and_assert(
        fault_trials,
        sim,
        groups,
        verdicts,
        restart,
        history,
        lambda v: [f"step {RESAVED} holds the {v.kind[0]} copy"],
    )


def _is_new_file_fsync(op: Op) -> bool:
    """An fsync of a file of the re-save's tmp dir (the writers' and the commit's)."""
    return op.kind == "fsync" and bool(TMP_RE.fullmatch(os.path.basename(os.path.dirname(op.path))))


def test_negative_control_resave_without_file_fsyncs_is_caught(
    resaved: Resaved, tmp_path: Path
) -> None:
    """Without the fsyncs of the new copy's files, the swap can commit empty files: caught."""
    t = resaved.traced
    kept = [op for op in t.ops if not _is_new_file_fsync(op)]
    assert len(kept) < len(t.ops), "the log holds no such fsync to drop"
    sim = CrashSim(t.root, t.initial, kept)
    sim.check_final(t.root)
    judge = partial(evaluate_resave, old=resaved.old, new=resaved.new)
    verdicts = replay(sim, sim.states(), tmp_path, judge)
    problems = [p for v in verdicts.values() for p in v.outcome.problems]
    assert any(f"committed step {RESAVED} does not verify" in p for p in problems), problems


def test_negative_control_resave_without_root_fsync_stays_consistent(
    resaved: Resaved, tmp_path: Path
) -> None:
    """Without the root's fsync after the swap every state is still consistent (the swap is
    atomic whether or not it reached the disk), but the re-save is durable only if a later
    fsync of the root happens to make it so."""
    t = resaved.traced
    root = os.path.normpath(t.root)
    swap = next(op.index for op in t.ops if op.kind == "exchange")
    sync = next(op.index for op in t.ops[swap:] if op.kind == "fsync" and op.path == root)
    kept = [op for op in t.ops if op.index != sync]
    sim = CrashSim(t.root, t.initial, kept)
    sim.check_final(t.root)
    states = sim.states() + sim.states(metadata="ordered")
    judge = partial(evaluate_resave, old=resaved.old, new=resaved.new)
    verdicts = replay(sim, list({s.entries: s for s in states}.values()), tmp_path, judge)
    bad = [p for v in verdicts.values() for p in v.outcome.problems]
    assert not bad, bad
    synced_later = any(op.kind == "fsync" and op.path == root for op in t.ops[sync + 1 :])
    history = history_problems(sim, verdicts, "the re-save")
    lost = "a power cut after the save returned loses the re-save"
    assert history == ([] if synced_later else [lost]), history
