"""The GPU path, measured from a training loop's own step times: dckpt against DCP and torch.save.

One process, one GPU (NCCL world size 1, in a ``cpu:gloo,cuda:nccl`` group so that
``dcp.async_save`` has the CPU backend it asks for). The state is a stack of
``Linear(--hidden, --hidden)`` layers plus AdamW after one step (8 x 8192 by default: 537M
parameters, 6.44 GB with the moments). The training loop is forward, backward, ``optimizer.step()``
and a ``torch.cuda.synchronize()`` per step, as a loop that logs its loss does.

What it measures, all in one run, into ``--out`` (``gpu.json`` and ``gpu.md``):

- ``step_s``: the median step without any save (the baseline);
- per method, over ``--saves`` saves (after one warm-up save that allocates buffers):
  ``stall_s`` = (the save call + the ``--window`` steps after it) - ``--window`` x baseline:
  what the loop lost, read from its step times; ``reported_stall_s`` = what the method says it
  blocked (dckpt's own figure); ``steps_during_write_x`` = the median step while the save was
  still writing, over the baseline; ``commit_s`` = from the call to durable;
- methods: ``dckpt`` (``CheckpointManager`` with the default config: device staging, drain,
  background write), ``dcp_save``, ``dcp_async_thread``, ``dcp_async_process`` (with DCP's
  ``DefaultStager``; where this torch fails it, the error is recorded), ``torch_save``;
- ``pinned_d2h_gbps``: the ceiling of a pinned device-to-host copy of 1 GB; dckpt's drain
  (``staged_device_bytes / drain_s``) is set beside it;
- ``fingerprint``: the capture check's fingerprint (issue 53), per GB: on the device, queued
  on the stream as ``save()`` queues it (``device_gbps``), and over host bytes as the writer
  computes it for each GPU tensor it writes (``host_gbps``, one thread as the writer has);
- ``disk_gbps``: the disk's own write bandwidth (64 MiB writes + ``fdatasync``) for the
  checkpoint's size; dckpt's commit throughput is set beside it;
- loads, cold page cache (``posix_fadvise(DONTNEED)`` on the files first), interleaved:
  ``dcp.load`` of the model and optimizer from dckpt's checkpoint, and dckpt's verified load
  (every byte hashed, ranks cross-checked) of the same checkpoint.

Without CUDA it says so and exits 0; ``--device cpu`` runs the same code on the CPU with a small
state (a smoke test of this script, not a measurement of anything that matters).

    python bench/gpu.py [--layers 8 --hidden 8192 --batch 4096] [--saves 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _harness import CHUNK, GB, evict, write_file

import dckpt
from dckpt.root.manifest import read_manifest

METHODS = ("dckpt", "dcp_save", "dcp_async_thread", "dcp_async_process", "torch_save")


class Trainer:
    """The model, its optimizer and one training step, on one device."""

    def __init__(self, device: torch.device, layers: int, hidden: int, batch: int) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = torch.nn.Sequential(
            *(torch.nn.Linear(hidden, hidden, device=device) for _ in range(layers))
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(batch, hidden, device=device)
        self.step()  # the optimizer state exists from here on

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.model(self.x).float().square().mean()
        loss.backward()
        self.opt.step()
        sync(self.device)

    def state_bytes(self) -> int:
        n = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for st in self.opt.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        return n

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(trainer: Trainer, n: int) -> list[tuple[float, float]]:
    """(start, end) of each of ``n`` steps."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.step()
        out.append((t0, time.perf_counter()))
    return out


