"""What do per-file digests cost a save? One command, one process tree, one interleaved run.

What it measures. ``--world-size`` ranks (spawned here, gloo over a FileStore) hold the same
state: a DDP-wrapped stack of ``nn.Linear`` layers plus its AdamW state after one step, sized so
that parameters + ``exp_avg`` + ``exp_avg_sq`` come to about ``--gb`` GB (1 GB = 1e9 bytes). DDP
replicates it; DCP's planner de-duplicates it, so each rank writes about ``1/world_size`` of it.
Each method below runs ``--repeats`` times, interleaved round by round (the order of the saves is
rotated each round so no method always follows the same one), into a fresh directory that is
deleted after it was measured:

- ``disk_write_1proc`` / ``disk_write_<N>proc``: the disk itself: one process writes a file as
  big as the checkpoint in 64 MiB chunks, then ``os.fdatasync``; or each of the N ranks writes its
  share in parallel. This is the ceiling any save can reach in this run.
- ``dcp_plain``: ``dcp.save`` with DCP's ``FileSystemWriter(sync_files=True)``: no digests.
- ``dcp_hashing``: the same through ``dckpt.storage.HashingWriter`` (xxh3-128 digests of every
  byte as it is written); ``dcp_hashing_sha256`` the same with sha256, for information.
- ``dckpt_save``: the whole ``CheckpointManager.save`` (state dict, digests, manifest, atomic
  commit with its fsyncs).
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
which is less sensitive to drift over the run. ``dckpt_save / dcp_plain`` adds what the manifest
and commit cost; ``dckpt_load_verified / dcp_load`` what verification costs on load. The
fraction of disk bandwidth says how far a save is from what the disk allows. On a shared or
virtual machine single times are noisy; compare ratios from one run, not seconds across runs.

Threads: ranks run with ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` = ``--torch-threads``
(default 1); see bench/README.md for the measurement behind that default.

Usage::

    .venv/bin/python bench/digest_overhead.py --gb 1.0 --repeats 3 [--world-size 2]
        [--dir DIR] [--name NAME]

Writes ``bench/results/<name>.json`` and prints a markdown table with the key ratios.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing as mp
import os
import platform
import queue
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GB = 1e9
CHUNK = 64 << 20
HIDDEN = 2048
RESULTS_DIR = Path(__file__).resolve().parent / "results"

SAVE_METHODS = ("dcp_plain", "dcp_hashing", "dcp_hashing_sha256")
LOAD_METHODS = ("dckpt_load_verified", "dcp_load", "dckpt_load_verified_warm", "dcp_load_warm")
TARGET_OVERHEAD_PCT = 5.0


@dataclass(frozen=True)
class Config:
    gb: float
    repeats: int
    world_size: int
    base_dir: str
    torch_threads: int


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


def disk_method(world_size: int) -> str:
    return f"disk_write_{world_size}proc"


def layers_for(gb: float, hidden: int = HIDDEN) -> int:
    """Linear layers of ``hidden`` x ``hidden`` whose fp32 params + AdamW state make ``gb`` GB."""
    per_layer = 3 * 4 * (hidden * hidden + hidden)  # param, exp_avg, exp_avg_sq
    return max(1, round(gb * GB / per_layer))


# --- rank side ----------------------------------------------------------------------------------


def _tensors(obj: Any) -> Iterator[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _dir_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _evict(path: Path) -> None:
    """Drop the page cache of every file under ``path`` (they are clean: fsynced by the save)."""
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _write_file(path: Path, nbytes: int, chunk: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _rank_main(rank: int, cfg: Config, store_path: str, out: Any) -> None:
    try:
        result = _run_rank(rank, cfg, store_path)
        if rank == 0:
            out.put(("ok", result))
    except BaseException as exc:
        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def _run_rank(rank: int, cfg: Config, store_path: str) -> RankOutput | None:  # noqa: PLR0915
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.nn.parallel import DistributedDataParallel

    import dckpt
    from dckpt.storage import HashingWriter

    torch.set_num_threads(cfg.torch_threads)
    ws = cfg.world_size
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=1800),
    )
    try:
        dcp_group = dist.new_group(backend="gloo")
        base = Path(cfg.base_dir)

        def timed(fn: Callable[[], object]) -> float:
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            return time.perf_counter() - t0

        def on_rank0(fn: Callable[[], object]) -> None:
            """Run ``fn`` on rank 0 (cleanup, eviction) while the other ranks wait."""
            if rank == 0:
                fn()
            dist.barrier()

        # The state: DDP model + AdamW after one step, identical on every rank (same seed).
        torch.manual_seed(0)
        layers = layers_for(cfg.gb)
        blocks: list[torch.nn.Module] = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
        model = DistributedDataParallel(torch.nn.Sequential(*blocks))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(torch.randn(4, HIDDEN)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # free the grads: they are not saved
        train_state = dckpt.TrainState(model, opt)
        t0 = time.perf_counter()
        state_dict = train_state.state_dict()
        state_dict_s = time.perf_counter() - t0
        state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state_dict))
        params = sum(p.numel() for p in model.parameters())

        def save_with(path: Path, method: str) -> None:
            writer: FileSystemWriter
            if method == "dcp_plain":
                writer = FileSystemWriter(path, sync_files=True, overwrite=False)
            elif method == "dcp_hashing":
                writer = HashingWriter(path, algorithm="xxh3_128", rank=rank)
            else:
                writer = HashingWriter(path, algorithm="sha256", rank=rank)
            dcp.save(state_dict, storage_writer=writer, process_group=dcp_group)

        # Warm-up, untimed: every code path once on a tiny state, then one full plain save,
        # which also gives the checkpoint's size on disk.
        tiny_model = torch.nn.Linear(8, 8)
        tiny_opt = torch.optim.AdamW(tiny_model.parameters())
        tiny_model(torch.randn(2, 8)).sum().backward()
        tiny_opt.step()
        tiny = {"w": torch.zeros(16), "progress": {"step": 0}}
        warm = base / "warmup"
        for i, method in enumerate(SAVE_METHODS):
            dcp.save(
                tiny,
                storage_writer=(
                    FileSystemWriter(warm / f"t{i}", overwrite=False)
                    if method == "dcp_plain"
                    else HashingWriter(
                        warm / f"t{i}",
                        algorithm="sha256" if method.endswith("sha256") else "xxh3_128",
                        rank=rank,
                    )
                ),
                process_group=dcp_group,
            )
            dcp.load(tiny, storage_reader=FileSystemReader(warm / f"t{i}"), process_group=dcp_group)
        with dckpt.CheckpointManager(warm / "mgr", dckpt.TrainState(tiny_model, tiny_opt)) as m:
            m.save(0)
            m.load()
        full = base / "warmup-full"
        save_with(full, "dcp_plain")
        dist.barrier()
        checkpoint_bytes, files = _dir_bytes(full)
        on_rank0(lambda: (shutil.rmtree(warm), shutil.rmtree(full)))

        # Disk ceiling: one writer for the whole size, or each rank its share.
        chunk = memoryview(os.urandom(CHUNK))

        def disk_1proc(path: Path) -> None:
            if rank == 0:
                _write_file(path / "blob-0", checkpoint_bytes, chunk)

        def disk_nproc(path: Path) -> None:
            share = checkpoint_bytes // ws + (checkpoint_bytes % ws if rank == ws - 1 else 0)
            _write_file(path / f"blob-{rank}", share, chunk)

        seconds: dict[str, list[float]] = {}
        order: list[list[str]] = []

        def record(method: str, value: float) -> None:
            seconds.setdefault(method, []).append(value)
            if rank == 0:
                print(f"  {method:<28} {value:8.3f} s", flush=True)

        def run_disk(path: Path, method: str) -> None:
            on_rank0(lambda: path.mkdir(parents=True))
            record(method, timed(lambda: disk_1proc(path) if ws == 1 else None) if False else 0.0)

        units: list[str] = ["disk_1proc", "disk_nproc", *SAVE_METHODS, "dckpt"]
        for rnd in range(cfg.repeats):
            shift = rnd % len(units)
            this_round = units[shift:] + units[:shift]
            done: list[str] = []
            if rank == 0:
                print(f"round {rnd + 1}/{cfg.repeats}: {', '.join(this_round)}", flush=True)
            for unit in this_round:
                path = base / f"r{rnd}-{unit}"
                if unit in ("disk_1proc", "disk_nproc"):
                    on_rank0(lambda p=path: p.mkdir(parents=True))  # type: ignore[misc]
                    fn = disk_1proc if unit == "disk_1proc" else disk_nproc
                    name = "disk_write_1proc" if unit == "disk_1proc" else disk_method(ws)
                    record(name, timed(lambda f=fn, p=path: f(p)))  # type: ignore[misc]
                    done.append(name)
                elif unit in SAVE_METHODS:
                    record(unit, timed(lambda u=unit, p=path: save_with(p, u)))  # type: ignore[misc]
                    done.append(unit)
                else:
                    with dckpt.CheckpointManager(path, train_state) as mgr:
                        record("dckpt_save", timed(lambda: mgr.save(rnd)))
                        step_dir = path / f"step-{rnd:08d}"
                        cold = ["dckpt_load_verified", "dcp_load"]
                        if rnd % 2:
                            cold.reverse()
                        loads: dict[str, Callable[[], object]] = {
                            "dckpt_load_verified": mgr.load,
                            "dcp_load": lambda: dcp.load(
                                state_dict,
                                storage_reader=FileSystemReader(step_dir),
                                process_group=dcp_group,
                            ),
                        }
                        for name in cold:
                            on_rank0(lambda: _evict(step_dir))
                            record(name, timed(loads[name]))
                        for name in reversed(cold):
                            record(f"{name}_warm", timed(loads[name]))
                        done += ["dckpt_save", *cold, *(f"{n}_warm" for n in reversed(cold))]
                on_rank0(lambda p=path: shutil.rmtree(p))  # type: ignore[misc]
            order.append(done)
        del run_disk
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
    finally:
        dist.destroy_process_group()
