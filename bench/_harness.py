"""Machinery shared by the benchmarks in bench/: ranks, state, memory, disk, rounds, output.

- ``spawn`` starts ``world_size`` ranks (multiprocessing spawn, gloo over a FileStore), runs a
  function on each and returns what rank 0 returned; a failure on any rank fails the run.
- ``build_state`` makes the benchmark state: a DDP-wrapped stack of ``Linear(HIDDEN, HIDDEN)``
  layers plus its AdamW state after one step, sized to ``gb`` GB (1 GB = 1e9 bytes).
- ``Ranks`` is one rank's view of a run: ``timed`` (between two barriers, after ``prepare``:
  prefault + gc + barrier), ``on_rank0`` (clean-up, eviction while the others wait), ``gather``.
- ``Disk`` measures the disk's own write bandwidth: one process, or each rank its share.
- ``round_order``: rotate the units every two rounds and reverse every other round.

Why prefault (``touch``): on a VM with free page reporting (the dev VM: virtio-balloon, freed
pages are handed back to the host after ~2 s) memory the guest frees goes back to the host, and
the next measurement pays host page faults for its page cache and buffers, so a method's time
would depend on what ran before it. ``Ranks.prepare`` faults in and frees ``prefault`` bytes
first, so every measurement starts with the same warm memory. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import multiprocessing as mp
import os
import platform
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dckpt.storage.digest import new_hasher

GB = 1e9
CHUNK = 64 << 20
HIDDEN = 2048
PAGE = 4096
PREFAULT_FACTOR = 1.5  # x a rank's share of the checkpoint
RESULTS_DIR = Path(__file__).resolve().parent / "results"
COLD_CACHE = "cold: posix_fadvise(DONTNEED) on the checkpoint's files first"

T = TypeVar("T")


# --- sizes, files, memory -----------------------------------------------------------------------


def layers_for(gb: float, hidden: int = HIDDEN) -> int:
    """Linear layers of ``hidden`` x ``hidden`` whose fp32 params + AdamW state make ``gb`` GB."""
    per_layer = 3 * 4 * (hidden * hidden + hidden)  # param, exp_avg, exp_avg_sq
    return max(1, round(gb * GB / per_layer))


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested dict / list / tuple."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors(value)


def tensor_bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(obj))


def dir_bytes(path: Path) -> tuple[int, int]:
    """Total size and number of the files under ``path`` (or of ``path``, a file)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


class PeakRss:
    """The largest resident set size of this process while the block runs, above its size
    before (``extra_mib``), sampled every 5 ms by a thread."""

    def __init__(self) -> None:
        self.extra_mib = 0.0
        self._stop = threading.Event()
        self._before = self._peak = 0

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, self._rss())

    def __enter__(self) -> PeakRss:
        self._before = self._peak = self._rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._rss())
        self.extra_mib = (self._peak - self._before) / (1 << 20)


def evict(path: Path) -> None:
    """Drop the page cache of every file under ``path`` (they are clean: fsynced by the save)."""
    for p in [path] if path.is_file() else path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def touch(nbytes: int) -> None:
    """Fault in ``nbytes`` of fresh memory, one write per page, and free it again.

    The freed pages stay backed by the host for a while, so the page cache the next measurement
    fills costs the same whatever ran before it (see the module docstring)."""
    if nbytes > 0:
        buf = bytearray(nbytes)
        buf[::PAGE] = b"\1" * len(range(0, nbytes, PAGE))
        del buf


def remove(path: Path, settle_s: float) -> None:
    """Delete what a measurement wrote, ``sync`` so that its freeing (ext4 may ``discard``) and
    any writeback happen now, not in the next measurement, then wait ``settle_s``."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.sync()
    time.sleep(settle_s)


def write_file(path: Path, nbytes: int, chunk: memoryview) -> None:
    """Write ``nbytes`` to a new file in ``chunk``-sized writes, then ``fdatasync``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        os.fdatasync(fd)
    finally:
        os.close(fd)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def round_order(units: Sequence[str], rnd: int) -> list[str]:
    """The units of round ``rnd``: rotated every two rounds, reversed every other round.

    A rotation alone keeps each unit's neighbours, so one unit would always run right after the
    same other one; reversing every other round breaks that too."""
    shift = (rnd // 2) % len(units)
    order = [*units[shift:], *units[:shift]]
    if rnd % 2:
        order.reverse()
    return order


# --- the state ----------------------------------------------------------------------------------


def build_state(gb: float) -> tuple[DistributedDataParallel, torch.optim.AdamW, int]:
    """DDP model + AdamW after one step, identical on every rank (same seed); and its layers.

    The gradients are freed (``set_to_none``): they are not part of a checkpoint."""
    torch.manual_seed(0)
    layers = layers_for(gb)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*blocks))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, HIDDEN)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, layers


