"""An s3:// resume on two nodes brings each node only the objects its ranks read.

The example trainer (FSDP, 2 ranks) runs as two "nodes" on this host: two processes given
torchrun's environment, each its own node (``LOCAL_WORLD_SIZE`` 1) with its own local mirror
(``DCKPT_CACHE_DIR``), against a real S3 server (moto's, on 127.0.0.1). It saves steps 2 and
4; the same command then resumes on fresh mirrors. What each node's mirror holds afterwards
is what it downloaded: DCP's load plan for that rank's state, plus ``.metadata`` and the
manifest, never the whole step on each node; the digests of every object are still checked
by some rank (the report's ``digests`` line counts them all).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_kit import MotoServer, moto_server

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--parallel", "fsdp", "--d-model", "256", "--steps", "4", "--save-every", "2"]


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


def _two_nodes(root: str, caches: Path, env: dict[str, str]) -> list[str]:
    """launch/train.py as 2 ranks on 2 "nodes", each with its own mirror; their outputs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in (0, 1):
        rank_env = {
            **os.environ,
            **env,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "DCKPT_CACHE_DIR": str(caches / f"node{rank}"),
        }
        cmd = [sys.executable, str(REPO / "launch" / "train.py"), "--ckpt-dir", root, *ARGS]
        procs.append(
            subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)[-6000:]
    return outs


def _mirror_files(cache: Path, objects: dict[str, int]) -> dict[str, int]:
    """The step's objects that the mirror under ``cache`` holds (name -> bytes)."""
    steps = [p for p in cache.rglob("step-00000004") if p.is_dir()]
    assert len(steps) == 1, steps
    return {p.name: p.stat().st_size for p in steps[0].iterdir() if p.name in objects}


def test_each_node_downloads_what_its_ranks_read(s3: MotoServer, tmp_path: Path) -> None:
    env = {**s3.env(), "DCKPT_S3_PART_MB": "5"}
    bucket = s3.bucket()
    root = f"s3://{bucket}/runs/fsdp"
    _two_nodes(root, tmp_path / "saving", env)
    objects = {
        k.rsplit("/", 1)[1]: v for k, v in s3.keys(bucket, "runs/fsdp/step-00000004/").items()
    }
    shards = {k: v for k, v in objects.items() if k.endswith(".distcp")}
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"]

    outs = _two_nodes(root, tmp_path / "resuming", env)  # fresh mirrors: as on new nodes
    text = "\n".join(outs)
    assert f"dckpt resume: step 4 from {root}/step-00000004" in text, text[-4000:]
    n = len(objects) - 1  # the manifest is not one of its own files
    assert re.search(rf"{n} of {n} files hashed and matched", text), text[-4000:]
    held = [_mirror_files(tmp_path / "resuming" / f"node{r}", objects) for r in (0, 1)]
    for files in held:
        assert {".metadata", "manifest.json"} <= set(files)
        assert all(files[f] == objects[f] for f in files)  # whole objects, as in the bucket
    fetched = [sum(v for k, v in files.items() if k in shards) for files in held]
    whole = sum(shards.values())
    # Each node's rank reads its own FSDP shard; rank 1's plan needs no other object, so its
    # node never holds rank 0's. (Rank 0 reads replicated values DCP placed in rank 1's file.)
    assert "__1_0.distcp" in held[1] and "__0_0.distcp" not in held[1], held
    assert fetched[1] < 0.6 * whole, (fetched, whole)
    assert sum(fetched) < 1.6 * whole, (fetched, whole)  # was 2 x whole: every node all of it
    print(f"shard bytes fetched per node: {fetched} of {whole} ({[f / whole for f in fetched]})")
