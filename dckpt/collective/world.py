"""Forming the training world and checking that it answers: init and the warmup collective.

``init_distributed`` starts the training process group with a bounded timeout (NCCL when the
process has a CUDA device and gloo otherwise, or the backend asked for, ``cpu:gloo,cuda:nccl``
included), or keeps the group the script already made; the device follows the group's backend
for CUDA. ``warmup_collective`` is the last step of a resume: an all-reduce of a known value on
the *training* group (the NCCL path when training runs on NCCL), whose result and latency are
checked. A rank that does not join within the timeout is named, from markers in the job's
store, on every rank that waited for it; the markers are sealed (``dckpt.collective.sealed``),
so one planted by a writer outside the job never hides the rank that did not join.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import WorldError
from ..faults import fault_point
from ..phases import Phase
from ..units import plural
from . import sealed
from .store import default_store

__all__ = [
    "WarmupResult",
    "backends_by_device",
    "check_warmup",
    "init_distributed",
    "training_device",
    "warmup_collective",
]


def backends_by_device(backend: str) -> dict[str, str]:
    """``'cpu:gloo,cuda:nccl'`` → ``{'cpu': 'gloo', 'cuda': 'nccl'}``; a bare name (``'nccl'``,
    ``'gloo'``) serves the devices that backend supports."""
    if ":" not in backend:
        name = backend.strip().lower()
        return {"cuda": name} if name == "nccl" else {"cpu": name, "cuda": name}
    pairs = (part.split(":", 1) for part in backend.split(",") if part.strip())
    return {dev.strip().lower(): name.strip().lower() for dev, name in pairs}


def training_device(backend: str, *, cuda_available: bool, local_rank: int) -> torch.device:
    """The device a group with ``backend`` trains on: this rank's GPU when the group has a GPU
    backend for CUDA (NCCL, alone or beside gloo as ``cpu:gloo,cuda:nccl``), else the CPU."""
    cuda_backend = backends_by_device(backend).get("cuda")
    if cuda_available and cuda_backend is not None and cuda_backend != "gloo":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _group_device(local_rank: int) -> torch.device:
    try:
        backend = str(dist.get_backend_config())
    except (RuntimeError, ValueError, AttributeError):  # an older torch: the plain name
        backend = str(dist.get_backend())
    return training_device(backend, cuda_available=torch.cuda.is_available(), local_rank=local_rank)


def init_distributed(
    timeout_s: float = 300.0, backend: str | None = None
) -> tuple[int, int, torch.device]:
    """Join the job's process group (from torchrun's environment); returns rank, world, device.

    ``backend`` defaults to ``nccl`` with CUDA and ``gloo`` without; ``cpu:gloo,cuda:nccl``
    also works (DCP's own ``async_save`` asks for a CPU backend). A group the script made
    before is kept as it is. The device is this rank's GPU (``LOCAL_RANK``) whenever the
    group has a GPU backend for CUDA, and is made current.
    """
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as exc:
            raise WorldError(
                f"could not form the process group ({backend}) within {timeout_s:.0f} s: {exc}. "
                "Check that every node was started with the same rendezvous settings."
            ) from exc
    device = _group_device(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


@dataclass(frozen=True)
class WarmupResult:
    """What one rank's warmup all-reduce returned, against what it must return."""

    rank: int
    value: float
    expected: float
    latency_s: float

    @property
    def ok(self) -> bool:
        return self.value == self.expected


def warmup_collective(nonce: str, timeout_s: float) -> WarmupResult:
    """All-reduce (rank + 1) over the training group; return the sum this rank got and the
    latency. The caller compares every rank's result (``check_warmup``): a backend broken on
    one host returns a wrong sum there and a right one elsewhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    broken = fault_point(Phase.WARMUP, rank)  # True: act as a backend that sums wrong here
    store = default_store()
    key = f"{nonce}/warmup"
    if store is not None:
        with contextlib.suppress(Exception):  # a hint: names who did not join, if it fails
            sealed.put(store, f"{key}/{rank}", "1")
    device = _group_device(0)
    if device.type == "cuda":  # the GPU this rank trains on, as init_distributed set it
        device = torch.device("cuda", torch.cuda.current_device())
    value = torch.tensor([float(rank + 1)], device=device)
    t0 = time.perf_counter()
    try:
        work = dist.all_reduce(value, async_op=True)
        assert work is not None
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except RuntimeError as exc:
        missing: list[int] = []
        if store is not None:
            with contextlib.suppress(Exception):
                joined = sealed.get_many(store, [f"{key}/{r}" for r in range(world)])
                missing = [r for r, mark in enumerate(joined) if mark != "1"]
        who = f"rank(s) {', '.join(map(str, missing))}" if missing else "a rank"
        raise WorldError(
            f"warmup all-reduce failed after {time.perf_counter() - t0:.1f} s: {who} did not "
            f"join (seen from rank {rank}): {exc}. The job cannot train; restart it, and check "
            "that host's health."
        ) from exc
    latency = time.perf_counter() - t0
    got = float(value.item()) + (1.0 if broken else 0.0)
    return WarmupResult(rank=rank, value=got, expected=world * (world + 1) / 2, latency_s=latency)


def check_warmup(results: list[WarmupResult]) -> str:
    """Every rank's warmup result, as the report line; WorldError naming each rank whose sum
    was wrong (raised on every rank, since every rank checks every result)."""
    wrong = [r for r in results if not r.ok]
    if wrong:
        raise WorldError(
            "; ".join(
                f"warmup all-reduce returned {r.value} instead of {r.expected} on rank {r.rank}"
                for r in wrong
            )
            + ": the collective backend is broken on that host. The job must not train on it;"
            " restart it without that host."
        )
    slowest = max(r.latency_s for r in results)
    first = results[0]
    return (
        f"{plural(len(results), 'rank')} answered, sum {first.value:g} = {first.expected:g} "
        f"on every rank, slowest {slowest * 1000:.1f} ms"
    )
