"""The memory tier against the durable tier (a local directory), same state, same run.

What it runs. ``--world-size`` gloo ranks, each its own *node* (``GROUP_RANK`` = rank), so each
node's partner is the next rank's node on the ring and replicas really move between ranks,
over dckpt's own gloo group (loopback here; no socket of dckpt's), the ranks meeting through a
TCPStore as under torchrun (a FileStore's waits poll its file, which a partner restore's
meetings paid and a disk resume does not: 0.25 vs 0.21 s here). The state is
bench/_harness.build_state (DDP stack + AdamW) of ``--size`` GB. Per round, interleaved and
rotated:

- ``disk_commit``: ``save(step)`` to the directory root, from the call to the commit
  (``SaveResult.commit_s``: the rename), background save as in training;
- ``memory_commit``: ``save(step, tier="memory")``, from the call to the commit (the manifest
  in the root's ledger), and ``memory_replicated``: to every partner's verified replica;
- ``replica_push``: the seconds each rank spent sending its file to its partner and taking
  the one it keeps (``SaveResult.replicas_s``, the slowest rank's), against
  ``gloo_exchange``: gloo's own send and receive of the same bytes between the same ranks
  (one isend and one irecv of whole, pre-touched tensors on the default group), timed in the
  same round;
- ``disk_resume``: ``resume()`` from the directory (no memory tier): every file hashed, the
  DCP load through the verifying reader, the warmup collective. The files were written
  moments before with O_DIRECT (dckpt's default), so they are read from the disk, as after
  a restart;
- ``memory_local_resume``: ``resume()`` with the memory tier holding a newer step: each rank
  hashes its files in shared memory and copies them into the state;
- ``memory_partner_resume``: the same after the last node's memory was wiped (a lost node,
  requeued): the node that keeps its replica sends it that node's files, hashed as they
  arrive (the time is the slowest rank's, the lost node's);

and, once per round, the background save's cost to a training loop: ``--steps`` iterations of
fixed matmul work + ``opt.step()``, one save at the first, for each tier, against the loop
without a save. Reported: dckpt's stall (``handle.stall_s``) and the loop's loss (its wall time
minus the no-save loop's), each the slowest rank's.

Targets (issue 24): memory commit <= 0.2x a disk commit; restore from local memory <= 0.25x a
verified disk load, from the partner <= 0.5x; the stall no higher than a disk save's; the
replica push at >= 0.8x gloo's own exchange of the same bytes.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

Tier = Literal["durable", "memory"]
COMMITS = ("disk_commit", "memory_commit")
GB_PER_S = ("replica_push", "gloo_exchange")
RESUMES = ("disk_resume", "memory_local_resume", "memory_partner_resume")


def _rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import dckpt
    from dckpt.tiers import memory_layout

    ranks = h.Ranks(cfg["settle_s"])
    rank, world = ranks.rank, ranks.world_size
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    model, opt, _ = h.build_state(cfg["size"])
    state = dckpt.TrainState(model, opt)
    base = Path(cfg["base_dir"])
    memory_dir = Path(cfg["memory_dir"])
    logging.getLogger("dckpt").setLevel(logging.WARNING)

    def memory_of(root: Path) -> Path:
        # A memory directory belongs to one root (a second root is refused the memory tier):
        # each root of this run gets its own, beside the others under the same tmpfs.
        return memory_dir.with_name(f"{memory_dir.name}-{root.name}")

    def config(root: Path, memory: bool) -> Any:
        return dckpt.CheckpointConfig(
            root=root,
            lock=False,
            memory=memory,
            memory_dir=memory_of(root),
            loss_watch="off",
            _value_checks=cfg["value_checks"],  # not a setting: this benchmark's switch
        )

    seconds: dict[str, list[float]] = {
        m: [] for m in (*COMMITS, "memory_replicated", *GB_PER_S, *RESUMES, "disk_write_nproc")
    }
    pushed: list[int] = []  # bytes each push moved on the slowest rank (sent + received)
    loops: dict[str, list[dict[str, float]]] = {"none": [], "disk": [], "memory": []}
    sizes: dict[str, int] = {}
    step = 0
    node_dirs: list[Path] = []
    try:
        # Warm-up, untimed: every buffer and memory slot is made once.
        with dckpt.CheckpointManager(config(base / "warm", True), state) as mgr:
            mgr.save(1).result()
            mgr.save(2, tier="memory").result()
        ranks.prefault = int(cfg["size"] * h.GB * h.PREFAULT_FACTOR / world)
        disk = h.Disk(ranks, int(cfg["size"] * h.GB))
        for rnd in range(cfg["repeats"]):
            where = base / f"disk-{rnd}"  # the disk's own write bandwidth, in this run
            seconds["disk_write_nproc"].append(disk.measure(where, parallel=True))
            ranks.cleanup(where)
            root = base / f"r{rnd}"
            node_dir = memory_layout.node_dir(memory_of(root), rank)
            node_dirs.append(node_dir)
            with dckpt.CheckpointManager(config(root, True), state) as mgr:
                for _ in range(2):  # untimed: the ranks agree on who writes which replicated
                    step += 10  # tensor, and the slots take that size: the steady state
                    mgr.save(step, tier="memory").result()
                step += 10  # untimed too: DCP's plan cache and the staging buffers, so the
                mgr.save(step).result()  # disk commit is a steady-state save, as memory's is
                for method in h.round_order(COMMITS, rnd):
                    step += 10
                    tier: Tier = "memory" if method == "memory_commit" else "durable"
                    ranks.prepare()
                    t0 = time.perf_counter()
                    result = mgr.save(step, tier=tier).result()
                    done = time.perf_counter() - t0
                    dist.barrier()
                    seconds[method].append(max(ranks.gather(result.commit_s)))
                    if tier == "memory":
                        seconds["memory_replicated"].append(max(ranks.gather(done)))
                        assert result.replicas_s is not None, "no replica was sent"
                        seconds["replica_push"].append(max(ranks.gather(result.replicas_s)))
                        mine = _own_file(node_dir, rank).stat().st_size
                        sizes_told = ranks.gather(mine)
                        took = _gloo_exchange(ranks, sizes_told, torch)
                        seconds["gloo_exchange"].append(max(ranks.gather(took)))
                        pushed.append(mine + sizes_told[(rank - 1) % world])
                    sizes[method] = result.bytes
            # The durable tier's newest is `step - 10` or `step`; the memory tier's newest is
            # the other. Make the memory step the newer one, so a memory resume uses it.
            with dckpt.CheckpointManager(config(root, True), state) as mgr:
                step += 10
                mgr.save(step, tier="memory").result()
            for method in h.round_order(RESUMES, rnd):
                if method == "memory_partner_resume" and rank == world - 1:  # a node lost
                    shutil.rmtree(node_dir, ignore_errors=True)
                with dckpt.CheckpointManager(config(root, method != "disk_resume"), state) as m:
                    ranks.prepare()
                    t0 = time.perf_counter()
                    report = m.resume()
                    took = time.perf_counter() - t0
                    dist.barrier()
                    want_memory = method != "disk_resume"
                    if ("memory tier" in report.origin) != want_memory:
                        raise RuntimeError(f"{method} resumed from {report.origin or report.path}")
                    if (
                        method == "memory_partner_resume"
                        and "from other nodes" not in report.origin
                    ):
                        raise RuntimeError(f"{method} resumed from {report.origin}")
                    seconds[method].append(max(ranks.gather(took)))
                if method == "memory_partner_resume":  # the memory tier has a local step again
                    with dckpt.CheckpointManager(config(root, True), state) as mgr:
                        step += 10
                        mgr.save(step, tier="memory").result()
            for number, kind in enumerate(h.round_order(("none", "disk", "memory"), rnd)):
                loop_root = base / f"loop-{rnd}-{kind}"  # a root of its own: see memory_of
                with dckpt.CheckpointManager(config(loop_root, True), state) as mgr:
                    for extra in (100, 150):  # the layout and the slots, untimed
                        mgr.save(step + extra + number, tier="memory").result()
                    ranks.prepare()
                    save = None if kind == "none" else step + 200 + number
                    loop_tier: Tier = "memory" if kind == "memory" else "durable"
                    got = h.save_loop(mgr, opt, cfg["steps"], cfg["matmul"], save, tier=loop_tier)
                worst = max(ranks.gather(got["loop_s"])), max(ranks.gather(got["stall_s"]))
                loops[kind].append({"loop_s": worst[0], "stall_s": worst[1]})
                ranks.cleanup(loop_root)
                shutil.rmtree(memory_layout.node_dir(memory_of(loop_root), rank), True)
            step += 10
            ranks.cleanup(root)
    finally:
        for node_dir in node_dirs:
            shutil.rmtree(node_dir, ignore_errors=True)
    return {"seconds": seconds, "loops": loops, "bytes": sizes, "pushed": max(pushed)}


def _own_file(node_dir: Path, rank: int) -> Path:
    """This rank's file of the newest memory step in its node's memory."""
    from dckpt.tiers import memory_layout

    name = memory_layout.file_name(rank)
    return max(memory_layout.own_dir(node_dir).glob(f"step-*/{name}"))


def _gloo_exchange(ranks: h.Ranks, sizes: list[int], torch: Any) -> float:
    """gloo's own move of the same bytes between the same ranks as the replica push: each
    rank sends its file's size to the next rank on the ring and takes the previous one's,
    whole tensors, touched first; returns this rank's seconds."""
    rank, world = ranks.rank, ranks.world_size
    out = torch.ones(sizes[rank], dtype=torch.uint8)
    into = torch.zeros(sizes[(rank - 1) % world], dtype=torch.uint8)
    ranks.barrier()
    t0 = time.perf_counter()
    works = [dist.irecv(into, (rank - 1) % world), dist.isend(out, (rank + 1) % world)]
    for work in works:
        assert work is not None
        work.wait()
    return time.perf_counter() - t0


