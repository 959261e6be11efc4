"""``LoaderPosition``: a DataLoader's place and order as checkpoint state, for any loader.

A ``TrainState`` given ``data=loader`` (a ``torch.utils.data.DataLoader``, or the loader
``accelerator.prepare`` returns) keeps its position here, so that a resume in any epoch
continues with the very batches the run that stopped would have drawn next, without the
script swapping its loader for ``GlobalBatchSampler``.

What the position is (global: the same on every rank, as the ``data`` category must be):

- ``epoch``: the iterations of the loader begun and ended since the run started;
- ``batches``: the batches handed to the training loop in the current iteration (counted
  where the loader yields them, not where the sampler is read: a loader reads ahead, one
  batch for Accelerate's, ``prefetch_factor * num_workers`` with workers);
- ``generators``: the state, as it was when the current iteration began, of every
  ``torch.Generator`` that decides the order (the loader's, its sampler's and batch sampler's,
  Accelerate's synchronized one), named by where it was found.

How it counts: the loader object is given a subclass of its own type whose ``__iter__`` wraps
the original one (made once per type; the object, its attributes and ``isinstance`` are
unchanged). A resume restores the generators to their state at the start of the saved
iteration, the epoch (``set_epoch`` where the loader or its samplers have one), and the next
iteration drops the first ``batches`` batches: they are drawn (their samples are read) and
not handed out, so the loop resumes on exactly the next batch, whatever the sampler. A copy
of the loader (pickled, deep-copied) is the plain loader it was, without a position.

Two things that made a resume differ, and what is done about them:

- Creating a DataLoader's iterator draws its base seed from the global RNG when the loader
  has no generator of its own, and so does a shuffling sampler without one, for its order: a
  resumed run draws them at another point of the global stream than the run that stopped (at
  the resume, not at the epoch's start), so the order and every later dropout mask differed.
  A loader or sampler without a generator is given one here, seeded from the state's seed
  (the same on every rank, as the base seed of a seeded run is), whose state is part of the
  position. (A plain shuffling loader's order is then a function of that seed, no longer of
  the global RNG.)
- Accelerate's loader broadcasts rank 0's generator state at the start of each iteration;
  before that, the ranks' states may differ (a run that did not seed every rank alike), and
  the position must be global. The broadcast is made here first, on the same default group,
  so the state recorded is the one every rank then uses.

Not covered: a dataset that draws from the global RNG while it is read (augmentations with
``num_workers=0``) interleaves those draws with the training step's; a resume re-reads the
dropped batches, so such draws repeat. Give the dataset its own generator or use workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..errors import StateMismatchError

__all__ = ["LoaderPosition", "position_of"]

_ATTR = "_dckpt_position"
_COUNTING: dict[type, type] = {}


def _counting_type(real: type) -> type:
    """A subclass of ``real`` whose ``__iter__`` goes through the loader's position."""
    made = _COUNTING.get(real)
    if made is None:
        original: Callable[[Any], Iterator[Any]] = getattr(real, "__iter__")  # noqa: B009

        def __iter__(self: Any) -> Iterator[Any]:  # noqa: N807 (the dunder it overrides)
            position: LoaderPosition = vars(self)[_ATTR]
            return position.iterate(lambda: original(self))

        def __reduce_ex__(self: Any, protocol: Any) -> Any:  # noqa: N807
            # Pickled as the loader it was (this type is made here, not importable), without
            # its position: a copy in another process is a plain loader again.
            return (_plain_copy, (real, {k: v for k, v in vars(self).items() if k != _ATTR}))

        made = type(
            real.__name__,
            (real,),
            {"__iter__": __iter__, "__reduce_ex__": __reduce_ex__, "__module__": real.__module__},
        )
        _COUNTING[real] = made
    return made


def _plain_copy(cls: type, state: dict[str, Any]) -> Any:
    """A loader of type ``cls`` with ``state`` as its attributes (what a pickled one becomes)."""
    obj: Any = object.__new__(cls)
    vars(obj).update(state)
    return obj


def _set_type(obj: Any, cls: type) -> None:
    """``obj.__class__ = cls``. Accelerate's loader reports its wrapped loader's type through a
    read-only ``__class__`` property; ``object``'s own descriptor sets the real type."""
    object.__dict__["__class__"].__set__(obj, cls)


def _maker(loader: Any) -> DataLoader[Any] | None:
    """The torch DataLoader whose iterator draws the base seed: Accelerate's loader holds one
    (``base_dataloader``); a plain loader is its own."""
    base = vars(loader).get("base_dataloader", loader)
    return base if isinstance(base, DataLoader) else None


