"""What dckpt's control plane costs as the world grows: counted at N = 2..32, modelled to 16k.

Three parts (issue 29, item 6):

1. **Real jobs, counted.** For each N (``--worlds``, default 2 4 8 16; ``--big`` adds 32) and
   each wrapper (``--parallel``: a tiny model under DDP and under FSDP2 ``fully_shard``), N
   processes on gloo (forked from a fork server that imported torch, DDP, FSDP2, DCP and dckpt
   once) run what ``launch/train.py`` runs: a ``CheckpointManager`` (start,
   ``watch_preemption``), ``--steps`` training steps each followed by ``preempted(step)``, two
   durable saves waited for (after half the steps, and at the end: a first save and a later
   one), ``close``, then a fresh manager's ``resume()`` and ``close``. The
   counting shim ``bench/scale_shim/sitecustomize.py`` (dckpt does not know it) counts every
   ``torch.distributed`` call and every TCPStore access per rank and per operation; this script
   tallies them: collectives per rank (rank 0, and the most any other rank made), payload
   bytes received by rank 0 and by the other rank that received the most, and the store's
   calls and bytes per rank, per operation and per call site.
2. **Synthetic, one process, N = 1k..16k** (``--synthetic``): rank 0's manifest (dckpt's
   ``Manifest`` of N ranks' files: built, sealed, encoded) and its parse on every rank; DCP's
   ``DefaultSavePlanner.create_global_plan`` on N synthesised local plans (FSDP: every tensor
   sharded over the N ranks; DDP: every tensor replicated); every rank's
   ``dckpt.storage.verifying_reader.check_metadata`` on a synthesised ``Metadata`` with N
   chunks per sharded tensor. Sizes beyond the time budget (``--budget-s`` per part) are
   extrapolated from the two largest measured sizes (log-log), and marked ``~``. The parts
   are measured on ``--synthetic-tensors`` tensors and scaled linearly to ``--tensors``
   (per-tensor work: planning and checks handle each tensor's chunks on their own).
3. **A latency model** (``--no-model`` skips it): alpha measured as the round-trip floor of a
   4-byte gloo send/recv ping-pong between 2 processes on this machine, beta as gloo's loopback
   bandwidth (a 64 MiB ping-pong), and the issue's alpha = 40 µs / 100 µs with beta = 1 GB/s.
   Each call counted in part 1 at the largest N is replayed at N = 1k, 4k, 16k with the shape
   gloo uses for it (``HOPS``), its payload fitted in N across the measured jobs (``_fit``:
   the simplest of constant, log N, N, N^2); dckpt's p2p trees cost ceil(log2 N) hops per
   reduction; store traffic (calls and bytes per call, fitted the same way) costs its round
   trips or the store server's share; part 2's compute is added where it runs (rank 0's
   planning and manifest to a save, the checks and the manifest's parse to a resume). The
   first save and a later one are costed apart (``MODEL_OPS``).

Invariants: dckpt's code is never modified or monkeypatched from here (only the shim
wraps it, to label operations); every figure comes from a count or a timing of this run;
absolute seconds on a shared 2-core machine are noisy, so the tables lead with counts and
ratios. Output: a markdown report (``--md``; ``bench/results/scale.md`` by default) and,
with ``--json PATH``, every tally (``tests/test_scale.py`` reads it).

    .venv/bin/python bench/scale.py --big                 # make bench-scale
    .venv/bin/python bench/scale.py --worlds 2 8 --parallel ddp --no-synthetic --no-model \\
        --md none --json /tmp/scale.json                  # what tests/test_scale.py runs
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHIM = Path(__file__).resolve().parent / "scale_shim"
RESULTS = Path(__file__).resolve().parent / "results"
OPS = ("start", "step", "save", "resume", "close")
MODEL_OPS = ("start", "step", "save:first", "save:later", "resume")
"""What the model costs: a job's two saves apart (the first one connects gloo's pairs lazily
and plans uncached; the later one is what every save after it costs)."""
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
"""Point-to-point calls: counted apart, as messages of a tree (dckpt's own reductions are a
binomial tree of sends and receives toward rank 0: up to ceil(log2 N) messages per rank)."""
TARGET_N = (1024, 4096, 16384)
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "dckpt",
    "dckpt.manager",
    "dckpt.load.resumer",
]

# --- part 1: real jobs ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tiny(parallel: str, width: int) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    net: nn.Module = nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4)
    )
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in list(net.children()):
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(net)
    else:
        net = nn.parallel.DistributedDataParallel(net)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def _train_step(net: Any, opt: Any, seed: int, width: int) -> float:
    import torch

    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    loss = net(torch.randn(8, width, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    return float(loss.detach())


def _rank_main(rank: int, world: int, port: int, root: str, job: dict[str, Any], out: Any) -> None:
    """One rank of a counted job (see the module docstring, part 1)."""
    os.environ.update(
        DCKPT_SCALE_COUNT=job["counts"],
        DCKPT_SCALE_LABEL=job["label"],
        RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        import dckpt

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=job["timeout"]),
        )
        width, steps = job["width"], job["steps"]
        net, opt = _tiny(job["parallel"], width)
        state = dckpt.TrainState(net, opt)
        with dckpt.CheckpointManager(root, state, run_config={"width": width}) as manager:
            manager.watch_preemption()
            for step in range(1, steps + 1):
                manager.observe(_train_step(net, opt, 1000 * step + rank, width))
                if manager.preempted(step):
                    raise RuntimeError("preempted without a signal")
                if step == steps // 2:  # the first save: new connections, planning uncached
                    manager.save(step).result()
            manager.save(steps).result()  # a later save: what every save after costs
        with dckpt.CheckpointManager(root, state, run_config={"width": width}) as manager:
            report = manager.resume()
        if report.step != steps:
            raise RuntimeError(f"resumed step {report.step}, expected {steps}")
        from dckpt.root.manifest import read_manifest

        files = read_manifest(report.path).files if report.path is not None else ()
        sizes = {
            kind: sum(f.bytes for f in files if _kind(f.path) == kind)
            for kind in ("data", "items", "metadata")
        }
        dist.destroy_process_group()  # the shim writes this rank's counts here
        out.put((rank, "ok", json.dumps({"hashed": report.hashed_bytes, **sizes})))
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _context() -> Any:
    """A fork server with the shim active and the heavy modules imported once."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(SHIM), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    os.environ.setdefault("DCKPT_SCALE_COUNT", tempfile.gettempdir())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_job(
    ctx: Any, parallel: str, world: int, steps: int, width: int, timeout: float
) -> dict[str, Any]:
    """Run one counted job; returns ``{"parallel", "world", "wall_s", "ranks": {r: counts}}``."""
    work = Path(tempfile.mkdtemp(prefix=f"dckpt-scale-{parallel}{world}-"))
    try:
        job: dict[str, Any] = {
            "counts": str(work / "counts"),
            "label": f"{parallel}-{world}",
            "parallel": parallel,
            "steps": steps,
            "width": width,
            "timeout": max(60.0, timeout),
        }
        out = ctx.Queue()
        port = _free_port()
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world, port, str(work / "root"), job, out),
                daemon=True,
            )
            for r in range(world)
        ]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        results: dict[int, tuple[str, str]] = {}
        deadline = t0 + timeout
        while len(results) < world and time.perf_counter() < deadline:
            try:
                rank, status, text = out.get(timeout=0.2)
                results[rank] = (status, text)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    with contextlib.suppress(queue.Empty):
                        while True:
                            rank, status, text = out.get_nowait()
                            results[rank] = (status, text)
                    break
        wall = time.perf_counter() - t0
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        errors = {r: t for r, (s, t) in results.items() if s != "ok"}
        errors.update(
            {r: "no result (killed or timed out)" for r in range(world) if r not in results}
        )
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(errors.items())[:3])
            raise RuntimeError(f"{parallel} job at N={world}: {len(errors)} rank(s) failed\n{text}")
        ranks: dict[int, Any] = {}
        for path in glob.glob(os.path.join(job["counts"], "rank*.json")):
            with open(path) as f:
                data = json.load(f)
            ranks[int(data["rank"])] = data
        if sorted(ranks) != list(range(world)):
            raise RuntimeError(
                f"{parallel} job at N={world}: counts from ranks {sorted(ranks)} only; is the "
                f"shim active? (PYTHONPATH must start with {SHIM})"
            )
        return {
            "parallel": parallel,
            "world": world,
            "steps": steps,
            "wall_s": wall,
            "ranks": ranks,
            "hashed": {r: json.loads(text) for r, (_, text) in results.items()},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- tallies -------------------------------------------------------------------------------


def _others(values: dict[int, int]) -> int:
    return max((v for r, v in values.items() if r != 0), default=0)


def _matches(name: str, op: str, occ: int) -> bool:
    """Whether a call counted under ``op`` (entry ``occ``) belongs to ``name``: an operation,
    or ``save:first`` (the first save and its ``result``: entries 1-2) / ``save:later``."""
    if name == "save:first":
        return op == "save" and occ in (1, 2)
    if name == "save:later":
        return op == "save" and occ > 2
    return op == name


def _label(e: dict[str, Any]) -> str:
    """The operation of ``MODEL_OPS`` a counted call belongs to (saves: first or later)."""
    return next((m for m in MODEL_OPS if _matches(m, e["op"], e.get("occ", 0))), e["op"])


def tally(job: dict[str, Any]) -> dict[str, Any]:
    """Per operation (and for the first and later saves apart): collectives, groups, bytes
    received, store traffic, each per rank (rank 0 and the most any other rank had), and per
    call site for each operation."""
    ranks: dict[int, Any] = job["ranks"]
    ops: dict[str, Any] = {}
    sites: dict[str, Any] = {}
    for op in (*OPS, "save:first", "save:later"):
        calls = {r: 0 for r in ranks}
        p2p = {r: 0 for r in ranks}
        groups = {r: 0 for r in ranks}
        recv = {r: 0 for r in ranks}
        sent = {r: 0 for r in ranks}
        st_calls = {r: 0 for r in ranks}
        st_bytes = {r: 0 for r in ranks}
        for r, data in ranks.items():
            for e in data["events"]:
                if not _matches(op, e["op"], e.get("occ", 0)):
                    continue
                if e["kind"] == "new_group":
                    groups[r] += 1
                elif e["kind"] in P2P:
                    p2p[r] += 1
                else:
                    calls[r] += 1
                recv[r] += e["recv"]
                sent[r] += e["sent"]
                if op not in OPS:
                    continue
                key = f"{op}|{e['kind']}|{e['site']}"
                s = sites.setdefault(key, {"calls": {}, "recv": {}})
                s["calls"][r] = s["calls"].get(r, 0) + 1
                s["recv"][r] = s["recv"].get(r, 0) + e["recv"]
            for key, c in data["store"].items():
                name, _, occ = key.split("|")  # op|method|occurrence
                if _matches(op, name, int(occ)):
                    st_calls[r] += c["calls"]
                    st_bytes[r] += c["sent"] + c["recv"]
        ops[op] = {
            "calls_r0": calls.get(0, 0),
            "calls_other": _others(calls),
            "calls_other_min": min((v for r, v in calls.items() if r != 0), default=0),
            "p2p_r0": p2p.get(0, 0),
            "p2p_other": _others(p2p),
            "groups": max(groups.values(), default=0),
            "recv_r0": recv.get(0, 0),
            "recv_other": _others(recv),
            "sent_r0": sent.get(0, 0),
            "sent_other": _others(sent),
            "store_calls": max(st_calls.values(), default=0),
            "store_bytes": max(st_bytes.values(), default=0),
            "store_calls_r0": st_calls.get(0, 0),
            "store_bytes_r0": st_bytes.get(0, 0),
            "store_calls_other": _others(st_calls),
            "store_bytes_other": _others(st_bytes),
            "store_calls_total": sum(st_calls.values()),
            "store_bytes_total": sum(st_bytes.values()),
            "entries": max(d["entries"].get(op, 0) for d in ranks.values()),
        }
    site_rows = {
        key: {
            "calls_r0": s["calls"].get(0, 0),
            "calls_other": _others(s["calls"]),
            "recv_r0": s["recv"].get(0, 0),
            "recv_other": _others(s["recv"]),
        }
        for key, s in sites.items()
    }
    init_store = max(
        sum(c["sent"] + c["recv"] for k, c in d["store"].items() if k.startswith("outside|"))
        for d in ranks.values()
    )
    return {
        "parallel": job["parallel"],
        "world": job["world"],
        "steps": job["steps"],
        "wall_s": round(job["wall_s"], 2),
        "ops": ops,
        "sites": site_rows,
        "init_store_bytes": init_store,
        "hashed_share": _hashed_share(job),
        "data_per_rank": max(
            (h.get("data", 0) / job["world"] for h in (job.get("hashed") or {}).values()),
            default=0,
        ),
    }


def _kind(name: str) -> str:
    """What a checkpoint file is, for the resume's hashing figures."""
    if name == ".metadata":
        return "metadata"
    return "items" if name.endswith(".items") else "data"


def _hashed_share(job: dict[str, Any]) -> float | None:
    """The most bytes any rank hashed at the resume, over what it must read at least: its
    share of the data files (their bytes / N) and DCP's ``.metadata``, which every rank reads
    whole. 1.0 when each rank proves exactly that; above it, the items of other ranks' files
    it read and their item digests."""
    got = [h for h in (job.get("hashed") or {}).values() if h.get("data")]
    if not got:
        return None
    return float(max(h["hashed"] / (h["data"] / job["world"] + h["metadata"]) for h in got))


# --- part 2: synthetic, one process --------------------------------------------------------


EXPONENT = (1.0, 2.0)
"""The growth exponents extrapolation allows: the parts are at least linear in N (every rank's
items are read) and at most quadratic (pairwise checks of N chunks); a noisy pair of timings
must not extrapolate to more."""


def _exponent(pts: list[tuple[int, float]]) -> float:
    if len(pts) < 2:
        return EXPONENT[1]
    (n1, t1), (n2, t2) = pts[-2:]
    k = math.log(max(t2, 1e-9) / max(t1, 1e-9)) / math.log(n2 / n1)
    return min(max(k, EXPONENT[0]), EXPONENT[1])


def _ladder(
    build: Callable[[int], Any],
    run: Callable[[Any], Any],
    sizes: Iterable[int],
    budget_s: float,
) -> dict[int, dict[str, Any]]:
    """Time ``run(build(n))`` at doubling n up to max(sizes): always up to the smallest size
    asked for, then while the budget allows (the next size's time guessed from the last two);
    each the best of 3 while a run takes under 0.5 s (others share these cores). The sizes
    not reached are extrapolated log-log from the two largest measured, the exponent within
    ``EXPONENT``."""
    wanted = sorted(set(sizes))
    ladder = [n for n in (128, 256, 512, 1024, 2048, 4096, 8192, 16384) if n <= wanted[-1]]
    ladder = sorted(set(ladder) | set(wanted))
    measured: dict[int, float] = {}
    spent = 0.0
    for n in ladder:
        if n > wanted[0] and measured:
            n2, t2 = max(measured.items())
            guess = t2 * (n / n2) ** _exponent(sorted(measured.items()))
            if spent + 2 * guess > budget_s:
                break
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            data = build(n)
            t1 = time.perf_counter()
            run(data)
            t = time.perf_counter() - t1
            spent += time.perf_counter() - t0
            del data
            best = min(best, t)
            if t >= 0.5:
                break
        measured[n] = best
        if spent > budget_s and n >= wanted[0]:
            break
    out: dict[int, dict[str, Any]] = {}
    pts = sorted(measured.items())
    k = _exponent(pts)
    n2, t2 = pts[-1]
    for n in wanted:
        if n in measured:
            out[n] = {"s": measured[n], "measured": True}
        else:
            out[n] = {"s": t2 * (n / n2) ** k, "measured": False, "exponent": round(k, 2)}
    return out


def _records(n: int) -> Any:
    from dckpt.storage.records import FileRecord

    return [
        FileRecord(path=f"__{r}_0.distcp", bytes=1 << 20, digest=f"xxh3_128:{r:032x}", rank=r)
        for r in range(n)
    ] + [FileRecord(path=".metadata", bytes=1 << 16, digest="xxh3_128:" + "f" * 32, rank=0)]


def synth_manifest(sizes: Iterable[int]) -> dict[int, dict[str, float]]:
    """Rank 0 builds, seals and encodes the manifest of N ranks' files; each rank parses it."""
    from dckpt.root.manifest import Manifest, manifest_bytes, parse_manifest

    out: dict[int, dict[str, float]] = {}
    for n in sizes:
        recs = _records(n)
        t0 = time.perf_counter()
        m = Manifest(
            step=1,
            world_size=n,
            files=tuple(sorted(recs)),
            run_id="synthetic",
            save_id="0" * 32,
            created_at=0.0,
            bytes_per_rank=tuple(1 << 20 for _ in range(n)),
        )
        raw = manifest_bytes(m)
        t1 = time.perf_counter()
        parse_manifest(raw, "synthetic")
        t2 = time.perf_counter()
        out[n] = {"build_s": t1 - t0, "parse_s": t2 - t1, "bytes": float(len(raw))}
    return out


ROWS = 64  # rows of each tensor's shard per rank (FSDP shards dim 0)
COLS = 32


def _plans(n: int, tensors: int, sharded: bool) -> Any:
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        BytesIOWriteData,
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    props = TensorProperties(dtype=torch.float32)
    plans = []
    for r in range(n):
        items = []
        for t in range(tensors):
            fqn = f"model.layers.{t}.weight"
            if sharded:
                offsets, sizes = torch.Size([r * ROWS, 0]), torch.Size([ROWS, COLS])
                size = torch.Size([n * ROWS, COLS])
                kind = WriteItemType.SHARD
            else:
                offsets, sizes = torch.Size([0, 0]), torch.Size([ROWS, COLS])
                size, kind = sizes, WriteItemType.TENSOR
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=kind,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=props,
                        size=size,
                    ),
                )
            )
        for key in ("progress.step", "progress.epoch"):  # replicated bytes: deduplicated
            items.append(
                WriteItem(
                    index=MetadataIndex(key),
                    type=WriteItemType.BYTE_IO,
                    bytes_io_data=BytesIOWriteData(nbytes=8),
                )
            )
        items.append(
            WriteItem(
                index=MetadataIndex(f"rng.{r}"),
                type=WriteItemType.BYTE_IO,
                bytes_io_data=BytesIOWriteData(nbytes=64),
            )
        )
        plans.append(
            SavePlan(items=items, planner_data={i.index.fqn: (i.index.fqn,) for i in items})
        )
    return plans


