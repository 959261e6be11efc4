"""The checks a save makes of its values: one rank's replica digests and non-finite values.

Role: gathers, for one save on one rank, what ``dckpt.save.findings`` judges. The caller
(the stager, the memory route) decides *when* each check runs, so that it always sees the
state of ``save()`` time:

- a tensor on a GPU is checked on its device, with kernels queued on the training stream
  inside ``save()`` (``device``): ordered before anything the loop does next, so they read
  the ``save()``-time values, and the host never waits for them there. An event recorded
  behind them is waited for before their few bytes of results are read, in the background
  (``findings``). Replicas get a fingerprint (two wrapping 64-bit integer sums of the
  tensor's 32-bit words, one of them position-weighted: integer sums are exact, so every
  rank, every reduction order and the host give the same value); finiteness is ``aminmax``
  (NaN propagates through it, and an infinity is its own minimum or maximum).
- a host tensor is checked on its staged copy in the background, or, when this rank does not
  stage it (DCP has another rank write it), on the live tensor inside ``save()``
  (``host``): xxh3-64 of its bytes (10-15 GB/s on one core here), ``aminmax`` for
  finiteness, and an exact count of NaN and Inf only when that finds one.
- a non-tensor value: xxh3-64 of a canonical encoding, inside ``save()`` (``value``): not
  its pickle, which differs between equal values (a tensor's storage identity, a set's hash
  order, strings shared or not).

What is a replica (``replica_key``): a plain tensor, by its name (DCP keeps one copy of a
name every rank holds), and a DTensor shard with a ``Replicate`` placement, by its name and
its coordinates on the other mesh dimensions (DCP keeps one copy of each shard; under HSDP
the replica groups hold one each). A DTensor shard that is only sharded, a ``Partial`` one,
and a ``PerRank`` value (its name is the rank's own) have no other copy.

Every replica digest covers the dtype and shape too, and says how it was made (``x:`` on
the host, ``g:`` on a GPU): only digests made the same way are compared. A tensor the checks
cannot read (sparse, quantized; a GPU that has no memory left for the fingerprint) is saved
unchecked and named in the findings. Invariant: nothing here changes a tensor, and nothing
reads a GPU tensor outside the stream order it was queued in.
"""

from __future__ import annotations

import enum
import logging
import math
import pickle
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor

from .findings import Findings

__all__ = ["Inspection", "host_digest", "replica_key", "value_digest"]

log = logging.getLogger("dckpt")

_CHUNK = 1 << 22
"""32-bit words per fingerprint kernel: bounds its int64 temporaries (three of 32 MiB) on a GPU."""
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # the golden-ratio constant, as a signed int64
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT8 = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
_DEPTH = 64
"""Nesting a non-tensor value may have before its digest gives up (it is saved unchecked)."""


def replica_key(fqn: str, value: torch.Tensor) -> str | None:
    """The name under which ranks' copies of ``value`` are compared, or None when no other
    rank holds a copy DCP would drop (see the module docstring)."""
    if not isinstance(value, DTensor):
        return fqn
    placements = value.placements
    if not any(p.is_replicate() for p in placements) or any(p.is_partial() for p in placements):
        return None
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    shard = [c for c, p in zip(coordinate, placements, strict=True) if not p.is_replicate()]
    return f"{fqn} [shard {tuple(shard)}]" if shard else fqn


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


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


