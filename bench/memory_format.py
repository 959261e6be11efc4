"""One format for both tiers? The memory tier written as a DCP directory, against today's.

Issue 46, item 1 ("one format, if the numbers allow"). The memory tier keeps each rank's state
in its node's ``/dev/shm`` in a flat format of its own (dckpt.storage.memory_file); the durable
tier writes DCP's format through the ``Stager`` and the ``HashingWriter``. This measures what
the memory tier would cost if it wrote DCP's format instead, in one run, same state (the DDP
stack + AdamW of bench/_harness.build_state, ``--size`` GB), ``--world-size`` gloo ranks, each
its own node (``GROUP_RANK`` = rank), rounds interleaved and rotated (h.round_order), medians of
the slowest rank:

- ``disk_commit``: ``save(step)`` to a directory root on the disk, call to commit
  (``SaveResult.commit_s``), background save, as bench/memory.py;
- ``memory_commit_flat``: today's ``save(step, tier="memory")``, call to commit (the
  manifest in the root's ledger), as bench/memory.py;
- ``memory_commit_dcp``: the prototype: a ``CheckpointManager`` whose root is a directory in
  ``/dev/shm`` (``direct_io`` off: tmpfs refuses O_DIRECT), so the save runs the whole
  ``DurableRoute``: the Stager's snapshot into host buffers, DCP's planning (its plan cache
  warm) and its pickled ``.metadata``, the HashingWriter's hashed write of one file per rank
  into tmpfs, the value checks, the gather and the commit protocol (fsyncs, which tmpfs makes
  near free, the manifest, the rename); plus, on rank 0, the commit record a memory step needs
  in the durable root (today's ledger: ``write_atomic`` of the manifest's bytes, fsynced, into
  a directory of the disk root, and that directory fsynced) = ``dcp_route`` + ``dcp_ledger``;
- ``disk_commit_first`` / ``dcp_route_first``: each durable manager's first save of the
  round (DCP plans afresh, the Stager makes its buffers), untimed in the figures above; the
  first is what bench/memory.py's ``disk_commit`` times (the 0.22x of
  bench/results/memory.json is against it), so both baselines are reported;
- ``disk_resume``: ``resume()`` from the disk root (files written with O_DIRECT, their page
  cache dropped besides): every file hashed, DCP's load through the verifying reader;
- ``memory_local_resume_flat``: today's ``resume()`` from the local memory tier;
- ``memory_local_resume_dcp``: ``resume()`` of a manager on the ``/dev/shm`` root: the verified
  durable read path (dckpt.load.durable, storage.verifying_reader / one_pass) over tmpfs;
- ``push_flat`` / ``push_dcp``: the partner replica push, both through the memory tier's own
  exchange (dckpt.collective.transfer.move: one file per Incoming, hashed as it arrives,
  renamed in once proven, into a spare reserved beforehand as in the steady state): each rank
  sends its files of the newest step to the next rank on the ring. Flat: one file per rank.
  DCP: each rank's data file, and on rank 0 the ``.metadata`` and the manifest as well.
  ``replica_push_flat`` is dckpt's own figure for the flat push in the same save
  (``SaveResult.replicas_s``), to check the prototype's against.

Every durable manager (disk and ``/dev/shm``) saves once per round before it is timed
(the plan cached, the staging buffers made), and the flat memory tier twice (its owners and
slots): each is timed in its steady state. Both durable managers save in the background
(``async_save=True``: an automatic mode's synchronous trial save would skip the snapshot copy).

Decision rule (issue 46): one format if a DCP-format memory commit is <= 0.25x a disk commit
AND a DCP-format local memory resume is <= 0.5x a disk resume.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import mmap
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

COMMITS = ("disk_commit", "memory_commit_flat", "memory_commit_dcp")
RESUMES = ("disk_resume", "memory_local_resume_flat", "memory_local_resume_dcp")
PUSHES = ("push_flat", "push_dcp")
COMMIT_LIMIT = 0.25
RESUME_LIMIT = 0.5


def _rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    import dckpt
    from dckpt.collective.comm import Comm
    from dckpt.tiers import memory_layout

    ranks = h.Ranks(cfg["settle_s"])
    rank = ranks.rank
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    model, opt, _ = h.build_state(cfg["size"])
    state = dckpt.TrainState(model, opt)
    base = Path(cfg["base_dir"])
    shm = Path(cfg["shm_dir"])  # the DCP-format memory roots, and the push prototype's files
    memory_dir = Path(cfg["memory_dir"])
    logging.getLogger("dckpt").setLevel(logging.WARNING)

    def memory_of(root: Path) -> Path:
        return memory_dir.with_name(f"{memory_dir.name}-{root.name}")

    def config(root: Path, memory: bool, direct_io: bool = True) -> Any:
        return dckpt.CheckpointConfig(
            root=root,
            lock=False,
            memory=memory,
            memory_dir=memory_of(root),
            loss_watch="off",
            async_save=True,
            direct_io=direct_io,
            _value_checks=cfg["value_checks"],  # not a setting: this benchmark's switch
        )

    def shm_config(root: Path) -> Any:
        return config(root, False, direct_io=False)

    seconds: dict[str, list[float]] = {
        m: []
        for m in (
            *COMMITS,
            *("dcp_route", "dcp_ledger", "disk_commit_first", "dcp_route_first"),
            *("replica_push_flat", *RESUMES, *PUSHES),
        )
    }
    save_timings: dict[str, list[dict[str, float]]] = {"disk_commit": [], "dcp_route": []}
    resume_timings: dict[str, list[dict[str, float]]] = {m: [] for m in RESUMES}
    sizes: dict[str, int] = {}
    micro: dict[str, list[float]] = {}
    files: dict[str, list[tuple[str, int]]] = {}
    step = 0
    node_dirs: list[Path] = []
    comm = Comm(timeout_s=600.0)  # the push prototype's own gloo group, as the manager's
    slots = memory_layout.Slots(shm / "push" / f"node-{rank}")
    try:
        with dckpt.CheckpointManager(config(base / "warm", True), state) as mgr:  # untimed
            mgr.save(1).result()
            mgr.save(2, tier="memory").result()
        ranks.prefault = int(cfg["size"] * h.GB * h.PREFAULT_FACTOR / ranks.world_size)
        for rnd in range(cfg["repeats"]):
            ranks.say(f"round {rnd + 1}/{cfg['repeats']}")
            root = base / f"r{rnd}"
            shm_root = shm / f"r{rnd}"
            ledger = root / "memory-dcp"
            ranks.on_rank0(functools.partial(ledger.mkdir, parents=True))
            node_dir = memory_layout.node_dir(memory_of(root), rank)
            node_dirs.append(node_dir)
            with (
                dckpt.CheckpointManager(config(root, True), state) as mgr,
                dckpt.CheckpointManager(shm_config(shm_root), state) as mgr_dcp,
            ):
                for _ in range(2):  # untimed: the steady state of each
                    step += 10
                    mgr.save(step, tier="memory").result()
                step += 10  # each durable manager's first save, as bench/memory.py times it
                first = mgr.save(step).result()
                seconds["disk_commit_first"].append(max(ranks.gather(first.commit_s)))
                first = mgr_dcp.save(step).result()
                seconds["dcp_route_first"].append(max(ranks.gather(first.commit_s)))
                for method in h.round_order(COMMITS, rnd):
                    step += 10
                    ranks.prepare()
                    if method == "memory_commit_dcp":
                        result = mgr_dcp.save(step).result()
                        ledger_s = _ledger_record(ledger, step, result.path) if rank == 0 else 0.0
                        dist.barrier()
                        route = max(ranks.gather(result.commit_s))
                        ledger_s = max(ranks.gather(ledger_s))
                        seconds["dcp_route"].append(route)
                        seconds["dcp_ledger"].append(ledger_s)
                        seconds[method].append(route + ledger_s)
                        save_timings["dcp_route"].append(_manifest_timings(result.path))
                        files["push_dcp"] = _dcp_files(result.path, rank)
                    else:
                        tier: Literal["durable", "memory"] = (
                            "memory" if method == "memory_commit_flat" else "durable"
                        )
                        result = mgr.save(step, tier=tier).result()
                        dist.barrier()
                        seconds[method].append(max(ranks.gather(result.commit_s)))
                        if tier == "memory":
                            assert result.replicas_s is not None, "no replica was sent"
                            seconds["replica_push_flat"].append(
                                max(ranks.gather(result.replicas_s))
                            )
                            own = _own_file(node_dir, rank)
                            files["push_flat"] = [(str(own), own.stat().st_size)]
                        else:
                            save_timings[method].append(_manifest_timings(result.path))
                    sizes[method] = result.bytes
                for method in h.round_order(PUSHES, rnd):
                    seconds[method].append(_push(ranks, comm, slots, files[method], method))
                share = max(size for _, size in files["push_dcp"])  # this rank's data file
                for key, took in _micro(ranks, share, shm).items():
                    micro.setdefault(key, []).append(took)
                # The memory step must be the newest on the disk root for the flat resume.
                step += 10
                mgr.save(step, tier="memory").result()
            for method in h.round_order(RESUMES, rnd):
                if method == "disk_resume":  # written with O_DIRECT; dropped all the same
                    ranks.on_rank0(functools.partial(h.evict, root))
                if method == "memory_local_resume_dcp":
                    conf = shm_config(shm_root)
                else:
                    conf = config(root, method == "memory_local_resume_flat")
                with dckpt.CheckpointManager(conf, state) as m:
                    ranks.prepare()
                    t0 = time.perf_counter()
                    report = m.resume()
                    took = time.perf_counter() - t0
                    dist.barrier()
                    from_memory = "memory tier" in report.origin
                    if from_memory != (method == "memory_local_resume_flat"):
                        raise RuntimeError(f"{method} resumed from {report.origin or report.path}")
                    if (
                        method == "memory_local_resume_dcp"
                        and shm_root not in Path(str(report.path)).parents
                    ):
                        raise RuntimeError(f"{method} resumed from {report.path}")
                    seconds[method].append(max(ranks.gather(took)))
                    resume_timings[method].append(_slowest(ranks.gather(dict(report.timings))))
            ranks.cleanup(root)
            ranks.on_rank0(functools.partial(shutil.rmtree, shm_root, ignore_errors=True))
            shutil.rmtree(node_dir, ignore_errors=True)
    finally:
        slots.close()
        for made in node_dirs:
            shutil.rmtree(made, ignore_errors=True)
    return {
        "seconds": seconds,
        "save_timings": save_timings,
        "resume_timings": resume_timings,
        "bytes": sizes,
        "files": ranks.gather(files),
        "micro": micro,
    }


def _micro(ranks: h.Ranks, nbytes: int, where: Path) -> dict[str, float]:
    """What the parts of a save of this rank's share cost alone (slowest rank, all ranks at
    once): one memcpy (the Stager's snapshot, or the flat format's copy into its mapping),
    one xxh3-128 pass (the HashingWriter hashes each byte for the file and for its item), a
    ``write()`` into a new tmpfs file (its pages allocated: every DCP save makes new files)
    and into the same file again (its pages already there, as the flat format's spares)."""
    import torch

    from dckpt.storage.digest import new_hasher

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    view = src.numpy().data
    path = where / f"micro-{ranks.rank}"
    chunk = h.CHUNK

    def hash_once() -> None:
        new_hasher("xxh3_128").update(view)

    def write(flags: int) -> None:
        fd = os.open(path, flags, 0o600)
        try:
            for a in range(0, nbytes, chunk):
                os.pwrite(fd, view[a : a + chunk], a)
        finally:
            os.close(fd)

    out = {
        "memcpy": ranks.timed(lambda: dst.copy_(src)),
        "xxh3_128": ranks.timed(hash_once),
        "tmpfs_write_new": ranks.timed(lambda: write(os.O_WRONLY | os.O_CREAT | os.O_EXCL)),
        "tmpfs_write_allocated": ranks.timed(lambda: write(os.O_WRONLY)),
    }
    path.unlink()
    return out


def _ledger_record(ledger: Path, step: int, committed: Path) -> float:
    """Rank 0: the commit record of a DCP-format memory step in the durable root, as today's
    ledger writes one (the manifest's bytes, written whole, fsynced, renamed in, the
    directory fsynced); its seconds."""
    from dckpt.owned import write_atomic
    from dckpt.root.durable import fsync_dir
    from dckpt.root.manifest import MANIFEST_FILE

    t0 = time.perf_counter()
    data = (committed / MANIFEST_FILE).read_bytes()
    write_atomic(ledger, f"step-{step:08d}.json", data)
    fsync_dir(ledger)
    return time.perf_counter() - t0


def _manifest_timings(committed: Path) -> dict[str, float]:
    """The save's phases as its manifest records them (every rank's slowest)."""
    from dckpt.root.manifest import MANIFEST_FILE

    doc = json.loads((committed / MANIFEST_FILE).read_text())
    doc = doc.get("manifest", doc)
    return {k: float(v) for k, v in doc.get("timings", {}).items()}


def _dcp_files(committed: Path, rank: int) -> list[tuple[str, int]]:
    """What a DCP-format replica of ``rank`` would carry: the data files this rank wrote, and
    on rank 0 the ``.metadata`` and the manifest too."""
    from dckpt.root.manifest import MANIFEST_FILE

    doc = json.loads((committed / MANIFEST_FILE).read_text())
    doc = doc.get("manifest", doc)
    mine = [str(f["path"]) for f in doc["files"] if f.get("rank") == rank]
    if not mine:  # the records name no rank: DCP's names do (``__<rank>_<n>.distcp``)
        mine = [p.name for p in committed.iterdir() if p.name.startswith(f"__{rank}_")]
    if rank == 0:
        mine += [".metadata", MANIFEST_FILE]
    out = []
    for name in dict.fromkeys(mine):
        path = committed / name
        if path.is_file() and path.stat().st_size > 0:
            out.append((str(path), path.stat().st_size))
    return out


def _own_file(node_dir: Path, rank: int) -> Path:
    """This rank's file of the newest memory step in its node's memory."""
    from dckpt.tiers import memory_layout

    name = memory_layout.file_name(rank)
    return max(memory_layout.own_dir(node_dir).glob(f"step-*/{name}"))


def _push(ranks: h.Ranks, comm: Any, slots: Any, mine: list[tuple[str, int]], kind: str) -> float:
    """Each rank sends ``mine`` to the next rank on the ring and takes the previous rank's,
    through the memory tier's exchange (``move``); the slowest rank's seconds. Untimed: the
    digests (the writer's, in a real save), one spare reserved per incoming file (the steady
    state), and, after, the received files dropped."""
    from dckpt.collective.transfer import Incoming, Outgoing, move
    from dckpt.storage.digest import format_digest, new_hasher

    rank, world = ranks.rank, ranks.world_size
    told = []
    for path, size in mine:
        hasher = new_hasher("xxh3_128")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
            hasher.update(memoryview(mm))
        told.append((size, format_digest("xxh3_128", hasher)))
    theirs = ranks.gather(told)[(rank - 1) % world]
    into_dir = slots.node / kind
    spares = [f"{kind}-{i}" for i in range(len(theirs))]
    for spare, (size, _) in zip(spares, theirs, strict=True):
        slots.reserve(spare, size)
    incoming = [
        Incoming(
            src=(rank - 1) % world,
            into=into_dir / f"file-{i}",
            size=size,
            digest=digest,
            tag=i,
            spare_of=spare,
        )
        for i, ((size, digest), spare) in enumerate(zip(theirs, spares, strict=True))
    ]
    handles = []
    outgoing = []
    for i, (path, size) in enumerate(mine):
        f = open(path, "rb")  # noqa: SIM115 - closed below, after the exchange
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        handles.append((f, mm))
        outgoing.append(Outgoing(mm, (rank + 1) % world, size, tag=i))
    try:
        ranks.prepare()
        t0 = time.perf_counter()
        got = move(comm, outgoing, incoming, slots, timeout_s=600.0)
        took = time.perf_counter() - t0
        dist.barrier()
    finally:
        for f, mm in handles:
            mm.close()
            f.close()
    errors = [r.error for r in got if r.error is not None]
    if errors:
        raise RuntimeError(f"{kind}: {errors}")
    for item in incoming:
        slots.drop(item.into)
    return max(ranks.gather(took))


def _slowest(per_rank: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for timings in per_rank:
        for k, v in timings.items():
            out[k] = max(out.get(k, 0.0), float(v))
    return out


def _median_dict(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: round(h.median([r[k] for r in rows if k in r]), 4) for k in keys}


def summarize(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    med = {m: h.median(v) for m, v in raw["seconds"].items() if v}
    commit_ratio = med["memory_commit_dcp"] / med["disk_commit"]
    resume_ratio = med["memory_local_resume_dcp"] / med["disk_resume"]
    per_rank_files = raw["files"]
    pushed = {
        kind: {
            "files_per_rank": [len(f.get(kind, [])) for f in per_rank_files],
            "bytes_per_rank": [sum(s for _, s in f.get(kind, [])) for f in per_rank_files],
            "names_per_rank": [[Path(n).name for n, _ in f.get(kind, [])] for f in per_rank_files],
        }
        for kind in PUSHES
    }
    secs = raw["seconds"]

    def paired(a: str, b: str) -> float:
        """The median over rounds of ``a / b`` in the same round (drift on a shared host)."""
        return round(h.median([x / y for x, y in zip(secs[a], secs[b], strict=True)]), 3)

    return {
        **h.run_header(args.name, args.torch_threads),
        "loadavg_before": raw["loadavg_before"],
        "loadavg_after": h.loadavg(),
        "world_size": args.world_size,
        "size_gb": args.size,
        "rounds": args.repeats,
        "value_checks": not args.no_value_checks,
        "bytes": raw["bytes"],
        "seconds": raw["seconds"],
        "median_s": {m: round(v, 4) for m, v in med.items()},
        "ratios": {
            "memory_commit_flat_vs_disk_commit": round(
                med["memory_commit_flat"] / med["disk_commit"], 3
            ),
            "memory_commit_dcp_vs_disk_commit": round(commit_ratio, 3),
            "dcp_route_vs_disk_commit": round(med["dcp_route"] / med["disk_commit"], 3),
            "memory_commit_flat_vs_disk_commit_first": round(
                med["memory_commit_flat"] / med["disk_commit_first"], 3
            ),
            "memory_commit_dcp_vs_disk_commit_first": round(
                med["memory_commit_dcp"] / med["disk_commit_first"], 3
            ),
            "dcp_route_first_vs_disk_commit_first": round(
                med["dcp_route_first"] / med["disk_commit_first"], 3
            ),
            "memory_local_resume_flat_vs_disk_resume": round(
                med["memory_local_resume_flat"] / med["disk_resume"], 3
            ),
            "memory_local_resume_dcp_vs_disk_resume": round(resume_ratio, 3),
            "push_dcp_vs_push_flat": round(med["push_dcp"] / med["push_flat"], 3),
        },
        "paired_ratios": {
            "memory_commit_flat_vs_disk_commit": paired("memory_commit_flat", "disk_commit"),
            "memory_commit_dcp_vs_disk_commit": paired("memory_commit_dcp", "disk_commit"),
            "memory_commit_dcp_vs_memory_commit_flat": paired(
                "memory_commit_dcp", "memory_commit_flat"
            ),
            "memory_local_resume_flat_vs_disk_resume": paired(
                "memory_local_resume_flat", "disk_resume"
            ),
            "memory_local_resume_dcp_vs_disk_resume": paired(
                "memory_local_resume_dcp", "disk_resume"
            ),
            "memory_local_resume_dcp_vs_memory_local_resume_flat": paired(
                "memory_local_resume_dcp", "memory_local_resume_flat"
            ),
            "push_dcp_vs_push_flat": paired("push_dcp", "push_flat"),
        },
        "decision": {
            "commit_limit": COMMIT_LIMIT,
            "resume_limit": RESUME_LIMIT,
            "commit_ok": commit_ratio <= COMMIT_LIMIT,
            "resume_ok": resume_ratio <= RESUME_LIMIT,
            "one_format": commit_ratio <= COMMIT_LIMIT and resume_ratio <= RESUME_LIMIT,
        },
        "pushed": pushed,
        "save_timings_median_s": {k: _median_dict(v) for k, v in raw["save_timings"].items() if v},
        "micro_median_s": {k: round(h.median(v), 4) for k, v in raw["micro"].items()},
        "resume_timings_median_s": {
            k: _median_dict(v) for k, v in raw["resume_timings"].items() if v
        },
    }


def render(doc: dict[str, Any]) -> str:
    s, r, d = doc["median_s"], doc["ratios"], doc["decision"]
    pushed = doc["pushed"]

    pr = doc["paired_ratios"]

    def row(name: str, what: str, key: str = "", limit: str = "", base: bool = False) -> str:
        ratio = f"{r[key]:.2f}x" if key else ("1x" if base else "")
        same = f"{pr[key]:.2f}x" if key in pr else ""
        if limit:
            ratio, same = f"**{ratio}**", f"**{same}**"
        return f"| {name} | {what} | {s[name]:.3f} s | {ratio} | {same} | {limit} |"

    def files(kind: str) -> str:
        p = pushed[kind]
        return (
            f"files per rank {p['files_per_rank']}, bytes per rank "
            f"{[round(b / 1e6, 1) for b in p['bytes_per_rank']]} MB"
        )

    lines = [
        f"# The memory tier in DCP's format against its own ({doc['date']})",
        "",
        f"`{doc['command']}`; dckpt {doc['dckpt_revision']}; {doc['world_size']} gloo ranks, "
        f"each its own node; {doc['size_gb']} GB of state; {doc['rounds']} rounds, "
        "interleaved; medians of the slowest rank. Value checks "
        f"{'on' if doc['value_checks'] else 'off'}. Load average (1, 5, 15 min) before "
        f"{doc['loadavg_before']}, after {doc['loadavg_after']} on "
        f"{doc['host']['cpu_count']} CPUs (a shared host: read the ratios, not the seconds). "
        "See bench/memory_format.py's docstring.",
        "",
        "| figure | what | median | ratio of medians | median of per-round ratios | limit |",
        "|---|---|---:|---:|---:|---|",
        row("disk_commit", "save() to a disk root, call to commit", base=True),
        row(
            "memory_commit_flat",
            "today's save(tier='memory'), call to commit",
            "memory_commit_flat_vs_disk_commit",
        ),
        row(
            "memory_commit_dcp",
            "DCP format: DurableRoute into /dev/shm + ledger record on disk",
            "memory_commit_dcp_vs_disk_commit",
            f"<= {d['commit_limit']}x",
        ),
        row(
            "dcp_route",
            "of which: call to commit of the /dev/shm root",
            "dcp_route_vs_disk_commit",
        ),
        row("dcp_ledger", "of which: rank 0's ledger record (fsynced, disk)"),
        row(
            "disk_commit_first",
            "a disk manager's first save (plan and buffers made), as bench/memory.py times it",
        ),
        row(
            "dcp_route_first",
            "the /dev/shm manager's first save",
            "dcp_route_first_vs_disk_commit_first",
        ),
        row("disk_resume", "resume() from the disk root, verified", base=True),
        row(
            "memory_local_resume_flat",
            "today's resume() from local memory, verified",
            "memory_local_resume_flat_vs_disk_resume",
        ),
        row(
            "memory_local_resume_dcp",
            "DCP format: resume() of the /dev/shm root, verified durable path",
            "memory_local_resume_dcp_vs_disk_resume",
            f"<= {d['resume_limit']}x",
        ),
        row("replica_push_flat", "dckpt's own flat push (SaveResult.replicas_s)"),
        row("push_flat", f"move() of the flat files: {files('push_flat')}", base=True),
        row("push_dcp", f"move() of the DCP files: {files('push_dcp')}", "push_dcp_vs_push_flat"),
        "",
        "Against a disk manager's first save (bench/memory.py's disk_commit, from which "
        "bench/results/memory.json's 0.22x comes): flat "
        f"{r['memory_commit_flat_vs_disk_commit_first']:.2f}x, DCP format "
        f"{r['memory_commit_dcp_vs_disk_commit_first']:.2f}x. The DCP-format commit against "
        f"today's, round by round: {pr['memory_commit_dcp_vs_memory_commit_flat']:.2f}x; the "
        "DCP-format local resume against today's: "
        f"{pr['memory_local_resume_dcp_vs_memory_local_resume_flat']:.2f}x.",
        "",
        "DCP files per rank: "
        + "; ".join(
            f"rank {i}: {', '.join(names)}"
            for i, names in enumerate(pushed["push_dcp"]["names_per_rank"])
        )
        + ".",
        "",
        f"Decision (issue 46): commit {'meets' if d['commit_ok'] else 'misses'} "
        f"<= {d['commit_limit']}x, local resume {'meets' if d['resume_ok'] else 'misses'} "
        f"<= {d['resume_limit']}x: "
        + ("one format." if d["one_format"] else "keep the flat format."),
        "",
        "The parts alone, on one rank's share of "
        f"{max(pushed['push_dcp']['bytes_per_rank']) / 1e6:.0f} MB (all ranks at once, slowest, "
        "medians): " + ", ".join(f"{k} {v:.3f} s" for k, v in doc["micro_median_s"].items()) + ".",
        "",
        "Where a save's time goes (the manifest's timings, slowest rank, medians):",
        "",
        "| timing | " + " | ".join(doc["save_timings_median_s"]) + " |",
        "|---|" + "---:|" * len(doc["save_timings_median_s"]),
    ]
    st = doc["save_timings_median_s"]
    for key in sorted({k for v in st.values() for k in v}):
        lines.append(f"| {key} | " + " | ".join(_cell(v, key) for v in st.values()) + " |")
    rt = doc["resume_timings_median_s"]
    lines += [
        "",
        "Where a resume's time goes (ResumeReport.timings, slowest rank, medians):",
        "",
        "| timing | " + " | ".join(rt) + " |",
        "|---|" + "---:|" * len(rt),
    ]
    for key in sorted({k for v in rt.values() for k in v}):
        lines.append(f"| {key} | " + " | ".join(_cell(v, key) for v in rt.values()) + " |")
    return "\n".join(lines) + "\n"


def _cell(timings: dict[str, float], key: str) -> str:
    """One cell of a timings table: seconds, bytes as MB, or a dash where not recorded."""
    if key not in timings:
        return "-"
    value = timings[key]
    return f"{value / 1e6:.1f} MB" if key.endswith("_bytes") else f"{value:.4f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    h.add_loop_args(p)
    p.add_argument("--memory-dir", default="/dev/shm", help="where the memory tier lives (a tmpfs)")
    p.add_argument(
        "--no-value-checks", action="store_true", help="every save without the value checks"
    )
    h.add_common_args(p, "memory_format")
    args = p.parse_args(argv)
    token = uuid.uuid4().hex[:12]
    memory_dir = Path(args.memory_dir) / f"dckpt-bench-{token}"
    shm_dir = Path(args.memory_dir) / f"dckpt-bench-dcp-{token}"
    before = h.loadavg()
    try:
        with h.bench_run(args.dir) as run:
            cfg = h.loop_config(args, run.base_dir, memory_dir=str(memory_dir))
            cfg["shm_dir"] = str(shm_dir)
            cfg["value_checks"] = not args.no_value_checks
            raw = h.spawn(args.world_size, args.torch_threads, _rank_main, cfg)
            raw["loadavg_before"] = before
    finally:
        for made in memory_dir.parent.glob(f"{memory_dir.name}-*"):
            shutil.rmtree(made, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    doc = summarize(raw, args)
    h.publish(args.name, doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
