"""The verified memory tier end to end, with real processes: a lost worker, a lost node, a
flipped bit, both nodes lost, a full memory, and the memory bound.

Role: proves the issue's cases on real jobs of launch/train.py (gloo, CPU), no mocks. Every
run trains ``STEPS`` steps, saving to the durable root every ``SAVE_EVERY`` and to the memory
tier every ``MEMORY_EVERY`` steps in between (``--memory-every``); the resume must take the
newest of the two tiers, prove every byte against the writer's digest, and log the same
losses, bit for bit, as an uninterrupted reference run (2 ranks, no memory tier: so the
memory saves are also shown not to perturb training; it runs beside the first tests).

- ``test_worker_killed_node_lives``: one node, ``torchrun --max-restarts 1``; rank 1 is
  SIGKILLed from outside right after memory step 8 committed; torchrun restarts the workers
  in place, the node's keeper survives (same pid), the restart resumes step 8 from local
  memory. (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as launch/netns_cluster.sh sets: with
  torch's shared rendezvous store the restarted workers read the dead round's gloo
  addresses and fail to connect, a torch matter, not dckpt's.)
- ``lost_node`` (module fixture): a two-node job (two network namespaces,
  launch/netns_cluster.sh) loses node B (every process, its keeper too) right after node B's
  memory step 8 was replicated to node A. From that state, at once:
  - ``test_whole_node_lost_uses_partner_replica``: node B's memory wiped, both nodes requeued:
    node B's rank fetches its file from node A's (surviving) keeper;
  - ``test_flipped_bit_in_replica_falls_back_to_durable``: (a copy) the replica of node B's
    file on node A has a flipped byte, node B's memory wiped: the memory tier is refused
    (digest mismatch named) and the durable step 6 is used;
  - ``test_flipped_bit_in_own_copy_uses_replica``: (a copy) node B's own copy has a flipped
    byte, the replica is intact: the replica is used;
  - ``test_both_nodes_lost_uses_durable``: (a copy) both nodes' memory wiped: the durable tier.
  The copies run as two-"node" jobs on this host's network (two processes started with
  torchrun's environment, ``GROUP_RANK`` 0 and 1: the memory tier's node index), beside the
  requeue, to fit the time budget; the resume code does not know the difference.
- ``size_runs`` (module fixture): two single-rank jobs at once, each on a private tmpfs:
  - ``test_memory_full_fails_clearly``: a 1 MiB tmpfs as the memory dir: the memory save
    fails naming the memory tier and saying the durable checkpoints are untouched; the
    durable checkpoint verifies (the trainer exits non-zero: the error of a save is raised
    by the next ``save()``);
  - ``test_memory_bound_after_fifty_saves``: the memory used (statvfs) once the first memory
    save is done (its file and its reserved spare) and after fifty differ by under 1 %.

Every keeper a test starts is stopped, every tmpfs unmounted, every namespace removed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, losses, torchrun_workers
from proc_kit import pid_alive
from test_two_node import Cluster, _netns_list, _netns_unavailable

from dckpt.root.layout import committed_steps, list_checkpoints, step_dir_name
from dckpt.root.verify import verify_checkpoint
from dckpt.tiers.keeper_client import read_keeper_file
from dckpt.tiers.memory_layout import committed_memory_steps, own_dir, replica_dir

pytestmark = [pytest.mark.multiproc]

STEPS, SAVE_EVERY, MEMORY_EVERY = 12, 6, 2
TRAIN = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
MEMORY = ["--memory-every", str(MEMORY_EVERY)]
KILL_AFTER = 8  # the memory step after which a worker or a node is lost
DURABLE_BEFORE = 6  # the newest durable step then
START_TIMEOUT = 120.0
RUN_TIMEOUT = 180.0


# --- helpers ----------------------------------------------------------------------------------


def _is_keeper(pid: int) -> bool:
    try:
        return b"dckpt.tiers.keeper" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _stop_keepers(memory_dir: Path) -> None:
    """Stop the keeper of every ``node-*`` under ``memory_dir`` (SIGTERM: it stops cleanly),
    and wait until each is gone: keepers are detached and would outlive the test."""
    pids = []
    for node in sorted(memory_dir.glob("node-*")):
        rec = read_keeper_file(node)
        if rec is not None and pid_alive(rec["pid"]) and _is_keeper(rec["pid"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec["pid"], signal.SIGTERM)
            pids.append(rec["pid"])
    deadline = time.monotonic() + 10
    for pid in pids:
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def memory_dirs() -> Iterator[list[Path]]:
    """Append each memory dir a test uses: their keepers are stopped at the end."""
    dirs: list[Path] = []
    yield dirs
    for d in dirs:
        _stop_keepers(d)


def _wait_until(
    cond: Callable[[], bool],
    procs: list[subprocess.Popen[bytes]],
    what: str,
    logs: Callable[[], str],
) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if cond():
            return
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"exited ({p.returncode}) before {what}\n{logs()}")
        time.sleep(0.005)
    pytest.fail(f"not {what} within {START_TIMEOUT} s\n{logs()}")


def _flip_byte(path: Path) -> None:
    """Flip every bit of one byte in the middle of the file (in a tensor's bytes)."""
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))