def position_of(loader: Any, *, seed: int) -> LoaderPosition:
    """The one ``LoaderPosition`` of ``loader``, made and attached on first use."""
    existing = vars(loader).get(_ATTR)
    if isinstance(existing, LoaderPosition):
        return existing
    return LoaderPosition(loader, seed=seed)


class LoaderPosition:
    """The position of one loader; see the module docstring. Build it with ``position_of``."""

    def __init__(self, loader: Any, *, seed: int) -> None:
        self.loader = loader
        self.epoch = 0
        self.batches = 0
        self._skip = 0
        self._at_begin: dict[str, torch.Tensor] = {}
        for i, (_, owner) in enumerate(self._owners()):
            if owner.generator is None:  # see the module docstring
                owner.generator = torch.Generator().manual_seed(seed * 1_000_003 + i)
        vars(loader)[_ATTR] = self
        real = type(loader)
        if real not in _COUNTING.values():
            _set_type(loader, _counting_type(real))
        self._at_begin = self._states()

    def _owners(self) -> list[tuple[str, Any]]:
        """The loader and samplers that may hold a generator (a ``generator`` attribute), by
        where they are: the DataLoader that makes the iterator, its sampler, the batch
        sampler's sampler, and, under Accelerate's shard of a batch sampler, the one within."""
        loader = self.loader
        batch_sampler = getattr(loader, "batch_sampler", None)
        inner = getattr(batch_sampler, "batch_sampler", None)
        owners = [
            ("loader", _maker(loader)),
            ("sampler", getattr(loader, "sampler", None)),
            ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None)),
            ("batch_sampler.batch_sampler.sampler", getattr(inner, "sampler", None)),
        ]
        return [
            (name, obj) for name, obj in owners if obj is not None and hasattr(obj, "generator")
        ]

    def _generators(self) -> dict[str, torch.Generator]:
        """Every generator that decides the order, by where it was found (each once)."""
        found: dict[str, torch.Generator] = {}
        seen: set[int] = set()
        candidates = [
            ("synchronized", vars(self.loader).get("synchronized_generator")),
            *((name, owner.generator) for name, owner in self._owners()),
        ]
        for name, gen in candidates:
            if isinstance(gen, torch.Generator) and id(gen) not in seen:
                seen.add(id(gen))
                found[name] = gen
        return found

    def _states(self) -> dict[str, torch.Tensor]:
        return {name: gen.get_state() for name, gen in self._generators().items()}

    def _agree_synchronized(self) -> None:
        """Rank 0's synchronized generator state on every rank, before it is recorded."""
        gen = vars(self.loader).get("synchronized_generator")
        kinds = getattr(self.loader, "rng_types", None) or ()
        if not isinstance(gen, torch.Generator) or "generator" not in [str(k) for k in kinds]:
            return
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        state = gen.get_state()
        if dist.get_backend() == "nccl":  # NCCL moves device tensors only
            moved = state.to(torch.device("cuda", torch.cuda.current_device()))
            dist.broadcast(moved, 0)
            state = moved.cpu()
        else:
            dist.broadcast(state, 0)
        gen.set_state(state)

    def iterate(self, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """One iteration of the loader, counted; the first ``_skip`` batches dropped."""
        self._agree_synchronized()
        self._at_begin = self._states()
        skip, self._skip = self._skip, 0
        handed = 0
        for batch in start():
            if skip:
                skip -= 1
                handed += 1
                continue
            handed += 1
            self.batches = handed
            yield batch
        self.epoch += 1
        self.batches = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "loader",
            "epoch": self.epoch,
            "batches": self.batches,
            "generators": {name: state.clone() for name, state in self._at_begin.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "loader":
            raise StateMismatchError(
                "the checkpoint's data position is not a DataLoader's (it was saved with "
                "another kind of data object, e.g. a GlobalBatchSampler): pass the same kind "
                "of object as `data=` that the run saved with."
            )
        gens = self._generators()
        saved: dict[str, torch.Tensor] = state["generators"]
        if set(saved) != set(gens):
            raise StateMismatchError(
                f"the DataLoader's order was saved from generators {sorted(saved)} and this "
                f"loader has {sorted(gens)}: it is built differently (shuffle, sampler, "
                "generator), so its order would differ. Build it as the run that saved did."
            )
        for name, gen in gens.items():
            gen.set_state(saved[name])
        self._at_begin = {name: s.clone() for name, s in saved.items()}
        self.epoch = int(state["epoch"])
        self.batches = self._skip = int(state["batches"])
        set_epoch = getattr(self.loader, "set_epoch", None)
        if callable(set_epoch):  # Accelerate's loader: its iteration count and samplers' epoch
            set_epoch(self.epoch)
