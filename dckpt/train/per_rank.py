"""``PerRank``: a value each rank saves and gets back as its own.

Every other category of a ``TrainState`` must be the same on every rank (or sharded tensors):
DCP de-duplicates replicated keys, so a per-rank value saved under one name comes back as one
rank's value on all ranks. ``PerRank`` stores this rank's value under ``rank_<r>`` instead, as
the RNG state is, serialised to bytes so that DCP never splits it or needs its shape to load
it. Loading reads it back with ``torch.load(weights_only=True)``: tensors, numbers, strings,
lists, tuples and dicts of them; nothing that runs code.

Typical use, a batch drawn before ``save()`` and consumed after it (that batch is in no other
part of the checkpoint)::

    pending = dckpt.PerRank()                       # .value is None until set
    state = dckpt.TrainState(model, opt, data=sampler, extra={"pending": pending})
    ...
    pending.value = next_batch                      # before manager.save(step)

A wrapped object with ``state_dict``/``load_state_dict`` is saved through them:
``PerRank(my_object)``.

A resume with another world size cannot map rank r's value to a new rank: it is refused with
``StateMismatchError`` unless ``on_resize="fresh"``, which keeps each rank's current value
(and says so in the resume report).
"""

from __future__ import annotations

import io
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = ["PerRank"]


_PLAIN = (
    torch.Tensor,
    int,
    float,
    bool,
    str,
    bytes,
    complex,
    type(None),
    torch.dtype,
    torch.device,
)


def _unloadable(obj: Any) -> str | None:
    """The type name of the first value in ``obj`` that weights-only loading refuses, or None.
    A walk, not a trial load: no second serialisation inside ``save()``."""
    if isinstance(obj, _PLAIN):
        return None
    if isinstance(obj, (list, tuple)):
        return next((t for t in map(_unloadable, obj) if t is not None), None)
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
        return next((t for t in map(_unloadable, items) if t is not None), None)
    return type(obj).__name__


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class PerRank:
    """A per-rank value (or object) in a ``TrainState``'s ``extra``; see the module docstring."""

    def __init__(self, obj: Any = None, *, on_resize: Literal["raise", "fresh"] = "raise") -> None:
        if on_resize not in ("raise", "fresh"):
            raise ValueError(f"on_resize must be 'raise' or 'fresh', got {on_resize!r}")
        self._stateful = hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
        self.obj: Any = obj if self._stateful else None
        self.value: Any = None if self._stateful else obj
        self.on_resize = on_resize

    def _payload(self) -> Any:
        return self.obj.state_dict() if self._stateful else self.value

    def state_dict(self) -> dict[str, Any]:
        payload = self._payload()
        odd = _unloadable(payload)
        if odd is not None:  # what the resume could not read back must fail this save
            raise ValueError(
                f"a PerRank value holds a {odd}, which torch.load(weights_only=True) refuses "
                "on resume: keep tensors, numbers, strings, bytes, None, and lists, tuples "
                "and dicts of them"
            )
        buf = io.BytesIO()
        torch.save(payload, buf)
        return {f"rank_{_rank()}": buf.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = f"rank_{_rank()}"
        raw = state_dict.get(key)
        if not isinstance(raw, bytes):
            raise KeyError(f"no value for {key} in this PerRank's saved state")
        payload = torch.load(io.BytesIO(raw), weights_only=True)
        if self._stateful:
            self.obj.load_state_dict(payload)
        else:
            self.value = payload
