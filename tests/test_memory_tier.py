"""The verified memory tier end to end, with real processes: a lost worker, a lost node, a
flipped bit, both nodes lost, a full memory, the memory bound, and what an outside peer can do.

Role: proves the issue's cases on real jobs of launch/train.py (gloo, CPU), no mocks. Every
run trains ``STEPS`` steps, saving to the durable root every ``SAVE_EVERY`` and to the memory
tier every ``MEMORY_EVERY`` steps in between (``--memory-every``); the resume must take the
newest of the two tiers, prove every byte against the writer's digest (the manifest from the
root's ledger, ``ROOT/memory/``), and log the same losses, bit for bit, as an uninterrupted
reference run (2 ranks, no memory tier: so the memory saves are also shown not to perturb
training; it runs beside the first tests).

- ``test_worker_killed_node_lives``: one node, ``torchrun --max-restarts 1``; rank 1 is
  SIGKILLed from outside right after memory step 8 committed; torchrun restarts the workers
  in place, and the restart resumes the newest memory step from the node's memory, which
  outlived the workers (it is a directory, no process holds it).
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as launch/netns_cluster.sh sets: with torch's
  shared rendezvous store the restarted workers read the dead round's gloo addresses and fail
  to connect, a torch matter, not dckpt's.)
- ``lost_node`` (module fixture): a two-node job (two network namespaces,
  launch/netns_cluster.sh) loses node B (every process) right after node B's file of memory
  step 8 arrived, verified, at node A (sent over dckpt's gloo group). From that state, at once:
  - ``test_whole_node_lost_uses_partner_replica``: node B's memory wiped, both nodes requeued:
    node A's ranks send node B's rank the files it lacks, hashed as they arrive;
  - ``test_flipped_bit_in_replica_falls_back_to_durable``: (a copy) the replica of node B's
    file on node A has a flipped byte, node B's memory wiped: no intact copy of the step is
    left, so its record is quarantined (the damage named) and the durable step 6 is used (or,
    when the loss came after the next memory save but before it retired step 8, memory step
    8, which node A still holds whole);
  - ``test_flipped_bit_in_own_copy_uses_replica``: (a copy) node B's own copy has a flipped
    byte, the replica is intact: the replica is used;
  - ``test_both_nodes_lost_uses_durable``: (a copy) both nodes' memory wiped: the durable
    tier, and the report says why the memory step was not used.
  The copies run as two-"node" jobs on this host's network (two processes started with
  torchrun's environment, ``GROUP_RANK`` 0 and 1: the memory tier's node index), beside the
  requeue, to fit the time budget; the resume code does not know the difference.
- ``size_runs`` (module fixture): single-rank jobs at once, each on a private tmpfs:
  - ``test_memory_full_fails_clearly``: a 1 MiB tmpfs as the memory dir: the memory save
    fails naming the memory tier and saying the durable checkpoints are untouched; training
    goes on, the durable checkpoints verify;
  - ``test_memory_bound_after_fifty_saves``: the memory used (statvfs) once the first memory
    save is done (its file and its reserved spare) and at the fiftieth differ by under 1 %;
    and once the run ended well (its last checkpoint durable) the memory is freed;
  - ``test_fresh_root_ignores_stale_memory``: a run killed after its memory saves, its root
    then deleted: the same command starts from scratch (the memory has no record in the root).
- ``test_no_listener_private_files_and_planted_steps``: a two-"node" memory job with every
  Python ``socket.bind`` in its ranks logged by an audit hook: none happens; at every look its
  ranks listen only on gloo's loopback ports (one per process group: training's and dckpt's
  two) and rank 0 on the rendezvous store's; no process is started; every memory file is 0600
  in 0700 directories; then a step planted in a node's memory, without the job's record, is
  listed by ``dckpt ls`` as unrecorded and never restored.
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
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, dckpt_cli, losses, torchrun_workers
from test_two_node import Cluster, _netns_list, _netns_unavailable

from dckpt.root.layout import committed_steps, list_checkpoints, step_dir_name
from dckpt.root.memory_ledger import DirectoryLedger
from dckpt.root.verify import verify_checkpoint
from dckpt.tiers.memory_layout import own_dir, replica_dir

pytestmark = [pytest.mark.multiproc]

STEPS, SAVE_EVERY, MEMORY_EVERY = 12, 6, 2
TRAIN = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
MEMORY = ["--memory-every", str(MEMORY_EVERY)]
KILL_AFTER = 8  # the memory step after which a worker or a node is lost
DURABLE_BEFORE = 6  # the newest durable step then
START_TIMEOUT = 120.0
RUN_TIMEOUT = 180.0


# --- helpers ----------------------------------------------------------------------------------


def _held(parent: Path, name: str) -> list[int]:
    """Steps under ``parent`` (a node's ``own/`` or ``replica/node-k/``) holding file ``name``."""
    try:
        dirs = list(parent.iterdir())
    except OSError:
        return []
    return sorted(int(d.name[5:]) for d in dirs if (d / name).is_file() and d.name[5:].isdigit())


def _recorded(root: Path) -> list[int]:
    """Memory steps committed: their manifests are in the root's ledger."""
    return DirectoryLedger(root).steps()


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
    """A private tmpfs at ``path`` (root only); unmounted at the end."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a private tmpfs")
    path.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield path
    finally:
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
    env: dict[str, str] = field(default_factory=dict)

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
                **self.env,
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
    tmp_path: Path, reference: Callable[[], dict[int, float]]
) -> None:
    root, memory, log = tmp_path / "ckpt", tmp_path / "mem", tmp_path / "loss.jsonl"
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
        committed = root / "memory" / f"{step_dir_name(KILL_AFTER)}.json"
        _wait_until(committed.exists, [agent], f"memory step {KILL_AFTER}", lambda: _tail(out))
        workers[1].kill()  # SIGKILL, as the OOM killer or a segfault would
        # Nothing can commit now (every save needs rank 1): the newest memory step is final.
        newest = _recorded(root)[-1]
        for rank in (0, 1):  # both files outlive their processes: no process holds them
            assert newest in _held(own_dir(node), f"rank-{rank:05d}.mem"), newest
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
    assert f"against the manifest in {root / 'memory' / step_dir_name(newest)}.json" in text
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
    step: int  # the newest memory step node A alone holds every file of (B's as a replica)
    older: int | None
    """The newest memory step before ``step`` that node A alone still holds every file of, if
    any (the ledger keeps two records): restorable, and newer than the durable step 6 when
    the kill landed after the memory save of step 10, before it retired step 8."""
    requeue: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]
    requeue_log: Path
    copies: dict[str, Job]


def _arg(job: Job, flag: str) -> Path:
    return Path(job.args[job.args.index(flag) + 1])


def _memory_of(job: Job) -> Path:
    return _arg(job, "--memory-dir")


def _copy_state(src_root: Path, src_memory: Path, dst: Path) -> tuple[Path, Path]:
    """A copy of the root (its ledger too) and of both nodes' memory."""
    root, memory = dst / "ckpt", dst / "mem"
    shutil.copytree(src_root, root)
    shutil.copytree(src_memory, memory)
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
        # Node B's file of the step is on node A (sent after the step committed): lose node B.
        replica = replica_dir(memory / "node-0", 1) / step_dir_name(KILL_AFTER) / "rank-00001.mem"
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

        # The newest memory step node A alone can restore, with node B's memory gone: recorded
        # in the root, node A's own file, and node B's file as the replica node A keeps.
        own_a = set(_held(own_dir(memory / "node-0"), "rank-00000.mem"))
        replica_b = set(_held(replica_dir(memory / "node-0", 1), "rank-00001.mem"))
        both = sorted(own_a & replica_b & set(_recorded(root)))
        assert both and both[-1] in (KILL_AFTER, KILL_AFTER + MEMORY_EVERY), (own_a, replica_b)
        step = both[-1]
        older = both[-2] if len(both) > 1 else None
        assert step in _held(own_dir(memory / "node-1"), "rank-00001.mem")

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

        # Node B's machine is gone, and its memory with it.
        shutil.rmtree(memory / "node-1")
        again_log = tmp / "again.jsonl"
        args = [*args, "--loss-log", str(again_log)]
        requeue = (
            cluster.start("A", "job-2", "a2", *args),
            cluster.start("B", "job-2", "b2", *args),
        )
        for c in copies.values():
            c.start()
        yield LostNode(cluster, root, memory, step, older, requeue, again_log, copies)
    finally:
        mp.undo()
        for c in copies.values():
            c.kill()
        cluster.down()  # every process of both nodes
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
    want = f"dckpt resume: step {lost.step} from the memory tier (ranks [1] from other nodes'"
    assert line.startswith(want), lost.cluster.tails()
    # Node B lost its memory: node A's rank sent it both files (the de-duplicated layout),
    # node A's own and the replica node A kept of node B's, each proven as it arrived.
    assert "[ok  ] memory: rank 0: local memory; rank 1: from node 0 (" in text, text
    assert "hashed as it arrived" in text, text
    assert "[ok  ] warmup all-reduce: 2 ranks answered, sum 3 = 3 on every rank" in text, text
    assert "rng           restored on every rank" in text, text
    _check_losses(lost.requeue_log, range(lost.step + 1, STEPS + 1), reference())
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
    # The newest step still whole: the durable step 6, or a memory step node A still holds
    # whole that is not older (a tie goes to the memory tier), when node B was lost after the
    # next memory save but before it retired the one before
    older = lost_node.older
    if older is None or older < DURABLE_BEFORE:
        resumed = DURABLE_BEFORE
        assert line == f"dckpt resume: step {DURABLE_BEFORE} from {durable}", text
    else:
        resumed = older
        want = f"dckpt resume: step {older} from the memory tier (ranks [1] from other"
        assert line.startswith(want), text
    # No intact copy of the step is left anywhere: its record is quarantined, the damage named.
    skipped = next(
        (ln for ln in text.splitlines() if f"skipped step {lost_node.step} (quarantined)" in ln),
        None,
    )
    assert skipped is not None, text
    assert "IntegrityError: no copy of memory step" in skipped, skipped
    # Node B took the bytes straight into its state as they came (the digest known at the
    # end); the damaged copy they came from is named: node A's replica.
    assert "rank-00001.mem from rank 0" in skipped and "digest mismatch" in skipped, skipped
    assert "node 0's copy" in skipped and "node-0/replica/node-1" in skipped, skipped
    assert "rank(s) [1] had taken the arriving bytes into their tensors" in skipped, skipped
    quarantined = root / "memory" / "quarantine" / f"{step_dir_name(lost_node.step)}.json"
    assert quarantined.is_file(), text
    assert re.search(r"\[ok  \] digests: (\d+) of \1 files hashed and matched", text), text
    _check_losses(log, range(resumed + 1, STEPS + 1), reference())
    assert committed_steps(root) == [DURABLE_BEFORE, STEPS]


def test_flipped_bit_in_own_copy_uses_replica(
    lost_node: LostNode, reference: Callable[[], dict[int, float]]
) -> None:
    job = lost_node.copies["own_flipped"]
    text = job.finish()
    root, log = job.root, _arg(job, "--loss-log")
    line = _resume_line(text)
    want = f"dckpt resume: step {lost_node.step} from the memory tier (ranks [1] from other nodes'"
    assert line.startswith(want), text
    assert re.search(r"rank 0: local memory; rank 1: (local memory and )?from node 0 \(", text)
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
    assert "Traceback" not in text, text
    # The root records the memory step; the report says why it was not used.
    passed = f"warning: memory tier: step {lost_node.step} not used: no node holds rank-"
    assert passed in text and "in memory (a node lost its memory" in text, text
    assert re.search(r"\[ok  \] digests: (\d+) of \1 files hashed and matched", text), text
    _check_losses(log, range(DURABLE_BEFORE + 1, STEPS + 1), reference())
    assert committed_steps(root) == [DURABLE_BEFORE, STEPS]


# --- 5-6: the memory's size ---------------------------------------------------------------------


def _bytes_used_on(mount: Path) -> Callable[[], int]:
    """Bytes used on the private tmpfs ``mount`` since this call (pages, as the kernel counts
    them: files, directories, reserved spares)."""

    def used() -> int:
        st = os.statvfs(mount)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    base = used()
    return lambda: used() - base


@dataclass
class SizeRuns:
    """Single-rank jobs started together: two with a private tmpfs as their memory dir, one
    too small for a memory save, one doing sixty of them; and the stale-memory case."""

    full: Job
    full_memory: Path
    bound: Job
    bound_memory: Path
    stale: Job  # started again after its root was deleted, its memory kept
    stale_memory: Path
    used: Callable[[], int]  # bytes used on the bound job's tmpfs since before it started
    file_size: int  # the bound job's memory file
    after_one: int  # bytes used once its first memory save was done
    after_fifty: int  # bytes used once its fiftieth memory save was committed


BOUND_SAVES = 60  # memory saves of the bound job; its last step is saved to the root


@pytest.fixture(scope="module")
def size_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SizeRuns]:
    tmp = tmp_path_factory.mktemp("memory_size")
    with _tmpfs(tmp / "full", "1m") as full, _tmpfs(tmp / "bound", "64m") as bound:
        used = _bytes_used_on(bound)
        args = ["--steps", "4", "--save-every", "2", "--memory-every", "3"]
        full_args = [*args, "--memory-dir", str(full)]
        full_job = Job(tmp / "ckpt-full", full_args, tmp / "full-out", nodes=(0,))
        steps = str(BOUND_SAVES + 1)
        args = ["--steps", steps, "--memory-every", "1", "--save-every", "1000"]
        bound_args = [*args, "--memory-dir", str(bound)]
        # The job holds at the copy of step 2 and of step 51 until the test has measured the
        # memory it holds then (a machine too busy to poll in time would otherwise see the
        # run end first).
        gates = (tmp / "measured-one", tmp / "measured-fifty")
        holds = ";".join(
            f"phase=memory_copy,rank=0,step={s},action=wait,path={g},seconds=600"
            for s, g in zip((2, 51), gates, strict=True)
        )
        bound_job = Job(
            tmp / "ckpt-bound", bound_args, tmp / "bound-out", nodes=(0,),
            env={"DCKPT_FAULT": holds},
        )  # fmt: skip
        # The stale-memory case: a run killed after two memory saves, then the same command
        # on a deleted root.
        stale_memory = tmp / "stale-mem"
        args = ["--steps", "4", "--memory-every", "1", "--save-every", "100"]
        stale_args = [*args, "--memory-dir", str(stale_memory)]
        stale_job = Job(
            tmp / "ckpt-stale", [*stale_args, "--crash-at-step", "3"], tmp / "stale-out", (0,)
        )
        again = Job(tmp / "ckpt-stale", stale_args, tmp / "stale-again", nodes=(0,))
        try:
            full_job.start()
            bound_job.start()
            stale_job.start()
            node = bound / "node-0"
            first = own_dir(node) / step_dir_name(1) / "rank-00000.mem"
            size = 0

            def first_save_done() -> bool:
                # Held at step 2's copy: step 2's file was claimed (the spare save 1
                # reserved, so save 1 finished, reserve included) beside step 1's file.
                nonlocal size
                try:
                    size = first.stat().st_size
                    return size > 0 and any((own_dir(node) / step_dir_name(2)).iterdir())
                except OSError:
                    return False

            _wait_until(first_save_done, bound_job.procs, "the first memory save", bound_job.text)
            after_one = used()
            gates[0].touch()
            assert stale_job.wait() == [-9], stale_job.text()  # killed itself at step 3
            # save(2) waited for save(1); save(2)'s own commit may not have landed
            assert _recorded(stale_job.root) in ([1], [1, 2]), stale_job.text()
            shutil.rmtree(stale_job.root)
            again.start()  # beside the bound job's saves
            fiftieth = bound_job.root / "memory" / f"{step_dir_name(50)}.json"
            _wait_until(fiftieth.exists, bound_job.procs, "the 50th memory save", bound_job.text)
            after_fifty = used()  # held at the next memory save's copy, as after_one was
            gates[1].touch()
            yield SizeRuns(
                full_job, full, bound_job, bound, again, stale_memory, used, size, after_one,
                after_fifty,
            )  # fmt: skip
        finally:
            for job in (full_job, bound_job, stale_job, again):
                job.kill()


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
    left = sorted(str(p) for p in node.rglob("*") if not p.is_dir())
    assert left == [], left  # nothing committed, not even a half-written file
    assert committed_steps(job.root) == [2, 4]
    for step in (2, 4):
        result = verify_checkpoint(job.root / step_dir_name(step))
        assert result.ok, result.problems


