"""Where the time of ``make bench-s3`` goes: a sampling profile of every process, with CPU seconds.

``bench/s3.py`` times dckpt's save to an s3:// root against boto3's multipart put of the same
bytes, and dckpt's verified load against boto3's get, with moto's S3 server on the same 2 cores.
This script runs the same operations on the same state (``bench/_harness.build_state``, the
same part size and concurrency for the raw client) and, for each one, measures:

- wall time (slowest rank, between two barriers, as ``Ranks.timed``), and CPU seconds
  (``psutil`` ``cpu_times``, user + system, all threads) of every process involved: the ranks,
  moto's server, this driver, the profilers; and the whole machine's busy and idle time
  (``psutil.cpu_times()``), so that what other users of the box took shows as "other";
- with ``--profile`` (the default), once more under ``py-spy record --native --threads
  --format raw``, attached by pid to each rank and to moto's server for exactly that
  operation. Each process's samples are put into categories (leaf-first rules, ``CATEGORIES``)
  and the shares are scaled by that process's measured CPU seconds in the same run: py-spy
  counts a runnable thread that waits for a core as busy, so its sample counts alone would
  overstate CPU on a saturated box.

Operations (``--phases``; the first four by default):

- ``raw_put``: each rank ``upload_fileobj`` of its share's bytes (as bench/s3.py);
- ``dckpt_save``: ``CheckpointManager(s3://..., async_save=False).save(step)`` to the commit;
- ``raw_get``: each rank ``download_fileobj`` of its raw object into a BytesIO;
- ``dckpt_load``: ``CheckpointManager(...).load()`` of a committed step into an empty mirror;
- ``raw_get_dcp_load`` (reference): boto3 download of the step's objects, then ``dcp.load``.

Each is run ``--repeats`` times unprofiled (the timings and CPU shares), then once profiled.
With ``--pin``, moto's server runs on CPU 1 only and the ranks on CPU 0 only (``taskset`` /
``sched_setaffinity``), so the client and the server no longer take each other's core.

Output: a summary on stdout and ``bench/results/<name>.json`` (default ``s3_profile``);
with ``--keep DIR`` the raw profiles (folded stacks: flamegraph.pl or https://speedscope.app
open them) are kept in DIR. Needs py-spy (``.venv/bin/pip install py-spy``) and ptrace
rights (root, or ``kernel.yama.ptrace_scope=0``). About 2-3 minutes on the 2-core dev box.

    .venv/bin/python bench/s3_profile.py                 # profile + timings, shared cores
    .venv/bin/python bench/s3_profile.py --pin --no-profile --name s3_profile_pinned
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

PHASES = ("raw_put", "dckpt_save", "raw_get", "dckpt_load", "raw_get_dcp_load")
DEFAULT_PHASES = PHASES[:4]
POLL_S = 0.002

# --- categories ---------------------------------------------------------------------------------
# Leaf-first: for each sampled stack, the frames are looked at from the innermost outwards,
# and the first frame that matches a rule (rules in order, for that frame) gives the category.
# Frames that match none (libc memcpy, the interpreter, threading.py) pass to their caller.

CATEGORIES = {
    "a_moto": "(a) moto's server (all of its CPU)",
    "b_http": "(b) botocore / s3transfer / urllib3 / http.client / sockets",
    "b_checksum": "(b') botocore's checksums of parts (CRC32, MD5)",
    "b_setup": "(b'') botocore client creation (service models, endpoints)",
    "c_torch": "(c) DCP / torch: planning, torch.save / torch.load, tensor copies",
    "d_hash": "(d) dckpt's digests (xxhash)",
    "e_file": "(e) local files: mirror writes and reads (pwrite, read, bounce copy)",
    "g_upbuf": "(g') dckpt UploadStream part buffers (zero-fill, copy)",
    "g_dckpt": "(g) other dckpt Python (fetch, manifests, checks, DCP glue)",
    "h_collective": "(h) gloo collectives and barriers",
    "z_other": "(z) other: interpreter, GC, imports, unresolved native frames",
}
"""CPU categories. (f), waiting, is not one: it is the machine's idle core-seconds in the
window, and each rank's wall minus its CPU. Samples py-spy took of threads that waited on a
lock, a condition or the GIL (``w_wait``, runnable but doing no work) are counted apart and
left out of the scaling to CPU seconds."""

MOTO_PARTS = {
    "moto_value": "moto: whole-object read + slice per ranged GET (FakeKey.value)",
    "moto_hash": "moto: MD5 ETags, multipart checksums (FULL_OBJECT pass at completion)",
    "moto_complete": "moto: CompleteMultipartUpload (copies the parts)",
    "moto_spool": "moto: bodies spooled to temp files (SpooledTemporaryFile)",
    "moto_http": "moto: werkzeug / sockets / request parsing",
    "moto_other": "moto: other (routing, responses, models)",
}

_FILE_SYSCALLS = (
    "pwrite",
    "pread",
    "fdatasync",
    "fsync",
    "ftruncate",
    "_io_FileIO_readinto",
    "openat",
    "__open",
    "unlink",
    "rename",
    "getdents",
    "fstat",
    "statx",
)
_NET = ("socket.py", "http/client", "urllib3/", "botocore/", "s3transfer/", "selectors.py")
_WAITS = (
    "threading.py",
    "queue.py",
    "concurrent/futures/thread.py",
    "concurrent/futures/_base.py",
    "s3_profile.py",
)


def _frame_category(frame: str, net: bool, gloo: bool) -> str | None:
    name, _, where = frame.partition(" (")
    low = frame.lower()
    if "xxh" in low:
        return "d_hash"
    if "digest.py" in where and name in ("hash_stream", "hash_file"):
        return "d_hash"  # its own line (the hasher's update); its readinto is a file read
    if "httpchecksum" in where or ("md5" in low and "botocore/" in where):
        return "b_checksum"
    if not where.endswith(".py") and ".py:" not in where:  # a native frame
        file_call = name in ("read", "write") or any(s in name for s in _FILE_SYSCALLS)
        if file_call and not net and not gloo:
            return "e_file"
        if name.startswith(("send", "recv", "__libc_send", "__libc_recv", "poll", "sock_")):
            return "b_http"
    if "direct_file.py" in where or "verified_files.py" in where:
        return "e_file"
    if name == "_fetch_range" and "s3_store.py" in where:
        return "e_file"  # its own line is the pwrite into the mirror
    if any(part in where for part in (*_NET, "boto3/", "ssl.py")):
        return "b_http"
    if "gloo" in low or "distributed_c10d.py" in where or "c10d" in low:
        return "h_collective"
    if (
        where.startswith("torch/")
        or "libtorch" in where
        or name.startswith(("at::", "c10::", "torch::"))
    ):
        return "c_torch"
    if "s3_store.py" in where and name.startswith("UploadStream.") and name != "UploadStream._send":
        return "g_upbuf"
    if "dckpt/" in where:
        return "g_dckpt"
    return None


def _python_frames(stack: list[str]) -> list[str]:
    return [f for f in stack if ".py:" in f]


def categorize(stack: list[str]) -> str:
    text = ";".join(stack)
    if "botocore/loaders.py" in text or "create_client (botocore/session.py" in text:
        return "b_setup"
    py = _python_frames(stack)
    leaf = stack[-1] if stack else ""
    if leaf.startswith(("flock", "sem_wait", "pthread_cond_wait", "futex")):
        return "w_wait"  # blocked in a file lock (ranks of a node taking turns) or a futex
    if py and any(w in py[-1] for w in _WAITS) and "xxh" not in leaf.lower():
        return "w_wait"  # runnable, but in a lock / condition / queue wait (or our own poll)
    net = any(n in text for n in _NET)
    gloo = "gloo" in text.lower() or "distributed_c10d.py" in text
    for frame in reversed(stack):
        cat = _frame_category(frame, net, gloo)
        if cat is not None:
            return cat
    return "z_other"


def moto_part(stack: list[str]) -> str:
    text = ";".join(stack)
    py = _python_frames(stack)
    if py and (
        any(w in py[-1] for w in _WAITS) or ("selectors.py" in py[-1] and "serve_forever" in text)
    ):
        return "w_wait"  # the accept loop's select, a request thread's lock wait
    for frame in reversed(stack):
        name, _, where = frame.partition(" (")
        if "md5" in frame.lower() or "etag" in name.lower() or "Checksum" in name:
            return "moto_hash"
        if "_handle_range_header" in name or name == "FakeKey.value":
            return "moto_value"
        if "complete" in name and "moto/s3" in where:
            return "moto_complete"
        if "tempfile.py" in where:
            return "moto_spool"
    if py and any(
        w in py[-1]
        for w in (
            "werkzeug/",
            "socketserver.py",
            "socket.py",
            "selectors.py",
            "http/server.py",
            "http/client.py",
        )
    ):
        return "moto_http"
    return "moto_other"


def read_folded(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw output: ``frame;frame;... count`` per line (root first)."""
    out: list[tuple[list[str], int]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            frames = stack.split(";")
            if frames and frames[0].startswith(("thread (", "process ")):
                frames = [f for f in frames if not f.startswith(("thread (", "process "))]
            out.append((frames, int(count)))
    return out


def summarize_profile(path: Path, is_server: bool) -> dict[str, Any]:
    """Samples per category (moto: per part of moto), waits apart, the hottest leaf functions
    and the busiest threads of one process's profile."""
    cats: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    for frames, n in read_folded(path):
        cat = moto_part(frames) if is_server else categorize(frames)
        cats[cat] += n
        if cat != "w_wait":
            py = _python_frames(frames)
            leaf = frames[-1].split(" (")[0] if frames else "?"
            leaves[f"{leaf} <- {py[-1] if py else '?'}"] += n
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        stack, _, count = line.rpartition(" ")
        first = stack.split(";", 1)[0]
        if first.startswith("thread (") and count.isdigit():
            threads[first.split(": ", 1)[-1].rstrip("0123456789_-")] += int(count)
    busy = sum(n for c, n in cats.items() if c != "w_wait")
    if is_server:
        cats["a_moto"] = busy
    return {
        "samples": sum(n for c, n in cats.items() if c != "a_moto"),
        "busy_samples": busy,
        "wait_samples": cats.get("w_wait", 0),
        "categories": dict(cats),
        "top": leaves.most_common(15),
        "threads": threads.most_common(8),
    }


# --- the ranks ----------------------------------------------------------------------------------


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(POLL_S)


def _await_rank(path: Path, result: dict[str, Any]) -> Path:
    """The driver's wait for a rank's file; a rank's error, once the world reported one."""
    while not path.exists():
        if "error" in result:
            raise RuntimeError(result["error"])
        time.sleep(POLL_S)
    return path


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    import boto3
    import torch.distributed as dist
    from boto3.s3.transfer import TransferConfig

    import dckpt
    from dckpt.tiers.s3_store import S3Store
    from dckpt.tiers.url import parse_url

    ranks = h.Ranks(0.0)
    rank, world = ranks.rank, ranks.world_size
    ctl = Path(cfg["ctl"])
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)
    model, opt, _ = h.build_state(cfg["size"])
    state = dckpt.TrainState(model, opt)
    base = Path(cfg["base_dir"])
    bucket = cfg["bucket"]
    store = S3Store(parse_url(f"s3://{bucket}/x"))
    transfer = TransferConfig(
        multipart_threshold=store.part_bytes,
        multipart_chunksize=store.part_bytes,
        max_concurrency=store.concurrency,
    )
    client = boto3.client("s3")
    import logging

    logging.getLogger("dckpt").setLevel(logging.WARNING)
    with dckpt.CheckpointManager(
        dckpt.CheckpointConfig(
            root=f"s3://{bucket}/warm", mirror=base / "warm", async_save=False, lock=False
        ),
        state,
    ) as mgr:
        saved = mgr.save(1).result()
    share = ranks.gather(saved.bytes)[0] // world
    payload = os.urandom(share)
    ranks.prefault = int(share * h.PREFAULT_FACTOR)
    key = f"raw/{rank}"
    client.upload_fileobj(io.BytesIO(payload), bucket, f"{key}-get", Config=transfer)
    load_root = f"s3://{bucket}/load"
    with dckpt.CheckpointManager(
        dckpt.CheckpointConfig(
            root=load_root, mirror=base / f"prep-{rank}", async_save=False, lock=False
        ),
        state,
    ) as mgr:
        mgr.save(2).result()
    # warm the raw paths too (pools, imports), untimed
    client.download_fileobj(bucket, f"{key}-get", io.BytesIO(), Config=transfer)

    results: list[dict[str, Any]] = []
    for i, phase in enumerate(cfg["plan"]):
        with contextlib.ExitStack() as stack:
            after: Any = None
            if phase == "raw_put":
                fn: Any = functools.partial(
                    client.upload_fileobj, io.BytesIO(payload), bucket, key, Config=transfer
                )
            elif phase == "raw_get":
                fn = functools.partial(
                    client.download_fileobj, bucket, f"{key}-get", io.BytesIO(), Config=transfer
                )
            elif phase == "dckpt_save":
                mgr = stack.enter_context(
                    dckpt.CheckpointManager(
                        dckpt.CheckpointConfig(
                            root=f"s3://{bucket}/save-{i}",
                            mirror=base / f"save-{rank}",
                            async_save=False,
                            lock=False,
                        ),
                        state,
                    )
                )
                fn = lambda mgr=mgr: mgr.save(2).result()  # noqa: E731
            elif phase == "dckpt_load":
                fresh = base / f"load-{i}"
                mgr = stack.enter_context(
                    dckpt.CheckpointManager(
                        dckpt.CheckpointConfig(root=load_root, mirror=fresh, lock=False), state
                    )
                )
                fn = mgr.load
                after = fresh
            else:  # raw_get_dcp_load
                into = base / f"rawload-{i}"
                ranks.on_rank0(functools.partial(into.mkdir, parents=True, exist_ok=True))
                fn = functools.partial(
                    h.raw_get_then_dcp_load, client, bucket, "load", into, state, transfer
                )
                after = into
            ranks.prepare()
            _write(ctl / f"ready-{i}-{rank}", {"pid": os.getpid(), "phase": phase})
            _wait_for(ctl / f"go-{i}")
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            wall = time.perf_counter() - t0
            _write(ctl / f"done-{i}-{rank}", {"wall": wall})
            results.append({"phase": phase, "wall": wall})
        if after is not None:
            ranks.cleanup(after)
        _wait_for(ctl / f"next-{i}")
    return {"bytes": saved.bytes, "share": share, "results": results}


