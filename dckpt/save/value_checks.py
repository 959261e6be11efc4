"""The checks a save makes of its values: one rank's capture digests, replica digests and
non-finite values.

Role: gathers, for one save on one rank, what ``dckpt.save.findings`` judges. The caller
(the stager, the memory route) decides *when* each check runs, so that it always sees the
state of ``save()`` time:

- **capture** (dckpt.save.capture): every tensor this rank writes is digested from the live
  tensor inside ``save()``; after the write, that digest is compared with the digest of the
  bytes written for it (dckpt.storage.item_writes). A host tensor's is taken in the same
  pass as its staging copy (``copy_hashed``: the source as read, never the buffer), or from
  the live tensor when its copy waits (``take_host``: a deferred copy, a synchronous save);
  a GPU tensor's is a fingerprint queued on the training stream beside its copy.
- a tensor on a GPU is checked on its device, with kernels queued on the training stream
  inside ``save()`` (``device``): ordered before anything the loop does next, so they read
  the ``save()``-time values, and the host never waits for them there. An event recorded
  behind them is waited for before their few bytes of results are read, in the background
  (``findings``). Captures and replicas get a fingerprint (dckpt.storage.tensor_digest);
  finiteness is ``aminmax`` (NaN propagates through it, and an infinity is its own minimum
  or maximum).
- a host tensor's replica digest is its capture digest when this rank writes it; one this
  rank does not write (DCP has another rank write it) is digested live inside ``save()``
  (``host``): xxh3-64 of its bytes (18-19 GB/s on one core here). Finiteness is checked on
  the staged copy in the background: ``aminmax``, and an exact count of NaN and Inf only
  when that finds one.
- a non-tensor value: xxh3-64 of a canonical encoding, inside ``save()`` (``value``): not
  its pickle, which differs between equal values (a tensor's storage identity, a set's hash
  order, strings shared or not).

So every digest a save compares, across ranks or against the file, is of the live state at
``save()``: copies that differ across ranks differ in the training state itself (a faulty
device, a per-rank value under one name), and a capture that differs from the bytes written
is the save's own fault (a staging copy that was stale, torn or cut short).

What is a replica (``replica_key``): a plain tensor, by its name (DCP keeps one copy of a
name every rank holds), and a DTensor shard with a ``Replicate`` placement, by its name and
its coordinates on the other mesh dimensions (DCP keeps one copy of each shard; under HSDP
the replica groups hold one each). A DTensor shard that is only sharded, a ``Partial`` one,
and a ``PerRank`` value (its name is the rank's own) have no other copy.

Every digest covers the dtype and shape too, and says how it was made (``x:`` on the host,
``g:`` on a GPU): only digests made the same way are compared. A tensor the checks cannot
read (sparse, quantized; a GPU that has no memory left for the fingerprint) is saved
unchecked and named in the findings. Invariant: nothing here changes a tensor, and nothing
reads a GPU tensor outside the stream order it was queued in.
"""

from __future__ import annotations

import enum
import logging
import math
import pickle
from collections.abc import Mapping
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor

from ..storage.tensor_digest import (
    fingerprint,
    fingerprint_digest,
    host_digest,
    raw_bytes,
    shape_prefix,
)
from .findings import Findings

__all__ = ["Inspection", "host_digest", "replica_key", "value_digest"]

log = logging.getLogger("dckpt")

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


