"""dckpt's control plane at 2 and 8 ranks: the same calls per rank, no payload growing with N.

Runs ``bench/scale.py`` once (a subprocess: its fork server must start with the counting shim
``bench/scale_shim/sitecustomize.py`` on ``PYTHONPATH``, which dckpt does not know about) on
a tiny DDP model at 2 and at 8 gloo ranks: start, ``STEPS`` steps each with
``preempted(step)``, two durable saves (a first and a later one), a resume in a fresh
manager. Then, for each operation (start, step, save, resume):

- ``test_calls_per_rank_do_not_grow``: every rank makes the same collectives (and creates the
  same groups) at 8 ranks as at 2, call site by call site. For ``step`` the totals over the
  same number of steps are compared, and a run may check less often than every step (an
  agreement every K steps or seconds, the first check issuing three): at 8 ranks it may make at
  most max(its count at 2 ranks, one per step and one more). Point-to-point messages
  (``send``, ``recv``: dckpt's reductions are a binomial tree toward rank 0, its gathers a
  message from every rank to rank 0) may number, per reduction or gather the site made at 2
  ranks (one message each there), up to ceil(log2 N) on a rank other than 0, and N - 1 on
  rank 0.
- ``test_other_ranks_receive_o1_bytes``: at no call site does a rank other than 0 receive more
  bytes at 8 ranks than at 2, beyond ``SLACK_BYTES`` (pickles of equal objects may differ by
  a few bytes; a payload that shrinks at one site does not excuse one that grows at another),
  a tree's messages excepted: those may number log2 N, each of the size it had at 2
  ranks. Split by who makes the call: dckpt's own call sites, and DCP's (its
  ``_DistWrapper``: plans gathered and scattered, the metadata broadcast), so that what dckpt
  controls directly is told apart from what it inherits from DCP.

dckpt's own call sites must not grow at all. DCP's may grow by exactly what torch's object
collectives add under DCP's ``_DistWrapper``, and no more: ``gather_object`` all-gathers every
rank's 8-byte object size before its gather (8(N-1) bytes and a ring of N-1 hops on every
rank, per call), and the load's ``all_gather_object`` of every rank's (constant) read result
hands each rank N-1 of them. That is the one O(N) per rank left in a save and a resume; it is
DCP's, modelled in ``bench/results/scale.md``, and removing it means driving DCP's planner and
storage layer without its wrapper. Anything else of DCP's that grew (its metadata broadcast,
which dckpt's writer empties, or its plans) fails the test. The message names each call site
that grew and by how much.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parent.parent
SMALL, LARGE = 2, 8
STEPS = 4
SLACK_BYTES = 32
OPS = ("start", "step", "save", "resume")
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
TREE_HOPS = math.ceil(math.log2(LARGE))


@pytest.fixture(scope="module")
def tallies(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("scale") / "scale.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "scale.py"),
        "--worlds", str(SMALL), str(LARGE), "--parallel", "ddp", "--steps", str(STEPS),
        "--no-synthetic", "--no-model", "--md", "none", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO, check=False
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    doc = json.loads(out.read_text())
    return {t["world"]: t for t in doc["tallies"]}


def _sites(tally: dict[str, Any], op: str) -> dict[str, dict[str, int]]:
    """``kind|site`` -> calls and bytes received (rank 0, the most of any other rank)."""
    return {k.split("|", 1)[1]: v for k, v in tally["sites"].items() if k.split("|")[0] == op}


def _is_p2p(key: str) -> bool:
    return key.split("|", 1)[0] in P2P


def _reductions(small: dict[str, dict[str, int]], key: str) -> int:
    """The tree reductions a p2p call site made at 2 ranks: one message each on some rank."""
    site = key.split("|", 1)[1]
    rows = [v for k, v in small.items() if _is_p2p(k) and k.split("|", 1)[1] == site]
    return max([1, *(max(v["calls_r0"], v["calls_other"]) for v in rows)])


def _message(small: dict[str, dict[str, int]], key: str) -> int:
    """The largest message of a p2p call site at 2 ranks (rank 0 receives them there)."""
    site = key.split("|", 1)[1]
    sizes = [
        v["recv_r0"] // max(1, v["calls_r0"])
        for k, v in small.items()
        if _is_p2p(k) and k.split("|", 1)[1] == site
    ]
    return max(sizes, default=0)


@pytest.mark.parametrize("op", OPS)
def test_calls_per_rank_do_not_grow(tallies: dict[int, dict[str, Any]], op: str) -> None:
    small, large = _sites(tallies[SMALL], op), _sites(tallies[LARGE], op)
    zero = {"calls_r0": 0, "calls_other": 0}
    grew = []
    for site in sorted(set(small) | set(large)):
        a, b = small.get(site, zero), large.get(site, zero)
        for who, key in (("rank 0", "calls_r0"), ("other ranks", "calls_other")):
            if _is_p2p(site) and key == "calls_r0":  # rank 0 may gather from every rank
                allowed, exact = _reductions(small, site) * (LARGE - 1), False
            elif _is_p2p(site):  # a tree: up to log2 N messages per reduction on the others
                allowed, exact = _reductions(small, site) * TREE_HOPS, False
            elif op == "step":  # agreements every K steps: at most one per step, 3 at the first
                allowed, exact = max(a[key], STEPS + 1), False
            else:
                allowed, exact = a[key], True
            if b[key] > allowed or (exact and b[key] != a[key]):
                grew.append(
                    f"  {site}: {who} {a[key]} call(s) at N={SMALL}, {b[key]} at N={LARGE}"
                    + ("" if exact else f" (allowed: {allowed})")
                )
    o_small, o_large = tallies[SMALL]["ops"][op], tallies[LARGE]["ops"][op]
    if grew:
        pytest.fail(
            f"{op}: the calls per rank differ between {SMALL} and {LARGE} ranks "
            f"(totals rank 0 {o_small['calls_r0']} -> {o_large['calls_r0']}, others "
            f"{o_small['calls_other']} -> {o_large['calls_other']}):\n" + "\n".join(grew)
        )
    groups = (o_small["groups"], o_large["groups"])
    assert groups[1] <= groups[0], (
        f"{op}: {groups[0]} new_group call(s) at N={SMALL}, {groups[1]} at N={LARGE}"
    )


@pytest.mark.parametrize("owner", ["dckpt", "DCP"])
@pytest.mark.parametrize("op", OPS)
def test_other_ranks_receive_o1_bytes(
    tallies: dict[int, dict[str, Any]], op: str, owner: str
) -> None:
    def mine(site: str) -> bool:
        return site.split("|", 1)[1].startswith("DCP") == (owner == "DCP")

    every_small = _sites(tallies[SMALL], op)
    small = {s: v for s, v in every_small.items() if mine(s)}
    large = {s: v for s, v in _sites(tallies[LARGE], op).items() if mine(s)}

    def allowed(key: str) -> int:
        """What a site may hand another rank at 8 ranks: its bytes at 2 ranks, or for a
        tree's messages, log2 N messages per reduction, each the size it had at 2; for DCP's
        object collectives, what torch's size exchange adds (module docstring)."""
        if _is_p2p(key):
            return _reductions(every_small, key) * TREE_HOPS * _message(every_small, key)
        at_small = small.get(key, {})
        base = at_small.get("recv_other", 0)
        kind = key.split("|", 1)[0]
        if owner == "DCP" and kind == "gather_object":
            return base + 8 * (LARGE - SMALL) * max(1, at_small.get("calls_other", 1))
        if owner == "DCP" and kind == "all_gather_object":
            return base * (LARGE - 1) // (SMALL - 1)  # a constant object from each peer
        return base

    grew = []
    for site in sorted(set(small) | set(large)):
        a = allowed(site)
        b = large.get(site, {}).get("recv_other", 0)
        if b > a + SLACK_BYTES:
            grew.append(f"  {site}: {a} B allowed (from N={SMALL}), {b} B at N={LARGE}")
    total_small = sum(v["recv_other"] for v in small.values())
    total_large = sum(v["recv_other"] for v in large.values())
    if grew:
        pytest.fail(
            f"{op} ({owner}'s call sites): a rank other than 0 receives more at N={LARGE} than "
            f"at N={SMALL} (beyond {SLACK_BYTES} B per call site, and a tree's log2 N messages); "
            f"in all, the one that received the most got {total_small} B at N={SMALL}, "
            f"{total_large} B at N={LARGE}. Growing:\n" + "\n".join(grew)
        )
