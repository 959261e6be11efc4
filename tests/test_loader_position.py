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


Saved = tuple[dict[str, Any], dict[str, Any]]


def _save(position: LoaderPosition) -> Saved:
    """What a checkpoint holds of it: the position (global) and this rank's order."""
    return position.state_dict(), copy.deepcopy(position.order.state_dict())


def _load(position: LoaderPosition, saved: Saved) -> None:
    position.load_state_dict(saved[0])
    position.order.load_state_dict(saved[1])


def _batches(loader: DataLoader[Any], position: LoaderPosition, epochs: int, stop: tuple[int, int]
             ) -> tuple[list[list[int]], Saved | None]:  # fmt: skip
    """What ``epochs`` epochs yield, and the state saved after batch ``stop[1]`` of epoch
    ``stop[0]`` (the DistributedSampler's epoch set by the loop, as scripts do); a stop at
    batch 0 of an epoch saves between that epoch and the one before, where a script that
    saves every epoch does."""
    seen: list[list[int]] = []
    saved = None
    for epoch in range(position.epoch, epochs):
        if stop == (epoch, 0):
            saved = _save(position)
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for i, (batch,) in enumerate(loader):
            seen.append(batch.tolist())
            if (epoch, i + 1) == stop:
                saved = _save(position)
    return seen, saved


@pytest.mark.parametrize("kind", ["shuffle", "distributed", "plain"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [(0, 3), (1, 1), (1, 10), (2, 0)])
def test_a_rebuilt_loader_continues_with_the_next_batch(
    kind: str, workers: int, stop: tuple[int, int]
) -> None:
    if kind == "distributed" and stop[1] > 5:
        stop = (stop[0], 5)  # this rank's share: 20 samples, 5 batches
    torch.manual_seed(0)
    first = _loader(kind, workers)
    position = position_of(first)
    whole, saved = _batches(first, position, 3, stop)
    assert saved is not None
    per_epoch = len(first)

    torch.manual_seed(123)  # another global RNG state: the order must not depend on it
    again = _loader(kind, workers)
    resumed = position_of(again)
    _load(resumed, saved)
    rest, _ = _batches(again, resumed, 3, (-1, -1))
    done = stop[0] * per_epoch + stop[1]
    assert rest == whole[done:]


def test_a_loop_left_early_then_saved_resumes_with_the_next_order() -> None:
    """``break`` after 2 batches, save: the next iteration draws a new order; so does the
    resumed one, and the epoch stays (as Accelerate counts it)."""
    torch.manual_seed(0)
    first = _loader("shuffle")
    position = position_of(first)
    for i, _ in enumerate(first):
        if i == 1:
            break
    saved = _save(position)
    assert saved[0]["epoch"] == 0 and saved[0]["batches"] == 0
    expected = [b.tolist() for (b,) in first]
    again = _loader("shuffle")
    _load(position_of(again), saved)
    assert [b.tolist() for (b,) in again] == expected


def test_ranks_seeded_apart_shuffle_apart_and_alike_alike() -> None:
    """A shuffling loader without a generator gets one from one draw of the global RNG: as
    before dckpt, ranks seeded alike draw the same order and ranks seeded apart do not."""

    def order(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        loader = _loader("shuffle")
        position_of(loader)
        return [b.tolist() for (b,) in loader]

    assert order(1) == order(1) and order(1) != order(2)


def test_a_copy_made_by_its_type_iterates_as_a_plain_loader() -> None:
    loader = _loader("plain")
    position_of(loader)
    made = type(loader)(DATA, batch_size=4)  # Lightning re-instantiates loaders so
    assert sum(len(b) for (b,) in made) == 40


def test_persistent_workers_past_the_first_epoch_are_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loader = DataLoader(DATA, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)
    position = position_of(loader)
    with caplog.at_level("WARNING", logger="dckpt"):
        position.load_state_dict({"kind": "loader", "epoch": 0, "batches": 3})
        assert not caplog.records
        position.load_state_dict({"kind": "loader", "epoch": 1, "batches": 3})
    assert "persistent_workers=True" in caplog.text and "persistent_workers=False" in caplog.text


def test_the_iterator_draws_nothing_from_the_global_rng() -> None:
    loader = _loader("shuffle")
    position_of(loader)
    before = torch.get_rng_state()
    for _ in loader:
        pass
    assert torch.equal(torch.get_rng_state(), before)


def test_the_loader_stays_what_it_was() -> None:
    loader = _loader("shuffle")
    position = position_of(loader)
    assert isinstance(loader, DataLoader) and type(loader).__name__ == "DataLoader"
    assert position_of(loader) is position  # one position per loader
    state = dckpt.TrainState(torch.nn.Linear(2, 2), data=loader)
    assert state.data is position
    assert state.extra["dckpt_data_order"].obj is position.order  # per rank
    assert state.extra["dckpt_data_order"].on_resize == "fresh"


def test_a_copy_is_the_plain_loader_it_was() -> None:
    loader = _loader("shuffle")
    position_of(loader)
    for copied in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert type(copied) is DataLoader and not hasattr(copied, "_dckpt_position")
        assert sum(len(b) for (b,) in copied) == 40


def test_a_global_batch_sampler_in_a_loader_is_kept_as_it_is() -> None:
    sampler = dckpt.GlobalBatchSampler(40, 8)
    loader = DataLoader(DATA, batch_sampler=sampler)
    assert dckpt.TrainState(torch.nn.Linear(2, 2), data=loader).data is sampler


def test_a_loader_built_differently_is_refused_in_words() -> None:
    plain = position_of(_loader("plain"))
    shuffling = position_of(_loader("shuffle"))
    with pytest.raises(StateMismatchError, match="built differently"):
        shuffling.order.load_state_dict(plain.order.state_dict())
    # one generator shared by loader and sampler against two of their own: a subset of the
    # saved names is no match either (DCP would have filled the one the template names)
    g = torch.Generator().manual_seed(0)
    shared = position_of(DataLoader(DATA, batch_size=4, shuffle=True, generator=g))
    with pytest.raises(StateMismatchError, match="built differently"):
        shared.order.load_state_dict(shuffling.order.state_dict())
    with pytest.raises(StateMismatchError, match="not a DataLoader's"):
        shuffling.load_state_dict(dckpt.GlobalBatchSampler(40, 8).state_dict())