class Pending:
    """A save that returned: ``finish()`` blocks until it is durable and says when it was."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.returned = time.perf_counter()
        self.durable: float | None = self.returned  # a synchronous save: durable on return
        self.info: dict[str, Any] = {}
        self._wait: Callable[[], None] = lambda: None

    def track(self, future: Any) -> Pending:
        """An asynchronous save: durable when ``future`` completes (stamped by a callback)."""

        def stamp(_f: Any) -> None:
            self.durable = time.perf_counter()

        self.until(future.result)  # before the callback: a done future stamps at once
        future.add_done_callback(stamp)
        return self

    def until(self, wait: Callable[[], None]) -> Pending:
        """An asynchronous save: durable once ``wait`` returned (it sets ``durable`` itself,
        or the callback of ``track`` does)."""
        self.durable = None
        self._wait = wait
        return self

    def finish(self) -> float:
        """Seconds from the call to durable."""
        self._wait()
        while self.durable is None:  # the callback runs right after result() returns
            time.sleep(0.001)
        return self.durable - self.t0


class Savers:
    """Each method's save of the trainer's state into a fresh place under ``root``."""

    def __init__(self, trainer: Trainer, root: Path) -> None:
        self.trainer = trainer
        self.root = root
        self.group = dist.new_group(backend="gloo")  # DCP's collectives: CPU objects
        state = dckpt.TrainState(trainer.model, trainer.opt)
        self.manager = dckpt.CheckpointManager(
            dckpt.CheckpointConfig(root=root / "dckpt", keep_last=2), state
        )
        self.stager: Any = None
        self.step = 0

    def close(self) -> None:
        self.manager.close()
        if self.stager is not None:
            self.stager.close()

    def start(self, method: str) -> Pending:
        self.step += 1
        path = self.root / f"{method}-{self.step}"
        t0 = time.perf_counter()
        if method == "dckpt":
            handle = self.manager.save(self.step)
            pending = Pending(t0)

            def done() -> None:
                result = handle.result()
                pending.durable = t0 + result.commit_s
                pending.info = {
                    "bytes": result.bytes,
                    "reported_stall_s": result.stall_s,
                    "timings": read_manifest(result.path).timings,
                }

            return pending.until(done)
        if method == "torch_save":
            path.mkdir(parents=True)
            with open(path / "state.pt", "wb") as f:
                torch.save(self.trainer.state_dict(), f)
                f.flush()
                os.fsync(f.fileno())
            return Pending(t0)
        state_dict = dckpt.TrainState(self.trainer.model, self.trainer.opt).state_dict()
        writer = FileSystemWriter(path, sync_files=True, overwrite=False)
        if method == "dcp_save":
            dcp_save(state_dict, storage_writer=writer, process_group=self.group)
            return Pending(t0)
        if method == "dcp_async_thread":
            future = async_save(state_dict, storage_writer=writer, process_group=self.group)
            return Pending(t0).track(future)
        assert method == "dcp_async_process", method
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.stager is None:
            on_cuda = self.trainer.device.type == "cuda"
            self.stager = DefaultStager(StagingOptions(on_cuda, True, True, on_cuda))
        response = async_save(
            state_dict,
            storage_writer=writer,
            process_group=self.group,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self.stager,
        )
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            staging.result()  # the next optimizer step may not run before DCP's copy is taken
        return Pending(t0).track(getattr(response, "upload_completion", response))

    def remove_outputs(self, method: str) -> None:
        for p in self.root.glob(f"{method}-*"):
            shutil.rmtree(p, ignore_errors=True)


def measure_method(
    savers: Savers, method: str, saves: int, window: int, base_s: float
) -> dict[str, Any]:
    """One warm-up save (buffers allocated), then ``saves`` measured ones, each followed by
    ``window`` timed steps; the save is waited for after the window, outside it."""
    trainer = savers.trainer
    rows = []
    for _ in range(saves + 1):
        timed_steps(trainer, 2)  # a clean start: the previous save is durable
        pending = savers.start(method)
        steps = timed_steps(trainer, window)
        commit_s = pending.finish()
        durable = pending.t0 + commit_s
        during = [e - s for s, e in steps if e <= durable]
        rows.append(
            {
                "call_s": pending.returned - pending.t0,
                "stall_s": steps[-1][1] - pending.t0 - window * base_s,
                "commit_s": commit_s,
                "steps_during_write_x": statistics.median(during) / base_s if during else None,
                **pending.info,
            }
        )
        if method != "dckpt":
            savers.remove_outputs(method)
    warm, rows = rows[0], rows[1:]
    out: dict[str, Any] = {
        "saves": rows,
        "warmup_save": warm,
        **{k: statistics.median(r[k] for r in rows) for k in ("stall_s", "call_s", "commit_s")},
    }
    during = [r["steps_during_write_x"] for r in rows if r["steps_during_write_x"] is not None]
    out["steps_during_write_x"] = statistics.median(during) if during else None
    if method == "dckpt":
        out["reported_stall_s"] = statistics.median(r["reported_stall_s"] for r in rows)
        out["bytes_per_save"] = rows[-1]["bytes"]
        out["timings"] = rows[-1]["timings"]
    return out


def pinned_d2h_gbps(device: torch.device, nbytes: int) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GB


def fingerprint_gbps(device: torch.device, nbytes: int) -> dict[str, float]:
    """The capture check's fingerprint: GB/s on the device (queued kernels, then a sync, as a
    save waits for them) and on the host over the same bytes (dckpt.storage.tensor_digest)."""
    from dckpt.storage.tensor_digest import fingerprint

    host = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    out: dict[str, float] = {}
    best = float("inf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the writer's one thread
    try:
        for _ in range(2):
            t0 = time.perf_counter()
            fingerprint(host)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    out["host_gbps"] = nbytes / best / GB
    if device.type == "cuda":
        src = host.to(device)
        best = float("inf")
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            fingerprint(src)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        out["device_gbps"] = nbytes / best / GB
    return out


def disk_gbps(root: Path, nbytes: int, repeats: int = 2) -> dict[str, Any]:
    chunk = memoryview(os.urandom(CHUNK))
    secs = []
    for i in range(repeats):
        path = root / f"disk-{i}"
        t0 = time.perf_counter()
        write_file(path, nbytes, chunk)
        secs.append(time.perf_counter() - t0)
        path.unlink()
    return {"bytes": nbytes, "seconds": secs, "gb_per_s": nbytes / statistics.median(secs) / GB}


def measure_loads(savers: Savers, ckpt: Path, repeats: int) -> dict[str, Any]:
    """dcp.load and dckpt's verified load of the same checkpoint, cold cache, interleaved."""
    state = dckpt.TrainState(savers.trainer.model, savers.trainer.opt)
    step = int(ckpt.name.split("-")[1])

    def plain() -> None:
        sd = state.state_dict()
        sd = {"model": sd["model"], "optimizer": sd["optimizer"]}
        dcp_load(sd, storage_reader=FileSystemReader(ckpt), process_group=savers.group)
        sync(savers.trainer.device)

    def verified() -> None:
        savers.manager.load(step=step)
        sync(savers.trainer.device)

    times: dict[str, list[float]] = {"dcp_load": [], "dckpt_load_verified": []}
    for i in range(repeats):
        order = [("dcp_load", plain), ("dckpt_load_verified", verified)]
        for name, fn in order if i % 2 == 0 else reversed(order):
            evict(ckpt)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "cache": "cold: posix_fadvise(DONTNEED) on the checkpoint's files first",
        "seconds": times,
        "median_s": med,
        "verified_over_dcp_load": med["dckpt_load_verified"] / med["dcp_load"],
    }


