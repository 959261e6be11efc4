"""TrainState: everything a checkpoint holds to resume a run exactly, as named categories.

Categories (top-level keys of the DCP state dict, listed in the manifest):

- ``model`` and ``optimizer``: through DCP's state-dict helpers (``get_state_dict`` /
  ``set_state_dict``), so plain modules, DDP and FSDP2 save sharded and load resharded;
- ``scheduler``: the LR scheduler(s); ``scaler``: the GradScaler (fp16);
- ``data``: the data position (``GlobalBatchSampler``, or a DataLoader's place and order:
  dckpt.train.loader), global, the same on every rank;
- ``progress``: step, epoch and samples seen;
- ``extra``: any user object with ``state_dict`` / ``load_state_dict``, and ``PerRank``
  values (dckpt.train.per_rank), which each rank saves and gets back as its own;
- ``rng``: added by the manager, one entry per rank (see dckpt.train.rng).

Every category but ``rng`` must hold the same values on every rank (or sharded tensors): DCP
de-duplicates replicated keys, so a per-rank value (a per-rank data cursor, say) would come
back as one rank's value on all ranks. Keep such state global, as ``GlobalBatchSampler`` is.

Loading is two-phase, as DCP requires: ``state_dict()`` gives the structure with tensors to
fill in place, DCP fills it, then ``load_state_dict()`` hands the values back, in the order of
the resume checklist: model, optimizer, scheduler, scaler, data position, counters (RNG last,
by the manager).

What is captured when: all of it when ``save()`` is called, on the caller's thread, before
``save()`` returns (the stager copies it). A batch drawn before ``save()`` and used after it is
in none of these categories unless the script puts it in a ``PerRank``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from ..errors import CheckpointError, StateMismatchError
from .data import GlobalBatchSampler
from .loader import LoaderPosition, position_of
from .per_rank import PerRank

__all__ = ["DATA_ORDER", "Stateful", "TrainState", "describe_layout"]

DATA_ORDER = "dckpt_data_order"
"""The ``extra`` entry a DataLoader's order is kept in (dckpt.train.loader.LoaderOrder)."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