# --- the driver ---------------------------------------------------------------------------------


def _cpu(pid: int) -> float:
    try:
        t = __import__("psutil").Process(pid).cpu_times()
        return float(t.user + t.system)
    except Exception:
        return float("nan")


def _machine() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine so far (iowait counts as idle)."""
    t = __import__("psutil").cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    busy = sum(t) - idle - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return busy, idle


class Profiler:
    """py-spy attached to one pid, until ``stop``."""

    def __init__(self, exe: str, pid: int, out: Path, rate: int, native: bool) -> None:
        cmd = [
            exe,
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--threads",
            "--format",
            "raw",
            "--output",
            str(out),
        ]
        if native:
            cmd.append("--native")
        self.out = out
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )  # it says "Sampling" on stdout
        self.started = threading.Event()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if "Sampling process" in line:
                self.started.set()
        self.started.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def drive(
    args: argparse.Namespace,
    ctl: Path,
    plan: list[tuple[str, bool]],
    server: Any,
    prof_dir: Path,
    result: dict[str, Any],
) -> list[dict[str, Any]]:
    """For each measurement: wait until the ranks are ready, attach the profilers, take the
    CPU counters, let the ranks go, take the counters again when they are done."""
    import psutil

    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    records = []
    for i, (phase, profiled) in enumerate(plan):
        ready = []
        for r in range(args.world_size):
            path = _await_rank(ctl / f"ready-{i}-{r}", result)
            ready.append(json.loads(path.read_text())["pid"])
        procs = {"moto": server.pid, **{f"rank{r}": pid for r, pid in enumerate(ready)}}
        with contextlib.suppress(psutil.Error):  # a werkzeug child, if any
            for child in psutil.Process(server.pid).children(recursive=True):
                procs[f"moto-child-{child.pid}"] = child.pid
        spies: dict[str, Profiler] = {}
        if profiled:
            if spy is None:
                raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
            for name, pid in procs.items():
                spies[name] = Profiler(
                    spy, pid, prof_dir / f"{i:02d}-{phase}-{name}.txt", args.rate, args.native
                )
            for p in spies.values():
                p.started.wait(30)
            time.sleep(0.3)
        watched = {
            **procs,
            "driver": os.getpid(),
            **{f"py-spy:{n}": p.proc.pid for n, p in spies.items()},
        }
        before = {n: _cpu(pid) for n, pid in watched.items()}
        m0 = _machine()
        t0 = time.perf_counter()
        (ctl / f"go-{i}").touch()
        for r in range(args.world_size):
            _await_rank(ctl / f"done-{i}-{r}", result)
        window = time.perf_counter() - t0
        m1 = _machine()
        after = {n: _cpu(pid) for n, pid in watched.items()}
        for p in spies.values():
            p.stop()
        walls = [
            json.loads((ctl / f"done-{i}-{r}").read_text())["wall"] for r in range(args.world_size)
        ]
        (ctl / f"next-{i}").touch()
        cpu = {n: round(after[n] - before[n], 4) for n in watched}
        rec: dict[str, Any] = {
            "phase": phase,
            "profiled": profiled,
            "wall_s": round(max(walls), 4),
            "window_s": round(window, 4),
            "cpu_s": cpu,
            "machine_busy_s": round(m1[0] - m0[0], 4),
            "machine_idle_s": round(m1[1] - m0[1], 4),
        }
        if profiled:
            rec["profiles"] = {
                n: summarize_profile(p.out, is_server=n.startswith("moto"))
                for n, p in spies.items()
            }
            rec["profiler_log"] = {n: p.log[-3:] for n, p in spies.items()}
            rec["profile_files"] = {n: p.out.name for n, p in spies.items()}
        records.append(rec)
        print(
            f"  {phase:<17} {'profiled' if profiled else 'plain':<8} wall {rec['wall_s']:6.3f} s"
            f"  cpu: ranks {sum(v for k, v in cpu.items() if k.startswith('rank')):5.2f}"
            f" moto {sum(v for k, v in cpu.items() if k.startswith('moto')):5.2f}"
            f" machine busy {rec['machine_busy_s']:5.2f} idle {rec['machine_idle_s']:5.2f}",
            flush=True,
        )
    return records


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


QUIET = 0.15
"""The largest share of a run's core-seconds that other processes may take for the run to
count as quiet (see ``analyse``)."""


def _others(r: dict[str, Any]) -> float:
    """CPU seconds that processes other than ours took during a run."""
    watched = sum(float(v) for v in r["cpu_s"].values())  # ranks, moto, driver, py-spy
    return max(0.0, float(r["machine_busy_s"]) - watched)


def _client(r: dict[str, Any]) -> float:
    return sum(float(v) for k, v in r["cpu_s"].items() if k.startswith("rank"))


def _moto(r: dict[str, Any]) -> float:
    return sum(float(v) for k, v in r["cpu_s"].items() if k.startswith("moto"))


def analyse(records: list[dict[str, Any]], nbytes: int, cores: int) -> dict[str, Any]:
    """Per phase: median wall and CPU of the plain runs; the profiled run's CPU seconds by
    category (each process's share of its samples times its measured CPU seconds)."""
    gb = nbytes / h.GB
    out: dict[str, Any] = {}
    for phase in PHASES:
        every = [r for r in records if r["phase"] == phase and not r["profiled"]]
        # The box is shared: a run in which other processes took more than QUIET of its
        # core-seconds is left out of the medians when at least one quieter run exists.
        quiet = [r for r in every if _others(r) / (cores * r["window_s"]) <= QUIET]
        plain = quiet or every
        prof = [r for r in records if r["phase"] == phase and r["profiled"]]
        if not plain and not prof:
            continue
        entry: dict[str, Any] = {}
        if plain:

            def med(f: Any, rows: list[dict[str, Any]] = plain) -> float:
                return round(_median([f(r) for r in rows]), 4)

            entry["plain"] = {
                "runs": len(plain),
                "runs_left_out_as_noisy": len(every) - len(plain),
                "wall_s": med(lambda r: r["wall_s"]),
                "walls": [r["wall_s"] for r in plain],
                "client_cpu_s": med(_client),
                "moto_cpu_s": med(_moto),
                "other_processes_cpu_s": med(_others),
                "idle_core_s": med(lambda r: r["machine_idle_s"]),
                "client_cpu_s_per_gb": round(med(_client) / gb, 3),
                "moto_cpu_s_per_gb": round(med(_moto) / gb, 3),
                "client_share_of_cores": med(lambda r: _client(r) / (cores * r["window_s"])),
                "moto_share_of_cores": med(lambda r: _moto(r) / (cores * r["window_s"])),
            }
        if prof:
            r = prof[-1]
            cats: dict[str, float] = collections.defaultdict(float)
            waits: list[float] = []
            for name, p in r["profiles"].items():
                busy = p["busy_samples"]
                cpu = r["cpu_s"].get(name, 0.0)
                for cat, n in p["categories"].items():
                    if cat != "w_wait":
                        cats[cat] += cpu * n / busy if busy else 0.0
                waits.append(p["wait_samples"] / max(1, p["samples"]))
            spy_cpu = sum(v for k, v in r["cpu_s"].items() if k.startswith("py-spy"))
            entry["profiled"] = {
                "wall_s": r["wall_s"],
                "cpu_s_by_category": {k: round(cats.get(k, 0.0), 3) for k in CATEGORIES},
                "moto_cpu_s_by_part": {k: round(cats.get(k, 0.0), 3) for k in MOTO_PARTS},
                "wait_share_of_samples": {
                    n: round(w, 3) for n, w in zip(r["profiles"], waits, strict=True)
                },
                "client_cpu_s": round(
                    sum(v for k, v in r["cpu_s"].items() if k.startswith("rank")), 3
                ),
                "moto_cpu_s": round(
                    sum(v for k, v in r["cpu_s"].items() if k.startswith("moto")), 3
                ),
                "py_spy_cpu_s": round(spy_cpu, 3),
                "idle_core_s": r["machine_idle_s"],
                "rank_wait_s": round(
                    sum(r["wall_s"] - r["cpu_s"][k] for k in r["cpu_s"] if k.startswith("rank")), 3
                ),
            }
        out[phase] = entry
    ratios = {}
    for num, den, label in (
        ("dckpt_save", "raw_put", "save_vs_raw_put"),
        ("dckpt_load", "raw_get", "verified_load_vs_raw_get"),
        ("dckpt_load", "raw_get_dcp_load", "verified_load_vs_raw_get_dcp_load"),
    ):
        a, b = out.get(num, {}).get("plain"), out.get(den, {}).get("plain")
        if a and b:
            ratios[label] = {
                "measured_speed_ratio": round(b["wall_s"] / a["wall_s"], 3),
                "client_cpu_ratio": round(b["client_cpu_s"] / a["client_cpu_s"], 3),
                "all_our_cpu_ratio": round(
                    (b["client_cpu_s"] + b["moto_cpu_s"]) / (a["client_cpu_s"] + a["moto_cpu_s"]), 3
                ),
            }
    return {"phases": out, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=float, default=0.25, help="GB of state (default 0.25)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="unprofiled runs per operation")
    p.add_argument("--phases", default=",".join(DEFAULT_PHASES), help=f"of {','.join(PHASES)}")
    p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one more run of each operation under py-spy (default on)",
    )
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="py-spy --native (C frames: xxhash, memcpy, syscalls)",
    )
    p.add_argument("--pin", action="store_true", help="moto on CPU 1, the ranks on CPU 0")
    p.add_argument("--keep", default=None, help="keep the raw profiles in this directory")
    p.add_argument("--name", default="s3_profile", help="bench/results/<name>.json")
    p.add_argument(
        "--reanalyse",
        default=None,
        metavar="DIR",
        help="re-read the profiles kept in DIR (--keep) into bench/results/<name>.json"
        " with the current rules; runs nothing",
    )
    args = p.parse_args(argv)
    if args.reanalyse:
        out = h.RESULTS_DIR / f"{args.name}.json"
        doc = json.loads(out.read_text())
        for rec in doc["records"]:
            for n, f in rec.get("profile_files", {}).items():
                rec["profiles"][n] = summarize_profile(
                    Path(args.reanalyse) / f, n.startswith("moto")
                )
        doc.update(analyse(doc["records"], doc["bytes"], 2 if doc["pinned"] else doc["cpu_count"]))
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print_summary(doc)
        return 0
    phases = [x for x in args.phases.split(",") if x]
    if any(x not in PHASES for x in phases):
        p.error(f"--phases: choose from {PHASES}")
    cores = os.cpu_count() or 1
    if args.pin and cores < 2:
        p.error("--pin needs 2 CPUs")
    # interleaved: each round runs every phase once (rotated), the profiled runs last
    plan: list[tuple[str, bool]] = []
    for rnd in range(args.repeats):
        plan += [(x, False) for x in h.round_order(phases, rnd)]
    if args.profile:
        plan += [(x, True) for x in phases]

    server, endpoint = h.start_moto(args.pin)
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    ctl = Path(tempfile.mkdtemp(prefix="dckpt-s3prof-ctl-"))
    prof_dir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dckpt-s3prof-"))
    prof_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        import boto3

        bucket = f"dckpt-prof-{uuid.uuid4().hex[:12]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        with h.bench_run(None) as run:
            cfg = {
                "size": args.size,
                "base_dir": run.base_dir,
                "bucket": bucket,
                "ctl": str(ctl),
                "plan": [x for x, _ in plan],
            }
            result: dict[str, Any] = {}

            def ranks() -> None:
                if args.pin:
                    os.sched_setaffinity(0, {0})  # inherited by the ranks spawned here
                try:
                    result["value"] = h.spawn(args.world_size, 1, _rank_main, cfg)
                except BaseException as exc:
                    result["error"] = f"{type(exc).__name__}: {exc}"

            thread = threading.Thread(target=ranks)
            thread.start()
            pinned = " on CPU 1, ranks on CPU 0" if args.pin else ""
            print(f"moto at {endpoint} (pid {server.pid}){pinned}", flush=True)
            try:
                records = drive(args, ctl, plan, server, prof_dir, result)
            finally:
                thread.join()
            if "error" in result:
                raise RuntimeError(result["error"])
        raw = result["value"]
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(ctl, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(prof_dir, ignore_errors=True)
    doc = {
        **h.host_info(1),
        "name": args.name,
        "date": h.now_iso(),
        "command": h.command_line(),
        "dckpt_revision": h.source_revision(),
        "pinned": args.pin,
        "py_spy": {"rate": args.rate, "native": args.native} if args.profile else None,
        "bytes": raw["bytes"],
        "share_bytes": raw["share"],
        "world_size": args.world_size,
        "total_wall_s": round(time.perf_counter() - t_start, 1),
        "records": records,
        **analyse(records, raw["bytes"], 2 if args.pin else cores),
    }
    out = h.RESULTS_DIR / f"{args.name}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print_summary(doc)
    print(f"wrote {out}" + (f"; profiles in {prof_dir}" if args.keep else ""))
    return 0


def print_summary(doc: dict[str, Any]) -> None:
    ph = doc["phases"]
    print(f"\n{doc['bytes'] / 1e9:.3f} GB, {doc['world_size']} ranks, pinned={doc['pinned']}")
    print(f"{'phase':<17}{'wall s':>8}{'client cpu':>11}{'moto cpu':>9}{'other':>7}{'idle':>7}")
    for name, e in ph.items():
        if "plain" in e:
            q = e["plain"]
            print(
                f"{name:<17}{q['wall_s']:>8.3f}{q['client_cpu_s']:>11.2f}{q['moto_cpu_s']:>9.2f}"
                f"{q['other_processes_cpu_s']:>7.2f}{q['idle_core_s']:>7.2f}"
            )
    for label, r in doc["ratios"].items():
        print(
            f"{label}: measured {r['measured_speed_ratio']:.2f}x, client-CPU "
            f"{r['client_cpu_ratio']:.2f}x, client+moto CPU {r['all_our_cpu_ratio']:.2f}x"
        )
    cols = [n for n, e in ph.items() if "profiled" in e]
    if cols:
        head = "".join(f"{c:>17}" for c in cols)
        print(f"\n{'CPU seconds by category (profiled run)':<62}{head}")
        for cat, label in CATEGORIES.items():
            vals = [ph[c]["profiled"]["cpu_s_by_category"][cat] for c in cols]
            print(f"{label[:62]:<62}" + "".join(f"{v:>17.3f}" for v in vals))
        for cat, label in MOTO_PARTS.items():
            vals = [ph[c]["profiled"]["moto_cpu_s_by_part"][cat] for c in cols]
            print(f"  {label[:60]:<60}" + "".join(f"{v:>17.3f}" for v in vals))
        for key in ("client_cpu_s", "moto_cpu_s", "py_spy_cpu_s", "idle_core_s", "wall_s"):
            print(f"{key:<62}" + "".join(f"{ph[c]['profiled'][key]:>17.3f}" for c in cols))


if __name__ == "__main__":
    sys.exit(main())