def render(doc: dict[str, Any]) -> str:
    r = doc["results"]
    lines = [
        f"# GPU path: {doc['device_name']}, torch {doc['torch']}",
        "",
        f"State: {doc['state_gb']:.2f} GB ({doc['params_m']:.0f}M parameters + AdamW); "
        f"baseline step {r['step_s'] * 1e3:.1f} ms; stall = the save call + {doc['window']} "
        "steps after it, minus that many baseline steps (median of the saves).",
        "",
        "| method | stall (from step times) | reported stall | steps while writing | commit |",
        "|---|---|---|---|---|",
    ]
    for name, m in r["methods"].items():
        if "error" in m:
            lines.append(f"| {name} | failed: {m['error'][:120]} | | | |")
            continue
        rep = m.get("reported_stall_s")
        during = m.get("steps_during_write_x")
        lines.append(
            f"| {name} | {m['stall_s'] * 1e3:.1f} ms | "
            f"{'' if rep is None else f'{rep * 1e3:.1f} ms'} | "
            f"{'' if during is None else f'{during:.3f}x'} | {m['commit_s']:.2f} s |"
        )
    fp = r.get("fingerprint", {})
    if fp:
        on_device = f"{fp['device_gbps']:.1f} GB/s on the device, " if "device_gbps" in fp else ""
        lines += [
            "",
            f"Capture check fingerprint: {on_device}{fp['host_gbps']:.2f} GB/s on the host "
            "(one thread, as the writer computes it over each GPU tensor it writes).",
        ]
    lines += ["", "| target | value | goal | verdict |", "|---|---|---|---|"]
    for t in r["targets"]:
        verdict = "n/a" if t["value"] is None else ("PASS" if t["ok"] else "FAIL")
        value = "" if t["value"] is None else f"{t['value']:.4g}"
        lines.append(f"| {t['name']} | {value} | {t['goal']} | {verdict} |")
    lines.append("")
    return "\n".join(lines)


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    d = r["methods"].get("dckpt", {})
    timings = d.get("timings", {})
    drain_gbps = None
    if timings.get("drain_s"):
        drain_gbps = timings.get("staged_device_bytes", 0.0) / timings["drain_s"] / GB
    commit_gbps = d["bytes_per_save"] / d["commit_s"] / GB if "commit_s" in d else None
    rows = [
        ("stall per save (s)", d.get("stall_s"), "<= 0.010", lambda v: v <= 0.010),
        (
            "stall share when saving every 10 steps",
            None if "stall_s" not in d else d["stall_s"] / (10 * r["step_s"]),
            "<= 0.005",
            lambda v: v <= 0.005,
        ),
        (
            "steps while writing / baseline",
            d.get("steps_during_write_x"),
            "<= 1.03",
            lambda v: v <= 1.03,
        ),
        (
            "drain / pinned D2H ceiling",
            None
            if drain_gbps is None or not r["pinned_d2h_gbps"]
            else drain_gbps / r["pinned_d2h_gbps"],
            ">= 0.8",
            lambda v: v >= 0.8,
        ),
        (
            "commit throughput / disk bandwidth",
            None if commit_gbps is None else commit_gbps / r["disk"]["gb_per_s"],
            ">= 0.9",
            lambda v: v >= 0.9,
        ),
        (
            "verified load / dcp.load",
            r["loads"].get("verified_over_dcp_load"),
            "<= 1.10",
            lambda v: v <= 1.10,
        ),
    ]
    return [
        {"name": n, "value": v, "goal": g, "ok": None if v is None else bool(ok(v))}
        for n, v, g, ok in rows
    ]