def _global_plan(plans: Any) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    DefaultSavePlanner().create_global_plan(plans)


def _metadata(n: int, tensors: int) -> Any:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dckpt.storage.records import FileRecord

    props = TensorProperties(dtype=torch.float32)
    shard = ROWS * COLS * 4
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        chunks = []
        for r in range(n):
            offsets = torch.Size([r * ROWS, 0])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([ROWS, COLS])))
            storage[MetadataIndex(fqn, offsets, r)] = _StorageInfo(
                relative_path=f"__{r}_0.distcp", offset=t * shard, length=shard
            )
        sdm[fqn] = TensorStorageMetadata(
            properties=props, size=torch.Size([n * ROWS, COLS]), chunks=chunks
        )
    expected = {
        f"__{r}_0.distcp": FileRecord(
            path=f"__{r}_0.distcp", bytes=tensors * shard, digest=f"xxh3_128:{r:032x}", rank=r
        )
        for r in range(n)
    }
    return Metadata(state_dict_metadata=sdm, storage_data=storage), expected


def _check(data: Any) -> None:
    from dckpt.storage.verifying_reader import check_metadata

    metadata, expected = data
    check_metadata(metadata, expected, "synthetic")


def synthetic(sizes: list[int], tensors: int, budget_s: float) -> dict[str, Any]:
    """Part 2 (see the module docstring); seconds for ``tensors`` tensors."""
    out: dict[str, Any] = {"tensors_measured": tensors, "manifest": synth_manifest(sizes)}
    for name, build, run in (
        ("plan_fsdp", lambda n: _plans(n, tensors, True), _global_plan),
        ("plan_ddp", lambda n: _plans(n, tensors, False), _global_plan),
        ("check_metadata", lambda n: _metadata(n, tensors), _check),
    ):
        try:
            out[name] = _ladder(build, run, sizes, budget_s)
        except Exception as exc:  # an API that moved: say so, keep the rest
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