def _encode(value: Any, out: Any, depth: int) -> None:
    """Feed ``out`` a canonical encoding of ``value``: equal values, equal bytes."""
    if depth > _DEPTH:
        raise ValueError("nested too deeply")
    kind = type(value)
    if isinstance(value, torch.Tensor):
        local = _local(value).detach()
        out.update(b"T" + _shape(local))
        out.update(_bytes_of(local.cpu()))
    elif value is None or kind in (bool, int, float, complex, str):
        text = repr(value).encode()
        out.update(f"{kind.__name__}:{len(text)}:".encode() + text)
    elif isinstance(value, (bytes, bytearray)):
        out.update(f"bytes:{len(value)}:".encode())
        out.update(value)
    elif isinstance(value, (list, tuple)):
        out.update(f"{kind.__qualname__}[{len(value)}".encode())
        for item in value:
            _encode(item, out, depth + 1)
    elif isinstance(value, dict):
        out.update(f"{kind.__qualname__}{{{len(value)}".encode())
        for key, item in sorted(value.items(), key=lambda kv: _digest_of(kv[0], depth + 1)):
            _encode(key, out, depth + 1)
            _encode(item, out, depth + 1)
    elif isinstance(value, (set, frozenset)):
        out.update(f"{kind.__qualname__}({len(value)}".encode())
        for digest in sorted(_digest_of(item, depth + 1) for item in value):
            out.update(digest.encode())
    elif isinstance(value, enum.Enum):
        out.update(f"enum:{kind.__module__}.{kind.__qualname__}.{value.name}".encode())
    elif isinstance(value, type):
        out.update(f"type:{value.__module__}.{value.__qualname__}".encode())
    elif isinstance(getattr(value, "__dict__", None), dict):  # an object: its type, its fields
        out.update(f"object:{kind.__module__}.{kind.__qualname__}".encode())
        _encode(vars(value), out, depth + 1)
    else:  # no structure to walk (a slotted object, an enum): its pickle stands for it
        out.update(pickle.dumps(value, protocol=4))


def _digest_of(value: Any, depth: int) -> str:
    hasher = xxhash.xxh3_64()
    _encode(value, hasher, depth)
    return hasher.hexdigest()


def value_digest(value: Any) -> str | None:
    """``x:<hex>``: xxh3-64 of a non-tensor value's canonical encoding; None when it cannot
    be encoded (DCP will say so when it pickles it, if it cannot either)."""
    try:
        return f"x:{_digest_of(value, 0)}"
    except Exception:
        return None


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums (plain, position-weighted) of ``t``'s 32-bit words, on its device,
    queued on the current stream. Integer addition wraps exactly: any order gives one value.
    A view at a byte offset that is not a multiple of 4 is copied first, so that two copies
    of one value at different offsets give one fingerprint."""
    flat = t.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    words = raw
    if raw.numel() % 4 == 0:
        if raw.storage_offset() % 4:
            raw = raw.clone()
        words = raw.view(torch.int32)
    acc = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + chunk.numel(), device=t.device)
        acc[0] += chunk.sum()
        acc[1] += (chunk * weights.mul_(_MIX)).sum()
    return acc


def _floats(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as something ``aminmax`` takes, or None when it holds no floating values."""
    if t.dtype in _FLOATS:
        return t
    if t.dtype in _FLOAT8:
        return t.to(torch.bfloat16)  # every float8 value, NaN and Inf included, is a bf16
    if t.is_complex():
        return torch.view_as_real(t)
    return None


def _range(t: torch.Tensor) -> torch.Tensor:
    """min and max of a floating tensor, as float64, queued on the current stream."""
    lo, hi = torch.aminmax(t.detach())
    return torch.stack([lo.to(torch.float64), hi.to(torch.float64)])


def _finite(pair: tuple[float, float]) -> bool:
    return math.isfinite(pair[0]) and math.isfinite(pair[1])