def test_memory_bound_after_fifty_saves(size_runs: SizeRuns) -> None:
    """The memory the tier holds once its first save is done (the file, and the spare it
    reserves for the next) is what it holds at the fiftieth, within 1 %: retired files are
    reused, nothing accumulates. The run then ends well, its last checkpoint in the root:
    its memory is freed."""
    runs = size_runs
    text = runs.bound.finish()
    assert text.count("to memory |") == BOUND_SAVES, text
    size, after_one = runs.file_size, runs.after_one
    assert 2 * size <= after_one < 3 * size, (size, after_one)  # this save and its spare
    assert abs(runs.after_fifty - after_one) <= 0.01 * after_one, (after_one, runs.after_fifty)
    assert "the memory tier's copies of this run were freed" in text, text
    assert runs.used() < size, (runs.used(), size)  # no file left, at most a directory's page
    assert not (runs.bound_memory / "node-0").exists()


def test_fresh_root_ignores_stale_memory(size_runs: SizeRuns) -> None:
    """A memory checkpoint is restored only from its record in the root. A run saved steps 1
    and 2 to memory and was killed; its root was then deleted and the same command started
    again (a new run in its place: same path, same config, the memory still there): it must
    start from scratch, not resume step 2 of a root that is gone."""
    text = size_runs.stale.finish()
    assert "dckpt resume: no committed checkpoint; starting from scratch" in text, text
    assert "from the memory tier" not in text, text


