"""What do per-file digests cost a save? One command, one process tree, one interleaved run.

What it measures. ``--world-size`` ranks (spawned here, gloo over a FileStore) hold the same
state: a DDP-wrapped stack of ``nn.Linear`` layers plus its AdamW state after one step, sized so
that parameters + ``exp_avg`` + ``exp_avg_sq`` come to about ``--gb`` GB (1 GB = 1e9 bytes). DDP
replicates it; DCP's planner de-duplicates it, so each rank writes about ``1/world_size`` of it.
Each method below runs ``--repeats`` times, interleaved round by round (the order is reversed
every other round and rotated every two, so no method always follows the same one), into a fresh
directory that is deleted (then ``sync``) after it was measured:

- ``disk_write_1proc`` / ``disk_write_<N>proc``: the disk itself: one process writes a file as
  big as the checkpoint in 64 MiB chunks, then ``os.fdatasync``; or each of the N ranks writes its
  share in parallel. This is the ceiling any save can reach in this run.
- ``cpu_hash_xxh3_128`` / ``cpu_hash_sha256``: the digest alone, no file: each rank hashes its
  share of the checkpoint's bytes from memory. Its ratio to ``dcp_plain`` is the overhead to
  expect when nothing else is noisy (a lower bound: the writer reads each byte twice, once to
  hash it and once to write it).
- ``dcp_plain``: ``dcp.save`` with DCP's ``FileSystemWriter(sync_files=True)``: no digests.
- ``dcp_hashing``: the same through ``dckpt.storage.HashingWriter`` (xxh3-128 digests of every
  byte as it is written); ``dcp_hashing_sha256`` the same with sha256, for information.
- ``dckpt_save``: the whole ``CheckpointManager.save`` with the default config (asynchronous:
  staging copy, digests, manifest, atomic commit with its fsyncs), timed until the handle's
  ``result()`` says it is committed; ``dckpt_save_stall`` is how long ``save()`` itself held the
  caller (slowest rank). ``dckpt_save_sync``: the same with ``async_save=False``. Each uses one
  manager for the whole run, as training does, so its staging buffers are allocated by an
  untimed warm-up save and reused.
- ``dckpt_load_verified``: ``CheckpointManager.load`` of that checkpoint (every file hashed and
  checked before use); ``dcp_load``: plain ``dcp.load`` with ``FileSystemReader`` of the same
  files. Both from a cold page cache (the checkpoint's pages are dropped with
  ``posix_fadvise(DONTNEED)`` first); the ``*_warm`` variants read the same files from the page
  cache, which shows the CPU cost of verifying with the disk out of the way.

Every time is taken on rank 0 between two barriers, so it is the time of the slowest rank. The
state dict handed to ``dcp.save`` / ``dcp.load`` is built once, outside the timing; ``dckpt_save``
and ``dckpt_load_verified`` build theirs inside (that is part of what a user pays).

How to read it. ``digest overhead = median(dcp_hashing) / median(dcp_plain) - 1`` is the number
that matters (target: at most 5 %); the "paired" figure is the median of the per-round ratios,
which is less sensitive to drift over the run. ``dckpt_save / dcp_plain`` adds what staging, the
manifest and the commit cost; ``dckpt_load_verified / dcp_load`` what verification costs on
load. The fraction of disk bandwidth says how far a save is from what the disk allows. On a
shared or virtual machine single times are noisy; compare ratios from one run, not seconds
across runs.

Memory. On a VM with free page reporting (the dev VM: virtio-balloon, pages reported after
~2 s) memory the guest frees goes back to the host, and the next save pays host page faults to
get page cache for its files: a save right after a deletion can be twice as fast as one after a
pause, so a method's time would depend on what ran before it. Before each measurement every
rank therefore faults in and frees 1.5x its share of the checkpoint (``--no-prefault`` turns
this off), so every method starts with the same warm memory. After each measurement its files
are deleted, ``sync`` runs, and the ranks wait ``--settle`` seconds (default 0).

Threads: ranks run with ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` = ``--torch-threads``
(default 1); see bench/README.md for the measurement behind that default.

Usage::

    .venv/bin/python bench/digest_overhead.py --gb 1.0 --repeats 3 [--world-size 2]
        [--dir DIR] [--name NAME] [--torch-threads 1] [--settle 0] [--no-prefault]

Writes ``bench/results/<name>.json`` and prints a markdown table with the key ratios.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _harness import (
    COLD_CACHE,
    GB,
    HIDDEN,
    PREFAULT_FACTOR,
    Disk,
    Ranks,
    Run,
    RunConfig,
    add_common_args,
    bench_run,
    build_state,
    check_common_args,
    dir_bytes,
    disk_record,
    evict,
    median,
    round_order,
    spawn,
    tensor_bytes,
    write_json,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import dckpt
from dckpt.storage.hashing_writer import HashingWriter

SAVE_METHODS = ("dcp_plain", "dcp_hashing", "dcp_hashing_sha256")
TARGET_OVERHEAD_PCT = 5.0
WARMUP_STEP = 999_999


@dataclass(frozen=True, kw_only=True)
class Config(RunConfig):
    gb: float
    repeats: int
    world_size: int


@dataclass(frozen=True)
class RankOutput:
    """What rank 0 reports to the parent after the run."""

    seconds: dict[str, list[float]]
    order: list[list[str]]
    state_bytes: int
    checkpoint_bytes: int
    files_per_checkpoint: int
    layers: int
    params: int
    state_dict_s: float


# --- rank side ----------------------------------------------------------------------------------


def _writer(method: str, path: Path, rank: int) -> FileSystemWriter:
    if method == "dcp_plain":
        return FileSystemWriter(path, sync_files=True, overwrite=False)
    algorithm = "sha256" if method.endswith("sha256") else "xxh3_128"
    return HashingWriter(path, algorithm=algorithm, rank=rank)


def _run_rank(cfg: Config) -> RankOutput | None:
    ranks = Ranks(cfg.settle_s)
    rank, ws = ranks.rank, ranks.world_size
    dcp_group = dist.new_group(backend="gloo")
    base = Path(cfg.base_dir)

    model, opt, layers = build_state(cfg.gb)
    train_state = dckpt.TrainState(model, opt)
    t0 = time.perf_counter()
    state_dict = train_state.state_dict()
    state_dict_s = time.perf_counter() - t0
    state_bytes = tensor_bytes(state_dict)
    params = sum(p.numel() for p in model.parameters())

    def save_with(path: Path, method: str) -> None:
        dcp_save(state_dict, storage_writer=_writer(method, path, rank), process_group=dcp_group)

    # Warm-up, untimed: every code path once on a tiny state, then one full plain save,
    # which also gives the checkpoint's size on disk.
    tiny_model = torch.nn.Linear(8, 8)
    tiny_opt = torch.optim.AdamW(tiny_model.parameters())
    tiny_model(torch.randn(2, 8)).sum().backward()
    tiny_opt.step()
    tiny = {"w": torch.zeros(16), "progress": {"step": 0}}
    warm = base / "warmup"
    for i, method in enumerate(SAVE_METHODS):
        dcp_save(
            tiny, storage_writer=_writer(method, warm / f"t{i}", rank), process_group=dcp_group
        )
        dcp_load(tiny, storage_reader=FileSystemReader(warm / f"t{i}"), process_group=dcp_group)
    with dckpt.CheckpointManager(warm / "mgr", dckpt.TrainState(tiny_model, tiny_opt)) as m:
        m.save(0).result()
        m.load()
    # One manager per configuration for the whole run, as in training: its staging buffers
    # are allocated by the first (warm-up) save and reused by the measured ones.
    mgr = dckpt.CheckpointManager(base / "dckpt", train_state)
    mgr_sync = dckpt.CheckpointManager(
        dckpt.CheckpointConfig(root=base / "dckpt_sync", async_save=False), train_state
    )
    for manager in (mgr, mgr_sync):
        ranks.on_rank0(partial(shutil.rmtree, manager.save(WARMUP_STEP).result().path))
    full = base / "warmup-full"
    save_with(full, "dcp_plain")
    ranks.barrier()
    checkpoint_bytes, files = dir_bytes(full)
    if cfg.prefault:
        ranks.prefault = int(PREFAULT_FACTOR * checkpoint_bytes / ws)
    ranks.on_rank0(partial(shutil.rmtree, warm))
    ranks.on_rank0(partial(shutil.rmtree, full))

    disk = Disk(ranks, checkpoint_bytes)

    seconds: dict[str, list[float]] = {}
    order: list[list[str]] = []

    def record(method: str, value: float) -> None:
        seconds.setdefault(method, []).append(value)
        order[-1].append(method)
        ranks.say(f"  {method:<26} {value:8.3f} s")

    def measure(method: str, fn: Callable[[], object]) -> None:
        record(method, ranks.timed(fn))

    def run_dckpt(rnd: int) -> Path:
        """dckpt's default (async) save, timed to its commit, then the four loads of it."""
        saved: list[dckpt.SaveResult] = []
        stall: list[float] = []

        def save() -> None:
            handle = mgr.save(rnd)
            stall.append(handle.stall_s)  # how long save() held the caller
            saved.append(handle.result())

        measure("dckpt_save", save)
        record("dckpt_save_stall", max(ranks.gather(stall[0])))
        step_dir = saved[0].path
        loads: dict[str, Callable[[], object]] = {
            "dckpt_load_verified": mgr.load,
            "dcp_load": partial(
                dcp_load,
                state_dict,
                storage_reader=FileSystemReader(step_dir),
                process_group=dcp_group,
            ),
        }
        cold = list(loads) if rnd % 2 == 0 else list(reversed(loads))
        for name in cold:
            ranks.on_rank0(partial(evict, step_dir))
            measure(name, loads[name])
        for name in reversed(cold):  # the cold loads left every page in the cache
            measure(f"{name}_warm", loads[name])
        return step_dir

    def run_dckpt_sync(rnd: int) -> Path:
        """dckpt with ``async_save=False``: save() returns after the commit."""
        saved: list[dckpt.SaveResult] = []
        measure("dckpt_save_sync", lambda: saved.append(mgr_sync.save(rnd).result()))
        return saved[0].path

    units = ["disk_1proc", "disk_nproc", "cpu_hash", *SAVE_METHODS, "dckpt", "dckpt_sync"]
    for rnd in range(cfg.repeats):
        order.append([])
        ranks.say(f"round {rnd + 1}/{cfg.repeats}")
        for unit in round_order(units, rnd):
            path = base / f"r{rnd}-{unit}"
            if unit == "disk_1proc":
                record("disk_write_1proc", disk.measure(path, parallel=False))
            elif unit == "disk_nproc":
                record(disk.parallel_method, disk.measure(path, parallel=True))
            elif unit == "cpu_hash":
                measure("cpu_hash_xxh3_128", partial(disk.hash_share, "xxh3_128"))
                measure("cpu_hash_sha256", partial(disk.hash_share, "sha256"))
            elif unit in SAVE_METHODS:
                measure(unit, partial(save_with, path, unit))
            elif unit == "dckpt":
                path = run_dckpt(rnd)
            else:
                path = run_dckpt_sync(rnd)
            ranks.cleanup(path)
    mgr.close()
    mgr_sync.close()
    if rank != 0:
        return None
    return RankOutput(
        seconds=seconds,
        order=order,
        state_bytes=state_bytes,
        checkpoint_bytes=checkpoint_bytes,
        files_per_checkpoint=files,
        layers=layers,
        params=params,
        state_dict_s=state_dict_s,
    )