class TrainState:
    """The complete state of one training run; see the module docstring.

    Args:
        model: the (possibly DDP- or FSDP2-wrapped) model.
        optimizer: its optimizer.
        scheduler: an LR scheduler, or a list of them.
        scaler: the GradScaler (only meaningful for fp16).
        data: the data position: a ``GlobalBatchSampler``, any object with ``state_dict`` /
            ``load_state_dict``, or the ``DataLoader`` itself (a plain one or the one
            ``accelerator.prepare`` returns), whose place and order are then kept by
            ``dckpt.train.loader``.
        extra: further named objects with ``state_dict`` / ``load_state_dict``.
        seed: the run's seed, used to reseed RNG when a resume changes the world size.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scheduler: Stateful | Sequence[Stateful] | None = None,
        scaler: Stateful | None = None,
        data: Stateful | DataLoader[Any] | None = None,
        extra: Mapping[str, Stateful] | None = None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.optimizer = _unwrap_optimizer(optimizer)
        if scheduler is None:
            self.schedulers: list[Stateful] = []
        elif isinstance(scheduler, Sequence):
            self.schedulers = list(scheduler)
        else:
            self.schedulers = [scheduler]
        self.scaler = scaler
        self.data = _data_position(data)
        self.extra = dict(extra or {})
        if isinstance(self.data, LoaderPosition):  # its order: each rank's generators
            self.extra.setdefault(DATA_ORDER, PerRank(self.data.order, on_resize="fresh"))
        self.seed = seed
        self.step = 0
        self.epoch = 0
        self.samples_seen = 0
        self._options = StateDictOptions(strict=True)
        self.in_torch_state_dict = False
        """True while DCP's state-dict helpers run: they call ``optimizer.step()`` themselves
        on an optimizer that holds no state (torch's ``_init_optim_state``: zero grads, lr 0;
        a stateless SGD at every save, Adam before its first step). Such a step is no
        training step: a step pre-hook reads this to tell them apart."""

    def at(self, step: int, epoch: int | None = None) -> None:
        """The progress the next ``state_dict`` records: ``step`` (and ``epoch``, when given);
        a save calls it with the step it saves."""
        self.step = step
        if epoch is not None:
            self.epoch = epoch

    def categories(self) -> list[str]:
        cats = ["model"]
        if self.optimizer is not None:
            cats.append("optimizer")
        if self.schedulers:
            cats.append("scheduler")
        if self.scaler is not None:
            cats.append("scaler")
        if self.data is not None:
            cats.append("data")
        cats.append("progress")
        if self.extra:
            cats.append("extra")
        return cats

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            sd: dict[str, Any] = {"model": get_model_state_dict(self.model, options=self._options)}
        else:
            self.in_torch_state_dict = True
            try:
                msd, osd = get_state_dict(self.model, self.optimizer, options=self._options)
            finally:
                self.in_torch_state_dict = False
            sd = {"model": msd, "optimizer": osd}
        if self.schedulers:
            sd["scheduler"] = {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        if self.data is not None:
            sd["data"] = self.data.state_dict()
        sd["progress"] = {
            "step": self.step,
            "epoch": self.epoch,
            "samples_seen": self.samples_seen,
        }
        if self.extra:
            sd["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every category from ``state_dict`` (DCP filled it: the model's tensors,
        loaded in place, hold the checkpoint's values already). The data position goes first.
        Any object's refusal (a sampler with another seed or global batch, a scheduler built
        differently) is a ``StateMismatchError`` naming the category (a plain ``ValueError``
        escaped the resume's refusal as a bare traceback)."""
        if self.data is not None:
            _restore("data", self.data, state_dict["data"])
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"], options=self._options)
        else:
            self.in_torch_state_dict = True
            try:
                set_state_dict(
                    self.model,
                    self.optimizer,
                    model_state_dict=state_dict["model"],
                    optim_state_dict=state_dict["optimizer"],
                    options=self._options,
                )
            finally:
                self.in_torch_state_dict = False
        for i, sched in enumerate(self.schedulers):
            _restore(f"scheduler {i}", sched, state_dict["scheduler"][str(i)])
        if self.scaler is not None:
            _restore("scaler", self.scaler, state_dict["scaler"])
        progress = state_dict["progress"]
        self.step = int(progress["step"])
        self.epoch = int(progress.get("epoch", 0))
        self.samples_seen = int(progress.get("samples_seen", 0))
        for name, obj in self.extra.items():
            if name in state_dict.get("extra", {}):  # absent: a PerRank started fresh
                _restore(f"extra {name!r}", obj, state_dict["extra"][name])

    def param_keys(self, state_dict: dict[str, Any]) -> tuple[frozenset[str], frozenset[str]]:
        """The keys DCP gives (``model.<name>``) to the entries of ``state_dict`` (as
        ``state_dict()`` made it) that hold a model parameter, in one pass: (those that
        require grad, those that do not). The frozen ones are what an incremental save writes
        to a file of their own. Matched by storage, not by name, so wrappers' prefixes (DDP's
        ``module.``) need no knowledge here; an entry that is a copy (an offloaded state dict)
        matches nothing, and is saved as any other; so do an empty shard (FSDP gives rank 0 a
        non-empty one of every parameter) and a tensor with no plain storage of its own to
        point at (sparse, a wrapper subclass: ``_ptr``)."""
        grad = {ptr: p.requires_grad for p in self.model.parameters() if (ptr := _ptr(p))}
        trainable: set[str] = set()
        frozen: set[str] = set()
        if grad:
            for k, v in state_dict.get("model", {}).items():
                if isinstance(v, torch.Tensor) and (g := grad.get(_ptr(v) or 0)) is not None:
                    (trainable if g else frozen).add(f"model.{k}")
        return frozenset(trainable), frozenset(frozen)

    def per_rank(self) -> dict[str, PerRank]:
        """The ``extra`` entries that are per rank."""
        return {name: obj for name, obj in self.extra.items() if isinstance(obj, PerRank)}


