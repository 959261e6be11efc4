"""The verified memory tier end to end, with real processes: a lost worker, a lost node, a
flipped bit, both nodes lost, a full memory, and the memory bound.

Role: proves the issue's cases on real torchrun jobs of launch/train.py (gloo, CPU), no mocks.
Every run trains ``STEPS`` steps, saving to the durable root every ``SAVE_EVERY`` and to the
memory tier every ``MEMORY_EVERY`` steps in between (``--memory-every``); the resume must take
the newest of the two tiers, prove every byte against the writer's digest, and log the same
losses, bit for bit, as an uninterrupted reference run (standalone, 2 ranks, no memory tier:
so the memory saves are also shown not to perturb training).

- ``test_worker_killed_node_lives``: one node, ``--max-restarts 1``; rank 1 is SIGKILLed from
  outside right after memory step 8 committed; torchrun restarts the workers in place, the
  node's keeper survives (same pid), the restart resumes step 8 from local memory.
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
- ``test_memory_full_fails_clearly``: a 1 MiB tmpfs as the memory dir: the memory save fails
  naming the memory tier and saying the durable checkpoints are untouched; they verify.
- ``test_memory_bound_after_fifty_saves``: the memory used on a private tmpfs after one memory
  save and after fifty differ by under 1 %.

Every keeper a test starts is stopped, every tmpfs unmounted, every namespace removed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
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
from conftest import REPO, losses, torchrun_train, torchrun_train_beside, torchrun_workers
from test_two_node import Cluster, _netns_list, _netns_unavailable, _segments

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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
        if rec is not None and _alive(rec["pid"]) and _is_keeper(rec["pid"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec["pid"], signal.SIGTERM)
            pids.append(rec["pid"])
    deadline = time.monotonic() + 10
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _alive(pid):
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
    cond: Callable[[], bool], procs: list[subprocess.Popen[bytes]], what: str, logs: Callable[[], str]
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


def _used_bytes(mount: Path) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


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
class TwoNodes:
    """A two-node job on this host: rank r is node r (``GROUP_RANK``), gloo on 127.0.0.1."""

    root: Path
    memory: Path
    log: Path
    out: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> None:
        port = str(_free_port())
        args = [*TRAIN, *MEMORY, "--memory-dir", str(self.memory), "--loss-log", str(self.log)]
        for rank in (0, 1):
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "GROUP_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
            cmd = [sys.executable, str(REPO / "launch" / "train.py"), "--ckpt-dir", str(self.root)]
            with open(self.out.with_suffix(f".rank{rank}.log"), "wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        [*cmd, *args],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )

    def wait(self) -> str:
        """Both ranks' exit status must be 0; returns their output."""
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=RUN_TIMEOUT))
            except subprocess.TimeoutExpired:
                codes.append(None)
        text = self.text()
        assert codes == [0, 0], f"exit codes {codes}\n{text[-8000:]}"
        return text

    def text(self) -> str:
        return "\n".join(
            self.out.with_suffix(f".rank{r}.log").read_text(errors="replace") for r in (0, 1)
        )

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


# --- the reference ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], dict[int, float]]]:
    """The losses of an uninterrupted run without the memory tier (standalone, 2 ranks); it
    runs beside the module's tests; calling the fixture's value waits for it."""
    tmp = tmp_path_factory.mktemp("memory_ref")
    log = tmp / "ref.jsonl"
    with torchrun_train_beside(tmp / "ckpt", *TRAIN, "--loss-log", str(log)) as ref:

        @functools.cache
        def get() -> dict[int, float]:
            proc = ref.result()
            assert proc.returncode == 0, proc.stderr
            got = losses(log)
            assert sorted(got) == list(range(1, STEPS + 1))
            return got

        yield get