def _tail(path: Path, chars: int = 6000) -> str:
    try:
        return f"--- {path.name} ---\n" + path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"--- {path.name}: absent ---"


def _resume_line(text: str) -> str:
    """The first line of the last resume report."""
    lines = [ln for ln in text.splitlines() if ln.startswith("dckpt resume: step ")]
    assert len(lines) >= 1, text
    return lines[-1]


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A private tmpfs at ``path`` (root only); unmounted at the end, its keepers stopped."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a private tmpfs")
    path.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield path
    finally:
        _stop_keepers(path)
        if subprocess.run(["umount", str(path)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun_cmd(root: Path, *args: str, nproc: int, max_restarts: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
        str(REPO / "launch" / "train.py"), "--ckpt-dir", str(root), *args,
    ]  # fmt: skip


@dataclass
class Job:
    """launch/train.py as ``len(nodes)`` processes given torchrun's environment, without its
    agent (one torch import less per job): rank r runs on node ``nodes[r]`` (``GROUP_RANK``,
    the memory tier's node index), gloo over 127.0.0.1. Rank r's output goes to
    ``<out>.rank<r>.log``."""

    root: Path
    args: list[str]
    out: Path
    nodes: tuple[int, ...] = (0, 0)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> Job:
        port = str(_free_port())
        cmd = [sys.executable, str(REPO / "launch" / "train.py"), "--ckpt-dir", str(self.root)]
        for rank, node in enumerate(self.nodes):
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "RANK": str(rank),
                "WORLD_SIZE": str(len(self.nodes)),
                "LOCAL_RANK": str(self.nodes[:rank].count(node)),
                "LOCAL_WORLD_SIZE": str(self.nodes.count(node)),
                "GROUP_RANK": str(node),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
            with open(self._log(rank), "wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        [*cmd, *self.args],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )
        return self

    def _log(self, rank: int) -> Path:
        return self.out.with_name(f"{self.out.name}.rank{rank}.log")

    def wait(self) -> list[int | None]:
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=RUN_TIMEOUT))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def finish(self) -> str:
        """Every rank must exit 0; returns their output."""
        codes = self.wait()
        assert codes == [0] * len(self.nodes), f"exit codes {codes}\n{self.text()[-8000:]}"
        return self.text()

    def text(self) -> str:
        return "\n".join(self._log(r).read_text(errors="replace") for r in range(len(self.nodes)))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


# --- the reference ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], dict[int, float]]]:
    """The losses of an uninterrupted run without the memory tier (2 ranks, one node); it
    runs beside the module's tests; calling the fixture's value waits for it."""
    tmp = tmp_path_factory.mktemp("memory_ref")
    log = tmp / "ref.jsonl"
    job = Job(tmp / "ckpt", [*TRAIN, "--loss-log", str(log)], tmp / "ref").start()

    @functools.cache
    def get() -> dict[int, float]:
        job.finish()
        got = losses(log)
        assert sorted(got) == list(range(1, STEPS + 1))
        return got

    try:
        yield get
    finally:
        job.kill()


def _logged(log: Path) -> list[tuple[int, float]]:
    """Every (step, loss) line of a loss log, in order (a restart appends to the same log)."""
    return [(r["step"], r["loss"]) for r in map(json.loads, log.read_text().splitlines())]


def _check_losses(log: Path, steps: range, reference: dict[int, float]) -> None:
    """The log holds ``steps``, in order, after whatever came before them; every loss it
    holds equals the uninterrupted reference's at that step, bit for bit (dropout too)."""
    logged = _logged(log)
    assert [s for s, _ in logged[-len(steps) :]] == list(steps), logged
    assert logged == [(s, reference[s]) for s, _ in logged]


# --- 1: a worker lost, the node lives -----------------------------------------------------------


def test_worker_killed_node_lives(
    tmp_path: Path, reference: Callable[[], dict[int, float]], memory_dirs: list[Path]
) -> None:
    root, memory, log = tmp_path / "ckpt", tmp_path / "mem", tmp_path / "loss.jsonl"
    memory_dirs.append(memory)
    out = tmp_path / "torchrun.log"
    args = [*TRAIN, *MEMORY, "--memory-dir", str(memory), "--loss-log", str(log)]
    with open(out, "wb") as f:
        agent = subprocess.Popen(
            _torchrun_cmd(root, *args, nproc=2, max_restarts=1),
            stdout=f,
            stderr=subprocess.STDOUT,
            # As launch/netns_cluster.sh: with torch's shared rendezvous store, the restarted
            # workers read the dead round's gloo addresses (same store, same keys) and fail.
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "LOGLEVEL": "INFO",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            },
            start_new_session=True,
        )
    try:
        node = memory / "node-0"
        workers: dict[int, Any] = {}

        def found() -> bool:
            workers.update(torchrun_workers(agent))  # type: ignore[arg-type]
            return set(workers) == {0, 1}

        _wait_until(found, [agent], "both workers started", lambda: _tail(out))
        committed = own_dir(node) / step_dir_name(KILL_AFTER) / "manifest.json"
        _wait_until(committed.exists, [agent], f"memory step {KILL_AFTER}", lambda: _tail(out))
        workers[1].kill()  # SIGKILL, as the OOM killer or a segfault would
        # Nothing can commit now (every save needs rank 1): the newest memory step is final.
        newest = committed_memory_steps(own_dir(node))[-1]
        keeper = read_keeper_file(node)
        assert keeper is not None and pid_alive(keeper["pid"])
        assert agent.wait(timeout=RUN_TIMEOUT) == 0, _tail(out)
    finally:
        if agent.poll() is None:
            for worker in torchrun_workers(agent).values():  # type: ignore[arg-type]
                with contextlib.suppress(Exception):
                    worker.kill()
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=30)
    text = out.read_text(errors="replace")
    assert newest in (KILL_AFTER, KILL_AFTER + MEMORY_EVERY), newest
    assert newest > committed_steps(root)[0] == DURABLE_BEFORE  # memory is newer than durable
    # torchrun restarted the workers in place: two runs, the second resumed.
    assert "dckpt resume: no committed checkpoint; starting from scratch" in text, text
    assert "restart_count=1" in text, text
    assert f"train: 2 ranks, starting after step {newest}, to {STEPS}" in text, text
    line = _resume_line(text)
    assert line.startswith(f"dckpt resume: step {newest} from the memory tier (local memory"), line
    assert "[ok  ] memory: rank 0: local memory; rank 1: local memory" in text, text
    assert "rng           restored on every rank" in text, text
    # The keeper outlived its workers and served the restart: the same process, still alive.
    after = read_keeper_file(memory / "node-0")
    assert after is not None and after["pid"] == keeper["pid"] and pid_alive(keeper["pid"])
    _check_losses(log, range(newest + 1, STEPS + 1), reference())
    assert {s for s, _ in _logged(log)} == set(range(1, STEPS + 1))
    assert committed_steps(root) == [DURABLE_BEFORE, STEPS]