def _encode(value: Any, out: Any, depth: int) -> None:
    """Feed ``out`` a canonical encoding of ``value``: equal values, equal bytes."""
    if depth > _DEPTH:
        raise ValueError("nested too deeply")
    kind = type(value)
    if isinstance(value, torch.Tensor):
        local = _local(value).detach()
        out.update(b"T" + shape_prefix(local))
        out.update(raw_bytes(local.cpu()))
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

    def __init__(
        self,
        *,
        replicas: bool,
        finite: bool,
        sample: tuple[int, int] = (0, 1),
        capture: bool = False,
    ) -> None:
        self.replicas = replicas
        self.finite = finite
        self.capture = capture
        """Whether each tensor this rank writes gets a capture digest (dckpt.save.capture)."""
        self.sample = sample
        """(this save's index, k): a replicated tensor is compared in one save of every k,
        the same one on every rank (its key's hash mod k); k = 1: in every save."""
        self._digests: dict[str, str] = {}
        self._captured: dict[str, str] = {}
        self._nonfinite: dict[str, str] = {}
        self._device_prints: dict[str, tuple[bytes, torch.Tensor]] = {}
        """Tensor name → its fingerprint, queued on its GPU (a capture, a replica, or both)."""
        self._device_replicas: dict[str, str] = {}
        """Tensor name → the replica key its fingerprint stands for."""
        self._device_captured: set[str] = set()
        self._read: dict[str, str] | None = None
        """The GPU fingerprints' digests, once read (``_device_digests``)."""
        self._device_ranges: dict[str, torch.Tensor] = {}
        self._queued: dict[torch.device, Any] = {}
        """Per GPU: an event behind the last kernels queued here (waited for by findings)."""
        self.unchecked: list[str] = []
        """Tensors the checks could not read: saved unchecked, named in the findings."""

    @property
    def active(self) -> bool:
        return self.replicas or self.finite or self.capture

    def staged_replica(self, replica: str | None) -> str | None:
        """The replica key to check a host tensor's staged copy under in the background:
        None when its capture digest (taken in ``save()``) already stands for it."""
        return None if self.capture else replica

    def value(self, name: str, value: Any) -> None:
        """A non-tensor value, as DCP would pickle it (a replica if another rank has it)."""
        if self.replicas:
            digest = value_digest(value)
            if digest is not None:
                self._digests[name] = digest

    def captured_host(self, name: str, digest: str, *, replica: str | None) -> None:
        """The digest of host tensor ``name`` taken from the live tensor inside ``save()``
        (``copy_hashed``, ``host_digest``): its capture, and its replica digest if it is one."""
        if self.capture:
            self._captured[name] = digest
        if self._sampled(replica):
            assert replica is not None
            self._digests[replica] = digest

    def take_host(self, name: str, t: torch.Tensor, *, replica: str | None) -> None:
        """Capture live host tensor ``name`` now, inside ``save()``, when it is not copied now
        (its copy deferred, a synchronous save): ``captured_host`` of its ``host_digest``."""
        if not self.capture:
            return
        try:
            digest = host_digest(t)
        except Exception as exc:  # a tensor kind the checks cannot read: saved unchecked
            self.cannot_read(name, exc)
            return
        self.captured_host(name, digest, replica=replica)

    def host(self, name: str, t: torch.Tensor, *, replica: str | None, finite: bool) -> None:
        """Check a host tensor now (its staged copy, or the live tensor inside ``save()``);
        ``replica``: its replica key (None: not compared)."""
        try:
            self._host(name, t, replica=replica, finite=finite)
        except Exception as exc:  # a tensor kind the checks cannot read: saved unchecked
            self.cannot_read(name, exc)

    def device(
        self,
        name: str,
        t: torch.Tensor,
        *,
        replica: str | None,
        finite: bool,
        capture: bool = False,
    ) -> None:
        """Queue the checks of a GPU tensor on the current (training) stream; ``capture``:
        this rank writes it, so its fingerprint is its capture digest too."""
        try:
            self._device(name, t, replica=replica, finite=finite, capture=capture)
        except Exception as exc:  # torch.cuda.OutOfMemoryError included: saved unchecked
            self.cannot_read(name, exc)

    def cannot_read(self, name: str, exc: Exception) -> None:
        """``name`` cannot be read by the checks (where it was copied, or here): it is saved
        unchecked, and named in the findings."""
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

    def _device(
        self, name: str, t: torch.Tensor, *, replica: str | None, finite: bool, capture: bool
    ) -> None:
        queued = False
        captured = capture and self.capture
        if captured or self._sampled(replica):
            self._device_prints[name] = (shape_prefix(t), fingerprint(t))
            if captured:
                self._device_captured.add(name)
            if self._sampled(replica):
                assert replica is not None
                self._device_replicas[name] = replica
            queued = True
        floats = _floats(t) if finite and self.finite and t.numel() else None
        if floats is not None:
            self._device_ranges[name] = _range(floats)
            queued = True
        if queued:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            self._queued[t.device] = event

    def capture_kind(self, name: str) -> str | None:
        """How ``name``'s capture digest was made (``x`` on the host, ``g`` on its GPU), so
        the bytes written for it are digested the same way; None: not captured."""
        if name in self._captured:
            return "x"
        return "g" if name in self._device_captured else None

    def captured(self) -> dict[str, str]:
        """Every capture digest (GPU ones read once their kernels ran)."""
        read = self._device_digests()
        return {**self._captured, **{name: read[name] for name in self._device_captured}}

    def _device_digests(self) -> dict[str, str]:
        """Each GPU fingerprint's digest, read once (a wait for the kernels queued in
        ``save()``, then a few bytes from the device each) and kept."""
        if self._read is None:
            for event in self._queued.values():
                event.synchronize()
            self._read = {n: fingerprint_digest(*p) for n, p in self._device_prints.items()}
        return self._read

    def findings(
        self,
        written: set[str] | None = None,
        writes: Mapping[str, str] | None = None,
        copies: Mapping[str, str] | None = None,
    ) -> Findings:
        """What was found; GPU results are read once the kernels queued for them finished.
        ``written``: the tensors this rank wrote (only theirs count as non-finite, and only
        theirs are compared with what was written); None: all that were checked. ``writes``:
        the digest of the bytes written for each tensor (None: nothing is compared);
        ``copies``: which copy each one's bytes came from (``Findings.mismatched``)."""
        captured = self.captured()  # waits for the GPU's kernels
        read = self._device_digests()
        digests = {**self._digests, **{k: read[n] for n, k in self._device_replicas.items()}}
        nonfinite = dict(self._nonfinite)
        for name, pair in self._device_ranges.items():
            lo, hi = pair.tolist()
            if not _finite((lo, hi)):
                nonfinite[name] = f"NaN or Inf (min {lo}, max {hi}, read on its GPU)"
        if written is not None:
            nonfinite = {k: v for k, v in nonfinite.items() if k in written}
        compared, uncompared = 0, []
        mismatched: dict[str, tuple[str, str, str]] = {}
        if writes is not None:
            for name in sorted(captured if written is None else written & captured.keys()):
                wrote = writes.get(name)
                if wrote is None:
                    uncompared.append(name)
                elif wrote != captured[name]:
                    copy = (copies or {}).get(name, "staged")
                    mismatched[name] = (copy, captured[name], wrote)
                else:
                    compared += 1
        return Findings(
            replicas=digests,
            nonfinite=nonfinite,
            unchecked=tuple(self.unchecked),
            compared=compared,
            mismatched=mismatched,
            uncompared=tuple(uncompared),
        )
