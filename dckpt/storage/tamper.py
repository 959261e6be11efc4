"""A staging copy falsified on purpose, for the fault hook's ``stale``, ``torn`` and ``skip``.

Role: the capture check (dckpt.save.capture) exists for copies that go wrong silently: a
buffer reused without being refreshed, a buffer changed after its copy, a copy cut short.
The fault hook (dckpt.faults.tampering) names such a copy; the code that takes it calls
``tampered_copy`` instead of ``copy_``, and the save must then refuse to commit. Nothing here
runs unless a ``DCKPT_FAULT`` spec asks for it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["pick", "staged_copy", "tampered_copy"]


def pick(item: str, sizes: Iterable[tuple[str, int]]) -> str:
    """The tensor a tamper hits: ``item`` if named, else the largest of (name, bytes)."""
    if item:
        return item
    return max(sizes, key=lambda kv: kv[1], default=("", 0))[0]


def staged_copy(
    dst: torch.Tensor, src: torch.Tensor, bad: str | None = None, *, non_blocking: bool = False
) -> None:
    """A staging copy: ``dst.copy_(src)``, or, where the fault hook names this copy
    (``bad``), the copy falsified as ``tampered_copy`` says."""
    if bad is None:
        dst.copy_(src, non_blocking=non_blocking)
    else:
        tampered_copy(dst, src, bad)


def tampered_copy(dst: torch.Tensor, src: torch.Tensor, action: str) -> None:
    """Copy ``src`` into ``dst`` as ``action`` says: ``stale``, not at all; ``skip``, only
    the first half of its elements; ``torn``, whole and then one bit of ``dst`` flipped."""
    if action == "stale" or dst.numel() == 0:
        return
    if action == "skip":
        half = max(1, dst.numel() // 2)
        dst.view(-1)[:half].copy_(src.reshape(-1)[:half])
        return
    dst.copy_(src)
    first = dst.view(-1)[:1].view(torch.uint8)  # on its device: queued after the copy
    first.bitwise_xor_(1)