# --- one rank's view of a run -------------------------------------------------------------------


class Ranks:
    """Barriers, timing and rank-0 chores on the default (gloo) group."""

    def __init__(self, settle_s: float) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.settle_s = settle_s
        self.prefault = 0  # bytes faulted in before each measurement; set after the warm-up

    def barrier(self) -> None:
        dist.barrier()

    def prepare(self) -> None:
        """Warm memory (see the module docstring), collect garbage, then line the ranks up."""
        touch(self.prefault)
        gc.collect()
        dist.barrier()

    def timed(self, fn: Callable[[], object]) -> float:
        """Seconds from the start of ``fn`` on all ranks to its end on the slowest rank."""
        self.prepare()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def on_rank0(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on rank 0 (clean-up, eviction) while the other ranks wait."""
        if self.rank == 0:
            fn()
        dist.barrier()

    def cleanup(self, path: Path) -> None:
        """Delete a measurement's output on rank 0, sync, settle; the others wait."""
        self.on_rank0(lambda: remove(path, self.settle_s))

    def gather(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[no-any-return]

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)


class Disk:
    """The disk's own write bandwidth for ``nbytes`` (a checkpoint's size) in this run."""

    def __init__(self, ranks: Ranks, nbytes: int) -> None:
        self.ranks = ranks
        self.nbytes = nbytes
        self.chunk = memoryview(os.urandom(CHUNK))

    @property
    def parallel_method(self) -> str:
        return f"disk_write_{self.ranks.world_size}proc"

    def one_process(self, path: Path) -> None:
        """Rank 0 writes the whole size into one file, then ``fdatasync``."""
        if self.ranks.rank == 0:
            write_file(path / "blob-0", self.nbytes, self.chunk)

    def parallel(self, path: Path) -> None:
        """Each rank writes its share into its own file, then ``fdatasync``."""
        rank, ws = self.ranks.rank, self.ranks.world_size
        share = self.nbytes // ws + (self.nbytes % ws if rank == ws - 1 else 0)
        write_file(path / f"blob-{rank}", share, self.chunk)

    def hash_share(self, algorithm: str) -> None:
        """Only the digest: hash this rank's share of ``nbytes`` from memory, no file."""
        hasher = new_hasher(algorithm)
        left = self.nbytes // self.ranks.world_size
        while left > 0:
            hasher.update(self.chunk[: min(left, CHUNK)])
            left -= CHUNK
        hasher.hexdigest()

    def measure(self, path: Path, *, parallel: bool) -> float:
        """Seconds to write ``nbytes`` under a new ``path`` (slowest rank)."""
        self.ranks.on_rank0(lambda: path.mkdir(parents=True))
        return self.ranks.timed(lambda: (self.parallel if parallel else self.one_process)(path))


def disk_record(
    nbytes: int, world_size: int, one: Sequence[float], parallel: Sequence[float]
) -> dict[str, Any]:
    """The JSON record of the disk measurements; ``gb_per_s`` is the better of the two."""
    bw_1 = nbytes / median(one) / GB
    bw_n = nbytes / median(parallel) / GB
    return {
        "bytes": nbytes,
        "chunk_bytes": CHUNK,
        "sync": "os.fdatasync after the last chunk",
        "one_process": {
            "seconds": [round(x, 4) for x in one],
            "median_s": round(median(one), 4),
            "gb_per_s": round(bw_1, 4),
        },
        "parallel": {
            "processes": world_size,
            "seconds": [round(x, 4) for x in parallel],
            "median_s": round(median(parallel), 4),
            "gb_per_s": round(bw_n, 4),
        },
        "gb_per_s": round(max(bw_1, bw_n), 4),
    }


# --- spawning the ranks -------------------------------------------------------------------------

RankFn = Callable[..., Any]


def _rank_entry(
    rank: int,
    world_size: int,
    store_path: str,
    fn: RankFn,
    args: tuple[Any, ...],
    out: Queue[tuple[str, Any]],
) -> None:
    try:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's checkpoint daemon needs it
        tcp = store_path.startswith("tcp://")
        dist.init_process_group(
            "gloo",
            init_method=store_path if tcp else f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=1800),
        )
        try:
            result = fn(*args)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            out.put(("ok", result))
    except BaseException as exc:
        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def spawn(
    world_size: int, torch_threads: int, fn: RankFn, *args: Any, tcp_store: bool = False
) -> Any:
    """Run ``fn(*args)`` on ``world_size`` fresh ranks; return what rank 0 returned.

    ``fn`` runs with the default process group initialised (gloo) and
    ``torch.set_num_threads(torch_threads)``; it must be a module-level function.
    ``tcp_store``: the ranks meet through a TCPStore on 127.0.0.1, as under torchrun (a
    FileStore's ``wait`` polls the file: what waits on the store pays that poll)."""
    ctx = mp.get_context("spawn")
    out: Queue[tuple[str, Any]] = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="dckpt-bench-store-")
    store = os.path.join(store_dir, "store")
    if tcp_store:
        with socket.socket() as sock:  # a free port (rank 0's store binds it)
            sock.bind(("127.0.0.1", 0))
            store = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    os.environ["OMP_NUM_THREADS"] = str(torch_threads)  # inherited by the spawned ranks
    procs = [
        ctx.Process(
            target=_rank_entry,
            args=(rank, world_size, store, _with_threads, (torch_threads, fn, args), out),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    result: Any = None
    received = False
    try:
        while not received:
            try:
                status, value = out.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a rank died without a report") from None
                if all(p.exitcode == 0 for p in procs):
                    raise RuntimeError("the ranks exited without a result") from None
                continue
            if status != "ok":
                raise RuntimeError(f"benchmark failed\n{value}")
            result, received = value, True
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    return result


def _with_threads(torch_threads: int, fn: RankFn, args: tuple[Any, ...]) -> Any:
    torch.set_num_threads(torch_threads)
    return fn(*args)


# --- command line and output -------------------------------------------------------------------


def host_info(torch_threads: int, **extra: Any) -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads_per_rank": torch_threads,
        **extra,
    }


def source_revision() -> str:
    """The git commit of the code measured, ``+dirty`` when dckpt/ has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "dckpt"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_line() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What every benchmark run takes: where to write, threads, memory preparation."""

    base_dir: str
    torch_threads: int
    settle_s: float
    prefault: bool

    @staticmethod
    def common(args: argparse.Namespace, base_dir: str) -> dict[str, Any]:
        """The fields of this class from ``add_common_args``' options."""
        return {
            "base_dir": base_dir,
            "torch_threads": args.torch_threads,
            "settle_s": args.settle,
            "prefault": args.prefault,
        }


@dataclass
class Run:
    """One benchmark run: its checkpoint directory and the machine's load around it."""

    base_dir: str
    started: float = field(default_factory=time.perf_counter)
    loadavg_before: list[float] = field(default_factory=loadavg)
    loadavg_after: list[float] = field(default_factory=list)
    revision: str = field(default_factory=source_revision)

    def header(self, name: str, cfg: RunConfig) -> dict[str, Any]:
        """The fields every result document starts with."""
        return {
            "name": name,
            "date": now_iso(),
            "command": command_line(),
            "dckpt_revision": self.revision,
            "wall_s": round(time.perf_counter() - self.started, 1),
            "host": host_info(
                cfg.torch_threads,
                settle_s=cfg.settle_s,
                prefault=cfg.prefault,
                loadavg_1_5_15_before=self.loadavg_before,
                loadavg_1_5_15_after=self.loadavg_after,
            ),
        }


@contextlib.contextmanager
def bench_run(where: str | None) -> Iterator[Run]:
    """A fresh checkpoint directory (under ``where`` if given), removed at the end."""
    if where is not None:
        Path(where).mkdir(parents=True, exist_ok=True)
    run = Run(tempfile.mkdtemp(prefix="dckpt-bench-", dir=where))
    try:
        yield run
    finally:
        shutil.rmtree(run.base_dir, ignore_errors=True)
        run.loadavg_after = loadavg()


def add_common_args(p: argparse.ArgumentParser, name: str) -> None:
    """--dir, --name, --torch-threads, --settle, --prefault."""
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a tmp dir)")
    p.add_argument("--name", default=name, help="bench/results/<name>.json")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds to wait after each measurement's cleanup (default 0; see bench/README.md)",
    )
    p.add_argument(
        "--prefault",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fault in 1.5x a rank's share of memory before each measurement (default on)",
    )


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.torch_threads < 1:
        p.error("--torch-threads must be >= 1")
    if args.settle < 0:
        p.error("--settle must be >= 0")


