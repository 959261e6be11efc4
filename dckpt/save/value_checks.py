"""The checks a save makes of its values: one rank's replica digests and non-finite values.

Role: gathers, for one save on one rank, what ``dckpt.save.findings`` judges. The caller
(the stager, the memory route) decides *when* each check runs, so that it always sees the
state of ``save()`` time:

- a tensor on a GPU is checked on its device, with kernels queued on the training stream
  inside ``save()`` (``device``): ordered before anything the loop does next, so they read
  the ``save()``-time values, and the host never waits for them there; their few bytes of
  results are read in the background (``findings``), after the stager waited for the copies
  queued with them. Replicas get a fingerprint (two wrapping 64-bit integer sums of the
  tensor's 32-bit words, one of them position-weighted: integer sums are exact, so every
  rank and every reduction order gives the same value); finiteness is ``aminmax`` (NaN
  propagates through it, and an infinity is its own minimum or maximum).
- a host tensor is checked on its staged copy in the background, or, when this rank does not
  stage it (DCP has another rank write it), on the live tensor inside ``save()``
  (``host``): xxh3-64 of its bytes (15 GB/s on one core here), ``aminmax`` for finiteness,
  and an exact count of NaN and Inf only when that finds one.
- a non-tensor value: xxh3-64 of its pickle, inside ``save()`` (``value``).

Every replica digest covers the dtype and shape too, and says how it was made (``x:`` on
the host, ``g:`` on a GPU): only digests made the same way are compared. Invariant: nothing
here changes a tensor, and nothing reads a GPU tensor outside the stream order it was
queued in.
"""

from __future__ import annotations

import logging
import math
import pickle
from typing import Any

import torch
import xxhash

from .findings import Findings

__all__ = ["Inspection", "host_digest", "value_digest"]

log = logging.getLogger("dckpt")

_CHUNK = 1 << 24
"""32-bit words per fingerprint kernel: bounds the int64 temporaries (128 MiB) on the GPU."""
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # the golden-ratio constant, as a signed int64
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if not flat.numel():
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy().data)


def _shape(t: torch.Tensor) -> bytes:
    return f"{t.dtype}{list(t.shape)}".encode()


def host_digest(t: torch.Tensor) -> str:
    """``x:<hex>``: xxh3-64 of a host tensor's dtype, shape and bytes."""
    hasher = xxhash.xxh3_64(_shape(t))
    hasher.update(_bytes_of(t))
    return f"x:{hasher.hexdigest()}"


def value_digest(value: Any) -> str | None:
    """``x:<hex>``: xxh3-64 of a non-tensor value's pickle; None if it cannot be pickled
    (DCP will say so when it saves it)."""
    try:
        blob = pickle.dumps(value, protocol=4)
    except Exception:
        return None
    return f"x:{xxhash.xxh3_64_hexdigest(blob)}"


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums (plain, position-weighted) of ``t``'s 32-bit words, on its device,
    queued on the current stream. Integer addition wraps exactly: any order gives one value."""
    flat = t.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    words = raw
    if raw.numel() % 4 == 0:
        try:  # a view whose byte offset is not a multiple of 4 is summed byte by byte
            words = raw.view(torch.int32)
        except RuntimeError:
            words = raw
    acc = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + chunk.numel(), device=t.device)
        acc[0] += chunk.sum()
        acc[1] += (chunk * (weights * _MIX)).sum()
    return acc


def _range(t: torch.Tensor) -> torch.Tensor:
    """min and max of a floating tensor, as float64, queued on the current stream."""
    lo, hi = torch.aminmax(t.detach())
    return torch.stack([lo.to(torch.float64), hi.to(torch.float64)])


def _finite(pair: tuple[float, float]) -> bool:
    return math.isfinite(pair[0]) and math.isfinite(pair[1])


class Inspection:
    """One save's checks on one rank; see the module docstring."""

    def __init__(self, *, replicas: bool, finite: bool) -> None:
        self.replicas = replicas
        self.finite = finite
        self._digests: dict[str, str] = {}
        self._nonfinite: dict[str, str] = {}
        self._device_prints: dict[str, tuple[bytes, torch.Tensor]] = {}
        self._device_ranges: dict[str, torch.Tensor] = {}
        self.unchecked: list[str] = []
        """Tensors of a kind the checks cannot read (sparse, quantized): saved unchecked."""

    @property
    def active(self) -> bool:
        return self.replicas or self.finite

    def value(self, name: str, value: Any) -> None:
        """A non-tensor value, as DCP would pickle it (a replica if another rank has it)."""
        if self.replicas:
            digest = value_digest(value)
            if digest is not None:
                self._digests[name] = digest

    def host(self, name: str, t: torch.Tensor, *, replica: bool, finite: bool) -> None:
        """Check a host tensor now (its staged copy, or the live tensor inside ``save()``)."""
        try:
            self._host(name, t, replica=replica, finite=finite)
        except Exception as exc:  # a tensor kind the checks cannot read: saved unchecked
            self._unchecked(name, exc)

    def device(self, name: str, t: torch.Tensor, *, replica: bool, finite: bool) -> None:
        """Queue the checks of a GPU tensor on the current (training) stream."""
        try:
            self._device(name, t, replica=replica, finite=finite)
        except Exception as exc:
            self._unchecked(name, exc)

    def _unchecked(self, name: str, exc: Exception) -> None:
        if not self.unchecked:
            log.debug("dckpt: %s cannot be checked (%r); it is saved unchecked", name, exc)
        self.unchecked.append(name)

    def _host(self, name: str, t: torch.Tensor, *, replica: bool, finite: bool) -> None:
        if replica and self.replicas:
            self._digests[name] = host_digest(t)
        if finite and self.finite and t.dtype in _FLOATS and t.numel():
            lo, hi = _range(t).tolist()
            if not _finite((lo, hi)):
                nan = int(torch.isnan(t).sum())
                inf = int(torch.isinf(t).sum())
                self._nonfinite[name] = f"{nan} NaN, {inf} Inf of {t.numel()} values"

    def _device(self, name: str, t: torch.Tensor, *, replica: bool, finite: bool) -> None:
        if replica and self.replicas:
            self._device_prints[name] = (_shape(t), _fingerprint(t))
        if finite and self.finite and t.dtype in _FLOATS and t.numel():
            self._device_ranges[name] = _range(t)

    def findings(self, written: set[str] | None = None) -> Findings:
        """What was found; GPU results are read here (their kernels were queued before the
        copies this rank waited for). ``written``: the tensors this rank wrote (only theirs
        count as non-finite); None: all."""
        digests = dict(self._digests)
        for name, (shape, sums) in self._device_prints.items():
            a, b = sums.tolist()
            hasher = xxhash.xxh3_64(shape)
            hasher.update(a.to_bytes(8, "little", signed=True))
            hasher.update(b.to_bytes(8, "little", signed=True))
            digests[name] = f"g:{hasher.hexdigest()}"
        nonfinite = dict(self._nonfinite)
        for name, pair in self._device_ranges.items():
            lo, hi = pair.tolist()
            if not _finite((lo, hi)):
                nonfinite[name] = f"NaN or Inf (min {lo}, max {hi}, read on its GPU)"
        if written is not None:
            nonfinite = {k: v for k, v in nonfinite.items() if k in written}
        return Findings(replicas=digests, nonfinite=nonfinite)