# --- 2-4: a node lost ---------------------------------------------------------------------------


@dataclass
class LostNode:
    """What the module's two-node run left when node B was lost, and the runs started from it."""

    cluster: Cluster
    root: Path
    memory: Path
    step: int  # the memory step both nodes hold a copy of (node B's on node A)
    keeper_a: int  # node A's keeper's pid, alive
    requeue: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]
    requeue_log: Path
    copies: dict[str, Job]


def _arg(job: Job, flag: str) -> Path:
    return Path(job.args[job.args.index(flag) + 1])


def _memory_of(job: Job) -> Path:
    return _arg(job, "--memory-dir")


def _copy_state(src_root: Path, src_memory: Path, dst: Path) -> tuple[Path, Path]:
    """A copy of the root and of both nodes' memory, without the live keeper's record (a
    keeper of the copy is started by the resume)."""
    root, memory = dst / "ckpt", dst / "mem"
    shutil.copytree(src_root, root)
    shutil.copytree(src_memory, memory, ignore=shutil.ignore_patterns("keeper.json"))
    return root, memory


@pytest.fixture(scope="module")
def lost_node(
    tmp_path_factory: pytest.TempPathFactory, reference: Callable[[], dict[int, float]]
) -> Iterator[LostNode]:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("lost_node")
    root, memory, first_log = tmp / "ckpt", tmp / "mem", tmp / "first.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv("DCKPT_PYTHON", sys.executable)  # the namespaces run this interpreter
    cluster = Cluster(tmp)
    copies: dict[str, Job] = {}
    try:
        cluster.up()
        args = [*TRAIN, *MEMORY, "--ckpt-dir", str(root), "--memory-dir", str(memory)]
        node_a = cluster.start("A", "job-1", "a1", *args, "--loss-log", str(first_log))
        node_b = cluster.start("B", "job-1", "b1", *args, "--loss-log", str(first_log))
        workers: dict[int, Any] = {}

        def found() -> bool:
            workers.update(torchrun_workers(node_b))  # type: ignore[arg-type]
            return 1 in workers

        _wait_until(found, [node_a, node_b], "node B's worker started", cluster.tails)
        # Node B's step is on node A (so node A's own copy committed before it): lose node B.
        replica = replica_dir(memory / "node-0", 1) / step_dir_name(KILL_AFTER) / "manifest.json"
        _wait_until(replica.exists, [node_a, node_b], "node B's replica on A", cluster.tails)
        workers[1].kill()  # first the worker (no step goes on), then every process of node B
        cluster.kill_node("B")
        assert node_b.wait(timeout=10) == -9
        # It fails by itself (gloo sees the peer gone); a bound, not a timing: a loaded
        # machine (a benchmark beside the suite) once needed more than 60 s to wind down.
        assert node_a.wait(timeout=150) != 0, cluster.tail("a1")
        assert committed_steps(root) == [DURABLE_BEFORE]
        before = _logged(first_log)
        assert before == [(s, reference()[s]) for s in range(1, len(before) + 1)]

        # The memory step both nodes can be restored from, with node B's memory gone.
        own_a = set(committed_memory_steps(own_dir(memory / "node-0")))
        replica_b = set(committed_memory_steps(replica_dir(memory / "node-0", 1)))
        both = sorted(own_a & replica_b)
        assert both and both[-1] in (KILL_AFTER, KILL_AFTER + MEMORY_EVERY), (own_a, replica_b)
        step = both[-1]
        keeper_a = read_keeper_file(memory / "node-0")
        assert keeper_a is not None and pid_alive(keeper_a["pid"])  # node A's keeper lives on
        assert step in committed_memory_steps(own_dir(memory / "node-1"))

        # The copies, each damaged its own way, run beside the requeue.
        name = f"{step_dir_name(step)}/rank-00001.mem"
        for case in ("replica_flipped", "own_flipped", "both_lost"):
            croot, cmem = _copy_state(root, memory, tmp / case)
            clog = str(tmp / case / "loss.jsonl")
            cargs = [*TRAIN, *MEMORY, "--memory-dir", str(cmem), "--loss-log", clog]
            copies[case] = Job(croot, cargs, tmp / case / "out", nodes=(0, 1))
        _flip_byte(replica_dir(_memory_of(copies["replica_flipped"]) / "node-0", 1) / name)
        shutil.rmtree(_memory_of(copies["replica_flipped"]) / "node-1")
        _flip_byte(own_dir(_memory_of(copies["own_flipped"]) / "node-1") / name)
        shutil.rmtree(_memory_of(copies["both_lost"]))

        # Node B's machine is gone, and its memory with it; its keeper died with the node.
        shutil.rmtree(memory / "node-1")
        again_log = tmp / "again.jsonl"
        args = [*args, "--loss-log", str(again_log)]
        requeue = (
            cluster.start("A", "job-2", "a2", *args),
            cluster.start("B", "job-2", "b2", *args),
        )
        for c in copies.values():
            c.start()
        yield LostNode(cluster, root, memory, step, keeper_a["pid"], requeue, again_log, copies)
    finally:
        mp.undo()
        for c in copies.values():
            c.kill()
            _stop_keepers(_memory_of(c))
        cluster.down()  # every process of both nodes, their keepers included
    assert not set(cluster.namespaces) & set(_netns_list().split())