class Inspection:
    """One save's checks on one rank; see the module docstring."""

    def __init__(self, *, replicas: bool, finite: bool, sample: tuple[int, int] = (0, 1)) -> None:
        self.replicas = replicas
        self.finite = finite
        self.sample = sample
        """(this save's index, k): a replicated tensor is compared in one save of every k,
        the same one on every rank (its key's hash mod k); k = 1: in every save."""
        self._digests: dict[str, str] = {}
        self._nonfinite: dict[str, str] = {}
        self._device_prints: dict[str, tuple[bytes, torch.Tensor]] = {}
        self._device_ranges: dict[str, torch.Tensor] = {}
        self._queued: dict[torch.device, Any] = {}
        """Per GPU: an event behind the last kernels queued here (waited for by findings)."""
        self.unchecked: list[str] = []
        """Tensors the checks could not read: saved unchecked, named in the findings."""

    @property
    def active(self) -> bool:
        return self.replicas or self.finite

    def value(self, name: str, value: Any) -> None:
        """A non-tensor value, as DCP would pickle it (a replica if another rank has it)."""
        if self.replicas:
            digest = value_digest(value)
            if digest is not None:
                self._digests[name] = digest

    def host(self, name: str, t: torch.Tensor, *, replica: str | None, finite: bool) -> None:
        """Check a host tensor now (its staged copy, or the live tensor inside ``save()``);
        ``replica``: its replica key (None: not compared)."""
        try:
            self._host(name, t, replica=replica, finite=finite)
        except Exception as exc:  # a tensor kind the checks cannot read: saved unchecked
            self._unchecked(name, exc)

    def device(self, name: str, t: torch.Tensor, *, replica: str | None, finite: bool) -> None:
        """Queue the checks of a GPU tensor on the current (training) stream."""
        try:
            self._device(name, t, replica=replica, finite=finite)
        except Exception as exc:  # torch.cuda.OutOfMemoryError included: saved unchecked
            self._unchecked(name, exc)

    def _unchecked(self, name: str, exc: Exception) -> None:
        log.debug("dckpt: %s cannot be checked (%r); it is saved unchecked", name, exc)
        self.unchecked.append(name)

    def _sampled(self, replica: str | None) -> bool:
        index, k = self.sample
        if replica is None or not self.replicas:
            return False
        return k == 1 or xxhash.xxh3_64_intdigest(replica.encode()) % k == index % k

    def _host(self, name: str, t: torch.Tensor, *, replica: str | None, finite: bool) -> None:
        if self._sampled(replica):
            assert replica is not None
            self._digests[replica] = host_digest(t)
        floats = _floats(t) if finite and self.finite and t.numel() else None
        if floats is not None:
            lo, hi = _range(floats).tolist()
            if not _finite((lo, hi)):
                # counted on the widened copy for float8 (torch has no isinf for most float8
                # kinds: counting on ``t`` raised, and the NaN went unrefused as "unchecked")
                counted = floats if t.dtype in _FLOAT8 else t
                nan = int(torch.isnan(counted).sum())
                inf = int(torch.isinf(counted).sum())
                self._nonfinite[name] = f"{nan} NaN, {inf} Inf of {t.numel()} values"

    def _device(self, name: str, t: torch.Tensor, *, replica: str | None, finite: bool) -> None:
        queued = False
        if self._sampled(replica):
            assert replica is not None
            self._device_prints[replica] = (_shape(t), _fingerprint(t))
            queued = True
        floats = _floats(t) if finite and self.finite and t.numel() else None
        if floats is not None:
            self._device_ranges[name] = _range(floats)
            queued = True
        if queued:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            self._queued[t.device] = event

    def findings(self, written: set[str] | None = None) -> Findings:
        """What was found; GPU results are read once the kernels queued for them finished.
        ``written``: the tensors this rank wrote (only theirs count as non-finite); None:
        all that were checked."""
        for event in self._queued.values():
            event.synchronize()
        digests = dict(self._digests)
        for key, (shape, sums) in self._device_prints.items():
            a, b = sums.tolist()
            hasher = xxhash.xxh3_64(shape)
            hasher.update(a.to_bytes(8, "little", signed=True))
            hasher.update(b.to_bytes(8, "little", signed=True))
            digests[key] = f"g:{hasher.hexdigest()}"
        nonfinite = dict(self._nonfinite)
        for name, pair in self._device_ranges.items():
            lo, hi = pair.tolist()
            if not _finite((lo, hi)):
                nonfinite[name] = f"NaN or Inf (min {lo}, max {hi}, read on its GPU)"
        if written is not None:
            nonfinite = {k: v for k, v in nonfinite.items() if k in written}
        return Findings(replicas=digests, nonfinite=nonfinite, unchecked=tuple(self.unchecked))
