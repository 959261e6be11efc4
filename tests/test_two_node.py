"""A real two-node job on one machine: two network namespaces, a lost node, the world re-formed.

Role: the end-to-end check that dckpt survives losing a whole node of a multi-node torchrun job,
without Docker. ``launch/netns_cluster.sh`` makes two Linux network namespaces joined by a veth
pair (two hosts that share the filesystem, so one checkpoint root), and runs
``torchrun --nnodes 2 --nproc-per-node 1`` of ``launch/train.py`` in each, c10d rendezvous
hosted by node A, gloo over the veth. Every process of node B is then SIGKILLed mid-run, as when
a machine dies.

What it proves, for each way back:

- requeue (``test_requeued_job_resumes_after_losing_a_node``): node A's job fails by itself,
  quickly (gloo sees the peer gone; no hang), as a scheduler would see it; both nodes started
  again with a new rendezvous id form a new world, resume from the newest committed checkpoint
  (the one on the shared root when the kill landed) with every digest checked, and log the same
  losses, bit for bit, as a run that never stopped.
- in place (``test_elastic_restart_of_the_lost_node_alone``): with ``--max-restarts 1``, node A's
  torchrun keeps the rendezvous and waits in a new round; node B alone is started again with
  the same rendezvous id; the world re-forms around it and resumes the same way. The notes
  (shared/notes/multinode-on-one-machine.md) saw this hang on ``torchelastic/role_info``: with
  torch's default shared TCP store, the agent of group rank 0 never publishes MASTER_ADDR/PORT
  for the second round, so the new node waits on it and node A on the role info. The script
  sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which makes every round publish its own, and
  shortens the keep-alive so the dead node leaves the rendezvous after 5 s, not 15 s. Limit:
  the surviving node must be the rendezvous host (A); losing A needs the requeue path.

In both, every committed checkpoint on the shared root verifies afterwards, and the namespaces
and all their processes are removed whatever happens (fixture finalizer), which is asserted.

The reference is a standalone ``--nproc-per-node 2`` run (cheaper than a third two-node run):
its losses were checked to equal an uninterrupted two-node run's bit for bit (gloo's 2-rank sum
is the same over loopback and veth, and group rank 0 is always node A, the lower address), and
each test re-checks it on the steps its first run logged before the kill.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, torchrun_train

from dckpt.root.layout import committed_steps, list_checkpoints
from dckpt.root.verify import verify_checkpoint

pytestmark = [pytest.mark.multiproc]

SCRIPT = REPO / "launch" / "netns_cluster.sh"
STEPS, SAVE_EVERY = 60, 5
KILL_AFTER = 15  # kill node B once a checkpoint at or past this step is committed
TRAIN_ARGS = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--d-model", "32"]
START_TIMEOUT = 120.0  # torch imports on a loaded 2-core machine are slow
LOST_PEER_TIMEOUT = 150.0  # node A notices node B is gone (seen: ~1 s alone; not a hang)
RUN_TIMEOUT = 180.0


@functools.cache
def _netns_unavailable() -> str | None:
    """Why this machine cannot host the namespaces, or None when it can."""
    if os.geteuid() != 0:
        return "two-node test needs root to create network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "two-node test needs iproute2's `ip` to create network namespaces"
    env = {**os.environ, "DCKPT_NETNS_ID": f"probe{os.getpid()}"}
    probe = subprocess.run(
        ["bash", str(SCRIPT), "check"], capture_output=True, text=True, env=env, check=False
    )
    if probe.returncode != 0:
        return f"`ip netns add` is not permitted here: {probe.stderr.strip()}"
    return None


def _netns_list() -> str:
    return subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True
    ).stdout


class Cluster:
    """The two namespaces of one test, and the torchrun processes started in them."""

    def __init__(self, workdir: Path) -> None:
        self.id = f"{os.getpid() % 100000}x{uuid.uuid4().hex[:6]}"
        self.namespaces = (f"dckpt-a-{self.id}", f"dckpt-b-{self.id}")
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[str, Path] = {}

    def _script(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "DCKPT_NETNS_ID": self.id}
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )

    def up(self) -> None:
        proc = self._script("up")
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def start(
        self, node: str, rdzv_id: str, name: str, *train_args: str, max_restarts: int = 0
    ) -> subprocess.Popen[bytes]:
        """Start ``run-node`` for one node in the background; output goes to ``name``.log."""
        log = self.workdir / f"{name}.log"
        env = {
            **os.environ,
            "DCKPT_NETNS_ID": self.id,
            "DCKPT_MAX_RESTARTS": str(max_restarts),
            "LOGLEVEL": "INFO",  # torchrun's agent logs its rendezvous rounds and restarts
        }
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", str(SCRIPT), "run-node", node, rdzv_id, *train_args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.procs.append(proc)
        self.logs[name] = log
        return proc

    def kill_node(self, node: str) -> None:
        proc = self._script("kill-node", node)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def down(self) -> None:
        """Kill every process in both namespaces, delete them, reap what this test started."""
        proc = self._script("down")
        for p in self.procs:
            if p.poll() is None:  # not in a namespace any more (never, but never leak it)
                p.kill()
            p.wait(timeout=30)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        left = [ns for ns in self.namespaces if ns in _netns_list().split()]
        assert not left, f"namespaces left behind: {left}"

    def tail(self, name: str, chars: int = 4000) -> str:
        return f"--- {name}.log ---\n" + self.logs[name].read_text(errors="replace")[-chars:]

    def tails(self) -> str:
        return "\n".join(self.tail(name) for name in self.logs)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Two fresh namespaces; removed, with every process in them, whatever the test does."""
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    c = Cluster(tmp_path)
    try:
        c.up()
        yield c
    finally:
        c.down()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Losses of the uninterrupted run (standalone, 2 ranks): equal to a two-node run's."""
    if _netns_unavailable() is not None:
        pytest.skip(str(_netns_unavailable()))
    tmp = tmp_path_factory.mktemp("two_node_ref")
    log = tmp / "ref.jsonl"
    proc = torchrun_train(tmp / "ckpt", *TRAIN_ARGS, "--loss-log", str(log))
    assert proc.returncode == 0, proc.stderr
    (losses,) = _segments(log)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _segments(log: Path) -> list[dict[int, float]]:
    """The loss log split into runs: a new run starts where the writing process changes (rank
    0 of a restarted world is a new process) or the step goes back. The step alone is not
    enough: a kill that lands right after a commit at step s, before step s + 1 is logged,
    leaves a log whose resumed run goes on at s + 1 as if nothing happened."""
    runs: list[dict[int, float]] = []
    last: tuple[int, int] | None = None
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if last is None or rec["pid"] != last[0] or rec["step"] <= last[1]:
            runs.append({})
        runs[-1][rec["step"]] = rec["loss"]
        last = (rec["pid"], rec["step"])
    return runs


