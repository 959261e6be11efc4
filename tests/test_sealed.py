"""dckpt/collective/sealed.py in one process, on a real store (a HashStore): a value is the
job's only when sealed for its own key under the job's secret. What an outside client of the
store can learn (every key's name, by listing them; every value, by reading them) is not
enough to seal one: a genuine value copied under another key, or a value sealed with anything
public, is ignored and named."""

from __future__ import annotations

import logging

import pytest
from torch.distributed import HashStore

from dckpt.collective import sealed


def test_a_sealed_value_reads_back_only_under_its_own_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = HashStore()
    prefix = sealed.register("the job's secret token")
    sealed.put(store, f"{prefix}/rank-0/mark", "1")
    assert sealed.get(store, f"{prefix}/rank-0/mark") == "1"
    # An outsider copies rank 0's genuine mark onto rank 1's key: not rank 1's.
    store.set(f"{prefix}/rank-1/mark", store.get(f"{prefix}/rank-0/mark"))
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        assert sealed.get(store, f"{prefix}/rank-1/mark") is None
    assert f"{prefix}/rank-1/mark" in caplog.text, caplog.text


def test_nothing_public_seals_a_value() -> None:
    """The key names an outsider lists (the prefix, the public name in it) are not the seal's
    secret: a stop flag sealed with them is not the job's."""
    store = HashStore()
    prefix = sealed.register("another secret token")
    name = prefix.split("/")[1]
    key = f"{prefix}/stop"
    for guess in (name.encode(), prefix.encode(), b"", key.encode()):
        store.set(key, sealed.Seal(guess).wrap(key, "1"))
        assert sealed.get(store, key) is None, guess
    sealed.put(store, key, "1")
    assert sealed.get(store, key) == "1"