# --- 7: what an outside peer can do -------------------------------------------------------------


def _listening(pid: int) -> list[tuple[str, int]]:
    import psutil

    conns = psutil.Process(pid).net_connections(kind="inet")
    return sorted((c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN)


# Loaded into each rank before anything else (``sitecustomize`` on PYTHONPATH): logs every
# socket a Python frame binds, with the stack that bound it. Any server the memory tier could
# open from Python (socketserver, asyncio, http.server, a bare socket) binds first.
_BIND_HOOK = """
import os, sys, traceback
_log = os.environ["DCKPT_TEST_BIND_LOG"] + "." + os.environ["RANK"]
def _hook(event, args):
    if event == "socket.bind":
        with open(_log, "a") as f:
            f.write(repr(args[1]) + "\\n" + "".join(traceback.format_stack(limit=12)) + "\\n")
sys.addaudithook(_hook)
open(_log + ".loaded", "w").close()
"""

# gloo listens on one loopback port per process group (training's, dckpt's control and io
# groups) while it connects that group's pairs, and closes it after; a job between two
# collectives may have fewer open. A listener of the memory tier's own would be one more.
_GLOO_GROUPS = 3
_LOOKS = 12


def _modes(memory: Path) -> list[str]:
    """Every directory and file under ``memory`` that others could enter or read."""
    loose = []
    for path in [memory, *memory.rglob("*")]:
        try:  # the job goes on: a spare renamed in since the listing is checked next look
            st = path.lstat()
        except FileNotFoundError:
            continue
        mode = st.st_mode & 0o777
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if mode != want:
            loose.append(f"{path}: {oct(mode)}")
    return loose


def test_no_listener_private_files_and_planted_steps(tmp_path: Path) -> None:
    """A memory job (2 ranks as 2 nodes), every Python ``socket.bind`` of its ranks logged: the
    memory tier binds no socket, and at every look a rank listens on at most one loopback port
    per gloo group (torch.distributed's own) and, on rank 0, the rendezvous store's; it starts
    no other process, and keeps its files 0600 in 0700 directories. Then a real memory step's
    files, planted in both nodes' memory as step 99 with a re-sealed manifest beside them, but
    without a record in the root, are never restored."""
    mem, log = tmp_path / "mem", tmp_path / "mem.jsonl"
    hook_dir, binds = tmp_path / "hook", tmp_path / "binds"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(_BIND_HOOK)
    path = os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH")) if p)
    args = ["--steps", "60", "--save-every", "10", "--memory-every", "1"]
    memory_job = Job(
        tmp_path / "ckpt",
        [*args, "--memory-dir", str(mem), "--loss-log", str(log)],
        tmp_path / "memory-job",
        nodes=(0, 1),
        env={"PYTHONPATH": path, "DCKPT_TEST_BIND_LOG": str(binds)},
    ).start()
    planted = tmp_path / "planted"
    try:

        def training() -> bool:
            steps = len(log.read_text().splitlines()) if log.exists() else 0
            return steps >= 3 and len(_recorded(memory_job.root)) >= 1

        _wait_until(training, memory_job.procs, "the job training", memory_job.text)
        store_port = None
        for _ in range(_LOOKS):
            for rank in (0, 1):
                listening = _listening(memory_job.procs[rank].pid)
                loopback = [a for a in listening if a[0] in ("127.0.0.1", "::1")]
                assert len(loopback) <= _GLOO_GROUPS, (rank, listening)
                for _ip, port in set(listening) - set(loopback):  # only the store, on rank 0
                    assert rank == 0 and store_port in (None, port), (rank, listening)
                    store_port = port
            time.sleep(0.1)
        import psutil

        for p in memory_job.procs:
            assert psutil.Process(p.pid).children(recursive=True) == [], "a process was started"
        assert _modes(mem) == [], _modes(mem)

        # Copy a real, committed memory step's files aside while they are in memory.
        def copied() -> bool:
            step = _recorded(memory_job.root)[-1]
            try:
                for rank in (0, 1):
                    src = own_dir(mem / f"node-{rank}") / step_dir_name(step)
                    shutil.copytree(src, planted / f"rank{rank}", dirs_exist_ok=True)
                    shutil.copy(memory_job.root / "memory" / f"{step_dir_name(step)}.json", planted)
            except OSError:
                shutil.rmtree(planted, ignore_errors=True)
                return False
            return True

        _wait_until(copied, memory_job.procs, "a memory step copied", memory_job.text)
        memory_job.finish()
    finally:
        memory_job.kill()
    assert sorted(p.name for p in tmp_path.glob("binds.*.loaded")) == [
        "binds.0.loaded",
        "binds.1.loaded",
    ]
    bound = {p.name: p.read_text() for p in tmp_path.glob("binds.?")}
    assert bound == {}, bound
    # The run ended well (its last checkpoint is durable): its memory was freed. Plant step 99.
    import dataclasses

    from dckpt.root.manifest import manifest_bytes, parse_manifest

    record = next(planted.glob("step-*.json"))
    forged = dataclasses.replace(parse_manifest(record.read_bytes(), str(record)), step=99)
    for node in (0, 1):
        for rank in (0, 1):
            where = own_dir if rank == node else lambda d, r=rank: replica_dir(d, r)
            target = where(mem / f"node-{node}") / step_dir_name(99)
            target.mkdir(parents=True, exist_ok=True)
            name = f"rank-{rank:05d}.mem"
            shutil.copy(planted / f"rank{rank}" / name, target / name)
            (target / "manifest.json").write_bytes(manifest_bytes(forged))
    listed = dckpt_cli("ls", str(memory_job.root), "--memory-dir", str(mem), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [r for r in json.loads(listed.stdout) if r["tier"] == "memory" and r["step"] == 99]
    assert rows and all(not r["recorded"] for r in rows), rows
    assert all("no record in the root: never restored" in r["error"] for r in rows), rows
    again = Job(
        memory_job.root,
        ["--steps", "61", "--save-every", "10", "--memory-every", "1", "--memory-dir", str(mem)],
        tmp_path / "again",
        nodes=(0, 1),
    ).start()
    text = again.finish()
    line = _resume_line(text)
    assert line == f"dckpt resume: step 60 from {memory_job.root / step_dir_name(60)}", text
    assert "from the memory tier" not in text, text
    note = "warning: memory tier: step 99 in node 0's memory has no record in "
    assert note in text and "never restored" in text, text  # said, for both nodes
    assert "step 99 in node 1's memory has no record" in text, text
