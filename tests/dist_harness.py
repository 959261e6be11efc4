"""Spawn real ranks on gloo from pytest and collect what each returned or raised.

``run_world(fn, world_size, *args)`` starts ``world_size`` fresh processes (from a fork server,
so no state leaks from pytest), initialises a gloo process group through a FileStore, runs
``fn(rank, world_size, *args)`` in each and returns the per-rank results. A rank that raises
fails the test with every rank's traceback; a world that does not finish in ``timeout`` seconds
is killed and fails the test. ``expect_failure=True`` returns exceptions instead of raising;
``backend`` is the training group's (``gloo``, or a per-device form such as ``cpu:gloo``).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

# A fork server that imported torch once: each rank forks from it, clean (no pytest state, no
# threads) and in a fraction of a second, where a spawned interpreter spends seconds importing
# torch. DCKPT_TEST_SPAWN=1 goes back to plain spawn.
#
# It also imports what ranks otherwise import on first use, each rank of each world again: DDP's
# constructor imports torch._dynamo (about 3 s of CPU), and FSDP2, DCP and dckpt's save and resume
# modules add about 1 s more. Importing them here creates no thread (checked: the server still
# has the threads `import torch` leaves), so forking from it stays as clean as before.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "dckpt",
    "fault_kit",
    "torch._dynamo",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "dckpt.manager",
    "dckpt.load.resumer",
    "dckpt.load.offline",
]
if os.environ.get("DCKPT_TEST_SPAWN") == "1":
    _CTX = mp.get_context("spawn")
else:
    _CTX = mp.get_context("forkserver")
    _CTX.set_forkserver_preload(_PRELOAD)


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    out: Any,
    args: tuple[Any, ...],
    env: dict[str, str],
    backend: str,
) -> None:
    # The caller's environment as it is now, whole: the forkserver's own is that of the test
    # that started it (a variable one test set, such as DCKPT_RUN_ID, reached later tests).
    os.environ.clear()
    os.environ.update(env)
    os.environ["RANK"] = str(rank)  # as torchrun sets it (the fault hook reads it)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        result = fn(rank, world_size, *args)
        # Plain pickle bytes: a Queue would send tensors as shared-memory handles, which die
        # with this process before the parent reads them.
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    expect_failure: bool = False,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; see the module docstring."""
    store_dir = tempfile.mkdtemp(prefix="dckpt-store-")
    store_path = os.path.join(store_dir, "store")
    out = _CTX.Queue()
    environ = {**os.environ, **(env or {})}  # the test's environment now, and what it adds
    procs = [
        _CTX.Process(
            target=_entry,
            args=(fn, rank, world_size, store_path, out, args, environ, backend),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                # A short poll: when a rank was killed, the loop ends this soon after the last
                # rank did (a rank that was killed never answers, so the wait was all waste).
                rank, status, value = out.get(timeout=min(remaining, 0.05))
                results[rank] = (status, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and all(not p.is_alive() for p in procs):
                    # What a rank put just before it ended is in the pipe by now (a process
                    # flushes its queue before it exits): take it rather than call it lost.
                    while True:
                        try:
                            rank, status, value = out.get_nowait()
                        except queue.Empty:
                            break
                        results[rank] = (status, value)
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        # Every rank is gone: its store file is no one's (a leftover directory per world
        # had filled /tmp with thousands of them).
        shutil.rmtree(store_dir, ignore_errors=True)
    missing = [r for r in range(world_size) if r not in results]
    for r in missing:
        results[r] = ("error", f"rank {r} produced no result (exit code {procs[r].exitcode})")
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors and not expect_failure:
        text = "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(errors.items()))
        raise AssertionError(f"{len(errors)} of {world_size} ranks failed:\n{text}")
    return [
        pickle.loads(results[r][1]) if results[r][0] == "ok" else results[r][1]
        for r in range(world_size)
    ]