# --- parent side --------------------------------------------------------------------------------


def summarize(out: RankOutput, cfg: Config, run: Run, name: str) -> dict[str, Any]:
    """The JSON document: one record per method, the disk, the key ratios."""
    nbytes = out.checkpoint_bytes
    med = {m: median(xs) for m, xs in out.seconds.items()}
    plain = med["dcp_plain"]
    records = [
        {
            "method": method,
            "world_size": cfg.world_size,
            "state_bytes": out.state_bytes,
            "checkpoint_bytes": nbytes,
            "repeats": len(xs),
            "seconds": [round(x, 4) for x in xs],
            "median_s": round(med[method], 4),
            "min_s": round(min(xs), 4),
            "max_s": round(max(xs), 4),
            "gb_per_s": round(nbytes / med[method] / GB, 4),
            "ratio_to_dcp_plain": round(med[method] / plain, 4),
        }
        for method, xs in out.seconds.items()
        if not method.startswith("disk_")
    ]
    disk = disk_record(
        nbytes,
        cfg.world_size,
        out.seconds["disk_write_1proc"],
        out.seconds[f"disk_write_{cfg.world_size}proc"],
    )
    disk_bw = disk["gb_per_s"]

    def paired(a: str, b: str) -> float:
        return median([x / y for x, y in zip(out.seconds[a], out.seconds[b], strict=True)])

    ratios = {
        "digest_overhead_pct": round((med["dcp_hashing"] / plain - 1) * 100, 2),
        "digest_overhead_paired_pct": round((paired("dcp_hashing", "dcp_plain") - 1) * 100, 2),
        "digest_overhead_target_pct": TARGET_OVERHEAD_PCT,
        "dcp_plain_spread_pct": round(
            (max(out.seconds["dcp_plain"]) - min(out.seconds["dcp_plain"])) / plain * 100, 2
        ),
        "digest_overhead_within_target": med["dcp_hashing"] / plain - 1
        <= TARGET_OVERHEAD_PCT / 100,
        "digest_overhead_best_pct": round(
            (min(out.seconds["dcp_hashing"]) / min(out.seconds["dcp_plain"]) - 1) * 100, 2
        ),
        "digest_cpu_cost_pct": round(med["cpu_hash_xxh3_128"] / plain * 100, 2),
        "sha256_overhead_pct": round((med["dcp_hashing_sha256"] / plain - 1) * 100, 2),
        "sha256_cpu_cost_pct": round(med["cpu_hash_sha256"] / plain * 100, 2),
        "dckpt_save_vs_dcp_plain": round(med["dckpt_save"] / plain, 4),
        "dckpt_save_vs_dcp_plain_paired": round(paired("dckpt_save", "dcp_plain"), 4),
        "dckpt_save_stall_s": round(med["dckpt_save_stall"], 4),
        "dckpt_save_sync_vs_dcp_plain": round(med["dckpt_save_sync"] / plain, 4),
        "dckpt_save_sync_vs_dcp_hashing": round(med["dckpt_save_sync"] / med["dcp_hashing"], 4),
        "dckpt_load_verified_vs_dcp_load": round(med["dckpt_load_verified"] / med["dcp_load"], 4),
        "dckpt_load_verified_vs_dcp_load_warm": round(
            med["dckpt_load_verified_warm"] / med["dcp_load_warm"], 4
        ),
        "disk_gb_per_s": round(disk_bw, 4),
        "fraction_of_disk": {
            m: round(nbytes / med[m] / GB / disk_bw, 4)
            for m in (*SAVE_METHODS, "dckpt_save", "dckpt_save_sync")
        },
    }
    return {
        **run.header(name, cfg),
        "config": {
            "gb": cfg.gb,
            "repeats": cfg.repeats,
            "world_size": cfg.world_size,
            "dir": cfg.base_dir,
            "layers": out.layers,
            "hidden": HIDDEN,
            "params": out.params,
            "state_bytes": out.state_bytes,
            "checkpoint_bytes": nbytes,
            "files_per_checkpoint": out.files_per_checkpoint,
            "state_dict_s": round(out.state_dict_s, 4),
            "load_cache": f"{COLD_CACHE}; *_warm: cached",
        },
        "order": out.order,
        "records": records,
        "disk": disk,
        "ratios": ratios,
    }


