"""DCP's save plan, cached between saves while the state's layout stays the same on every rank.

Without a cache every save runs DCP's whole planning: each rank sends its local plan to rank
0, which de-duplicates and validates the world's plans and builds the metadata (seconds at
hundreds of ranks, minutes at thousands), then scatters them back. DCP can cache its plans
(``DefaultSavePlanner(enable_plan_caching=True)``): a rank whose local plan equals the cached
one sends an empty one, and rank 0 reuses the de-duplicated plan and the metadata it built.
But DCP's comparison of two plans ignores dtypes (and what a tensor's properties record), so a
model cast between two saves would commit metadata with the old dtype; a cached plan is only
safe when the cache knows everything the metadata depends on.

``PlanCache`` gives DCP's cache a key it may trust:

1. each rank takes a fingerprint of the layout it hands DCP (``layout_fingerprint``): every
   flattened name in order, and for each tensor its shape, dtype, layout, device kind and
   ``requires_grad``, and for a DTensor its placements, its mesh's shape and this rank's
   coordinate in it (which fix its shard), and for a non-tensor its type; plus the nesting
   that flattening records;
2. one all-reduce of an int on the save's group says whether any rank's fingerprint changed
   (or any rank has no cached plan: a failed save forgets it);
3. if none did, every rank keeps the key of the last save and DCP reuses its plans; if any
   did, rank 0 broadcasts a new key, every rank drops what DCP cached under the old one, and
   DCP plans again from scratch (never merging a changed plan into a stale one).

Invariants: the key is the same on every rank at every save (it changes only through the
broadcast every rank takes part in); a key names one layout of one manager's state, never
reused; a change on any single rank re-plans on all of them.
"""

from __future__ import annotations

import inspect
import uuid
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.tensor import DTensor

from ..collective.comm import Comm

__all__ = ["CACHING", "PlanCache", "layout_fingerprint"]

CACHING = "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters
"""Whether this torch's DCP can cache save plans at all (without it, every save plans)."""

_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)
"""DCP's class-level caches, each keyed by the planner's ``_cached_plans_key``."""


def _describe(value: Any) -> tuple[Any, ...]:
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        return (
            "dtensor",
            tuple(value.shape),
            str(value.dtype),
            str(value.layout),
            value.device.type,
            value.requires_grad,
            tuple(map(str, value.placements)),
            tuple(mesh.shape),
            tuple(mesh.get_coordinate() or ()),
            tuple(value.to_local().shape),
        )
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tuple(value.shape),
            str(value.dtype),
            str(value.layout),
            value.device.type,
            value.requires_grad,
        )
    return ("object", type(value).__module__, type(value).__qualname__)


def layout_fingerprint(state_dict: dict[str, Any]) -> str:
    """What DCP's plan and metadata depend on in ``state_dict``, as a digest (module docstring,
    step 1); the values' bytes are not read."""
    flat, mappings = flatten_state_dict(state_dict)
    h = xxhash.xxh3_128()
    for fqn, value in flat.items():
        h.update(repr((fqn, _describe(value))).encode())
    h.update(repr(sorted((k, tuple(map(str, v))) for k, v in mappings.items())).encode())
    return h.hexdigest()


class PlanCache:
    """The key of DCP's plan cache for one manager's saves; see the module docstring."""

    def __init__(self, comm: Comm) -> None:
        self._comm = comm
        self._fingerprint: str | None = None
        self.key: str | None = None
        self.replans = 0
        """How many saves planned from scratch (the first, and one per layout change)."""

    def key_for(self, state_dict: dict[str, Any]) -> tuple[str | None, bool]:
        """This save's cache key (None: this torch cannot cache), and whether DCP may reuse
        the last save's plan under it. Every rank of the save's group calls it, in step."""
        if not CACHING:
            return None, False
        try:
            mine: str | None = layout_fingerprint(state_dict)
        except Exception:  # unseen before: re-plan, but still join the agreement below
            mine = None
        changed = self._comm.any(mine is None or mine != self._fingerprint or self.key is None)
        if changed:
            fresh = self._comm.broadcast(uuid.uuid4().hex if self._comm.rank == 0 else None)
            self.forget()
            self.key = f"dckpt-plan-{fresh}"
            self.replans += 1
        self._fingerprint = mine
        return self.key, not changed

    def forget(self) -> None:
        """Drop what DCP cached under this key (a failed save calls it on its rank: the next
        save's agreement then re-plans on every rank)."""
        self._fingerprint = None
        if self.key is None:
            return
        for name in _CACHES:
            cache = getattr(SavePlanner, name, None)
            if isinstance(cache, dict):
                cache.pop(self.key, None)
