"""Shared fixtures: real checkpoints written by a real 2-rank torchrun of launch/train.py.

Also the skip policy: the run prints how many tests were skipped, per file and reason, and
fails when a test of the multi-node, full-disk or power-loss files was skipped (the machine
lacked network namespaces, a tmpfs mount, strace or RENAME_EXCHANGE), so that CI cannot stay
green with them silently gone. ``DCKPT_ALLOW_SKIPS=1`` accepts such skips on a machine that
cannot run them (say so wherever the result is reported).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import zygote  # noqa: E402 - tests/ is on the path from the line above


def _train_cmd(ckpt: Path, args: tuple[str, ...], nproc: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), str(REPO / "launch" / "train.py"),
        "--ckpt-dir", str(ckpt), *args,
    ]  # fmt: skip


def _worker_env() -> dict[str, str]:
    # One BLAS thread per rank (2 ranks on 2 cores); a rank that aborts or hangs on a signal
    # prints every thread's Python stack, so a rare failure in CI says where it happened.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def torchrun_train(
    ckpt: Path, *args: str, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run launch/train.py as a torchrun job on gloo; returns the finished process. Its ranks
    are forked from a process that imported torch once (tests/zygote.py: torchrun's contract
    for a standalone job, at half the CPU); ``DCKPT_TEST_ZYGOTE=0``: under torchrun itself."""
    if zygote.enabled():
        return zygote.client().run(
            REPO / "launch" / "train.py", ["--ckpt-dir", str(ckpt), *args], nproc=nproc,
            env=_worker_env(), timeout=timeout,
        )  # fmt: skip
    return subprocess.run(
        _train_cmd(ckpt, args, nproc), capture_output=True, text=True, timeout=timeout,
        env=_worker_env(), check=False,
    )  # fmt: skip


