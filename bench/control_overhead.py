"""What dckpt's control hooks cost a training step: the fault hook unset, the preemption
agreement (``manager.preempted(step)``, called by every rank after every step), and
``manager.observe(loss)`` with the replay journal (rank 0 appends one line per step:
dckpt.root.replay_journal) and without it (``replay_check="off"``).

``preempted`` is timed inside a real training loop (the benchmark's DDP state, forward,
backward and AdamW step), since how often it makes a collective depends on the steps'
length: at the default ``check_every_s`` (about one agreement per second of training, issued
without waiting and read at the next check) and at ``check_every_s=0`` (a check at every
step, each reading the one the step before issued). The collectives are counted by wrapping
``torch.distributed.all_reduce`` in this process, which dckpt does not know about. Every
figure is a ratio to the training step measured in the same run.

    .venv/bin/python bench/control_overhead.py --gb 0.05 --world-size 2 --calls 2000 --steps 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import build_state, spawn, write_json

import dckpt
from dckpt.faults import PHASES, fault_point
from dckpt.preemption import CHECK_EVERY_S


def _median_s(fn: Any, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _count_all_reduces() -> list[int]:
    """Count every ``dist.all_reduce`` this process makes from now on (a one-element list,
    so the caller reads the running count)."""
    import torch.distributed as dist

    count = [0]
    real = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counted
    return count


def _rank(gb: float, calls: int, steps: int, root: str) -> dict[str, float]:
    model, opt, _ = build_state(gb)
    width = next(model.parameters()).shape[-1]
    batch = torch.randn(8, width)

    def train_step() -> None:
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        opt.step()

    step_s = _median_s(train_step, 20)

    def every_phase() -> None:
        for phase in PHASES:
            fault_point(phase, 0, 1)

    hook_s = _median_s(every_phase, calls) / len(PHASES)
    reduces = _count_all_reduces()
    loops: dict[str, float] = {}
    with dckpt.CheckpointManager(root, dckpt.TrainState(model, opt)) as mgr:
        for label, every_s in (("default", CHECK_EVERY_S), ("every_step", 0.0)):
            mgr.watch_preemption(check_every_s=every_s)
            took, before = [], reduces[0]
            for step in range(1, steps + 1):
                train_step()
                t0 = time.perf_counter()
                mgr.preempted(step)
                took.append(time.perf_counter() - t0)
            loops[f"preempted_{label}_mean_s"] = statistics.fmean(took)
            loops[f"preempted_{label}_max_s"] = max(took)
            loops[f"preempted_{label}_collectives_per_step"] = (reduces[0] - before) / steps
        mgr.save(1).result()  # the journal of step 1 is open from here on
        journal_s = _median_s(lambda: mgr.observe(2.5), calls)
    off = dckpt.CheckpointConfig(root=Path(root) / "off", replay_check="off")
    with dckpt.CheckpointManager(off, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1).result()
        plain_s = _median_s(lambda: mgr.observe(2.5), calls)
    return {
        "train_step_s": step_s,
        "fault_hook_s": hook_s,
        **loops,
        "observe_journal_s": journal_s,
        "observe_off_s": plain_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gb", type=float, default=0.05, help="state size (weights + AdamW)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000, help="calls timed per hook")
    p.add_argument("--steps", type=int, default=300, help="training steps per preempted() loop")
    p.add_argument("--name", default="control_overhead")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dckpt-bench-") as root:
        r = spawn(args.world_size, 1, _rank, args.gb, args.calls, args.steps, root)
    doc = {
        "name": args.name,
        "gb": args.gb,
        "world_size": args.world_size,
        **r,
        "fault_hook_per_save_over_step": r["fault_hook_s"] * len(PHASES) / r["train_step_s"],
        "preempted_default_over_step": r["preempted_default_mean_s"] / r["train_step_s"],
        "preempted_every_step_over_step": r["preempted_every_step_mean_s"] / r["train_step_s"],
        "journal_over_step": (r["observe_journal_s"] - r["observe_off_s"]) / r["train_step_s"],
    }
    print(
        f"train step {r['train_step_s'] * 1e3:.2f} ms | fault hook (unset) "
        f"{r['fault_hook_s'] * 1e9:.0f} ns/phase = {doc['fault_hook_per_save_over_step']:.1e} "
        f"of a step per save | preempted(), mean per step over {args.steps} steps: "
        f"{r['preempted_default_mean_s'] * 1e6:.0f} us = "
        f"{doc['preempted_default_over_step']:.1e} of a step with "
        f"{r['preempted_default_collectives_per_step']:.3f} all-reduces per step (default "
        f"check_every_s), {r['preempted_every_step_mean_s'] * 1e6:.0f} us = "
        f"{doc['preempted_every_step_over_step']:.1e} of a step with "
        f"{r['preempted_every_step_collectives_per_step']:.2f} per step (check_every_s=0) | "
        f"observe() {r['observe_journal_s'] * 1e6:.1f} us with the replay journal, "
        f"{r['observe_off_s'] * 1e6:.1f} us without: the journal "
        f"costs {doc['journal_over_step']:.1e} of a step (rank 0's figures)"
    )
    print(f"wrote {write_json(args.name, doc)}")


if __name__ == "__main__":
    main()
