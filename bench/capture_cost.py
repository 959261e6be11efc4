"""What the capture check costs a save: the same state saved with it and without, interleaved.

The capture check (issue 53, dckpt.save.capture) digests every tensor a rank writes inside
``save()``, from the live tensor, in the pass of its staging copy, and digests the bytes the
writer writes for it. This bench measures, on the example trainer's model (``launch/train.py``'s
``TinyLM``, the ``bench/true_cost.py`` job by default: d_model 768, 8 layers, 0.69 GB with
AdamW's moments) under DDP on ``--nproc`` gloo ranks:

- the stall (``save()`` until it returns), what the loop lost (the stall plus
  ``--steps-after`` training steps run beside the background write, less the same steps run
  with no save in flight, timed in the same round), and the time to commit (``save()`` until
  ``result()``), with the check on and off, one save of each in turn (the order rotates), on
  two managers of one process over the same state, so both meet the same machine at once;
- the staging copy alone: a host copy of one rank's share, plain (``copy_``) and with the
  source's digest taken in the same pass (``copy_hashed``), best of 7.

Ratios (on / off) of medians; the machine is noisy, the ratio is what to read.

    .venv/bin/python bench/capture_cost.py                    # about 2 minutes
    .venv/bin/python bench/capture_cost.py --saves 4 --d-model 256 --layers 2   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import _harness as h  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import importlib.util

    import torch
    import torch.distributed as dist

    import dckpt
    from dckpt.storage.tensor_digest import copy_hashed

    spec = importlib.util.spec_from_file_location("train", ROOT / "launch" / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        train.TinyLM(256, args.d_model, args.layers, 4, 32, 0.1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    tokens = torch.randint(0, 256, (4, 33))

    def step() -> None:
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)
        ).backward()
        opt.step()

    step()
    base = Path(args.worker)
    managers = {
        on: dckpt.CheckpointManager(
            dckpt.CheckpointConfig(
                root=base / ("on" if on else "off"),
                async_save=True,
                keep_last=2,
                lock=False,
                _capture_check=on,
            ),
            dckpt.TrainState(model, opt),
        )
        for on in (True, False)
    }
    times: dict[str, dict[str, list[float]]] = {
        k: {"stall_s": [], "commit_s": [], "loop_s": []} for k in ("on", "off", "none")
    }

    def steps() -> float:
        """``--steps-after`` training steps, timed: what the loop does beside a write."""
        t0 = time.perf_counter()
        for _ in range(args.steps_after):
            step()
        return time.perf_counter() - t0

    for i in range(args.saves + 1):  # the first save of each allocates its buffers
        dist.barrier()
        times["none"]["loop_s"].append(steps())  # the same steps with no save in flight
        for on in (True, False) if i % 2 else (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            handle = managers[on].save(i + 1)
            stall = time.perf_counter() - t0
            loop = steps()
            handle.result()
            commit = time.perf_counter() - t0
            if i:
                times["on" if on else "off"]["stall_s"].append(stall)
                times["on" if on else "off"]["commit_s"].append(commit)
                times["on" if on else "off"]["loop_s"].append(stall + loop)
    for mgr in managers.values():
        mgr.close()
    # the staging copy of this rank's share (about half the state under DDP), alone
    state = [p.detach() for p in model.parameters()]
    state += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    share = state[rank :: dist.get_world_size()]
    bufs = [torch.empty_like(t) for t in share]

    def best(fn: Any) -> float:
        out = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t0)
        return out

    plain = best(lambda: [b.copy_(t) for b, t in zip(bufs, share, strict=True)])
    hashed = best(lambda: [copy_hashed(b, t) for b, t in zip(bufs, share, strict=True)])
    nbytes = sum(t.numel() * t.element_size() for t in share)
    if rank == 0:
        doc = {"times": times, "copy_s": plain, "copy_hashed_s": hashed, "share_bytes": nbytes}
        print("CAPTURE " + json.dumps(doc), flush=True)
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with h.bench_run(args.dir) as run:
        where = Path(run.base_dir) / "capture"
        where.mkdir()
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={args.nproc}", __file__, "--worker", str(where),
            "--d-model", str(args.d_model), "--layers", str(args.layers),
            "--saves", str(args.saves), "--steps-after", str(args.steps_after),
        ]  # fmt: skip
        proc = subprocess.run(
            cmd,
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    found = [line for line in proc.stdout.splitlines() if line.startswith("CAPTURE ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    got = json.loads(found[0][len("CAPTURE ") :])
    med = {k: {m: statistics.median(v) for m, v in d.items() if v} for k, d in got["times"].items()}
    cost_on = med["on"]["loop_s"] - med["none"]["loop_s"]
    cost_off = med["off"]["loop_s"] - med["none"]["loop_s"]
    figures = {
        "cost_on_s": cost_on,
        "cost_off_s": cost_off,
        "cost_ratio": cost_on / cost_off,
        "stall_on_s": med["on"]["stall_s"],
        "stall_off_s": med["off"]["stall_s"],
        "commit_on_s": med["on"]["commit_s"],
        "commit_off_s": med["off"]["commit_s"],
        "stall_ratio": med["on"]["stall_s"] / med["off"]["stall_s"],
        "commit_ratio": med["on"]["commit_s"] / med["off"]["commit_s"],
        "copy_s": got["copy_s"],
        "copy_hashed_s": got["copy_hashed_s"],
        "copy_ratio": got["copy_hashed_s"] / got["copy_s"],
        "share_gb": got["share_bytes"] / 1e9,
    }
    return {
        **run.header("capture_cost", _cfg(args)),
        "job": {"nproc": args.nproc, "d_model": args.d_model, "layers": args.layers},
        "saves": args.saves,
        "steps_after": args.steps_after,
        "figures": figures,
        "times": got["times"],
    }


def _cfg(args: argparse.Namespace) -> h.RunConfig:
    return h.RunConfig(base_dir=args.dir or "", torch_threads=1, settle_s=0.0, prefault=False)


def render(doc: dict[str, Any]) -> str:
    f, job = doc["figures"], doc["job"]
    return "\n".join(
        [
            f"# The capture check's cost: {job['nproc']} ranks, d_model {job['d_model']}, "
            f"{job['layers']} layers, DDP",
            "",
            f"dckpt {doc['dckpt_revision']}, {doc['date']}; {doc['saves']} background saves "
            "of each, interleaved, medians:",
            "",
            "| | capture check on | off | on / off |",
            "|---|---|---|---|",
            f"| stall (save() until it returns) | {f['stall_on_s']:.4f} s | "
            f"{f['stall_off_s']:.4f} s | {f['stall_ratio']:.3f} |",
            f"| save() until committed | {f['commit_on_s']:.3f} s | {f['commit_off_s']:.3f} s | "
            f"{f['commit_ratio']:.3f} |",
            f"| what the loop lost (the stall and {doc['steps_after']} steps beside the write, "
            f"less the same steps alone) | {f['cost_on_s']:.3f} s | {f['cost_off_s']:.3f} s | "
            f"{f['cost_ratio']:.3f} |",
            f"| staging copy of rank 0's share ({f['share_gb']:.3f} GB), best of 7 | "
            f"{f['copy_hashed_s']:.4f} s | {f['copy_s']:.4f} s | {f['copy_ratio']:.3f} |",
            "",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--saves", type=int, default=10, help="measured saves of each kind")
    p.add_argument(
        "--steps-after", type=int, default=3, help="training steps timed beside each write"
    )
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a tmp dir)")
    p.add_argument("--name", default="capture_cost", help="bench/results/<name>.{json,md}")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    doc = measure(args)
    h.write_json(args.name, doc)
    text = render(doc)
    h.write_result(args.name, "md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
