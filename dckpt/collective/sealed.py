"""Values dckpt keeps in the job's store, sealed: one that the job's ranks did not write is
ignored and named, never acted on.

Role: torch's TCPStore serves any client that reaches its port. ``list_keys`` shows it every
key (the random token in dckpt's key names hides nothing from it), and ``set``,
``compare_set``, ``delete_key`` and ``add`` reach every one of them. Values planted under
dckpt's keys ended a job (a gate's "wait longer" that did not parse; meetings taken and
marked abandoned, which failed the memory replicas), and could stop a healthy save (a stop
flag), send a rank on before rank 0 had opened the root, or hide a late rank.

So every value dckpt writes under its keys carries a seal: HMAC-SHA256 (128 bits of it) of
the key and the value, under a secret that only the job's ranks hold. Rank 0 draws the
secret (``CheckpointManager``: ``secrets.token_hex(16)``, its "token") and sends it over
dckpt's own gloo group, never through the store; ``register`` derives two things from it,
one-way: the public name the keys go under (``dckpt/<name>``) and the seal's key. A client
of the store sees the name, never the secret, so it cannot seal a value; and a value is
sealed with its key, so a genuine value copied under another key (another rank's mark,
another save's flag) fails too.

Invariants:
- Every read of a value dckpt wrote (``get``, ``get_many``, ``claim``) returns its payload only
  when the seal holds; a value whose seal fails reads as absent, so the reader goes on waiting
  for its own value, within the deadline it already had. It is named once per key in a
  warning (the key, what was wrong, that something outside the job writes its store).
- ``claim`` (the meetings' atomic "first one wins") replaces a forged value atomically
  (``compare_set`` from that very value), so a genuine value written meanwhile is never lost.
- Nothing here adds a collective, and a seal costs microseconds: what a save, a step or a
  heartbeat pays does not change with it.

What a seal cannot stop, and the README says: a client of the store that deletes or
overwrites a genuine value, or keeps racing to replace it, makes that value absent: the
meeting or wait it served ends at its deadline, with the usual error naming the late rank.
A genuine value written again under its own key later (a replay) still opens: every key
that decides something is used once (a meeting's number, a save's id, one gate per
manager), the gate's "wait longer" counts only when newer than the last, and a heartbeat or
phase mark played back only changes the words of an error. dckpt makes no ``add`` on the
store (a counter cannot carry a seal). torch's own uses of the store (the rendezvous, the
groups' addresses, their barriers) are torch's and unsealed: a writer there can break a
group as it forms, or point gloo at its own address before the pair connects (the secret
then travels over that connection): keep the store's port reachable from the job's hosts
only.

A key under no registered token (``Comm`` used without a manager, in tests) is sealed under
an empty secret, which proves nothing: the format is the same, the protection is not there.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import threading
import time
from typing import Any

from .store import HINT_S, StoreUnreachableError, call

__all__ = [
    "MAC_CHARS",
    "Seal",
    "claim",
    "get",
    "get_many",
    "put",
    "register",
    "seal_for",
    "wait",
]

log = logging.getLogger("dckpt")

MAC_CHARS = 32
"""Hex characters of the seal: 128 bits of HMAC-SHA256, after a ``#`` at the value's end."""
NAMED_AT_MOST = 32
"""Forged keys named one by one; past this many, one more line and then silence (an outside
writer that plants thousands of keys does not fill the job's log)."""
CLAIM_TRIES = 16
"""Atomic replacements of a forged value ``claim`` tries before it gives up (a writer that
wins every race against the ranks): the meeting is then not met, as at its deadline."""
POLL_S = 0.5
"""While a forged value stands under a key a rank waits on, how often it looks again (the
store's own wait returns at once on a key that exists)."""
RETRY_S = 0.2
"""How soon a wait looks again after the store did not answer (calls fail at once while the
one that timed out still waits: dckpt.collective.store)."""

_lock = threading.Lock()
_seals: dict[str, Seal] = {}  # a token's public name -> its seal (a few per process)
_named: set[str] = set()


class Seal:
    """The seal of one job's values: ``wrap`` a payload for its key, ``open`` it back."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def mac(self, key: str, payload: str) -> str:
        raw = key.encode() + b"\0" + payload.encode()
        return hmac.new(self._secret, raw, hashlib.sha256).hexdigest()[:MAC_CHARS]

    def wrap(self, key: str, payload: str) -> str:
        """The value to store under ``key``: ``payload#<seal>``."""
        return f"{payload}#{self.mac(key, payload)}"

    def open(self, key: str, raw: bytes | str) -> str | None:
        """``raw``'s payload when its seal is this job's for ``key``; else None, and the key
        is named in a warning (once)."""
        payload, why = self._check(key, raw)
        if why is not None:
            _name(key, why)
        return payload

    def _check(self, key: str, raw: bytes | str) -> tuple[str | None, str | None]:
        try:
            text = raw.decode() if isinstance(raw, bytes) else raw
        except UnicodeDecodeError:
            return None, "not text"
        payload, sep, mac = text.rpartition("#")
        if not sep or len(mac) != MAC_CHARS:
            return None, "it carries no seal"
        if not hmac.compare_digest(mac, self.mac(key, payload)):
            return None, "its seal is not this job's for this key"
        return payload, None


