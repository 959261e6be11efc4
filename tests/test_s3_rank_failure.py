"""One rank's upload or download refused for good is every rank's error, at once.

The store refuses one rank's shard objects (``__<rank>_<n>.distcp``) with 403 AccessDenied,
every time, and lets everything else through (tests/s3_refusing_proxy.py): a save to the
bucket, and a resume from it into empty mirrors, first with rank 0's objects refused, then
with rank 1's. Every rank must raise the same error, naming the rank that failed and the
object, within the retry budget plus 30 s of the first refused request, and the job must
end within 2 minutes of it (a machine's load stretches both; what they rule out is a rank
that sits at a collective until its 600 s timeout or a watchdog ends the job: marin#9213,
S3 SlowDown on two ranks left the others at a barrier until a 30-minute watchdog). What was
committed before must stay whole: ``dckpt verify`` still passes it, and nothing is
quarantined.

Each rank talks to the store through a proxy of its own, both refusing the same objects, so
the proxy that refused says which rank asked: the error must name that rank (in a resume,
the rank that fetches an object is not the rank that wrote it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, dckpt_cli
from dist_harness import run_world
from s3_kit import MotoServer, moto_server
from s3_refusing_proxy import RefusingProxy, shard_pattern
from torch import nn

pytestmark = [pytest.mark.multiproc, pytest.mark.faults]

ATTEMPTS = 2
RETRY_BUDGET_S = 2.0
"""What DCKPT_S3_ATTEMPTS=2 may spend on one request: botocore's standard mode waits a
random share of 1 s before its second try (a 403 is not retried at all)."""
BOUND_S = RETRY_BUDGET_S + 30
"""By when every rank raised, after the first refusal (alone: 1-3 s; the timeout it rules out:
600 s)."""
JOB_BOUND_S = 120.0
"""By when the job's processes ended (their exit and torchrun's wind-down included)."""
UPLOADING = "(?:uploading|starting the upload of)"
"""How the store's error begins: a file smaller than a part is one PUT, a larger one starts
a multipart upload."""
Outcome = tuple[str, str, float]
"""What a rank raised (its type's name, its text) and when (time.time())."""


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


@pytest.fixture
def proxies(s3: MotoServer) -> Iterator[list[RefusingProxy]]:
    """One proxy per rank, in front of the same server."""
    made = [RefusingProxy(s3.port) for _ in range(2)]
    try:
        yield made
    finally:
        for proxy in made:
            proxy.close()


@pytest.fixture
def cli_env(s3: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dckpt`` run by the test talks to the server directly."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)


def _env(s3: MotoServer, **extra: str) -> dict[str, str]:
    return {**s3.env(), "DCKPT_S3_ATTEMPTS": str(ATTEMPTS), **extra}


def _model(width: int = 64, layers: int = 2) -> tuple[nn.Module, Any]:
    import torch

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.zero_grad()
    model(torch.randn(4, width)).pow(2).mean().backward()
    opt.step()
    return model, opt


def _manager(rank: int, root: str, mirror: str, endpoints: list[str]) -> Any:
    import dckpt

    os.environ["AWS_ENDPOINT_URL"] = endpoints[rank]
    model, opt = _model(*_SIZES.get(os.environ.get("TEST_MODEL", ""), (64, 2)))
    state = dckpt.TrainState(model, opt)
    config = dckpt.CheckpointConfig(root=root, mirror=Path(mirror) / f"node{rank}")
    return dckpt.CheckpointManager(config, state), state


_SIZES = {"large": (1024, 12)}
"""TEST_MODEL=large: about 150 MiB of parameters and AdamW state, several 5 MiB parts a rank."""


def _save(rank: int, world: int, root: str, mirror: str, endpoints: list[str]) -> None:
    mgr, state = _manager(rank, root, mirror, endpoints)
    with mgr:
        state.step = 2
        mgr.save(2).result()


def _save_2_then_4(rank: int, world: int, root: str, mirror: str, endpoints: list[str]) -> Outcome:
    """Step 2 commits; step 4 is the one whose objects the store refuses."""
    import dckpt

    caught: Outcome | None = None
    try:
        mgr, state = _manager(rank, root, mirror, endpoints)
        with mgr:
            state.step = 2
            mgr.save(2).result()
            state.step = 4
            try:
                mgr.save(4).result()
            except dckpt.SaveError as exc:
                caught = (type(exc).__name__, str(exc), time.time())
    except dckpt.CheckpointError as exc:  # close() raises the failed save again
        caught = caught or (type(exc).__name__, str(exc), time.time())
    return caught or ("saved", "", time.time())


def _resume(rank: int, world: int, root: str, mirror: str, endpoints: list[str]) -> Outcome:
    import dckpt

    # As under torchrun: the node's ranks share the fetch out (each with its own mirror).
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)
    try:
        mgr, _state = _manager(rank, root, mirror, endpoints)
        with mgr:
            mgr.resume()
    except dckpt.CheckpointError as exc:
        return type(exc).__name__, str(exc), time.time()
    return "resumed", "", time.time()


def _asker(proxies: list[RefusingProxy]) -> tuple[int, float]:
    """The rank whose requests were refused (one only), and when the first was."""
    refused = {r: p.first_refusal() for r, p in enumerate(proxies) if p.refused}
    assert len(refused) == 1, {r: p.refused for r, p in enumerate(proxies)}
    ((rank, first),) = refused.items()
    assert first is not None
    return rank, first


def _one_error(outcomes: list[Outcome], kind: str) -> str:
    """The ranks' errors: one kind, one text, on every rank."""
    kinds = [o[0] for o in outcomes]
    texts = [o[1] for o in outcomes]
    assert kinds == [kind] * len(outcomes), outcomes
    assert len(set(texts)) == 1, texts
    return texts[0]


def _in_time(outcomes: list[Outcome], first: float, ended: float) -> None:
    """Every rank raised within BOUND_S, and the job ended within JOB_BOUND_S."""
    late = {r: round(o[2] - first, 1) for r, o in enumerate(outcomes)}
    assert max(late.values()) <= BOUND_S, f"raised after the first refusal (s): {late}"
    assert ended - first <= JOB_BOUND_S, f"the job ended {ended - first:.1f} s after it"


def _verifies(root: str, step: int) -> None:
    checked = dckpt_cli("verify", root, "--step", str(step), "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    result = json.loads(checked.stdout)
    assert result["ok"] is True and [c["step"] for c in result["checkpoints"]] == [step]


@pytest.mark.parametrize("refused", [0, 1])
def test_a_rank_whose_upload_is_refused_fails_the_save_on_every_rank_at_once(
    s3: MotoServer, proxies: list[RefusingProxy], cli_env: None, tmp_path: Path, refused: int
) -> None:
    bucket = s3.bucket()
    root = f"s3://{bucket}/run"
    for proxy in proxies:
        proxy.refuse = shard_pattern(refused, "step-00000004")
    endpoints = [p.endpoint for p in proxies]
    outcomes = run_world(
        _save_2_then_4, 2, root, str(tmp_path), endpoints, env=_env(s3), timeout=90
    )
    ended = time.time()
    asker, first = _asker(proxies)
    assert asker == refused  # a rank writes its own shard objects
    text = _one_error(outcomes, "SaveError")
    assert text.startswith("save of step 4 failed, nothing was committed"), text
    assert re.search(
        rf"rank {refused}: writing shards failed: {UPLOADING} "
        rf"s3://{bucket}/run/step-00000004/__{refused}_\d+\.distcp: the store refused the "
        r"credentials \(AccessDenied\)",
        text,
    ), text
    assert f"rank {1 - refused}:" not in text  # the rank it stopped is not blamed
    _in_time(outcomes, first, ended)

    keys = s3.keys(bucket, "run/")
    assert "run/step-00000004/manifest.json" not in keys
    assert "run/step-00000002/manifest.json" in keys
    _verifies(root, 2)


@pytest.fixture(scope="module")
def saved(s3: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A bucket with step 2 committed (read-only for the tests)."""
    root = f"s3://{s3.bucket()}/run"
    mirror = tmp_path_factory.mktemp("saved")
    run_world(_save, 2, root, str(mirror), [s3.endpoint] * 2, env=_env(s3), timeout=90)
    return root


@pytest.mark.parametrize("refused", [0, 1])
def test_a_rank_whose_download_is_refused_fails_the_resume_on_every_rank_at_once(
    s3: MotoServer,
    proxies: list[RefusingProxy],
    saved: str,
    cli_env: None,
    tmp_path: Path,
    refused: int,
) -> None:
    for proxy in proxies:
        proxy.refuse = shard_pattern(refused)
    endpoints = [p.endpoint for p in proxies]
    outcomes = run_world(_resume, 2, saved, str(tmp_path), endpoints, env=_env(s3), timeout=90)
    ended = time.time()
    # Each rank fetches what its load plan reads: one rank, or both, may ask for the object.
    asked = {r: p.first_refusal() for r, p in enumerate(proxies) if p.refused}
    assert asked, "no request was refused"
    first = min(t for t in asked.values() if t is not None)
    who = f"rank {min(asked)}" if len(asked) == 1 else f"2 ranks, first on rank {min(asked)}"
    text = _one_error(outcomes, "StorageError")
    assert re.match(
        rf"fetching step 2 failed on {who} \(every rank stopped\): downloading "
        rf"{re.escape(saved)}/step-00000002/__{refused}_\d+\.distcp: the store refused the "
        r"credentials \(AccessDenied\)",
        text,
    ), text
    _in_time(outcomes, first, ended)

    bucket = saved.removeprefix("s3://").split("/")[0]
    assert not [k for k in s3.keys(bucket) if "/quarantine/" in k]  # not damage: kept
    _verifies(saved, 2)


def test_a_rank_still_uploading_stops_once_another_ranks_upload_is_refused(
    s3: MotoServer, proxies: list[RefusingProxy], cli_env: None, tmp_path: Path
) -> None:
    """Rank 0's parts go up slowly (1 s each, one at a time) while rank 1's are refused:
    rank 0 stops sending within a part or two instead of finishing a shard nothing will
    commit, and raises rank 1's error, not its own stop."""
    bucket = s3.bucket()
    root = f"s3://{bucket}/run"
    for proxy in proxies:
        proxy.refuse = shard_pattern(1, "step-00000004")
        proxy.slow, proxy.delay_s = re.compile(r"/step-00000004/__0_\d+\.distcp$"), 1.0
    env = _env(s3, DCKPT_S3_PART_MB="5", DCKPT_S3_CONCURRENCY="1", TEST_MODEL="large")
    endpoints = [p.endpoint for p in proxies]
    outcomes = run_world(_save_2_then_4, 2, root, str(tmp_path), endpoints, env=env, timeout=90)
    _, first = _asker(proxies)
    text = _one_error(outcomes, "SaveError")
    assert re.search(
        rf"rank 1: writing shards failed: {UPLOADING} s3://{bucket}/run/step-00000004/__1_\d+"
        r"\.distcp: the store refused the credentials \(AccessDenied\)",
        text,
    ), text
    assert "rank 0:" not in text and "stopped" not in text, text
    # Rank 0's shard of step 2 says how many parts its shard of step 4 would have taken.
    parts = -(-s3.keys(bucket, "run/step-00000002/")["run/step-00000002/__0_0.distcp"] // (5 << 20))
    # its parts (one PUT each, 1 s apart) sent after rank 1's first refusal: a rank that went
    # on would send the rest of its shard (a loaded machine sends a part or two more before
    # the stop reaches it, never the rest)
    after = [p for p in proxies[0].slowed if p[1] == "PUT" and p[0] >= first]
    assert parts >= 8, parts
    assert len(after) <= parts // 2, (len(after), parts)
    assert outcomes[0][2] - first <= parts, (outcomes[0][2] - first, parts)


def test_the_example_trainer_exits_on_every_rank_with_the_same_error(
    s3: MotoServer, proxies: list[RefusingProxy], cli_env: None, tmp_path: Path
) -> None:
    """launch/train.py under torchrun, rank 1's step-4 objects refused: both ranks end with
    the one SaveError, in time, and step 2 stays committed."""
    bucket = s3.bucket()
    root = f"s3://{bucket}/run"
    proxy = proxies[0]
    proxy.refuse = shard_pattern(1, "step-00000004")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--tee", "3", "--log-dir", str(tmp_path / "logs"), str(REPO / "launch" / "train.py"),
        "--ckpt-dir", root, "--steps", "4", "--save-every", "2",
    ]  # fmt: skip
    env = {
        **os.environ,
        **_env(s3, AWS_ENDPOINT_URL=proxy.endpoint),
        "OMP_NUM_THREADS": "1",
        "DCKPT_CACHE_DIR": str(tmp_path / "cache"),
    }
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, check=False)
    ended = time.time()
    assert done.returncode != 0
    first = proxy.first_refusal()
    assert first is not None, done.stderr[-3000:]
    lines = {
        int(m.group(1)): m.group(2)
        for m in re.finditer(r"^\[default(\d)\]:\[rank\d\]: dckpt\.errors\.SaveError: (.*)$",
                             done.stderr, re.MULTILINE)
    }  # fmt: skip
    assert sorted(lines) == [0, 1], done.stderr[-3000:]
    assert lines[0] == lines[1]
    blamed = rf"rank 1: writing shards failed: {UPLOADING} \S+/step-00000004/__1_\d+\.distcp"
    assert re.search(blamed, lines[0]) and "rank 0:" not in lines[0], lines[0]
    assert ended - first <= JOB_BOUND_S, f"the job ended {ended - first:.1f} s after the refusal"
    _verifies(root, 2)


class _UnrebuildableError(Exception):
    """Pickles, but cannot be unpickled: its ``__init__`` wants two arguments."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def _agree(rank: int, world: int) -> Any:
    from dckpt.collective.comm import Comm
    from dckpt.errors import StorageError

    comm = Comm(timeout_s=30)
    errors: dict[int, BaseException] = {
        1: _UnrebuildableError("rank 1's object", "refused"),
        2: StorageError("rank 2's object: refused"),
    }
    none = comm.first_failure(None)
    some = comm.first_failure(errors.get(rank))
    assert some is not None
    later = comm.first_failure(errors.get(rank) if rank == 2 else None)
    assert later is not None
    comm.close()
    return (
        none,
        (some.rank, some.count, type(some.error).__name__, str(some.error)),
        (later.rank, later.count, type(later.error).__name__),
    )


def test_the_agreement_gives_every_rank_the_lowest_failing_ranks_error_and_the_count() -> None:
    results = run_world(_agree, 3, timeout=60)
    assert len(set(map(repr, results))) == 1, results  # the same on every rank
    none, some, later = results[0]
    assert none is None
    # Rank 1's own exception could not be rebuilt elsewhere: its text travels instead.
    assert some == (1, 2, "CheckpointError", "_UnrebuildableError: rank 1's object: refused")
    assert later == (2, 1, "StorageError")