def _newest_committed(root: Path) -> int | None:
    try:
        steps = committed_steps(root)
    except OSError:  # the root is not there yet
        return None
    return steps[-1] if steps else None


def _wait_for_commit(cluster: Cluster, root: Path, procs: list[subprocess.Popen[bytes]]) -> int:
    """Poll the shared root until a checkpoint at or past KILL_AFTER is committed."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, "a node exited before the kill:\n" + cluster.tails()
        newest = _newest_committed(root)
        if newest is not None and newest >= KILL_AFTER:
            return newest
        time.sleep(0.02)
    pytest.fail(
        f"no checkpoint at step >= {KILL_AFTER} within {START_TIMEOUT} s\n" + cluster.tails()
    )


def _wait_for_text(cluster: Cluster, name: str, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in cluster.logs[name].read_text(errors="replace"):
            return
        time.sleep(0.05)
    pytest.fail(f"{text!r} not in {name}.log within {timeout} s\n" + cluster.tails())


def _wait(cluster: Cluster, proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a node did not finish within {timeout} s\n" + cluster.tails())


def _check_resumed_run(
    cluster: Cluster,
    root: Path,
    *,
    logs: list[str],
    losses: dict[int, float],
    step: int,
    reference: dict[int, float],
) -> None:
    """The resumed run (output in ``logs``) reported a verified resume from ``step``, logged
    ``losses`` equal to the reference's, and left only checkpoints that verify."""
    text = "\n".join(cluster.logs[name].read_text(errors="replace") for name in logs)
    assert f"dckpt resume: step {step} from {root / f'step-{step:08d}'}" in text, cluster.tails()
    assert re.search(r"\[ok  \] digests: (\d+) of \1 files hashed and matched", text), text
    assert "[ok  ] warmup all-reduce: 2 ranks answered, sum 3 = 3 on every rank" in text, text
    assert "rng           restored on every rank" in text, text
    assert sorted(losses) == list(range(step + 1, STEPS + 1))
    assert losses == {s: reference[s] for s in losses}  # bit-identical, dropout included
    assert committed_steps(root) == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    for entry in list_checkpoints(root):
        if entry.status == "committed":
            result = verify_checkpoint(entry.path)
            assert result.ok, (entry.path, result.problems)