def _compute(n: int) -> None:
    """One training step's stand-in: fixed matmul work."""
    a = torch.randn(n, n)
    for _ in range(4):
        a = torch.tanh(a @ a / n)


def save_loop(
    mgr: Any, opt: Any, steps: int, n: int, save: int | None, **save_kw: Any
) -> dict[str, float]:
    """``steps`` iterations of compute + ``opt.step()``; with ``save`` (a step, the same on
    every rank), one ``mgr.save(save, **save_kw)`` at the first. Returns the loop's wall time
    and dckpt's stall (0 without a save): a save's cost to the loop is read against the same
    loop without one."""
    dist.barrier()
    t0 = time.perf_counter()
    handle = None
    for i in range(steps):
        if save is not None and i == 0:
            handle = mgr.save(save, **save_kw)
        _compute(n)
        opt.step()
    loop_s = time.perf_counter() - t0
    stall = 0.0
    if handle is not None:
        handle.result()
        stall = handle.stall_s
    return {"loop_s": loop_s, "stall_s": stall}


def loop_costs(
    loops: dict[str, list[dict[str, float]]], kinds: Sequence[str]
) -> tuple[float, dict[str, dict[str, float]]]:
    """The no-save loop's median wall time, and for each kind of save its median stall and
    the loop's loss (its median wall time minus the no-save loop's)."""
    base = median([r["loop_s"] for r in loops["none"]])
    return base, {
        kind: {
            "stall_s": median([r["stall_s"] for r in loops[kind]]),
            "loop_loss_s": median([r["loop_s"] for r in loops[kind]]) - base,
        }
        for kind in kinds
    }


