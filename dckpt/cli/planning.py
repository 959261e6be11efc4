"""``dckpt plan``: recovery planning from a checkpoint's measured timings, or from flags.

With ROOT, the checkpoint's size, its write time (``timings.write_s``), what the save cost the
training loop and its time to commit come from the newest (or ``--step``) manifest; flags
override any of them. The cost per save is ``timings.training_slowed_s`` (the stall plus the
slowdown of the steps beside the background write, read from step times; see
dckpt.save.step_clock) where the save measured it, else the stall alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import psutil

from ..errors import IntegrityError, ManifestError
from ..units import plural
from .common import EXIT_INTEGRITY, EXIT_OK, EXIT_USAGE, cli_root, committed_step, fail, human, out
from .memory_tier import memory_costs, memory_dir_for
from .plan_model import PlanInputs, PlanResult, plan

__all__ = ["cmd_plan"]


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def cmd_plan(args: argparse.Namespace) -> int:
    measured: dict[str, float] = {}
    if args.root is not None:
        root = cli_root(args.root)
        try:
            manifest = root.read_manifest(committed_step(root, args.step))
        except (ManifestError, IntegrityError) as exc:
            fail(EXIT_INTEGRITY, str(exc))
        t = manifest.timings
        measured["bytes"] = manifest.total_bytes
        if t.get("write_s"):  # a linked file (an incremental save) was not written
            written = manifest.total_bytes - t.get("reused_bytes", 0.0)
            measured["write_gbps"] = written / t["write_s"] / 1e9
        measured["stall_s"] = t.get(
            "training_slowed_s", t.get("stall_s", t.get("to_commit_s", 0.0))
        )
        measured["commit_s"] = t.get("to_commit_s", 0.0)
    size = args.bytes if args.bytes is not None else measured.get("bytes")
    write = args.write_gbps or measured.get("write_gbps")
    if size is None or write is None:
        fail(EXIT_USAGE, "give a checkpoint ROOT, or --bytes and --write-gbps")
    read = args.read_gbps or write
    write_time = size / (write * 1e9)
    stall = args.stall_s if args.stall_s is not None else measured.get("stall_s", write_time)
    commit = measured.get("commit_s", write_time)
    try:
        inputs = PlanInputs(
            checkpoint_bytes=int(size),
            write_gbps=write,
            read_gbps=read,
            restart_s=args.restart_s,
            mtbf_node_hours=args.mtbf_hours,
            nodes=args.nodes,
            stall_s=stall,
            commit_s=commit,
            keep_last=args.keep_last,
            milestones=args.milestones,
            host_memory_bytes=int(args.host_mem_gb * 1e9)
            if args.host_mem_gb
            else psutil.virtual_memory().total,
        )
    except ValueError as exc:
        fail(EXIT_USAGE, str(exc))
    result = plan(inputs)
    memory = _memory_plan(args, inputs)
    if args.json:
        doc = {"inputs": inputs.__dict__, "plan": result.as_dict()}
        if memory is not None:
            doc["memory"] = {"inputs": memory[0].__dict__, "plan": memory[1].as_dict()}
        print(json.dumps(doc, indent=1))
        return EXIT_OK
    rows = [
        ("checkpoint", f"{human(inputs.checkpoint_bytes)}, costs training {inputs.stall_s:.3f} s, "
         f"commit {inputs.commit_s:.2f} s, write {inputs.write_gbps:.2f} GB/s, "
         f"read {inputs.read_gbps:.2f} GB/s" + ("" if args.read_gbps else " (assumed = write)")),
        ("job MTBF", f"{_duration(result.job_mtbf_s)} ({plural(inputs.nodes, 'node')} x "
         f"{inputs.mtbf_node_hours:g} h each)"),
        ("save every", f"{_duration(result.interval_s)} (Young-Daly: sqrt(2 x cost x MTBF))"),
        ("lost per failure", f"{_duration(result.expected_work_lost_s)} of work "
         "(half an interval + time to commit)"),
        ("RTO", f"{_duration(result.rto_s)} (size / read bandwidth + "
         f"{inputs.restart_s:g} s restart)"),
        ("overhead", f"{100 * result.overhead_fraction:.2f} % of the job's time"),
        ("storage", f"{human(result.storage_bytes)} (keep {inputs.keep_last} + "
         f"{plural(inputs.milestones, 'milestone')} + 1 in flight)"),
        ("staging", f"{human(result.staging_bytes_per_node)} per node, "
         + ("fits" if result.staging_fits else "DOES NOT fit")
         + f" in half of {human(inputs.host_memory_bytes)} host memory"),
    ]  # fmt: skip
    for key, value in rows:
        out.print(f"  {key:<17} {value}")
    if memory is not None:
        m_in, m = memory
        restore = m.rto_s - m_in.restart_s
        out.print("  memory tier (measured on this host; a lost node restores from its partner)")
        for key, value in [
            ("memory save", f"costs training {m_in.stall_s:.3f} s, commit {m_in.commit_s:.3f} s"),
            ("save every", f"{_duration(m.interval_s)} to memory (the durable saves above "
             "stay for losing both copies)"),
            ("lost per failure", f"{_duration(m.expected_work_lost_s)} of work"),
            ("RTO", f"{_duration(m.rto_s)} ({restore:.3f} s restore"
             + (" measured" if m_in.restore_s is not None else ", assumed = commit")
             + f" + {m_in.restart_s:g} s restart)"),
            ("overhead", f"{100 * m.overhead_fraction:.2f} % of the job's time"),
        ]:  # fmt: skip
            out.print(f"  {key:<17} {value}")
    return EXIT_OK


def _memory_plan(
    args: argparse.Namespace, durable: PlanInputs
) -> tuple[PlanInputs, PlanResult] | None:
    """The same plan with the memory tier's measured save and restore costs, when the root
    has memory checkpoints on this host; None otherwise."""
    if args.root is None:
        return None
    root = cli_root(args.root)
    costs = memory_costs(root.memory_ledger(), memory_dir_for(str(root), args.memory_dir))
    if costs is None:
        return None
    inputs = dataclasses.replace(
        durable,
        stall_s=costs["stall_s"],
        commit_s=costs["commit_s"],
        restore_s=costs.get("restore_s", costs["commit_s"]),
    )
    return inputs, plan(inputs)