def render(doc: dict[str, Any]) -> str:
    """The markdown table and the key ratios."""
    cfg, disk, r = doc["config"], doc["disk"], doc["ratios"]
    nbytes = cfg["checkpoint_bytes"]
    plain = next(x["median_s"] for x in doc["records"] if x["method"] == "dcp_plain")
    lines = [
        f"## digest overhead: {nbytes / GB:.3f} GB checkpoint "
        f"({cfg['state_bytes'] / GB:.3f} GB of tensors, {cfg['layers']} x Linear({HIDDEN}) "
        f"+ AdamW), world size {cfg['world_size']}, {cfg['repeats']} repeats, "
        f"{doc['host']['cpu_count']} CPUs, torch {doc['host']['torch']}",
        "",
        "| method | median s | min s | max s | GB/s | vs dcp_plain |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = [
        ("disk_write_1proc", disk["one_process"]),
        (f"disk_write_{cfg['world_size']}proc", disk["parallel"]),
    ]
    for name, d in rows:
        xs = d["seconds"]
        lines.append(
            f"| {name} | {d['median_s']:.3f} | {min(xs):.3f} | {max(xs):.3f} "
            f"| {d['gb_per_s']:.3f} | {d['median_s'] / plain:.3f} |"
        )
    for x in doc["records"]:
        lines.append(
            f"| {x['method']} | {x['median_s']:.3f} | {x['min_s']:.3f} | {x['max_s']:.3f} "
            f"| {x['gb_per_s']:.3f} | {x['ratio_to_dcp_plain']:.3f} |"
        )
    verdict = "within" if r["digest_overhead_within_target"] else "ABOVE"
    verdict += f" the {r['digest_overhead_target_pct']:.0f} % target"
    if abs(r["digest_overhead_pct"]) < r["dcp_plain_spread_pct"]:
        verdict += " (not resolved: smaller than the noise, next line)"
    frac = r["fraction_of_disk"]
    lines += [
        "",
        f"- digest overhead (xxh3_128), median(dcp_hashing)/median(dcp_plain) - 1: "
        f"**{r['digest_overhead_pct']:+.2f} %** (paired per round: "
        f"{r['digest_overhead_paired_pct']:+.2f} %): {verdict}",
        f"- noise: dcp_plain's own spread (max - min) is {r['dcp_plain_spread_pct']:.1f} % of its "
        "median; a difference smaller than that is not resolved by this run",
        f"- the same from the best of each: {r['digest_overhead_best_pct']:+.2f} %; the digest's "
        f"own CPU time (cpu_hash_xxh3_128, no I/O) is {r['digest_cpu_cost_pct']:.2f} % of "
        "dcp_plain: the overhead to expect without noise",
        f"- sha256 instead: {r['sha256_overhead_pct']:+.2f} % (its CPU time alone: "
        f"{r['sha256_cpu_cost_pct']:.2f} % of dcp_plain)",
        f"- dckpt_save (async default, to commit) / dcp_plain: {r['dckpt_save_vs_dcp_plain']:.3f} "
        f"(paired {r['dckpt_save_vs_dcp_plain_paired']:.3f}); save() held the caller "
        f"{r['dckpt_save_stall_s']:.3f} s",
        f"- dckpt_save_sync (async_save=False) / dcp_plain: "
        f"{r['dckpt_save_sync_vs_dcp_plain']:.3f}, / dcp_hashing: "
        f"{r['dckpt_save_sync_vs_dcp_hashing']:.3f}",
        f"- dckpt_load_verified / dcp_load: {r['dckpt_load_verified_vs_dcp_load']:.3f} cold, "
        f"{r['dckpt_load_verified_vs_dcp_load_warm']:.3f} warm",
        f"- disk: {disk['one_process']['gb_per_s']:.3f} GB/s from 1 process, "
        f"{disk['parallel']['gb_per_s']:.3f} GB/s from {cfg['world_size']} in parallel; "
        f"saves reach dcp_plain {frac['dcp_plain']:.0%}, dcp_hashing {frac['dcp_hashing']:.0%}, "
        f"sha256 {frac['dcp_hashing_sha256']:.0%}, dckpt_save {frac['dckpt_save']:.0%}, "
        f"dckpt_save_sync {frac['dckpt_save_sync']:.0%} of the better of the two",
        f"- state_dict() (outside the dcp_* timings, inside dckpt_*): {cfg['state_dict_s']:.3f} s",
        f"- load average before / after: {doc['host']['loadavg_1_5_15_before']} / "
        f"{doc['host']['loadavg_1_5_15_after']} on {doc['host']['cpu_count']} CPUs",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--gb", type=float, default=1.0, help="model + AdamW state size in GB (1e9)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each method once per round")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (gloo)")
    add_common_args(p, "digest_overhead")
    args = p.parse_args(argv)
    check_common_args(p, args)
    if args.gb <= 0 or args.repeats < 1 or args.world_size < 1:
        p.error("--gb must be > 0; --repeats and --world-size >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with bench_run(args.dir) as run:
        cfg = Config(
            **RunConfig.common(args, run.base_dir),
            gb=args.gb,
            repeats=args.repeats,
            world_size=args.world_size,
        )
        print(f"dckpt digest-overhead benchmark: {asdict(cfg)}", flush=True)
        out: RankOutput = spawn(cfg.world_size, cfg.torch_threads, _run_rank, cfg)
    doc = summarize(out, cfg, run, args.name)
    target = write_json(args.name, doc)
    print()
    print(render(doc))
    print(f"\nresults: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
