"""Capture and restore every random number generator a training rank uses.

Python's ``random``, NumPy's global generator, torch's CPU generator and the generator of the
rank's current CUDA device, per rank, as tensors (so DCP stores them as tensors, never as
pickles). Restoring RNG is the last step of a resume, so nothing in the resume itself consumes
random numbers after it.

When the world size changed, a rank's generator state has no meaning on another rank count:
``reseed`` derives a fresh, deterministic state from (seed, step, rank) instead, and the
resume report says so.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import xxhash

__all__ = ["capture", "reseed", "restore"]


def capture() -> dict[str, Any]:
    """This process's generator states, as tensors and plain numbers."""
    version, mt, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    _name, keys, pos, has_gauss, cached = np_state
    state: dict[str, Any] = {
        "python": torch.tensor(mt, dtype=torch.int64),
        "python_version": int(version),
        "python_gauss": -1.0 if gauss is None else float(gauss),
        "python_has_gauss": gauss is not None,
        "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_gauss": float(cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's device only: the number of visible devices may change across restarts.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what ``capture`` took (CUDA only where this process has the same devices)."""
    gauss = float(state["python_gauss"]) if state["python_has_gauss"] else None
    mt = tuple(int(x) for x in state["python"].tolist())
    random.setstate((int(state["python_version"]), mt, gauss))
    keys = state["numpy"].numpy().astype(np.uint32)
    np.random.set_state(
        (
            "MT19937",
            keys,
            int(state["numpy_pos"]),
            int(state["numpy_has_gauss"]),
            float(state["numpy_gauss"]),
        )
    )
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8).cpu())


def reseed(seed: int, step: int, rank: int) -> int:
    """Seed every generator from (seed, step, rank), deterministically; returns the seed used."""
    derived = xxhash.xxh3_64_intdigest(f"dckpt-reseed:{seed}:{step}:{rank}".encode()) % (2**31)
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)  # also seeds every CUDA device
    return derived