def _check_losses(log: Path, resumed_at: int, reference: dict[int, float]) -> None:
    """The run after the resume logged steps ``resumed_at``+1.. equal to the reference, bit
    for bit; so did every run before it."""
    segments = _segments(log)
    after = segments[-1]
    assert sorted(after) == list(range(resumed_at + 1, STEPS + 1)), segments
    for seg in segments:
        assert seg == {s: reference[s] for s in seg}  # bit-identical, dropout included


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
        assert keeper is not None and _alive(keeper["pid"])
        assert agent.wait(timeout=RUN_TIMEOUT) == 0, _tail(out)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=30)
    text = out.read_text(errors="replace")
    assert newest in (KILL_AFTER, KILL_AFTER + MEMORY_EVERY), newest
    assert newest > committed_steps(root)[0] == DURABLE_BEFORE  # memory is newer than durable
    # torchrun restarted the workers in place: two runs, the second resumed.
    assert "dckpt resume: no committed checkpoint; starting from scratch" in text, text
    line = _resume_line(text)
    assert line.startswith(f"dckpt resume: step {newest} from the memory tier (local memory"), line
    assert "[ok  ] memory: rank 0: local memory; rank 1: local memory" in text, text
    assert "rng           restored on every rank" in text, text
    # The keeper outlived its workers and served the restart: the same process, still alive.
    after = read_keeper_file(memory / "node-0")
    assert after is not None and after["pid"] == keeper["pid"] and _alive(keeper["pid"])
    _check_losses(log, newest, reference())
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
    copies: dict[str, TwoNodes]


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
    copies: dict[str, TwoNodes] = {}
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
        assert node_a.wait(timeout=60) != 0, cluster.tail("a1")  # it fails by itself
        assert committed_steps(root) == [DURABLE_BEFORE]
        (before,) = _segments(first_log)
        assert before == {s: reference()[s] for s in before}  # two nodes == the reference

        # The memory step both nodes can be restored from, with node B's memory gone.
        own_a = set(committed_memory_steps(own_dir(memory / "node-0")))
        replica_b = set(committed_memory_steps(replica_dir(memory / "node-0", 1)))
        both = sorted(own_a & replica_b)
        assert both and both[-1] in (KILL_AFTER, KILL_AFTER + MEMORY_EVERY), (own_a, replica_b)
        step = both[-1]
        keeper_a = read_keeper_file(memory / "node-0")
        assert keeper_a is not None and _alive(keeper_a["pid"])  # node A's keeper lives on
        assert step in committed_memory_steps(own_dir(memory / "node-1"))

        # The copies, each damaged its own way, run beside the requeue.
        name = f"{step_dir_name(step)}/rank-00001.mem"
        for case in ("replica_flipped", "own_flipped", "both_lost"):
            croot, cmem = _copy_state(root, memory, tmp / case)
            copies[case] = TwoNodes(croot, cmem, tmp / case / "loss.jsonl", tmp / case / "out")
        _flip_byte(replica_dir(copies["replica_flipped"].memory / "node-0", 1) / name)
        shutil.rmtree(copies["replica_flipped"].memory / "node-1")
        _flip_byte(own_dir(copies["own_flipped"].memory / "node-1") / name)
        shutil.rmtree(copies["both_lost"].memory)

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
        yield LostNode(
            cluster, root, memory, step, keeper_a["pid"], requeue, again_log, copies
        )
    finally:
        for c in copies.values():
            c.kill()
            _stop_keepers(c.memory)
        cluster.down()  # every process of both nodes, their keepers included
        mp.undo()
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
    want = f"dckpt resume: step {lost.step} from the memory tier (memory, ranks [1] from the "
    assert line.startswith(want + "partner's replica"), lost.cluster.tails()
    assert f"rank 1: replica on node 0" in text, text
    assert "[ok  ] warmup all-reduce: 2 ranks answered, sum 3 = 3 on every rank" in text, text
    assert "rng           restored on every rank" in text, text
    _check_losses(lost.requeue_log, lost.step, reference())
    # Node A's keeper served it: the one that survived the loss, still the node's keeper.
    rec = read_keeper_file(lost.memory / "node-0")
    assert rec is not None and rec["pid"] == lost.keeper_a and _alive(lost.keeper_a)
    assert committed_steps(lost.root) == [DURABLE_BEFORE, STEPS]
    for entry in list_checkpoints(lost.root):
        if entry.status == "committed":
            assert verify_checkpoint(entry.path).ok, entry.path