# --- part 3: calibration and model ---------------------------------------------------------


def _pingpong(rank: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    peer = 1 - rank

    def rounds(t: Any, iters: int) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            if rank == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)
        return (time.perf_counter() - t0) / iters

    small = torch.zeros(1, dtype=torch.int32)
    rounds(small, 200)
    # the floor: a low percentile of single round trips (a busy machine inflates the mean)
    each = sorted(rounds(small, 1) for _ in range(2000))
    rtt = each[len(each) // 20]
    big = torch.zeros(64 << 20, dtype=torch.uint8)
    rounds(big, 1)
    big_rtt = min(rounds(big, 2) for _ in range(3))
    if rank == 0:
        out.put((rtt, big_rtt, big.numel()))
    dist.destroy_process_group()


def calibrate() -> dict[str, float]:
    """alpha: the round-trip floor of 4 bytes over gloo (the 5th percentile of 2000 single
    round trips); beta: 64 MiB one way over gloo loopback (the best of 3)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_pingpong, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    rtt, big_rtt, nbytes = out.get(timeout=300)
    for p in procs:
        p.join(timeout=10)
    one_way = max(big_rtt / 2 - rtt / 2, 1e-9)
    return {"alpha_s": rtt, "rtt_4b_s": rtt, "beta_Bps": nbytes / one_way}


HOPS = {
    "all_reduce": "ring: 2(n-1) hops of s/n each (reduce-scatter + allgather), gloo's default",
    "reduce": "as all_reduce (gloo's reduce is ring-based)",
    "broadcast": "binomial tree: ceil(log2 n) rounds of s (gloo/broadcast.cc)",
    "all_gather": "ring: n-1 hops of s (gloo/allgather.cc)",
    "gather": "linear: the root receives n-1 messages of s, one after another",
    "scatter": "linear: the root sends n-1 messages of s, one after another",
    "barrier": "dissemination: ceil(log2 n) rounds (gloo/barrier.cc)",
    "send/recv": "dckpt's own: a binomial tree toward rank 0, ceil(log2 n) hops of s per "
    "reduction (the broadcast that follows is costed as a broadcast); or, where rank 0 "
    "receives from every rank, a gather: the root takes n-1 messages of s one after another",
    "all_to_all": "n-1 hops of s",
    "new_group": "one hop; the connections of its pairs, eager (a full mesh) or lazy (at "
    "first use), are costed through the store traffic they make (a peer's address fetched "
    "per pair)",
}


def prim_time(kind: str, n: int, s: float, alpha: float, beta: float, per_msg: float) -> float:
    """Seconds of one tensor-level call on a group of n, s bytes contributed per rank."""
    if n <= 1:
        return 0.0
    logn = math.ceil(math.log2(n))
    if kind in ("all_reduce", "reduce"):
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta
    if kind == "broadcast":
        return logn * (alpha + s / beta)
    if kind in ("all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single"):
        return (n - 1) * (alpha + s / beta)
    if kind in ("reduce_scatter", "reduce_scatter_tensor"):
        return (n - 1) * (alpha + s / beta)
    if kind in ("gather", "scatter"):
        return alpha + (n - 1) * (per_msg + s / beta)
    if kind in ("barrier", "monitored_barrier"):
        return logn * alpha
    if kind in ("send", "recv", "isend", "irecv", "batch_isend_irecv"):
        return alpha + s / beta
    return alpha  # new_group: its pairs cost what its store traffic costs (a key per pair)


GROWTHS = ("const", "log N", "N", "N^2")
FIT_WITHIN = 0.05


def _basis(name: str, n: float) -> list[float]:
    if name == "const":
        return [1.0]
    if name == "log N":
        return [1.0, math.log2(n)]
    if name == "N":
        return [1.0, float(n)]
    return [1.0, float(n), float(n) * n]  # a full mesh: N (a + b N) per rank


def _fit(
    points: list[tuple[int, float]], growths: tuple[str, ...] = GROWTHS[:3]
) -> tuple[Callable[[float], float], str]:
    """Least squares in N for the simplest of ``growths`` (constant, a + b log N, a + b N,
    a + b N + c N^2) that explains the measured points within ``FIT_WITHIN`` (RMS over their
    mean), with no negative growth term; else the one that explains them best. Never below
    0. N = 2 is left out when two larger N were measured: with one peer, a ring, a tree and
    a gather are the same connection, which makes it unlike any larger world. Returns the
    fit and the growth's name."""
    import numpy as np

    pts = sorted(points)
    if len([p for p in pts if p[0] > 2]) >= 2:
        pts = [p for p in pts if p[0] > 2]
    ys = np.array([p[1] for p in pts], dtype=float)
    if len({p[0] for p in pts}) < 2:
        v = float(ys[-1]) if len(ys) else 0.0
        return (lambda _n: v), "const"
    scale = max(float(np.mean(np.abs(ys))), 1e-9)
    best: tuple[float, str, list[float]] | None = None
    for name in growths:
        a = np.array([_basis(name, p[0]) for p in pts])
        if a.shape[1] > len(pts):
            break
        coeffs = [float(c) for c in np.linalg.lstsq(a, ys, rcond=None)[0]]
        if any(c < 0 for c in coeffs[1:]):
            continue  # nothing here shrinks as the world grows
        miss = float(np.sqrt(np.mean((a @ np.array(coeffs) - ys) ** 2))) / scale
        if best is None or miss < best[0]:
            best = (miss, name, coeffs)
        if miss <= FIT_WITHIN:
            best = (miss, name, coeffs)
            break
    if best is None:
        v = float(np.mean(ys))
        return (lambda _n: v), "const"
    _, name, coeffs = best
    return (
        lambda n: max(sum(c * b for c, b in zip(coeffs, _basis(name, n), strict=True)), 0.0)
    ), name


def occurrences(op: str, steps: int) -> int:
    """How often a job runs ``op``: two managers start and close, ``steps`` steps, two saves
    (``save:first``, ``save:later``: one each), one resume (figures per occurrence divide by
    it)."""
    return {"start": 2, "close": 2, "save": 2, "step": max(1, steps)}.get(op, 1)


def _ratio(
    tallies: list[tuple[int, dict[str, Any]]], op: str, num: str, den: str | None
) -> list[tuple[int, float]]:
    """(N, ``num`` / ``den``) of ``op`` for each job; ``den`` "world" divides by N, None by 1."""
    out = []
    for w, t in tallies:
        d = float(w) if den == "world" else float(t[op][den]) if den else 1.0
        out.append((w, float(t[op][num]) / d if d else 0.0))
    return out


def model(
    jobs: list[dict[str, Any]],
    parallel: str,
    synth: dict[str, Any] | None,
    tensors: int,
    alpha: float,
    beta: float,
    per_msg: float,
) -> dict[str, dict[int, dict[str, float]]]:
    """Seconds per operation at each of TARGET_N (see the module docstring, part 3): the
    blocking collectives (dckpt's own call sites, DCP's), the asynchronous ones (their
    latency, overlapped with training), the store, rank 0's DCP planning uncached (part 2)
    and the other compute (manifest, checks). Per occurrence (``occurrences``)."""
    mine = sorted((j for j in jobs if j["parallel"] == parallel), key=lambda j: j["world"])
    if not mine:
        return {}
    ref = mine[-1]
    who = 1 if ref["world"] > 1 else 0

    def keyed(job: dict[str, Any]) -> dict[tuple[str, str, str, int], dict[str, Any]]:
        seen: dict[tuple[str, str, str], int] = {}
        out: dict[tuple[str, str, str, int], dict[str, Any]] = {}
        for e in job["ranks"][who if job["world"] > who else 0]["events"]:
            k = (_label(e), e["kind"], e["site"])
            i = seen.get(k, 0)
            seen[k] = i + 1
            out[(k[0], k[1], k[2], i)] = e
        return out

    per_job = [(j["world"], keyed(j)) for j in mine]
    # p2p call sites of the largest job, per (op, site): the messages one non-root rank sends
    # (per reduction or gather), rank 0's receives and the largest message. Rank 0 receiving
    # from every rank is a gather (linear at the root); fewer is a tree (log2 N hops).
    trees: dict[str, dict[str, tuple[int, float, bool]]] = {}
    found: dict[tuple[str, str], list[float]] = {}  # [most sends, rank 0's recvs, largest]
    for r, data in ref["ranks"].items():
        sends: dict[tuple[str, str], int] = {}
        for e in data["events"]:
            if e["kind"] not in P2P:
                continue
            at = (_label(e), e["site"])
            f = found.setdefault(at, [1.0, 0.0, 0.0])
            sends[at] = sends.get(at, 0) + (e["kind"] in ("send", "isend"))
            f[1] += float(r == 0 and e["kind"] in ("recv", "irecv"))
            f[2] = max(f[2], float(max((p[2] for p in e["prims"]), default=0)))
        for at, count in sends.items():
            found[at][0] = max(found[at][0], float(count))
    for (op_, site_), (per_rank, at_root, size) in found.items():
        linear = ref["world"] > 2 and at_root >= per_rank * (ref["world"] - 1)
        trees.setdefault(op_, {})[site_] = (int(per_rank), size, linear)
    tallies = [(j["world"], tally(j)["ops"]) for j in mine]
    scale = tensors / max(1, (synth or {}).get("tensors_measured", tensors))
    result: dict[str, dict[int, dict[str, float]]] = {}
    for op in MODEL_OPS:
        result[op] = {}
        # the store: calls per rank (at most one per peer and group: <= N) times bytes per
        # call (a peer's address, or a full mesh's blob of N addresses: <= N)
        calls_max = _fit(_ratio(tallies, op, "store_calls", None))
        bpc_max = _fit(_ratio(tallies, op, "store_bytes", "store_calls"))
        calls_avg = _fit(_ratio(tallies, op, "store_calls_total", "world"))
        bpc_avg = _fit(_ratio(tallies, op, "store_bytes_total", "store_calls_total"))
        steps = occurrences(op, ref["steps"])
        for n in TARGET_N:
            parts = {"dckpt_s": 0.0, "dcp_s": 0.0, "async_s": 0.0}
            n_async = 0
            for key, e in per_job[-1][1].items():
                if key[0] != op or e["kind"] in P2P:
                    continue
                t = 0.0
                for j, prim in enumerate(e["prims"]):
                    pts = [
                        (w, float(ev["prims"][j][2]))
                        for w, evs in per_job
                        if (ev := evs.get(key)) is not None and len(ev["prims"]) > j
                    ]
                    s = _fit(pts)[0](n)
                    group = max(1, round(prim[1] * n / ref["world"])) if prim[1] else n
                    t += prim_time(prim[0], group, s, alpha, beta, per_msg)
                if e.get("async"):
                    parts["async_s"] += t
                    n_async += 1
                elif e["site"].startswith("DCP"):
                    parts["dcp_s"] += t
                else:
                    parts["dckpt_s"] += t
            for site, (per_rank, size, linear) in trees.get(op, {}).items():
                if linear:  # the root takes every rank's messages, one after another
                    t = alpha + per_rank * (n - 1) * (per_msg + size / beta)
                else:
                    t = per_rank * math.ceil(math.log2(n)) * (alpha + size / beta)
                parts["dcp_s" if site.startswith("DCP") else "dckpt_s"] += t
            busiest = calls_max[0](n)
            serial = busiest * alpha + busiest * bpc_max[0](n) / beta
            every = calls_avg[0](n) * n
            server = every * per_msg + every * bpc_avg[0](n) / beta
            planning = compute = 0.0
            if synth and op.startswith("save"):
                entry = synth.get(f"plan_{parallel}", {}).get(n, {})
                planning = entry.get("s", 0.0) * scale
                compute = synth["manifest"][n]["build_s"]
            if synth and op == "resume":
                check = synth.get("check_metadata", {}).get(n, {}).get("s", 0.0)
                compute = (check * scale if parallel == "fsdp" else 0.0) + synth["manifest"][n][
                    "parse_s"
                ]
            row: dict[str, Any] = {k: v / steps for k, v in parts.items()}
            row["async_s"] = parts["async_s"] / max(1, n_async)  # one call's latency
            # a step's store traffic is its first agreement connecting peers: once, not per step
            row["store_s"] = max(serial, server) / (1 if op == "step" else steps)
            row["store_growth"] = f"calls {calls_max[1]}, bytes/call {bpc_max[1]}"
            row["planning_s"] = planning
            row["compute_s"] = compute
            # the first save plans uncached; a later one is taken to hit dckpt's plan cache
            row["total_s"] = row["dckpt_s"] + row["dcp_s"] + compute
            row["total_s"] += planning if op == "save:first" else 0.0
            if op != "step":
                row["total_s"] += row["store_s"]
            row["cached_s"] = row["total_s"] - (planning if op == "save:first" else 0.0)
            result[op][n] = row
    return result


# --- the report ----------------------------------------------------------------------------


def _b(n: float) -> str:
    n = float(n)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _s(t: float) -> str:
    if t >= 60:
        return f"{t / 60:.3g} min"
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


CHECK_EVERY_S = 1.0
"""How far apart ``preempted`` issues its asynchronous agreements by default (about one per
second of training): an agreement slower than that sets the interval instead (twice the
latency the first, waiting check measured), so no later check waits for one."""


def verdict(op: str, r: dict[str, float]) -> str:
    """The issue's target for ``op`` at 16k ranks, met or missed by the modelled row ``r``."""
    if not r:
        return ""

    def mark(ok: bool, what: str) -> str:
        return ("meets " if ok else "**misses** ") + what

    if op == "step":
        hidden = r.get("async_s", 0.0) <= CHECK_EVERY_S
        return mark(r["total_s"] <= 1e-3, "≤ 1 ms blocking per step") + (
            ""
            if hidden
            else f"; an agreement takes {_s(r['async_s'])}, longer than the default "
            f"{CHECK_EVERY_S:g} s between checks: the first check (which waits, once, at "
            "the first step) measures it, and the checks then come twice that apart, so a "
            f"signal is acted on within about {_s(4 * r['async_s'])}"
        )
    if op.startswith("save"):
        own = r["dckpt_s"] + r["store_s"] + r["compute_s"]
        return (
            mark(own <= 1.0, f"dckpt ≤ 1 s ({_s(own)})")
            + "; "
            + mark(r["dcp_s"] <= 2.0, f"DCP, cached, ≤ 2 s ({_s(r['dcp_s'])})")
        )
    if op == "resume":
        return mark(r["total_s"] <= 30.0, "≤ 30 s")
    if op == "start":
        return mark(r["total_s"] <= 10.0, "≤ 10 s")
    return ""


def tree_ops(sites: dict[str, Any], op: str, site: str) -> int:
    """How many tree reductions a p2p call site runs: its most messages on any rank at the
    smallest N (a 2-rank tree is one message per reduction), at least 1."""
    rows = [v for k, v in sites.items() if k.startswith(f"{op}|") and k.endswith(f"|{site}")]
    return int(max([1, *(max(v["calls_r0"], v["calls_other"]) for v in rows)]))


def growth(tallies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per job, operation and call site: what the smallest and the largest N counted (calls
    per rank, bytes received by rank 0 and by the other ranks), with flags where it grew."""
    rows: list[dict[str, Any]] = []
    for parallel in sorted({t["parallel"] for t in tallies}):
        mine = sorted((t for t in tallies if t["parallel"] == parallel), key=lambda t: t["world"])
        lo, hi = mine[0], mine[-1]
        keys = sorted(
            set(lo["sites"]) | set(hi["sites"]), key=lambda k: (OPS.index(k.split("|")[0]), k)
        )
        for key in keys:
            op, kind, site = key.split("|", 2)
            a = lo["sites"].get(
                key, {"calls_r0": 0, "calls_other": 0, "recv_r0": 0, "recv_other": 0}
            )
            b = hi["sites"].get(
                key, {"calls_r0": 0, "calls_other": 0, "recv_r0": 0, "recv_other": 0}
            )
            steps = (lo["steps"], hi["steps"]) if op == "step" else (1, 1)
            grew = []
            more_calls = (
                b["calls_other"] / steps[1] > a["calls_other"] / steps[0]
                or b["calls_r0"] / steps[1] > a["calls_r0"] / steps[0]
            )
            if op == "step":  # agreements every K steps: at most one per step (the first: 2)
                more_calls = max(b["calls_r0"], b["calls_other"]) > max(
                    steps[1] + 1, a["calls_r0"], a["calls_other"]
                )
            tree_ok = False
            if kind in P2P:  # others: a tree's log2 N; rank 0 may gather from every rank
                reductions = tree_ops(lo["sites"], op, site)
                tree = reductions * math.ceil(math.log2(hi["world"]))
                if b["calls_other"] > tree:
                    grew.append(f"messages beyond a tree's log2 N ({tree})")
                elif b["calls_r0"] > max(tree, reductions * (hi["world"] - 1)):
                    grew.append("rank 0: messages beyond one per rank")
                elif more_calls:
                    tree_ok = True
                    grew.append(
                        "a gather to rank 0 (N-1 messages)"
                        if b["calls_r0"] > tree
                        else "log2 N messages (a tree)"
                    )
            elif more_calls:
                grew.append("calls")
            if b["recv_other"] > a["recv_other"] + 64 and not tree_ok and op != "step":
                grew.append("**bytes to other ranks**")
            if b["recv_r0"] > 2 * a["recv_r0"] + 64 and not tree_ok and op != "step":
                grew.append("bytes to rank 0 (allowed)")
            rows.append(
                {"parallel": parallel, "op": op, "kind": kind, "site": site, "small": a, "large": b}
                | {"flags": grew, "worlds": (lo["world"], hi["world"])}
            )
    return rows


def _growth_row(g: dict[str, Any]) -> str:
    a, b = g["small"], g["large"]
    return (
        f"| {g['parallel']} | {g['op']} | `{g['kind']}` | `{g['site']}` "
        f"| {a['calls_r0']}/{a['calls_other']} | {b['calls_r0']}/{b['calls_other']} "
        f"| {_b(a['recv_r0'])} → {_b(b['recv_r0'])} | {_b(a['recv_other'])} → "
        f"{_b(b['recv_other'])} | {', '.join(g['flags']) or '-'} |"
    )


def summary(doc: dict[str, Any]) -> list[str]:
    """The report's first lines: what grew with N in the real jobs, and the targets."""
    lines: list[str] = []
    items = growth(doc.get("tallies", []))
    bad = [
        g
        for g in items
        if any(
            f.startswith(("calls", "messages beyond", "rank 0: messages", "**")) for f in g["flags"]
        )
    ]
    if items:
        lo, hi = items[0]["worlds"]
        lines.append(f"What grows per rank from N={lo} to N={hi} (section 1):")
        lines.append("")
        if not bad:
            lines.append("- nothing: the same calls per rank, no rank but 0 receiving more.")
        for g in bad:
            a, b = g["small"]["recv_other"], g["large"]["recv_other"]
            lines.append(
                f"- {g['parallel']} {g['op']}: `{g['kind']}` at `{g['site']}`: "
                f"{', '.join(f.strip('*') for f in g['flags'])} "
                f"(other ranks received {_b(a)} → {_b(b)})"
            )
        for flag, what in (
            ("log2 N messages (a tree)", "binomial trees (ceil(log2 N) messages per reduction)"),
            ("a gather to rank 0 (N-1 messages)", "gathers to rank 0 (N-1 messages there)"),
        ):
            sites = sorted({(g["op"], g["site"]) for g in items if flag in g["flags"]})
            if sites:
                lines.append(
                    f"- and, as designed, {len(sites)} p2p call sites of dckpt's own that are "
                    f"{what}: " + ", ".join(f"{op} `{site}`" for op, site in sites) + "."
                )
        lines.append("")
    shares = sorted(
        (t["parallel"], t["world"], t["hashed_share"])
        for t in doc.get("tallies", [])
        if t.get("hashed_share") is not None
    )
    if shares:
        lines.append(
            f"Bytes a rank hashes at a resume (width {doc.get('width', '?')}), the most of any "
            "rank over its share: the data files' bytes / N, plus DCP's `.metadata`, which "
            "every rank reads whole (the issue's target under FSDP: <= 1.1x):"
        )
        lines.append("")
        per_rank = (t.get("data_per_rank", 0) for t in doc.get("tallies", []))
        small = max(per_rank, default=0) < (1 << 20)  # shards of kBs, not MBs
        for parallel in sorted({p for p, _, _ in shares}):
            row = ", ".join(f"N={n}: {x:.2f}x" for p, n, x in shares if p == parallel)
            worst = max(x for p, _, x in shares if p == parallel)
            if parallel != "fsdp":
                note = (
                    "every rank reads every replicated tensor (one copy, in rank 0's file): "
                    "what it hashes is what it reads"
                )
            else:
                note = ("meets" if worst <= 1.1 else "**misses**") + " <= 1.1x"
                if small and worst > 1.1:
                    note += (
                        " (on shards of a few kB, the item digests of the files a rank reads a "
                        "value from weigh as much as its share: `scale_hashing.md` measures MB "
                        "shards)"
                    )
            lines.append(f"- {parallel}: {row}: {note}")
        lines.append("")
    for name, per in (doc.get("model") or {}).items():
        if "issue" not in name:
            continue
        lines.append(f"Modelled at 16k ranks ({name}):")
        lines.append("")
        for parallel, ops in per.items():
            for op in MODEL_OPS:
                r16 = (ops.get(op) or {}).get(16384) or (ops.get(op) or {}).get("16384")
                if r16:
                    lines.append(f"- {parallel} {op}: {_s(r16['total_s'])}: {verdict(op, r16)}")
        lines.append("")
    return lines


def report(doc: dict[str, Any]) -> str:
    lines = [
        "# bench/scale.py: dckpt's control plane from 2 to 16k ranks",
        "",
        f"- date: {doc['date']}; revision {doc['revision']}; host: {doc['host']}; load "
        f"average {doc.get('load_before')} before, {doc.get('load_after')} after (other jobs "
        "share these cores: seconds are noisy, counts are exact)",
        f"- command: `{doc['command']}`",
        "- counted by `bench/scale_shim/sitecustomize.py` (every `torch.distributed` call and "
        "TCPStore access, per rank, labelled with the `CheckpointManager` operation it ran in); "
        "dckpt was not modified.",
        "",
        "## Summary",
        "",
        *summary(doc),
    ]
    tallies: list[dict[str, Any]] = doc.get("tallies", [])
    if tallies:
        lines += [
            "## 1. Real jobs (gloo, CPU): per operation, per rank",
            "",
            "Per occurrence: `start` and `close` per manager (a job starts two), `step` per "
            f"step (over {tallies[0]['steps']} steps). Collectives: rank 0 / the most any other "
            "rank made; p2p messages (send, recv: dckpt's tree reductions) apart. Groups: "
            "`new_group` calls. Bytes received: the "
            "payload a rank received from the others (pickled, padded sizes for `*_object`). "
            "Store: calls and bytes (sent + received), rank 0 / the busiest other rank.",
            "",
            "| job | N | op | collectives r0/others | p2p messages r0/others | groups "
            "| recv rank 0 | recv max other | store calls r0/other | store bytes r0/other "
            "| job wall s |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for t in sorted(tallies, key=lambda t: (t["parallel"], t["world"])):
            for op in OPS:
                o = t["ops"][op]
                k = occurrences(op, t["steps"])
                calls = (
                    f"{o['calls_r0'] / k:.3g}/{o['calls_other'] / k:.3g} "
                    f"| {o['p2p_r0'] / k:.3g}/{o['p2p_other'] / k:.3g}"
                )
                store = (
                    f"{o['store_calls_r0'] / k:.3g}/{o['store_calls_other'] / k:.3g} "
                    f"| {_b(o['store_bytes_r0'] / k)}/{_b(o['store_bytes_other'] / k)}"
                )
                lines.append(
                    f"| {t['parallel']} | {t['world']} | {op} | {calls} | {o['groups'] / k:.3g} "
                    f"| {_b(o['recv_r0'] / k)} | {_b(o['recv_other'] / k)} | {store} "
                    f"| {t['wall_s'] if op == 'start' else ''} |"
                )
        lines += [
            "",
            "`init_process_group`'s own store traffic (not dckpt's) per rank: "
            + ", ".join(
                f"{t['parallel']} N={t['world']}: {_b(t['init_store_bytes'])}" for t in tallies
            ),
            "",
            "### What grows with N (smallest N → largest N, per call site)",
            "",
            "Calls are rank 0/others. Flags: the calls per rank grew (`step`: more than one "
            "per step); p2p messages beyond a binomial tree's ceil(log2 N) per reduction "
            "(within it: `a tree`); the bytes a rank other than 0 received grew by more than "
            "64 B (**bold**: what issue 29 rules out); rank 0's more than doubled (allowed: "
            "rank 0 gathers).",
            "",
            "| job | op | call | site | calls, small N | calls, large N | recv rank 0 | "
            "recv max other | grows |",
            "|---|---|---|---|---:|---:|---:|---:|---|",
            *(_growth_row(g) for g in growth(tallies)),
            "",
        ]
    synth = doc.get("synthetic")
    if synth:
        tensors = doc["tensors"]
        factor = tensors / synth["tensors_measured"]
        lines += [
            f"## 2. Synthetic (one process), scaled to {tensors} sharded tensors",
            "",
            f"Measured on {synth['tensors_measured']} tensors, times x{factor:.3g}; "
            "`~`: extrapolated (log-log from the two largest sizes measured within "
            f"{doc['budget_s']} s per part, the exponent within {EXPONENT}).",
            "",
            "| N | manifest: rank 0 builds | manifest size | each rank parses | DCP plan, FSDP "
            "(rank 0) | DCP plan, DDP (rank 0) | check_metadata (each rank) |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        scale = factor

        def cell(part: str, n: int, k: float) -> str:
            d = synth.get(part, {})
            if "error" in d:
                return f"error: {d['error'][:60]}"
            e = d.get(n) or d.get(str(n))
            if e is None:
                return "-"
            return ("" if e["measured"] else "~") + _s(e["s"] * k)

        for n in doc["synthetic_sizes"]:
            m = synth["manifest"].get(n) or synth["manifest"].get(str(n))
            lines.append(
                f"| {n} | {_s(m['build_s'])} | {_b(m['bytes'])} | {_s(m['parse_s'])} "
                f"| {cell('plan_fsdp', n, scale)} | {cell('plan_ddp', n, scale)} "
                f"| {cell('check_metadata', n, scale)} |"
            )
        lines.append("")
    models = doc.get("model")
    if models:
        cal = doc["calibration"]
        lines += [
            "## 3. Latency model",
            "",
            f"Measured here: alpha = {_s(cal['alpha_s'])} (round-trip floor of 4 bytes, gloo "
            f"send/recv, 2 processes: the 5th percentile of 2000), beta = "
            f"{_b(cal['beta_Bps'])}/s (64 MiB over gloo loopback). Per-message cost at a "
            f"gather/scatter root and at the store server: {_s(doc['per_msg_s'])} (assumed).",
            "",
            "Shapes (gloo's algorithms, per tensor-level call; `*_object` calls are their "
            "primitives: a size exchange, then the pickled bytes):",
            "",
            *[f"- `{k}`: {v}" for k, v in HOPS.items()],
            "- store: the busiest rank's calls and bytes, and all ranks' together, each fitted "
            "in N by least squares: the simplest of a, a + b log N, a + b N, a + b N + c N^2 "
            "that explains the jobs within 5 % (RMS); the store costs the busiest "
            "rank's calls x alpha + bytes / beta, or the server's share (all calls x "
            "per-message + all bytes / beta), whichever is larger.",
            "- payloads: each call's bytes per rank fitted over the jobs measured, the same way "
            "(the simplest of constant, log N, N, N^2 within 5 %); group sizes scale with N. "
            "p2p trees: the most reductions any rank sent at a call site, each ceil(log2 N) "
            "hops of its largest message.",
            "- compute: rank 0's planning and manifest (part 2) added to `save`, the checks and "
            "the manifest parse to `resume` (check_metadata only for FSDP: DDP's tensors have "
            "one chunk each).",
            "",
        ]
        for name, per in models.items():
            lines += [
                f"### {name}",
                "",
                "Total: blocking collectives + store + compute. The first save plans uncached "
                "(rank 0's DCP planning, part 2, is in its total); a later save is taken to hit "
                "dckpt's plan cache (its `planning` column is what a miss would add). `cached`: "
                "the total without the planning. `async`: one call's latency for collectives "
                "issued without waiting (the preemption agreement: overlapped with training, "
                "not in the total). A step's store traffic (its first agreement connecting "
                "peers) happens once.",
                "",
                "| job | op | 1k | 4k | 16k | 16k cached | 16k: dckpt / DCP / store / planning "
                "/ compute | 16k async, per call | store per rank grows as | target at 16k |",
                "|---|---|---:|---:|---:|---:|---|---:|---|---|",
            ]
            for parallel, ops in per.items():
                for op in MODEL_OPS:
                    row = ops.get(op)
                    if not row:
                        continue
                    r16 = row.get(16384) or row.get("16384") or {}
                    cells = " | ".join(
                        _s((row.get(n) or row.get(str(n)) or {"total_s": 0.0})["total_s"])
                        for n in TARGET_N
                    )
                    split = " / ".join(
                        _s(r16.get(k, 0.0))
                        for k in ("dckpt_s", "dcp_s", "store_s", "planning_s", "compute_s")
                    )
                    label = {"step": "step (per step)", "save:first": "save (first)"}.get(
                        op, "save (later)" if op == "save:later" else op
                    )
                    if op == "step":
                        split += " (store: once, not in the total)"
                    lines.append(
                        f"| {parallel} | {label} | {cells} | {_s(r16.get('cached_s', 0.0))} "
                        f"| {split} | {_s(r16.get('async_s', 0.0))} "
                        f"| {r16.get('store_growth', '')} | {verdict(op, r16)} |"
                    )
            lines.append("")
    lines += [
        "## How to rerun",
        "",
        "`make bench-scale` (this report), or `.venv/bin/python bench/scale.py [--big] "
        "[--worlds 2 4 8 16] [--parallel ddp fsdp] [--json PATH]`; `tests/test_scale.py` "
        "asserts the counts at 2 and 8 ranks.",
        "",
    ]
    return "\n".join(lines)


def _revision() -> str:
    """The code measured (``bench/_harness.source_revision``, imported here: it loads torch)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _harness import source_revision

    return source_revision()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--big", action="store_true", help="add N=32 to --worlds")
    p.add_argument("--parallel", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--no-real", action="store_true")
    p.add_argument("--no-synthetic", action="store_true")
    p.add_argument("--no-model", action="store_true")
    p.add_argument("--synthetic-sizes", type=int, nargs="+", default=list(TARGET_N))
    p.add_argument("--synthetic-tensors", type=int, default=4)
    p.add_argument("--tensors", type=int, default=60, help="sharded tensors the model assumes")
    p.add_argument("--budget-s", type=float, default=30.0, help="per synthetic part")
    p.add_argument("--per-message-us", type=float, default=5.0)
    p.add_argument("--md", default=str(RESULTS / "scale.md"), help="'none': no report")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    worlds = sorted(set(args.worlds) | ({32} if args.big else set()))
    doc: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "revision": _revision(),
        "command": " ".join([".venv/bin/python", "bench/scale.py", *(argv or sys.argv[1:])]),
        "host": (
            f"{os.cpu_count()} CPUs, torch {_torch_version()}, Python {platform.python_version()}"
        ),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "tensors": args.tensors,
        "width": args.width,
        "budget_s": args.budget_s,
        "synthetic_sizes": args.synthetic_sizes,
        "per_msg_s": args.per_message_us * 1e-6,
    }
    jobs: list[dict[str, Any]] = []
    if not args.no_real:
        ctx = _context()
        for parallel in args.parallel:
            for world in worlds:
                t0 = time.perf_counter()
                jobs.append(run_job(ctx, parallel, world, args.steps, args.width, args.job_timeout))
                print(f"scale: {parallel} N={world}: {time.perf_counter() - t0:.1f} s", flush=True)
        doc["tallies"] = [tally(j) for j in jobs]
    synth = None
    if not args.no_synthetic:
        t0 = time.perf_counter()
        synth = synthetic(args.synthetic_sizes, args.synthetic_tensors, args.budget_s)
        doc["synthetic"] = synth
        print(f"scale: synthetic parts: {time.perf_counter() - t0:.1f} s", flush=True)
    if not args.no_model and jobs:
        cal = calibrate()
        doc["calibration"] = cal
        settings = {
            f"alpha = {_s(cal['alpha_s'])}, beta = {_b(cal['beta_Bps'])}/s (measured here)": (
                cal["alpha_s"],
                cal["beta_Bps"],
            ),
            "alpha = 40 µs, beta = 1 GB/s (the issue's targets)": (40e-6, 1e9),
            "alpha = 100 µs, beta = 1 GB/s": (100e-6, 1e9),
        }
        doc["model"] = {
            name: {
                parallel: model(jobs, parallel, synth, args.tensors, a, b, doc["per_msg_s"])
                for parallel in args.parallel
            }
            for name, (a, b) in settings.items()
        }
    doc["load_after"] = [round(x, 2) for x in os.getloadavg()]
    text = report(doc)
    print(text)
    if args.md != "none":
        Path(args.md).write_text(text)
        print(f"scale: wrote {args.md}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    return 0


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:  # without importing torch here (seconds on a busy machine)
        return version("torch")
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