def torchrun_job(
    script: Path,
    args: list[str],
    *,
    env: dict[str, str],
    timeout: float,
    nproc: int = 2,
    cwd: Path | None = None,
    flavor: str = "base",
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N script args``, its
    ranks forked from the zygote that preloaded ``flavor``'s framework (tests/zygote.py), or
    under torchrun itself with ``DCKPT_TEST_ZYGOTE=0``."""
    if zygote.enabled():
        return zygote.client(flavor).run(
            script, args, nproc=nproc, env=env, timeout=timeout, cwd=cwd
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(script), *args]  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False, cwd=cwd
    )


@contextmanager
def torchrun_train_beside(
    ckpt: Path, *args: str, nproc: int = 2, timeout: float = 240
) -> Iterator[Future[subprocess.CompletedProcess[str]]]:
    """``torchrun_train`` on a thread, for a run that shares no root and no log with the runs
    of the body (an uninterrupted reference, a run on a copy of the root): it runs while the body
    runs, filling the cores that a job leaves idle while its processes start and stop (each job
    alone keeps 2 cores about half busy). ``.result()`` is what ``torchrun_train`` returns;
    leaving the block waits for the run (its timeout still holds)."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(torchrun_train, ckpt, *args, nproc=nproc, timeout=timeout)


def torchrun_start(ckpt: Path, *args: str, nproc: int = 2) -> subprocess.Popen[str]:
    """Start launch/train.py under torchrun in its own session (killpg cleans it up); its
    stdout and stderr go to one pipe."""
    return subprocess.Popen(
        _train_cmd(ckpt, args, nproc), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=_worker_env(), start_new_session=True,
    )  # fmt: skip


def torchrun_workers(agent: subprocess.Popen[str]) -> dict[int, Any]:
    """torchrun's worker processes (psutil.Process), by rank (read from their environment)."""
    import psutil

    found: dict[int, Any] = {}
    for proc in psutil.Process(agent.pid).children(recursive=True):
        try:
            rank = proc.environ().get("RANK")
            cmdline = " ".join(proc.cmdline())
        except (psutil.Error, OSError):
            continue
        if rank is not None and "train.py" in cmdline:
            found[int(rank)] = proc
    return found


def losses(log: Path) -> dict[int, float]:
    """The trainer's loss log: step -> loss."""
    out: dict[int, float] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        assert set(rec) == {"step", "loss", "lr", "time", "pid"}
        out[rec["step"]] = rec["loss"]
    return out


def crash_and_resume_matches(tmp_path: Path, extra: list[str], nproc: int = 2) -> None:
    """The example trainer SIGKILLed after step 8 of 10 (saving every 3rd step) and started
    again logs the same losses, bit for bit, as a run that never stopped."""
    from dckpt.root.layout import committed_steps

    args = ["--steps", "10", "--save-every", "3", *extra]
    ref_log = str(tmp_path / "ref.jsonl")
    # The reference shares nothing with the crashed run (its own root and log): it runs beside.
    with torchrun_train_beside(tmp_path / "ref", *args, "--loss-log", ref_log, nproc=nproc) as ref:
        log = tmp_path / "run.jsonl"
        crashed = torchrun_train(
            tmp_path / "run", *args, "--loss-log", str(log), "--crash-at-step", "8", nproc=nproc
        )
        assert crashed.returncode != 0  # it really died (SIGKILL), between the saves of 6 and 9
        # Saves are asynchronous: step 6's may still have been writing when step 8 crashed.
        # Either it committed, or only its tmp dir is left; nothing under a final name is partial.
        committed = committed_steps(tmp_path / "run")
        assert committed in ([3], [3, 6])
        resumed = torchrun_train(tmp_path / "run", *args, "--loss-log", str(log), nproc=nproc)
        assert resumed.returncode == 0, resumed.stderr
    assert ref.result().returncode == 0, ref.result().stderr
    assert f"dckpt resume: step {committed[-1]}" in resumed.stderr
    verified = re.search(
        r"\[ok  \] digests: (\d+) of (\d+) files hashed and matched", resumed.stderr
    )
    assert verified and verified[1] == verified[2] and int(verified[1]) >= 2, resumed.stderr
    total = nproc * (nproc + 1) // 2
    warmup = f"[ok  ] warmup all-reduce: {nproc} ranks answered, sum {total} = {total} on every"
    assert warmup in resumed.stderr, resumed.stderr
    assert "rng           restored on every rank" in resumed.stderr
    want, got = losses(tmp_path / "ref.jsonl"), losses(log)
    assert sorted(got) == list(range(1, 11))
    after = range(committed[-1] + 1, 11)
    assert [got[s] for s in after] == [want[s] for s in after]  # bit-identical, dropout included
    assert committed_steps(tmp_path / "run") == [3, 6, 9, 10]


def dckpt_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the installed `dckpt` command as a user would."""
    cmd = [sys.executable, "-m", "dckpt.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def dckpt_cli_here(*args: str) -> subprocess.CompletedProcess[str]:
    """``dckpt_cli`` in this process: ``dckpt.cli.main(args)`` with its stdout and stderr
    taken, and argparse's exit (bad usage) as the exit code. The same command code, parser and
    exit codes as the installed command, without a process and its imports (boto3, torch for
    ``diff`` and ``export``: about 0.5 to 3 CPU-seconds a call). A test about the installed
    command itself keeps at least one real ``dckpt_cli``. Whatever the command reads from the
    environment it reads from ``os.environ`` here (a monkeypatched variable applies)."""
    import io
    import warnings
    from contextlib import redirect_stderr, redirect_stdout

    from dckpt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), warnings.catch_warnings():
        # as the command's own process filters it (dckpt.cli.main, argv None): DCP's note
        # that a single-process load assumes one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors (2) and --help (0)
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(
        ["dckpt", *args], code, stdout=out.getvalue(), stderr=err.getvalue()
    )


@pytest.fixture(scope="session")
def trained_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with checkpoints at steps 4, 8, 12 from a 2-rank run (read-only: copy to change)."""
    root = tmp_path_factory.mktemp("trained") / "ckpt"
    proc = torchrun_train(root, "--steps", "12", "--save-every", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


@pytest.fixture
def trained_copy(trained_root: Path, tmp_path: Path) -> Path:
    """A private copy of ``trained_root`` that a test may damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(trained_root, dst)
    return dst


# --- skips ------------------------------------------------------------------------------------

REQUIRED = (
    "tests/test_two_node.py",
    "tests/test_memory_tier.py",
    "tests/faults/test_full_disk.py",
    "tests/faults/test_power_loss.py",
)
"""Files whose tests must run, not skip, unless DCKPT_ALLOW_SKIPS=1."""
_SKIPPED: list[tuple[str, str]] = []


# The files that take longest, started first. `make test` runs files in parallel, each file's
# tests on one worker (--dist loadfile), handing out files in collection order; the suite ends
# when its last file does. In alphabetical order the two longest (about three minutes each,
# mostly ranks waiting) came last and ran alone at the end. Measured with --durations on 2
# cores; the order only moves files, every test still runs. (Re-measured file by file once the
# Trainer, Lightning and replay-kill files chained their launches: about 60 s alone for
# preemption and the memory tier, 50 the Trainer and hostile, 45 to 30 the rest here.)
SLOWEST_FIRST = (  # by the time each file took in a run of the suite (2026-12-07), longest first
    "test_resume_train.py",
    "test_two_node.py",
    "test_preemption.py",
    "test_integration_lightning.py",
    "test_memory_tier.py",
    "test_integration_hf_trainer.py",
    "test_integration_accelerate.py",
    "test_replay_kill.py",
    "faults/test_hostile.py",
    "test_s3_train.py",
    "test_s3_second_server.py",
    "test_s3.py",
    "faults/test_power_loss.py",
    "faults/test_external_kill.py",
    "test_lock_refusals.py",
    "faults/test_start_faults.py",
    "test_cli.py",
    "faults/test_kill_phases.py",
    "faults/test_memory_faults.py",
    "test_s3_rank_failure.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def key(item: pytest.Item) -> int:
        try:
            name = Path(str(item.path)).resolve().relative_to(here).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(name, len(rank))

    items.sort(key=key)  # stable: within a file, and among the rest, the order is pytest's


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == _TRIAL_PROPERTY:
                _TRIALS.append(SimpleNamespace(**value))
    if report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        _SKIPPED.append((report.nodeid, reason.removeprefix("Skipped: ")))


def _required_skips() -> list[tuple[str, str]]:
    return [(node, why) for node, why in _SKIPPED if node.startswith(REQUIRED)]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _required_skips() and os.environ.get("DCKPT_ALLOW_SKIPS") != "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _report_skips(tr: Any) -> None:
    by_file: dict[tuple[str, str], int] = {}
    for node, why in _SKIPPED:
        key = (node.split("::")[0], why)
        by_file[key] = by_file.get(key, 0) + 1
    tr.section("dckpt skips")
    tr.write_line(f"{len(_SKIPPED)} test(s) skipped" + (":" if _SKIPPED else ""))
    for (path, why), n in sorted(by_file.items()):
        tr.write_line(f"  {n:>3}  {path}: {why}")
    required = _required_skips()
    if required and os.environ.get("DCKPT_ALLOW_SKIPS") != "1":
        tr.write_line(
            f"FAILED: {len(required)} test(s) of the multi-node, full-disk or power-loss files "
            "were skipped, so what they prove was not checked. Run where they can run (root, "
            "ip netns, tmpfs, strace), or set DCKPT_ALLOW_SKIPS=1 to accept it knowingly."
        )


# --- the fault-injection suite's table (make faults) ------------------------------------------

_TRIALS: list[Any] = []
"""Every trial reported in this process (the controller's, under pytest-xdist)."""


_TRIAL_PROPERTY = "dckpt_fault_trial"


@pytest.fixture
def fault_trials(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Record each trial of a fault for the table printed at the end of the run. The trials
    travel on the test's report (its user properties), so the table is whole when pytest-xdist
    runs the test in a worker process."""
    from fault_kit import Trials

    sink: list[Any] = []
    yield Trials(sink)
    for trial in sink:
        request.node.user_properties.append((_TRIAL_PROPERTY, dict(trial.__dict__)))


def _report_mutants(tr: Any) -> None:
    """The newest mutation scores (``make mutants``, ``make probes``: they take their own
    budget, so they are not part of this run), shown beside the fault table with the commit
    each was made on."""
    tr.section("dckpt mutation score")
    found = False
    for name, what in (("mutants.json", "make mutants (drawn)"), ("mutation.json", "make probes")):
        path = REPO / "build" / name
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rows = report.get("rows", []) if isinstance(report, dict) else report
        run = [r for r in rows if r.get("verdict") in ("killed", "SURVIVED")]
        killed = sum(r["verdict"] == "killed" for r in run)
        if not run:
            continue
        found = True
        meta = report if isinstance(report, dict) else {}
        tr.write_line(
            f"{what}: {killed} of {len(run)} killed ({killed / len(run):.0%}), "
            f"{meta.get('finished', 'date unknown')} on {meta.get('commit', 'an unknown commit')} "
            f"({path.relative_to(REPO)})"
        )
    if not found:
        tr.write_line(
            "no score in build/: `make mutants` (MUTANTS_BUDGET_MIN=40) and `make probes` write one"
        )


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    _report_skips(terminalreporter)
    trials = _TRIALS
    if not trials:
        return
    rows: dict[str, list[int]] = {}
    for t in trials:
        row = rows.setdefault(t.fault, [0, 0, 0])
        row[0] += 1
        row[1] += int(t.survived)
        row[2] += t.lost
    width = max(len(f) for f in rows)
    tr = terminalreporter
    tr.section("dckpt fault injection")
    tr.write_line(f"{'fault':<{width}}  {'trials':>6}  {'survived':>8}  {'data lost':>9}")
    for fault, (n, ok, lost) in rows.items():
        tr.write_line(f"{fault:<{width}}  {n:>6}  {ok:>8}  {lost:>9}")
    total = [sum(r[i] for r in rows.values()) for i in range(3)]
    tr.write_line(f"{'total':<{width}}  {total[0]:>6}  {total[1]:>8}  {total[2]:>9}")
    for t in trials:
        if not t.survived or t.lost:
            tr.write_line(f"FAILED TRIAL {t.fault} / {t.case}: {t.detail}")
    _report_mutants(tr)
    out = os.environ.get("DCKPT_FAULTS_JSON")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps([t.__dict__ for t in trials], indent=1, default=str) + "\n")