def test_flipped_bit_in_replica_falls_back_to_durable(
    lost_node: LostNode, reference: Callable[[], dict[int, float]]
) -> None:
    run = lost_node.copies["replica_flipped"]
    text = run.wait()
    line = _resume_line(text)
    durable = run.root / step_dir_name(DURABLE_BEFORE)
    assert line == f"dckpt resume: step {DURABLE_BEFORE} from {durable}", text
    warning = next(
        (ln for ln in text.splitlines() if f"memory tier: step {lost_node.step} not used" in ln),
        None,
    )
    assert warning is not None, text
    assert "warning: memory tier:" in warning and "the durable tier was:" in warning, warning
    assert "rank 1" in warning and "digest mismatch" in warning, warning
    assert "replica on node 0" in warning, warning
    _check_losses(run.log, DURABLE_BEFORE, reference())
    assert committed_steps(run.root) == [DURABLE_BEFORE, STEPS]


def test_flipped_bit_in_own_copy_uses_replica(
    lost_node: LostNode, reference: Callable[[], dict[int, float]]
) -> None:
    run = lost_node.copies["own_flipped"]
    text = run.wait()
    line = _resume_line(text)
    want = f"dckpt resume: step {lost_node.step} from the memory tier (memory, ranks [1] from "
    assert line.startswith(want + "the partner's replica"), text
    assert "rank 0: local memory; rank 1: replica on node 0" in text, text
    _check_losses(run.log, lost_node.step, reference())
    assert committed_steps(run.root) == [DURABLE_BEFORE, STEPS]


def test_both_nodes_lost_uses_durable(
    lost_node: LostNode, reference: Callable[[], dict[int, float]]
) -> None:
    run = lost_node.copies["both_lost"]
    text = run.wait()
    line = _resume_line(text)
    durable = run.root / step_dir_name(DURABLE_BEFORE)
    assert line == f"dckpt resume: step {DURABLE_BEFORE} from {durable}", text
    assert "Traceback" not in text, text
    _check_losses(run.log, DURABLE_BEFORE, reference())
    assert committed_steps(run.root) == [DURABLE_BEFORE, STEPS]


# --- 5-6: the memory's size ---------------------------------------------------------------------


def test_memory_full_fails_clearly(tmp_path: Path) -> None:
    """A memory tier too small for one rank's state: the memory save fails, clearly, and the
    durable checkpoints stay committed and whole."""
    root = tmp_path / "ckpt"
    with _tmpfs(tmp_path / "shm", "1m") as shm:
        proc = torchrun_train(
            root, "--steps", "4", "--save-every", "2", "--memory-every", "3",
            "--memory-dir", str(shm), "--no-async", nproc=1,
        )  # fmt: skip
        own = committed_memory_steps(own_dir(shm / "node-0"))
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert "memory save of step 3 failed" in text, text
    assert "the memory tier at" in text and "could not hold rank 0's" in text, text
    assert "No space left on device" in text, text
    assert "the durable checkpoints are untouched" in text, text
    assert own == []
    assert committed_steps(root) == [2]
    result = verify_checkpoint(root / step_dir_name(2))
    assert result.ok, result.problems


def test_memory_bound_after_fifty_saves(tmp_path: Path) -> None:
    """The memory the tier holds after its first save is what it holds after fifty (within
    1 %): retired files are reused, nothing accumulates. Two runs side by side, each on its
    own tmpfs: one memory save, and fifty."""
    args = ["--memory-every", "1", "--save-every", "1000"]
    with _tmpfs(tmp_path / "one", "64m") as one, _tmpfs(tmp_path / "fifty", "64m") as fifty:
        base = {"one": _used_bytes(one), "fifty": _used_bytes(fifty)}
        with torchrun_train_beside(
            tmp_path / "ckpt-one", *args, "--steps", "2", "--memory-dir", str(one), nproc=1
        ) as first:
            many = torchrun_train(
                tmp_path / "ckpt-fifty", *args, "--steps", "51", "--memory-dir", str(fifty),
                nproc=1,
            )  # fmt: skip
        assert first.result().returncode == 0, first.result().stderr
        assert many.returncode == 0, many.stderr
        assert many.stderr.count("to memory |") == 50, many.stderr
        after_one = _used_bytes(one) - base["one"]
        after_fifty = _used_bytes(fifty) - base["fifty"]
        steps = committed_memory_steps(own_dir(fifty / "node-0"))
    assert steps == [50]
    assert after_one > 0
    assert abs(after_fifty - after_one) <= 0.01 * after_one, (after_one, after_fifty)
