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
        buf = io.BytesIO()
        torch.save(self._payload(), buf)
        raw = buf.getvalue()
        try:  # what the resume could not read back must fail this save, not that resume
            torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            why = next((line for line in lines if "Unsupported" in line), lines[0] if lines else "")
            raise ValueError(
                f"a PerRank value of type {type(self._payload()).__name__} cannot be restored "
                "safely (torch.load(weights_only=True) refuses it): keep tensors, numbers, "
                f"strings, and lists, tuples and dicts of them ({why})"
            ) from None
        return {f"rank_{_rank()}": raw}

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