def _wait_node(lost: LostNode, proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a node did not finish within {RUN_TIMEOUT} s\n" + lost.cluster.tails())


def test_whole_node_lost_uses_partner_replica(
    lost_node: LostNode, reference: Callable[[], dict[int, float]]
) -> None:
    lost = lost_node
    for proc in lost.requeue:
        assert _wait_node(lost, proc) == 0, lost.cluster.tails()
    text = lost.cluster.logs["a2"].read_text(errors="replace")
    line = _resume_line(text)
    want = f"dckpt resume: step {lost.step} from the memory tier (memory, ranks [1] from "
    assert line.startswith(want + "other nodes"), lost.cluster.tails()
    # Node B lost its memory: rank 1 fetched both files (the de-duplicated layout) from node
    # A's keeper, its own from A's replica of B, each proven as it arrived.
    assert "[ok  ] memory: rank 0: local memory; rank 1: from node 0" in text, text
    assert "[ok  ] warmup all-reduce: 2 ranks answered, sum 3 = 3 on every rank" in text, text
    assert "rng           restored on every rank" in text, text
    _check_losses(lost.requeue_log, range(lost.step + 1, STEPS + 1), reference())
    # Node A's keeper served it: the one that survived the loss, still the node's keeper.
    rec = read_keeper_file(lost.memory / "node-0")
    assert rec is not None and rec["pid"] == lost.keeper_a and pid_alive(lost.keeper_a)
    assert committed_steps(lost.root) == [DURABLE_BEFORE, STEPS]
    for entry in list_checkpoints(lost.root):
        if entry.status == "committed":
            assert verify_checkpoint(entry.path).ok, entry.path


def test_flipped_bit_in_replica_falls_back_to_durable(
    lost_node: LostNode, reference: Callable[[], dict[int, float]]
) -> None:
    job = lost_node.copies["replica_flipped"]
    text = job.finish()
    root, log = job.root, _arg(job, "--loss-log")
    line = _resume_line(text)
    durable = root / step_dir_name(DURABLE_BEFORE)
    assert line == f"dckpt resume: step {DURABLE_BEFORE} from {durable}", text
    warning = next(
        (ln for ln in text.splitlines() if f"memory tier: step {lost_node.step} not used" in ln),
        None,
    )
    assert warning is not None, text
    assert "warning: memory tier:" in warning, warning
    assert "rank 1" in warning and "digest mismatch" in warning, warning
    assert "node-0/replica/node-1" in warning, warning  # node A's replica, named
    assert re.search(r"\[ok  \] digests: (\d+) of \1 files hashed and matched", text), text
    _check_losses(log, range(DURABLE_BEFORE + 1, STEPS + 1), reference())
    assert committed_steps(root) == [DURABLE_BEFORE, STEPS]


def test_flipped_bit_in_own_copy_uses_replica(
    lost_node: LostNode, reference: Callable[[], dict[int, float]]
) -> None:
    job = lost_node.copies["own_flipped"]
    text = job.finish()
    root, log = job.root, _arg(job, "--loss-log")
    line = _resume_line(text)
    want = f"dckpt resume: step {lost_node.step} from the memory tier (memory, ranks [1] from "
    assert line.startswith(want + "other nodes"), text
    assert "rank 0: local memory; rank 1: from node 0" in text, text
    assert "rank 1: the copy of rank-00001.mem in its node's memory did not match" in text, text
    _check_losses(log, range(lost_node.step + 1, STEPS + 1), reference())
    assert committed_steps(root) == [DURABLE_BEFORE, STEPS]


def test_both_nodes_lost_uses_durable(
    lost_node: LostNode, reference: Callable[[], dict[int, float]]
) -> None:
    job = lost_node.copies["both_lost"]
    text = job.finish()
    root, log = job.root, _arg(job, "--loss-log")
    line = _resume_line(text)
    durable = root / step_dir_name(DURABLE_BEFORE)
    assert line == f"dckpt resume: step {DURABLE_BEFORE} from {durable}", text
    assert "Traceback" not in text and "memory tier: step" not in text, text
    assert re.search(r"\[ok  \] digests: (\d+) of \1 files hashed and matched", text), text
    _check_losses(log, range(DURABLE_BEFORE + 1, STEPS + 1), reference())
    assert committed_steps(root) == [DURABLE_BEFORE, STEPS]


# --- 5-6: the memory's size ---------------------------------------------------------------------


def _own_steps_any(node: Path) -> list[int]:
    """Steps under ``own/``: committed, in flight or abandoned."""
    try:
        names = [p.name for p in own_dir(node).iterdir()]
    except OSError:
        return []
    return [int(n[5:13]) for n in names if n.startswith("step-") and n[5:13].isdigit()]


def _bytes_used_on(mount: Path) -> Callable[[], int]:
    """Bytes used on the private tmpfs ``mount`` since this call (pages, as the kernel counts
    them: files, directories, the keeper's record and log, reserved spares)."""

    def used() -> int:
        st = os.statvfs(mount)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    base = used()
    return lambda: used() - base


@dataclass
class SizeRuns:
    """Single-rank jobs started together: two with a private tmpfs as their memory dir, one
    too small for a memory save, one doing fifty of them; and the stale-memory case."""

    full: Job
    full_memory: Path
    bound: Job
    bound_memory: Path
    stale: Job  # started again after its root was deleted, its memory kept
    used: Callable[[], int]  # bytes used on the bound job's tmpfs since before it started
    file_size: int  # the bound job's memory file
    after_one: int  # bytes used once its first memory save was done


@pytest.fixture(scope="module")
def size_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SizeRuns]:
    tmp = tmp_path_factory.mktemp("memory_size")
    with _tmpfs(tmp / "full", "1m") as full, _tmpfs(tmp / "bound", "64m") as bound:
        used = _bytes_used_on(bound)
        args = ["--steps", "4", "--save-every", "2", "--memory-every", "3"]
        full_args = [*args, "--memory-dir", str(full)]
        full_job = Job(tmp / "ckpt-full", full_args, tmp / "full-out", nodes=(0,))
        args = ["--steps", "51", "--memory-every", "1", "--save-every", "1000"]
        bound_args = [*args, "--memory-dir", str(bound)]
        bound_job = Job(tmp / "ckpt-bound", bound_args, tmp / "bound-out", nodes=(0,))
        # The stale-memory case: a short run, then the same command on a deleted root.
        args = ["--steps", "2", "--memory-every", "1", "--save-every", "100"]
        stale_args = [*args, "--memory-dir", str(tmp / "stale-mem")]
        stale_job = Job(tmp / "ckpt-stale", stale_args, tmp / "stale-out", nodes=(0,))
        again = Job(tmp / "ckpt-stale", stale_args, tmp / "stale-again", nodes=(0,))
        try:
            full_job.start()
            bound_job.start()
            stale_job.start()
            node = bound / "node-0"
            first = own_dir(node) / step_dir_name(1) / "rank-00000.mem"
            reserved = node / "spare" / "own" / "rank-00000.mem@reserved"
            size = 0

            def first_save_done() -> bool:
                # Its spare reserved in full; or the second save began (saves run one after
                # another, so the first one, reserve included, finished).
                nonlocal size
                try:
                    size = first.stat().st_size
                    if reserved.stat().st_blocks * 512 >= size:
                        return True
                except OSError:
                    pass
                return size > 0 and any(s >= 2 for s in _own_steps_any(node))

            _wait_until(first_save_done, bound_job.procs, "the first memory save", bound_job.text)
            after_one = used()
            stale_job.finish()
            assert committed_memory_steps(own_dir(tmp / "stale-mem" / "node-0")) == [1]
            shutil.rmtree(stale_job.root)
            again.start()  # beside the bound job's fifty saves
            yield SizeRuns(full_job, full, bound_job, bound, again, used, size, after_one)
        finally:
            for job in (full_job, bound_job, stale_job, again):
                job.kill()
            _stop_keepers(tmp / "stale-mem")