def test_requeued_job_resumes_after_losing_a_node(
    cluster: Cluster, reference: dict[int, float], tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    args = [*TRAIN_ARGS, "--ckpt-dir", str(root)]
    first_log, again_log = tmp_path / "first.jsonl", tmp_path / "again.jsonl"
    node_a = cluster.start("A", "job-1", "a1", *args, "--loss-log", str(first_log))
    node_b = cluster.start("B", "job-1", "b1", *args, "--loss-log", str(first_log))

    seen = _wait_for_commit(cluster, root, [node_a, node_b])
    cluster.kill_node("B")
    killed_at = time.monotonic()
    assert node_b.wait(timeout=10) == -9  # run-node execs into torchrun: it is the killed one
    # Node A fails by itself, quickly: its rank's next collective finds the peer gone.
    rc_a = _wait(cluster, node_a, LOST_PEER_TIMEOUT)
    assert rc_a != 0, cluster.tail("a1")
    assert time.monotonic() - killed_at < LOST_PEER_TIMEOUT

    # The newest checkpoint now on the shared root; one may have committed after the poll.
    newest = _newest_committed(root)
    assert newest is not None and seen <= newest < STEPS
    (before,) = _segments(first_log)
    assert max(before) < STEPS, "the first run finished before the kill"
    assert before == {s: reference[s] for s in before}  # two nodes == the standalone reference

    # The requeue: both nodes again, a new rendezvous id; the world re-forms and resumes.
    node_a = cluster.start("A", "job-2", "a2", *args, "--loss-log", str(again_log))
    node_b = cluster.start("B", "job-2", "b2", *args, "--loss-log", str(again_log))
    assert _wait(cluster, node_a, RUN_TIMEOUT) == 0, cluster.tails()
    assert _wait(cluster, node_b, RUN_TIMEOUT) == 0, cluster.tails()
    (after,) = _segments(again_log)
    _check_resumed_run(
        cluster, root, logs=["a2", "b2"], losses=after, step=newest, reference=reference
    )

    cluster.down()
    assert not set(cluster.namespaces) & set(_netns_list().split())


def test_elastic_restart_of_the_lost_node_alone(
    cluster: Cluster, reference: dict[int, float], tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    log = tmp_path / "loss.jsonl"  # the same command line after the restart: one log, two runs
    args = [*TRAIN_ARGS, "--ckpt-dir", str(root), "--loss-log", str(log)]
    node_a = cluster.start("A", "job-1", "a", *args, max_restarts=1)
    node_b = cluster.start("B", "job-1", "b1", *args, max_restarts=1)

    seen = _wait_for_commit(cluster, root, [node_a, node_b])
    cluster.kill_node("B")
    assert node_b.wait(timeout=10) == -9
    # Node A's worker fails; its agent stays up and opens a new rendezvous round.
    _wait_for_text(cluster, "a", "will restart worker group", LOST_PEER_TIMEOUT)
    assert node_a.poll() is None, cluster.tail("a")
    newest = _newest_committed(root)
    assert newest is not None and seen <= newest < STEPS

    # Only the lost node comes back, with the same rendezvous id.
    node_b = cluster.start("B", "job-1", "b2", *args, max_restarts=1)
    assert _wait(cluster, node_b, RUN_TIMEOUT) == 0, cluster.tails()
    assert _wait(cluster, node_a, RUN_TIMEOUT) == 0, cluster.tails()
    assert "restart_count=1" in cluster.logs["a"].read_text(), cluster.tail("a")
    before, after = _segments(log)
    assert max(before) < STEPS, "the first run finished before the kill"
    assert before == {s: reference[s] for s in before}
    _check_resumed_run(
        cluster, root, logs=["a", "b2"], losses=after, step=newest, reference=reference
    )

    cluster.down()
    assert not set(cluster.namespaces) & set(_netns_list().split())


@pytest.mark.faults
def test_a_node_that_loses_its_network_mid_save_ends(
    cluster: Cluster, tmp_path: Path, fault_trials: Any
) -> None:
    """Node B's link goes down while a save is in flight (its tmp dir is there): every
    process of the job, on both nodes, is gone within dckpt's timeout_s plus 30 s (the
    trainer's ``--timeout 30``: the training group's collectives wait 30 s, dckpt's 15 s).
    Node B's worker finds the job's store (on node A) unreachable, says so, and at its exit
    ends torchrun's agent, which would otherwise wait on its rendezvous without end; no
    committed step is damaged."""
    root = tmp_path / "ckpt"
    args = ["--steps", "400", "--save-every", "3", "--d-model", "64", "--timeout", "30"]
    args += ["--ckpt-dir", str(root)]
    node_a = cluster.start("A", "job-1", "a", *args)
    node_b = cluster.start("B", "job-1", "b", *args)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:  # a save in flight, after a first one committed
        for p in (node_a, node_b):
            assert p.poll() is None, "a node exited before the link went down:\n" + cluster.tails()
        if list(root.glob("step-*.tmp-*")) and len(committed_steps(root)) >= 2:
            break
        time.sleep(0.01)
    else:
        pytest.fail("no save in flight after two commits\n" + cluster.tails())
    proc = cluster._script("link-down", "B")
    assert proc.returncode == 0, proc.stderr
    down = time.monotonic()
    # Seen: 31 s and 36 s (the 30 s process-group timeout ends it); before the fix node B's
    # agent was still alive after 400 s. The bound tells the two apart with room for a
    # loaded machine.
    bound = 120.0
    gone: dict[str, float] = {}
    while time.monotonic() - down < bound + 60 and len(gone) < 2:
        for node, ns in zip("AB", cluster.namespaces, strict=True):
            listed = ["ip", "netns", "pids", ns]
            pids = subprocess.run(listed, capture_output=True, text=True, check=False)
            if node not in gone and not pids.stdout.split():
                gone[node] = time.monotonic() - down
        time.sleep(0.25)
    text = cluster.logs["b"].read_text(errors="replace")
    why = []
    for node in "AB":
        if gone.get(node, 1e9) > bound:
            why.append(f"node {node}'s processes were not all gone within {bound:.0f} s: {gone}")
    if "this node cannot reach the job's store" not in text:
        why.append("node B did not say it lost the job's store")
    for entry in list_checkpoints(root):
        if entry.status == "committed" and not verify_checkpoint(entry.path).ok:
            why.append(f"committed {entry.path.name} does not verify")
    fault_trials.record("a node loses its network", "link down mid-save", survived=not why,
                        detail="; ".join(why) or f"gone after {gone}")  # fmt: skip
    assert not why, "\n".join(why) + "\n" + cluster.tails()