def loop_record(
    base: float, cost: dict[str, dict[str, float]], loops: dict[str, Any]
) -> dict[str, Any]:
    """The result fields of ``loop_costs``: the costs (rounded), the no-save loop, the raw runs."""
    return {
        "background_save_cost": {
            k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in cost.items()
        },
        "no_save_loop_s": round(base, 4),
        "loops": loops,
    }


def add_loop_args(p: argparse.ArgumentParser) -> None:
    """The state size, ranks, rounds and the stall loop's shape (s3.py, memory.py)."""
    p.add_argument("--size", type=float, default=0.25, help="GB of state (default 0.25)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="loop iterations per stall measure")
    p.add_argument("--matmul", type=int, default=384, help="matmul size of one step's compute")


def loop_config(args: argparse.Namespace, base_dir: str, **extra: Any) -> dict[str, Any]:
    """What ``add_loop_args`` parsed, for the ranks (plus ``extra``)."""
    return {
        "base_dir": base_dir,
        "size": args.size,
        "repeats": args.repeats,
        "steps": args.steps,
        "matmul": args.matmul,
        "settle_s": args.settle,
        **extra,
    }


def publish(name: str, doc: dict[str, Any], text: str) -> None:
    """Write ``results/<name>.json`` and ``.md``, print the table and the ratios."""
    write_json(name, doc)
    write_result(name, "md", text)
    print(text)
    print(json.dumps(doc["ratios"]))


def run_header(name: str, torch_threads: int) -> dict[str, Any]:
    """The fields every result file starts with: what ran, when, on which code and host."""
    return {
        "name": name,
        "date": now_iso(),
        "command": command_line(),
        "dckpt_revision": source_revision(),
        "host": host_info(torch_threads),
    }


def write_result(name: str, suffix: str, text: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    target = RESULTS_DIR / f"{name}.{suffix}"
    target.write_text(text, encoding="utf-8")
    return target


def write_json(name: str, doc: dict[str, Any]) -> Path:
    return write_result(name, "json", json.dumps(doc, indent=2) + "\n")


def raw_get_then_dcp_load(
    client: Any, bucket: str, prefix: str, into: Path, state: Any, transfer: Any
) -> None:
    """The s3 benches' reference load: each rank downloads its share of step 2's objects
    (boto3, no digest), then ``dcp.load`` of model and optimizer from the local copy (no
    verification)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    step = f"{prefix}/step-00000002/"
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=step)["Contents"])
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, key in enumerate(keys):
        if i % world == rank and not key.endswith("manifest.json"):
            client.download_file(bucket, key, str(into / key[len(step) :]), Config=transfer)
    dist.barrier()
    full = state.state_dict()
    dcp_load({"model": full["model"], "optimizer": full["optimizer"]}, checkpoint_id=str(into))


def start_moto(pin: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """moto's standalone S3 server on a free port of 127.0.0.1 (``pin``: on CPU 1 alone, so
    it does not share a core with the ranks); the process and its endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    if pin:
        cmd = ["taskset", "-c", "1", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto's server did not start")