def run(args: argparse.Namespace, device: torch.device, root: Path) -> dict[str, Any]:
    trainer = Trainer(device, args.layers, args.hidden, args.batch)
    nbytes = trainer.state_bytes()
    print(f"gpu.py: state {nbytes / GB:.2f} GB on {device}", flush=True)
    timed_steps(trainer, 3)
    base = [e - s for s, e in timed_steps(trainer, args.baseline_steps)]
    step_s = statistics.median(base)
    print(f"gpu.py: baseline step {step_s * 1e3:.1f} ms", flush=True)
    results: dict[str, Any] = {"step_s": step_s, "baseline_steps_s": base, "methods": {}}
    results["pinned_d2h_gbps"] = pinned_d2h_gbps(device, min(nbytes, int(GB)))
    results["fingerprint"] = fingerprint_gbps(device, min(nbytes, int(GB)))
    print(f"gpu.py: fingerprint {json.dumps(results['fingerprint'])}", flush=True)
    results["disk"] = disk_gbps(root, min(nbytes, 4 * int(GB)))
    savers = Savers(trainer, root)
    try:
        for method in args.methods:
            print(f"gpu.py: {method} ...", flush=True)
            try:
                m = measure_method(savers, method, args.saves, args.window, step_s)
            except Exception as exc:
                traceback.print_exc()
                m = {"error": f"{type(exc).__name__}: {exc}"}
            results["methods"][method] = m
            print(f"gpu.py: {method}: {json.dumps(_short(m))}", flush=True)
        latest = sorted((root / "dckpt").glob("step-*"))
        if latest and "dckpt" in args.methods:
            results["loads"] = measure_loads(savers, latest[-1], args.load_repeats)
        else:
            results["loads"] = {}
    finally:
        savers.close()
    results["targets"] = targets(results)
    return {
        "name": "gpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "state_gb": nbytes / GB,
        "params_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
        "window": args.window,
        "results": results,
    }


def _short(m: dict[str, Any]) -> dict[str, Any]:
    keys = ("stall_s", "reported_stall_s", "steps_during_write_x", "commit_s", "error")
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in m.items() if k in keys}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--layers", type=int, default=None, help="default 8 (cuda), 2 (cpu)")
    p.add_argument("--hidden", type=int, default=None, help="default 8192 (cuda), 256 (cpu)")
    p.add_argument("--batch", type=int, default=None, help="default 4096 (cuda), 64 (cpu)")
    p.add_argument("--saves", type=int, default=2, help="measured saves per method")
    p.add_argument("--window", type=int, default=8, help="steps after each save call")
    p.add_argument("--baseline-steps", type=int, default=20)
    p.add_argument("--load-repeats", type=int, default=2)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a tmp dir)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    small = args.device == "cpu"
    args.layers = args.layers or (2 if small else 8)
    args.hidden = args.hidden or (256 if small else 8192)
    args.batch = args.batch or (64 if small else 4096)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu.py: no CUDA device here; this benchmark measures the GPU path. Nothing ran.")
        return 0
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="dckpt-gpu-bench-", dir=args.dir))
    try:
        doc = run(args, device, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu" if device.type == "cuda" else "gpu_cpu_smoke"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