def test_memory_full_fails_clearly(size_runs: SizeRuns) -> None:
    """A memory tier too small for one rank's state (1.7 MB into 1 MiB): the memory save
    fails, clearly, and training goes on: the durable checkpoints before and after it are
    committed and whole."""
    job, node = size_runs.full, size_runs.full_memory / "node-0"
    codes = job.wait()
    text = job.text()
    assert codes == [0], text  # a failed memory save is logged, not raised by the next save()
    assert "dckpt: preparing the memory save of step 3 failed, nothing was committed" in text
    assert "the memory tier at" in text and "could not hold rank 0's" in text, text
    assert "No space left on device" in text, text
    assert "the durable checkpoints are untouched" in text, text
    assert "Training goes on; the next memory save tries again." in text, text
    left = sorted(p.name for p in own_dir(node).iterdir())
    assert left == [], left  # nothing committed, not even a half-written tmp dir
    assert committed_steps(job.root) == [2, 4]
    for step in (2, 4):
        result = verify_checkpoint(job.root / step_dir_name(step))
        assert result.ok, result.problems


def test_memory_bound_after_fifty_saves(size_runs: SizeRuns) -> None:
    """The memory the tier holds once its first save is done (the file, and the spare it
    reserves for the next) is what it holds after fifty, within 1 %: retired files are
    reused, nothing accumulates."""
    runs = size_runs
    text = runs.bound.finish()
    after_fifty = runs.used()
    assert text.count("to memory |") == 50, text
    assert committed_memory_steps(own_dir(runs.bound_memory / "node-0")) == [50]
    size, after_one = runs.file_size, runs.after_one
    assert 2 * size <= after_one < 3 * size, (size, after_one)  # this save and its spare
    assert abs(after_fifty - after_one) <= 0.01 * after_one, (after_one, after_fifty)


def test_fresh_root_ignores_stale_memory(size_runs: SizeRuns) -> None:
    """A memory checkpoint belongs to the root it was saved for. A run saved step 1 to memory
    and step 2 to its root; the root was then deleted and the same command started again (a
    new run in its place: same path, same config, the node's keeper still up): it must start
    from scratch, not resume step 1 of a root that is gone."""
    text = size_runs.stale.finish()
    assert "dckpt resume: no committed checkpoint; starting from scratch" in text, text
    assert "from the memory tier" not in text, text