def summarize(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    med = {m: h.median(v) for m, v in raw["seconds"].items()}
    push_gbps = raw["pushed"] / med["replica_push"] / 1e9
    gloo_gbps = raw["pushed"] / med["gloo_exchange"] / 1e9
    loops = raw["loops"]
    base, cost = h.loop_costs(loops, ("disk", "memory"))
    return {
        **h.run_header(args.name, args.torch_threads),
        "world_size": args.world_size,
        "rounds": args.repeats,
        "value_checks": not args.no_value_checks,
        "bytes": raw["bytes"],
        "seconds": raw["seconds"],
        "median_s": {m: round(v, 4) for m, v in med.items()},
        "disk_write_gb_per_s": round(args.size / med["disk_write_nproc"], 3),
        "pushed_bytes": raw["pushed"],
        "replica_push_gb_per_s": round(push_gbps, 3),
        "gloo_exchange_gb_per_s": round(gloo_gbps, 3),
        "ratios": {
            "memory_commit_vs_disk_commit": round(med["memory_commit"] / med["disk_commit"], 3),
            "memory_replicated_vs_disk_commit": round(
                med["memory_replicated"] / med["disk_commit"], 3
            ),
            "replica_push_vs_gloo_exchange": round(push_gbps / gloo_gbps, 3),
            "local_resume_vs_disk_resume": round(
                med["memory_local_resume"] / med["disk_resume"], 3
            ),
            "partner_resume_vs_disk_resume": round(
                med["memory_partner_resume"] / med["disk_resume"], 3
            ),
            "stall_memory_vs_disk": round(
                cost["memory"]["stall_s"] / max(cost["disk"]["stall_s"], 1e-9), 3
            ),
            "loop_loss_memory_vs_disk": round(
                cost["memory"]["loop_loss_s"] / max(cost["disk"]["loop_loss_s"], 1e-9), 3
            ),
        },
        **h.loop_record(base, cost, loops),
    }


def render(doc: dict[str, Any]) -> str:
    r, s, c = doc["ratios"], doc["median_s"], doc["background_save_cost"]
    b = doc["bytes"]
    return (
        "\n".join(
            [
                f"# Memory tier against the durable tier ({doc['date']})",
                "",
                f"`{doc['command']}`; {doc['world_size']} ranks, each its own node (replicas "
                f"over dckpt's gloo group, loopback; a TCPStore, as under torchrun), "
                f"{doc['rounds']} rounds, medians, slowest "
                f"rank. Bytes: durable {b.get('disk_commit', 0) / 1e9:.2f} GB, memory "
                f"{b.get('memory_commit', 0) / 1e9:.2f} GB (both write DDP's replicated tensors "
                "once; each manager's first memory save, which writes everything while the "
                "ranks agree on who writes what, and the next, which sizes the slots, are not "
                "timed).",
                f"The disk's own write bandwidth in this run (each rank its share, then "
                f"fdatasync): {doc['disk_write_gb_per_s']:.2f} GB/s. Save-time value checks "
                f"(replica digests, NaN/Inf): {'on' if doc.get('value_checks', True) else 'off'}, "
                "on both tiers.",
                "",
                "| figure | memory | disk | ratio | target |",
                "|---|---:|---:|---:|---|",
                f"| save, call to commit | {s['memory_commit']:.3f} s | {s['disk_commit']:.3f} s"
                f" | {r['memory_commit_vs_disk_commit']:.2f}x | <= 0.2x |",
                f"| save, call to the partner's verified replica | {s['memory_replicated']:.3f} s"
                f" | {s['disk_commit']:.3f} s | {r['memory_replicated_vs_disk_commit']:.2f}x | "
                "(context) |",
                f"| resume from local memory, verified | {s['memory_local_resume']:.3f} s | "
                f"{s['disk_resume']:.3f} s | {r['local_resume_vs_disk_resume']:.2f}x | <= 0.25x |",
                f"| resume from the partner's replica, verified | "
                f"{s['memory_partner_resume']:.3f} s | {s['disk_resume']:.3f} s | "
                f"{r['partner_resume_vs_disk_resume']:.2f}x | <= 0.5x |",
                "",
                "| replica push (each rank sends its file and takes its partner's) | GB/s | "
                "ratio | target |",
                "|---|---:|---:|---|",
                f"| dckpt, into the partner's memory, hashed as it arrives | "
                f"{doc['replica_push_gb_per_s']:.2f} | "
                f"{r['replica_push_vs_gloo_exchange']:.2f}x | >= 0.8x |",
                f"| gloo's own isend/irecv of the same bytes, same ranks | "
                f"{doc['gloo_exchange_gb_per_s']:.2f} | 1x | |",
                "",
                "| background save, one per loop | dckpt stall | loop's loss (vs no save) |",
                "|---|---:|---:|",
                f"| durable (directory) | {c['disk']['stall_s']:.3f} s | "
                f"{c['disk']['loop_loss_s']:.3f} s |",
                f"| memory tier | {c['memory']['stall_s']:.3f} s | "
                f"{c['memory']['loop_loss_s']:.3f} s |",
                "",
                f"stall memory/disk: {r['stall_memory_vs_disk']:.2f}x (target: no higher); the "
                f"loop's loss memory/disk: {r['loop_loss_memory_vs_disk']:.2f}x (the memory "
                "save's hashing and replica share these cores with the loop). The disk "
                "resume reads files written moments before with O_DIRECT.",
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    h.add_loop_args(p)
    p.add_argument("--memory-dir", default="/dev/shm", help="where the memory tier lives (a tmpfs)")
    p.add_argument(
        "--no-value-checks",
        action="store_true",
        help="both tiers without the save-time value checks (to see what they cost a commit)",
    )
    h.add_common_args(p, "memory")
    args = p.parse_args(argv)
    memory_dir = Path(args.memory_dir) / f"dckpt-bench-{uuid.uuid4().hex[:12]}"
    try:
        with h.bench_run(args.dir) as run:
            cfg = h.loop_config(args, run.base_dir, memory_dir=str(memory_dir))
            cfg["value_checks"] = not args.no_value_checks
            raw = h.spawn(args.world_size, args.torch_threads, _rank_main, cfg, tcp_store=True)
    finally:  # every root's memory directory (see _rank_main's memory_of)
        for made in memory_dir.parent.glob(f"{memory_dir.name}-*"):
            shutil.rmtree(made, ignore_errors=True)
    doc = summarize(raw, args)
    h.publish(args.name, doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
