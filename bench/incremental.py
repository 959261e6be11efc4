"""Incremental saves: what a save writes and how long it takes, with a frozen backbone and with
everything trainable. One command, one process tree, one interleaved run.

The jobs (``--world-size`` DDP ranks, gloo, the same state on each): a stack of
``Linear(--hidden, --hidden)`` layers sized to ``--gb`` GB of parameters, then a
``Linear(--hidden, 8)`` head, under AdamW.

- ``frozen``: every layer of the stack frozen (``requires_grad=False``), AdamW over the head:
  the fine-tuning job of issue 30 (a frozen backbone, a small trainable part);
- ``trainable``: the same stack, all of it trained (AdamW's two moments of every parameter):
  where nothing can be reused, so what incremental saves cost shows alone.

The methods, each saving ``--saves`` consecutive steps (one optimizer step between two saves)
into a fresh root, round by round interleaved (``round_order``), the root deleted after each:

- ``dckpt_incremental``: ``CheckpointManager`` with ``async_save=False`` and the default
  ``incremental=True``: the frozen layers go to a file of their own per rank, linked by every
  save after the first whose frozen items hash the same;
- ``dckpt_full``: the same with ``incremental=False`` (every save writes everything);
- ``dcp_save``: ``dcp.save`` of the same state dict into one directory per step
  (``FileSystemWriter(sync_files=True)``);
- ``disk_write``: each rank writes as many bytes as its share of one full save, in 64 MiB
  writes, then ``fdatasync``: the disk's own bandwidth, in this run, beside the saves.

Per save, by its number in the run (save 1 writes everything; with the default
``incremental_copies=2`` save 2 writes the frozen file again, a second copy, and saves 3 on link
one of the two): the seconds from the call to the commit, on the slowest rank (between two
barriers), and the bytes it added to the root (the blocks of inodes that were not there before:
a link adds a name, no block). From ``dckpt_incremental``'s manifests: ``prehash_s``, the time a
rank spent hashing the frozen items before deciding to link or write them (slowest rank).

How to read it. Ratios of medians from one run, of the saves that link (3 on) of
``dckpt_incremental`` over the same saves of ``dckpt_full`` (time and bytes), the pre-hash over a
full save's time (what incremental saves add: on the ``trainable`` job nothing is pre-hashed at
all, as no item is frozen), and ``dckpt_full`` over ``dcp_save``.

Usage::

    .venv/bin/python bench/incremental.py [--gb 0.25] [--saves 4] [--repeats 3]
        [--world-size 2] [--hidden 2048] [--dir DIR] [--name incremental]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

from dckpt.root.directory import disk_bytes

METHODS = ("dckpt_incremental", "dckpt_full", "dcp_save", "disk_write")
JOBS = ("frozen", "trainable")


def _build(job: str, gb: float, hidden: int) -> tuple[DistributedDataParallel, Any]:
    torch.manual_seed(0)
    layers = max(1, round(gb * h.GB / (hidden * hidden * 4)))
    body = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)], nn.Linear(hidden, 8))
    if job == "frozen":
        for layer in list(body)[:-1]:
            layer.requires_grad_(False)
    model = DistributedDataParallel(body)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _train(model, opt, hidden)
    return model, opt


def _train(model: Any, opt: Any, hidden: int) -> None:
    model(torch.randn(4, hidden)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _run_method(
    method: str, ranks: h.Ranks, model: Any, opt: Any, root: Path, args: argparse.Namespace,
    disk: h.Disk,
) -> list[dict[str, float]]:  # fmt: skip
    """One run of ``method``: the figures of each of its saves (seconds: the slowest rank's,
    ``Ranks.timed``)."""
    import dckpt

    seen: set[tuple[int, int]] = set()
    if method == "disk_write":  # each rank its share of a full save, fdatasync'd
        secs = disk.measure(root, parallel=True)
        return [{"s": secs, "bytes": float(disk_bytes(root, seen))}]
    ranks.on_rank0(lambda: root.mkdir(parents=True))
    mgr = None
    if method.startswith("dckpt"):
        cfg = dckpt.CheckpointConfig(
            root=root, async_save=False, incremental=method == "dckpt_incremental",
            timeout_s=600, replay_check="off",
        )  # fmt: skip
        mgr = dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt))

    def save(step: int) -> None:
        if mgr is not None:
            mgr.save(step)
            return
        sd = {"model": model.module.state_dict(), "optimizer": opt.state_dict()}
        dcp_save(sd, storage_writer=FileSystemWriter(root / f"step-{step}"))

    saves: list[dict[str, float]] = []
    try:
        for step in range(1, args.saves + 1):
            _train(model, opt, args.hidden)
            record = {"s": ranks.timed(lambda: save(step))}  # noqa: B023 (called at once)
            if ranks.rank == 0:
                record["bytes"] = float(disk_bytes(root, seen))
            if mgr is not None and ranks.rank == 0:
                manifest = json.loads((root / f"step-{step:08d}" / "manifest.json").read_text())
                record["prehash_s"] = float(manifest["timings"].get("prehash_s", 0.0))
                record["reused_bytes"] = float(manifest["timings"].get("reused_bytes", 0.0))
            saves.append(record)
    finally:
        if mgr is not None:
            mgr.close()
    return saves


def _rank(args: argparse.Namespace, base: str) -> dict[str, Any] | None:
    ranks = h.Ranks(settle_s=0.0)
    out: dict[str, Any] = {}
    for job in JOBS:
        model, opt = _build(job, args.gb, args.hidden)
        state_bytes = h.tensor_bytes([model.module.state_dict(), opt.state_dict()])
        disk = h.Disk(ranks, state_bytes)
        runs: dict[str, list[list[dict[str, float]]]] = {m: [] for m in METHODS}
        for rnd in range(args.repeats):
            for method in h.round_order(list(METHODS), rnd):
                root = Path(base) / f"{job}-{method}-{rnd}"
                h.touch(int(state_bytes / ranks.world_size * h.PREFAULT_FACTOR))
                runs[method].append(_run_method(method, ranks, model, opt, root, args, disk))
                ranks.cleanup(root)
        out[job] = {"state_bytes": state_bytes, "runs": runs}
    return out if ranks.rank == 0 else None


LINKING = 2
"""Saves from this index on (the third) link with the default ``incremental_copies=2``."""


def _at(runs: list[list[dict[str, float]]], i: int, key: str) -> float:
    return h.median([run[i][key] for run in runs])


def _later(runs: list[list[dict[str, float]]], key: str) -> float:
    return h.median([s[key] for run in runs for s in run[LINKING:]] or [0.0])


def _first(runs: list[list[dict[str, float]]], key: str) -> float:
    return _at(runs, 0, key)


def summarize(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    jobs: dict[str, Any] = {}
    for job, data in raw.items():
        runs = data["runs"]
        disk = _first(runs["disk_write"], "s")
        full_first_bytes = _first(runs["dckpt_full"], "bytes")
        rows = {
            m: {
                "first_s": _first(runs[m], "s"),
                "first_bytes": _first(runs[m], "bytes"),
                "second_s": _at(runs[m], 1, "s"),
                "second_bytes": _at(runs[m], 1, "bytes"),
                "later_s": _later(runs[m], "s"),
                "later_bytes": _later(runs[m], "bytes"),
            }
            for m in METHODS
            if m != "disk_write"
        }
        inc, full = rows["dckpt_incremental"], rows["dckpt_full"]
        prehash = [s.get("prehash_s", 0.0) for run in runs["dckpt_incremental"] for s in run]
        jobs[job] = {
            "state_bytes": data["state_bytes"],
            "disk_write_s": disk,
            "disk_gbps": full_first_bytes / disk / h.GB if disk else 0.0,
            "methods": rows,
            "prehash_s": h.median(prehash),
            "ratios": {
                "later_time_incremental_over_full": inc["later_s"] / full["later_s"],
                "later_bytes_incremental_over_full": inc["later_bytes"] / full["later_bytes"],
                "prehash_over_full_save": h.median(prehash) / full["later_s"],
                "first_time_incremental_over_full": inc["first_s"] / full["first_s"],
                "full_over_dcp_save": full["later_s"] / rows["dcp_save"]["later_s"],
            },
        }
    return {**h.run_header(args.name, 1), "args": vars(args), "jobs": jobs}


def render(doc: dict[str, Any]) -> str:
    a = doc["args"]
    lines = [
        f"# Incremental saves ({doc['date']}, dckpt {doc['dckpt_revision']})",
        "",
        f"`{doc['command']}`: {a['world_size']} DDP ranks, {a['gb']} GB of stacked "
        f"Linear({a['hidden']}, {a['hidden']}) + a Linear({a['hidden']}, 8) head, AdamW; "
        f"{a['saves']} saves a run, {a['repeats']} runs a method, interleaved. Medians; "
        "`3rd on` = every save from a run's third (with the default `incremental_copies=2` "
        "the second writes the frozen file's second copy). Bytes: blocks the save added "
        "to the root.",
        "",
    ]
    for job, j in doc["jobs"].items():
        what = "backbone frozen, head trained" if job == "frozen" else "everything trained"
        lines += [
            f"## {job}: {what} ({j['state_bytes'] / 1e6:.0f} MB of state; the disk wrote a "
            f"full save's bytes in {j['disk_write_s']:.2f} s, {j['disk_gbps']:.2f} GB/s)",
            "",
            "| method | save 1 | its bytes | save 2 | its bytes | 3rd on | their bytes |",
            "|---|---|---|---|---|---|---|",
        ]
        for m, r in j["methods"].items():
            lines.append(
                f"| {m} | {r['first_s']:.3f} s | {r['first_bytes'] / 1e6:.2f} MB | "
                f"{r['second_s']:.3f} s | {r['second_bytes'] / 1e6:.2f} MB | "
                f"{r['later_s']:.3f} s | {r['later_bytes'] / 1e6:.3f} MB |"
            )
        r = j["ratios"]
        lines += [
            "",
            f"- saves 3 on, incremental / full: {r['later_time_incremental_over_full']:.2f}x "
            f"the time, {r['later_bytes_incremental_over_full']:.4f}x the bytes",
            f"- first save, incremental / full: {r['first_time_incremental_over_full']:.2f}x "
            "the time",
            f"- pre-hash of the frozen items: {j['prehash_s']:.3f} s, "
            f"{r['prehash_over_full_save']:.3f}x a full save's time",
            f"- dckpt full / dcp.save (saves 3 on): {r['full_over_dcp_save']:.2f}x",
            "",
        ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=0.25, help="GB of stacked layers (default 0.25)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--saves", type=int, default=4, help="saves in a run (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each method (default 3)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the roots go (default: a tmp dir)")
    p.add_argument("--name", default="incremental", help="bench/results/<name>.{json,md}")
    args = p.parse_args(argv)
    if args.saves < 3 or args.repeats < 1 or args.world_size < 1:
        p.error("--saves must be >= 3, --repeats and --world-size >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with h.bench_run(args.dir) as run:
        raw = h.spawn(args.world_size, 1, _rank, args, run.base_dir)
    doc = summarize(raw, args)
    text = render(doc)
    h.write_json(args.name, doc)
    h.write_result(args.name, "md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
