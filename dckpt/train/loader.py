"""``LoaderPosition``: a DataLoader's place and order as checkpoint state, for any loader.

A ``TrainState`` given ``data=loader`` (a ``torch.utils.data.DataLoader``, or the loader
``accelerator.prepare`` returns) keeps its position here, so that a resume in any epoch
continues with the very batches the run that stopped would have drawn next, without the
script swapping its loader for ``GlobalBatchSampler``.

What the position is, in two parts:

- ``LoaderPosition``, the ``data`` category, global (the same on every rank): ``epoch``, the
  iterations of the loader run to their end since the run started (as Accelerate's loader
  counts them), and ``batches``, those handed to the training loop in the current one
  (counted where the loader yields them, not where the sampler is read: a loader reads
  ahead, one batch for Accelerate's, ``prefetch_factor * num_workers`` with workers);
- ``LoaderOrder``, per rank (a ``PerRank`` the ``TrainState`` adds to ``extra`` as
  ``dckpt.data_order``): the state, as it was when the current iteration began, of every
  ``torch.Generator`` that decides the order (the loader's, its sampler's and batch sampler's,
  Accelerate's synchronized one), named by where it was found. Per rank, because ranks may
  shuffle alike or not: each gets back its own (Accelerate's loader then broadcasts rank 0's,
  as it did in the run that stopped). A resume with another world size keeps each rank's
  current generators, and the resume report says so.

How it counts: the loader object is given a subclass of its own type whose ``__iter__`` wraps
the original one (made once per type; the object, its attributes and ``isinstance`` are
unchanged). A resume restores the generators to their state at the start of the saved
iteration, the epoch (``set_epoch`` where the loader or its samplers have one), and the next
iteration drops the first ``batches`` batches: they are drawn (their samples are read) and
not handed out, so the loop resumes on exactly the next batch, whatever the sampler. An
iteration left early (``break``) counts as ended for the order (the next one draws a new
one) but not for ``epoch`` (Accelerate's count does not move either). The epoch is set back
through the loader's ``set_epoch`` where it has one (Accelerate's, which sets its
samplers'); a ``DistributedSampler`` under a plain loader gets it from the script's own
``set_epoch`` call, as in the run that stopped. A copy
of the loader (pickled, deep-copied) is the plain loader it was, without a position.

Two things that made a resume differ, and what is done about them:

- Creating a DataLoader's iterator draws its base seed from the global RNG when the loader
  has no generator of its own, and so does a shuffling sampler without one, for its order: a
  resumed run draws them at another point of the global stream than the run that stopped (at
  the resume, not at the epoch's start), so the order and every later dropout mask differed.
  A loader or sampler without a generator is given one here, seeded by one draw from the
  global RNG when the position is made (so ranks seeded alike shuffle alike, and ranks seeded
  apart shuffle apart, as the loader seeding itself from the global RNG did), whose state is
  part of the order.
- A loader with ``persistent_workers`` makes its iterator once, at the first epoch, and
  draws the workers' base seed then; a resume makes it again, so in an epoch after the first
  the workers are seeded anew (and a generator the loader shares with its sampler moves one
  draw): random augmentation in the workers, or that order, differs. The resume warns of it;
  ``persistent_workers=False`` makes it exact.

A copy of the loader made by its type (``type(loader)(...)``) iterates as a plain loader.

Not covered: a dataset that draws from the global RNG while it is read (augmentations with
``num_workers=0``) interleaves those draws with the training step's; a resume re-reads the
dropped batches, so such draws repeat. Give the dataset its own generator or use workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..errors import StateMismatchError

__all__ = ["LoaderOrder", "LoaderPosition", "position_of"]

log = logging.getLogger("dckpt")

_ATTR = "_dckpt_position"
_COUNTING: dict[type, type] = {}


def _counting_type(real: type) -> type:
    """A subclass of ``real`` whose ``__iter__`` goes through the loader's position."""
    made = _COUNTING.get(real)
    if made is None:
        original: Callable[[Any], Iterator[Any]] = getattr(real, "__iter__")  # noqa: B009

        def __iter__(self: Any) -> Iterator[Any]:  # noqa: N807 (the dunder it overrides)
            position: LoaderPosition | None = vars(self).get(_ATTR)
            if position is None:  # a copy made by its type: a plain loader
                return original(self)
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


def position_of(loader: Any) -> LoaderPosition:
    """The one ``LoaderPosition`` of ``loader``, made and attached on first use."""
    existing = vars(loader).get(_ATTR)
    if isinstance(existing, LoaderPosition):
        return existing
    return LoaderPosition(loader)


class LoaderPosition:
    """The position of one loader; see the module docstring. Build it with ``position_of``."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch = 0
        self.batches = 0
        self._skip = 0
        self._at_begin: dict[str, torch.Tensor] = {}
        for _, owner in self._owners():
            if owner.generator is None:  # see the module docstring
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
                owner.generator = torch.Generator().manual_seed(seed)
        self.order = LoaderOrder(self)
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

    def iterate(self, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """One iteration of the loader, counted; the first ``_skip`` batches dropped. When it
        ends, or is left early, the generators' states are those the next one starts from."""
        self._at_begin = self._states()
        skip, self._skip = self._skip, 0
        handed = 0
        try:
            for batch in start():
                if skip:
                    skip -= 1
                    handed += 1
                    continue
                handed += 1
                self.batches = handed
                yield batch
            self.epoch += 1
        finally:  # run to its end, or left (break: the generator is closed)
            self.batches = 0
            self._at_begin = self._states()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "loader", "epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "loader":
            raise StateMismatchError(
                "the checkpoint's data position is not a DataLoader's (it was saved with "
                "another kind of data object, e.g. a GlobalBatchSampler): pass the same kind "
                "of object as `data=` that the run saved with."
            )
        self.epoch = int(state["epoch"])
        self.batches = self._skip = int(state["batches"])
        set_epoch = getattr(self.loader, "set_epoch", None)
        if callable(set_epoch):  # Accelerate's loader: its iteration count and samplers' epoch
            set_epoch(self.epoch)
        maker = _maker(self.loader)
        if self.epoch and maker is not None and maker.persistent_workers and maker.num_workers:
            log.warning(
                "dckpt: the DataLoader has persistent_workers=True: its workers were seeded at "
                "the first epoch of the run that stopped and are seeded anew now (epoch %d), so "
                "random augmentation in them differs from that run (and so does the order if "
                "the loader shares its generator with its sampler). persistent_workers=False "
                "makes the resume exact.",
                self.epoch,
            )


class LoaderOrder:
    """The order part of a loader's position, per rank: its generators' states at the start
    of the current iteration, by name (see the module docstring)."""

    def __init__(self, position: LoaderPosition) -> None:
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        states = self.position._at_begin
        return {"names": sorted(states), "states": {n: s.clone() for n, s in states.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = self.position
        gens = position._generators()
        saved: dict[str, torch.Tensor] = state["states"]
        if sorted(state["names"]) != sorted(gens):
            raise StateMismatchError(
                f"the DataLoader's order was saved from generators {sorted(state['names'])} and "
                f"this loader has {sorted(gens)}: it is built differently (shuffle, sampler, "
                "generator), so its order would differ. Build it as the run that saved did."
            )
        for name, gen in gens.items():
            gen.set_state(saved[name])
        position._at_begin = {name: s.clone() for name, s in saved.items()}
