"""A DataLoader's place and order as checkpoint state (dckpt.train.loader), in one process:
a loader rebuilt and given the saved position yields exactly the batches the original would
have yielded next, at any point of any epoch, with and without workers (which read ahead),
for a shuffling loader, a DistributedSampler and a plain order; its iterator no longer draws
from the global RNG; a loader built differently is refused in words. (Accelerate's prepared
loader, on 2 ranks with real kills: test_integration_accelerate.py.)"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dckpt
from dckpt.errors import StateMismatchError
from dckpt.train.loader import LoaderPosition, position_of

DATA = TensorDataset(torch.arange(40))


def _loader(kind: str, workers: int = 0) -> DataLoader[Any]:
    if kind == "shuffle":
        return DataLoader(DATA, batch_size=4, shuffle=True, num_workers=workers)
    if kind == "distributed":
        sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=3)
        return DataLoader(DATA, batch_size=4, sampler=sampler, num_workers=workers)
    return DataLoader(DATA, batch_size=4, num_workers=workers)


def _batches(loader: DataLoader[Any], position: LoaderPosition, epochs: int, stop: tuple[int, int]
             ) -> tuple[list[list[int]], dict[str, Any] | None]:  # fmt: skip
    """What ``epochs`` epochs yield, and the state saved after batch ``stop[1]`` of epoch
    ``stop[0]`` (the DistributedSampler's epoch set by the loop, as scripts do)."""
    seen: list[list[int]] = []
    saved = None
    for epoch in range(position.epoch, epochs):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for i, (batch,) in enumerate(loader):
            seen.append(batch.tolist())
            if (epoch, i + 1) == stop:
                saved = position.state_dict()
    return seen, saved


@pytest.mark.parametrize("kind", ["shuffle", "distributed", "plain"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [(0, 3), (1, 1), (1, 10)])
def test_a_rebuilt_loader_continues_with_the_next_batch(
    kind: str, workers: int, stop: tuple[int, int]
) -> None:
    if kind == "distributed" and stop[1] > 5:
        stop = (stop[0], 5)  # this rank's share: 20 samples, 5 batches
    torch.manual_seed(0)
    first = _loader(kind, workers)
    position = position_of(first, seed=5)
    whole, saved = _batches(first, position, 3, stop)
    assert saved is not None
    per_epoch = len(first)

    torch.manual_seed(123)  # another global RNG state: the order must not depend on it
    again = _loader(kind, workers)
    resumed = position_of(again, seed=5)
    resumed.load_state_dict(saved)
    rest, _ = _batches(again, resumed, 3, (-1, -1))
    done = stop[0] * per_epoch + stop[1]
    assert rest == whole[done:]


def test_the_iterator_draws_nothing_from_the_global_rng() -> None:
    loader = _loader("shuffle")
    position_of(loader, seed=0)
    before = torch.get_rng_state()
    for _ in loader:
        pass
    assert torch.equal(torch.get_rng_state(), before)


def test_the_loader_stays_what_it_was() -> None:
    loader = _loader("shuffle")
    position = position_of(loader, seed=0)
    assert isinstance(loader, DataLoader) and type(loader).__name__ == "DataLoader"
    assert position_of(loader, seed=0) is position  # one position per loader
    state = dckpt.TrainState(torch.nn.Linear(2, 2), data=loader)
    assert state.data is position


def test_a_copy_is_the_plain_loader_it_was() -> None:
    loader = _loader("shuffle")
    position_of(loader, seed=0)
    for copied in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert type(copied) is DataLoader and not hasattr(copied, "_dckpt_position")
        assert sum(len(b) for (b,) in copied) == 40


def test_a_global_batch_sampler_in_a_loader_is_kept_as_it_is() -> None:
    sampler = dckpt.GlobalBatchSampler(40, 8)
    loader = DataLoader(DATA, batch_sampler=sampler)
    assert dckpt.TrainState(torch.nn.Linear(2, 2), data=loader).data is sampler


def test_a_loader_built_differently_is_refused_in_words() -> None:
    saved = position_of(_loader("plain"), seed=0).state_dict()
    shuffling = position_of(_loader("shuffle"), seed=0)
    with pytest.raises(StateMismatchError, match="built differently"):
        shuffling.load_state_dict(saved)
    with pytest.raises(StateMismatchError, match="not a DataLoader's"):
        shuffling.load_state_dict(dckpt.GlobalBatchSampler(40, 8).state_dict())
