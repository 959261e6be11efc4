"""What dckpt's control hooks cost a training step: the fault hook unset, the preemption
agreement (``manager.preempted(step)``, one all-reduce of an int32 on dckpt's gloo group,
called by every rank after every step), and ``manager.observe(loss)`` with the replay
journal (rank 0 appends one line per step: dckpt.root.replay_journal) and without it
(``replay_check="off"``).

Both are measured in the same run as the training step they ride on (the benchmark's DDP
state, forward, backward and AdamW step), so the figures are ratios: hook time / step time.

    .venv/bin/python bench/control_overhead.py --gb 0.05 --world-size 2 --calls 2000
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


def _median_s(fn: Any, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(gb: float, calls: int, root: str) -> dict[str, float]:
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
    with dckpt.CheckpointManager(root, dckpt.TrainState(model, opt)) as mgr:
        mgr.watch_preemption()
        agree_s = _median_s(lambda: mgr.preempted(1), calls)
        mgr.save(1).result()  # the journal of step 1 is open from here on
        journal_s = _median_s(lambda: mgr.observe(2.5), calls)
    off = dckpt.CheckpointConfig(root=Path(root) / "off", replay_check="off")
    with dckpt.CheckpointManager(off, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1).result()
        plain_s = _median_s(lambda: mgr.observe(2.5), calls)
    return {
        "train_step_s": step_s,
        "fault_hook_s": hook_s,
        "preempted_s": agree_s,
        "observe_journal_s": journal_s,
        "observe_off_s": plain_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gb", type=float, default=0.05, help="state size (weights + AdamW)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--name", default="control_overhead")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dckpt-bench-") as root:
        r = spawn(args.world_size, 1, _rank, args.gb, args.calls, root)
    doc = {
        "name": args.name,
        "gb": args.gb,
        "world_size": args.world_size,
        **r,
        "fault_hook_per_save_over_step": r["fault_hook_s"] * len(PHASES) / r["train_step_s"],
        "preempted_over_step": r["preempted_s"] / r["train_step_s"],
        "journal_over_step": (r["observe_journal_s"] - r["observe_off_s"]) / r["train_step_s"],
    }
    print(
        f"train step {r['train_step_s'] * 1e3:.2f} ms | fault hook (unset) "
        f"{r['fault_hook_s'] * 1e9:.0f} ns/phase = {doc['fault_hook_per_save_over_step']:.1e} "
        f"of a step per save | preempted() {r['preempted_s'] * 1e6:.0f} us = "
        f"{doc['preempted_over_step']:.3f} of a step | observe() "
        f"{r['observe_journal_s'] * 1e6:.1f} us with the replay journal, "
        f"{r['observe_off_s'] * 1e6:.1f} us without: the journal "
        f"costs {doc['journal_over_step']:.1e} of a step (rank 0's figures)"
    )
    print(f"wrote {write_json(args.name, doc)}")


if __name__ == "__main__":
    main()