def describe_layout(state_dict: dict[str, Any]) -> dict[str, Any]:
    """What a manifest records of a state dict's shape, for ``dckpt inspect``:
    ``device_mesh``, each distinct mesh of the model's DTensors as ``{dim name: size}`` (a
    one-mesh job's only one as a plain dict: ``{"dp": 2, "tp": 2}``); ``data``, the data
    position's ``epoch`` and ``batches`` into it, when the ``data`` category records them."""
    meshes: list[dict[str, int]] = []
    seen: set[int] = set()  # a model's tensors share a few mesh objects: each described once
    for value in state_dict.get("model", {}).values():
        if isinstance(value, DTensor) and id(value.device_mesh) not in seen:
            mesh = value.device_mesh
            seen.add(id(mesh))
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            described = dict(zip(names, (int(n) for n in mesh.shape), strict=True))
            if described not in meshes:
                meshes.append(described)
    layout: dict[str, Any] = {}
    if meshes:
        layout["device_mesh"] = meshes[0] if len(meshes) == 1 else meshes
    data = state_dict.get("data")
    if isinstance(data, dict) and type(data.get("epoch")) is int:
        batches = data.get("batches", data.get("batches_done"))
        layout["data"] = {
            "epoch": data["epoch"],
            **({"batches": batches} if type(batches) is int else {}),
        }
    return layout


def _unwrap_optimizer(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The optimizer that holds the state. Accelerate's ``AcceleratedOptimizer`` subclasses
    ``Optimizer`` without its hooks and keeps the real one as ``.optimizer``; DCP and the step
    hook need the real one, and its ``step`` calls the real one's, so the hook fires on every
    step that updates. Matched by type (by name: accelerate is not imported here), not by the
    attribute: another wrapper with an ``.optimizer`` may keep state of its own (Lookahead's
    slow weights), which its own ``state_dict`` holds."""
    kind = type(optimizer)
    inner = getattr(optimizer, "optimizer", None)
    if (
        kind.__name__ == "AcceleratedOptimizer"
        and kind.__module__.startswith("accelerate.")
        and isinstance(inner, torch.optim.Optimizer)
    ):
        return inner
    return optimizer


def _data_position(data: Stateful | DataLoader[Any] | None) -> Stateful | None:
    """What the ``data`` category saves: a DataLoader's position (or the GlobalBatchSampler
    it draws from, whose position is already global), any other object as it is."""
    if not isinstance(data, DataLoader):  # Accelerate's loader passes as one too
        return data
    batch_sampler = getattr(data, "batch_sampler", None)
    if isinstance(batch_sampler, GlobalBatchSampler):
        return batch_sampler
    return position_of(data)


def _ptr(t: torch.Tensor) -> int | None:
    """Where the bytes of ``t`` (of a DTensor, its shard on this rank) start; None for an
    empty tensor and for one whose address says nothing of its bytes (a sparse tensor, a
    wrapper subclass, whose ``data_ptr`` is 0 or raises)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.layout != torch.strided or not local.numel():
        return None
    try:
        return local.data_ptr() or None
    except RuntimeError:
        return None


def _restore(what: str, obj: Stateful, saved: Any) -> None:
    """``obj.load_state_dict(saved)``; its refusal as a StateMismatchError naming ``what``."""
    try:
        obj.load_state_dict(saved)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise StateMismatchError(
            f"restoring the {what} from the checkpoint failed: {type(exc).__name__}: {exc}. "
            "The object being restored does not fit the saved state (it was built "
            "differently); the checkpoint is not damaged."
        ) from exc