_UNSEALED = Seal(b"")


def _derive(token: str, what: bytes) -> bytes:
    return hmac.new(token.encode(), b"dckpt store " + what, hashlib.sha256).digest()


def register(token: str) -> str:
    """The key prefix of the job whose secret is ``token`` (``dckpt/<public name>``), its
    seal registered for every key under it. The name is a one-way function of the token, so
    listing the store's keys tells nothing of the secret."""
    name = _derive(token, b"names").hex()[:32]
    with _lock:
        _seals[name] = Seal(_derive(token, b"seal"))
    return f"dckpt/{name}"


def seal_for(key: str) -> Seal:
    """The seal of the job ``key`` belongs to (by its ``dckpt/<name>/`` prefix); the empty
    secret's under no registered name."""
    parts = key.split("/", 2)
    found = _seals.get(parts[1]) if len(parts) > 2 and parts[0] == "dckpt" else None
    return found if found is not None else _UNSEALED


def _name(key: str, why: str) -> None:
    """The warning for a value that failed its seal: once per key, ``NAMED_AT_MOST`` keys."""
    with _lock:
        if key in _named or len(_named) > NAMED_AT_MOST:
            return
        _named.add(key)
        more = len(_named) > NAMED_AT_MOST
    if more:
        log.warning(
            "dckpt: more values in the job's store that this job's ranks did not write were "
            "ignored; they are no longer named one by one"
        )
        return
    log.warning(
        "dckpt: ignored the value under %s in the job's store: %s, so this job's ranks did not "
        "write it. Something outside this job writes to its store (torch's TCPStore takes "
        "writes from any client that reaches its port). dckpt acts only on its own values: "
        "it goes on waiting for the real one, at worst until its deadline. Keep the store's "
        "port (MASTER_PORT, or the rendezvous endpoint) reachable from the job's hosts only.",
        key,
        why,
    )


def put(store: Any, key: str, payload: str) -> None:
    """Set ``key`` to ``payload``, sealed (one store call, with its deadline)."""
    call(store.set, key, seal_for(key).wrap(key, payload))


def get(store: Any, key: str) -> str | None:
    """``key``'s payload; None when it is not set or its seal fails. Never waits for it."""
    if not call(store.check, [key]):
        return None
    return seal_for(key).open(key, call(store.get, key))


def get_many(store: Any, keys: list[str]) -> list[str | None]:
    """Each key's payload (None where not set or forged): two store calls when every key is
    set, the usual case, else one or two per key. Never waits for a key."""
    if keys and call(store.check, keys):
        raws = call(store.multi_get, keys)
        return [seal_for(k).open(k, raw) for k, raw in zip(keys, raws, strict=True)]
    return [get(store, key) for key in keys]


def claim(store: Any, key: str, payload: str) -> str | None:
    """Set ``key`` to ``payload`` unless it already holds a genuine value: the payload the key
    holds after (``payload`` when this call set it, another rank's when that rank was first).
    A forged value there is replaced atomically (``compare_set`` from that very value: a
    genuine one written meanwhile stays). None after ``CLAIM_TRIES`` forged values in a row:
    an outside writer that keeps winning the race, for which the caller fails as at its
    deadline."""
    seal = seal_for(key)
    mine = seal.wrap(key, payload).encode()
    expected: bytes = b""
    for _ in range(CLAIM_TRIES):
        got = bytes(call(store.compare_set, key, expected, mine))
        if got == mine:
            return payload
        if expected and got == expected:
            # TCPStore answers a compare_set on an absent key with the value expected: the
            # forged value was deleted meanwhile; try again on an absent key.
            expected = b""
            continue
        found = seal.open(key, got)
        if found is not None:
            return found
        expected = got  # forged: replaced only if it is still that very value
    return None


def wait(store: Any, key: str, seconds: float) -> str | None:
    """Wait up to ``seconds`` for a genuine value under ``key``: its payload, or None when
    none came in time. The store's wait returns the moment the key is set; a forged value
    there is named and the wait goes on, looking again every ``POLL_S`` (a key that exists
    makes the store's wait return at once). A call the store did not answer in time (its
    wait, or the read of the value after it) is made again while ``seconds`` last: a store
    that stalls and answers again costs the wait the stall. StoreUnreachableError when it
    still did not answer at the end."""
    end = time.monotonic() + seconds
    lost: StoreUnreachableError | None = None  # the store at the last look, if it failed
    while True:
        left = end - time.monotonic()
        if left <= 0:
            if lost is not None:
                raise lost
            return None
        try:
            call(store.wait, [key], datetime.timedelta(seconds=left), deadline_s=left + HINT_S)
        except StoreUnreachableError as exc:
            lost = exc
            time.sleep(min(RETRY_S, max(end - time.monotonic(), 0.0)))
            continue
        except RuntimeError:  # timed out (DistStoreError, a RuntimeError, where typed)
            return None
        try:
            found = get(store, key)
        except StoreUnreachableError as exc:  # the key is there; its read did not answer
            lost = exc
            time.sleep(min(RETRY_S, max(end - time.monotonic(), 0.0)))
            continue
        lost = None
        if found is not None:
            return found
        time.sleep(min(POLL_S, max(end - time.monotonic(), 0.0)))  # forged, or deleted since
