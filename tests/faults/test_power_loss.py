"""Power loss during a save: only what was fsynced survives, and every durable prefix of the
save's operations leaves a consistent root.

How: two real ranks commit steps 1 and 2; that root is copied, and the copy counts as fully
durable. One more save (step 3, keep_last=2, so retention also renames step 1 to trash and
deletes it) then runs under ``strace``; ``crashsim`` turns the log into the ordered create,
write, fsync, rename and delete operations under the root and builds every state a power cut
after any prefix of them can leave (the model and its limits: tests/faults/crashsim.py; its
simulated final tree must equal the real one, so the trace was understood). Each distinct state
is written out, recovered as the next start would (``dckpt.commit.recover``) and checked:

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
and a synthetic trace checks the simulator itself against states worked out by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from crashsim import TRACED_SYSCALLS, CrashSim, CrashState, Entry, Op, parse_strace
from dist_harness import run_world
from fault_kit import (
    Baseline,
    Check,
    Trials,
    capture,
    check,
    failed,
    resume_world,
    saving_world,
)

from dckpt.commit import recover
from dckpt.layout import (
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
from dckpt.verify import verify_checkpoint

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
    """The traced save of step 3, ready to replay."""

    root: Path  # the root the traced run wrote (its final state)
    initial: Path  # the copy taken before it: durable
    ops: list[Op]
    sim: CrashSim
    baseline: Baseline


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Traced:
    options = _strace_options()
    work = tmp_path_factory.mktemp("power").resolve()
    root = work / "root"
    results = run_world(saving_world, 2, str(root), [1, 2], None, None, CONFIG)
    assert results == ["ok", "ok"], results
    assert committed_steps(root) == [1, 2]
    initial = work / "initial"
    shutil.copytree(root, initial, symlinks=True)

    child = work / "child.py"
    child.write_text(
        CHILD.format(tests=str(TESTS), root=str(root), step=NEW_STEP, config=CONFIG),
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
    assert committed_steps(root) == [2, NEW_STEP], "the traced save did not commit and retain"

    ops = parse_strace(log.read_text(encoding="utf-8", errors="surrogateescape"), root)
    sim = CrashSim(root, initial, ops)
    sim.check_final(root)  # the trace explains the final tree exactly
    kinds = {op.kind for op in ops}
    assert {"create", "write", "fsync", "rename", "mkdir", "unlink", "rmdir"} <= kinds, kinds
    return Traced(root, initial, ops, sim, capture(initial))


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

    def tree(state: CrashState) -> dict[str, bytes | None]:
        root = sim.materialize(state, tmp_path / f"s-{state.after}-{state.pending}-{id(state)}")
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
    sim: CrashSim, states: list[CrashState], baseline: Baseline, work: Path
) -> dict[tuple[Entry, ...], Verdict]:
    """Write out, recover and check each state; the verdicts, by state."""
    verdicts: dict[tuple[Entry, ...], Verdict] = {}
    for i, state in enumerate(states):
        root = sim.materialize(state, work / f"state-{i}")
        verdicts[state.entries] = evaluate(root, baseline)
        shutil.rmtree(root)
    return verdicts


def history_problems(sim: CrashSim, verdicts: dict[tuple[Entry, ...], Verdict]) -> list[str]:
    """Along the cut points (durable prefixes): a commit, once durable, stays; and the cut
    after the last operation (the save had returned) holds the new step."""
    problems: list[str] = []
    since: int | None = None
    for cut in range(len(sim.ops) + 1):
        verdict = verdicts[sim.state_at(cut).entries]
        if verdict.committed and since is None:
            since = cut
        elif since is not None and not verdict.committed:
            problems.append(f"step {NEW_STEP}, committed after op {since}, is gone after op {cut}")
            break
    if since is None:
        problems.append(f"a power cut after the save returned loses step {NEW_STEP}")
    return problems


# --- the test ----------------------------------------------------------------------------------


def test_every_durable_prefix_leaves_a_consistent_root(
    traced: Traced, tmp_path: Path, fault_trials: Trials
) -> None:
    sim, baseline = traced.sim, traced.baseline
    durable = sim.states()
    ordered: dict[tuple[Entry, ...], CrashState] = {}
    for data in ("lost", "zeros"):
        for state in sim.states(metadata="ordered", unsynced_data=data):
            ordered.setdefault(state.entries, state)
    known = {s.entries for s in durable}
    extra = [s for e, s in ordered.items() if e not in known]
    assert len(durable) >= 4, [sim.describe(s) for s in durable]  # before, commit, latest, trash

    verdicts = replay(sim, durable + extra, baseline, tmp_path)
    history = history_problems(sim, verdicts)

    # The restart, for real: one state per kind, all in one spawn.
    picked: dict[tuple[object, ...], CrashState] = {}
    for state in durable + extra:
        picked.setdefault(verdicts[state.entries].kind, state)
    chosen = list(picked.values())[:MAX_RESTARTS]
    roots = [sim.materialize(s, tmp_path / f"restart-{i}") for i, s in enumerate(chosen)]
    resumed = run_world(resume_world, 2, [str(r) for r in roots], timeout=240)
    restart: dict[tuple[Entry, ...], list[str]] = {}
    for i, (state, root) in enumerate(zip(chosen, roots, strict=True)):
        why: list[str] = []
        committed = verdicts[state.entries].committed
        expect = NEW_STEP if committed else NEW_STEP - 1
        for rank in range(2):
            got = resumed[rank][i]
            if got.get("error") or got.get("step") != expect or not got.get("exact"):
                why.append(f"restart on rank {rank}: {got} (expected step {expect}, exact)")
            elif not got.get("saved_next"):
                why.append(f"restart on rank {rank} did not save step {expect + 1}")
        leftovers = [p.name for p in root.iterdir() if _leftover(p.name)]
        if leftovers:
            why.append(f"the restart left {leftovers} behind")
        keep = {s: v for s, v in baseline.items() if not (committed and s == 1)}
        why += check(root, keep).problems
        restart[state.entries] = why

    for fault, group in ((FAULT, durable), (FAULT_ORDERED, extra)):
        for i, state in enumerate(group, 1):
            verdict = verdicts[state.entries]
            notes = [sim.describe(state)]
            if state.entries in restart:
                notes.append("restarted")
                notes += restart[state.entries]
            survived = not restart.get(state.entries)
            fault_trials.record_check(
                fault,
                f"prefix {i}/{len(group)}",
                verdict.outcome,
                survived=survived,
                detail="; ".join(notes),
            )
    bad = [
        f"{sim.describe(s)}: {verdicts[s.entries].outcome.problems + restart.get(s.entries, [])}"
        for s in durable + extra
        if not verdicts[s.entries].outcome.ok or restart.get(s.entries)
    ]
    assert not bad and not history, "\n".join(history + bad) + "\n" + failed(fault_trials._sink)


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
    verdicts = replay(sim, sim.states(), traced.baseline, tmp_path)
    problems = [p for v in verdicts.values() for p in v.outcome.problems]
    problems += history_problems(sim, verdicts)
    assert any(symptom in p for p in problems), problems
