"""The node's memory back after a memory resume: what arrived into the state, put back behind it.

A rank whose files arrived from another node straight into its state (dckpt.load.memory,
``StreamFill``) has none of them in its node's memory: ``refill`` writes each back (its
``own/`` or ``replica/`` place, as a file received into memory would be) in a thread, from
the bytes the transfer kept (header, non-tensor values, padding, another rank's RNG) and the
live tensors it filled, and returns the wait that must end before the state changes or the
node's memory is used again (``LoadResult.behind``: the first optimizer step, a save, a
resume, ``close``; dckpt.load.resumer.Resumer.settle).

Invariants: a file is named in the node's memory only once it hashed, through the mapping it
was written into, to the writer's digest from the root's ledger; a state that changed first
(a write through ``.data``, a buffer a forward pass updates) hashes otherwise, and that copy
is dropped, said in a warning (the next memory save writes it); the thread never raises past
itself, and its wait ends within ``timeout_s`` (then it is told to stop between two pieces).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from ..errors import CheckpointError
from ..faults import fault_point
from ..phases import Phase
from ..root.manifest import Manifest
from ..storage.digest import READ_CHUNK, format_digest, new_hasher
from ..storage.memory_file import StreamFill
from ..storage.records import FileRecord
from .memory import MemorySource

__all__ = ["refill"]

log = logging.getLogger("dckpt")


def refill(
    source: MemorySource, step: int, manifest: Manifest, streamed: dict[str, StreamFill]
) -> Callable[[float], None]:
    """Write the files that arrived straight into this rank's state back into this node's
    memory (its ``own/`` or ``replica/`` place, as a file received into memory would be),
    in a thread, behind the resume: each from the bytes the transfer kept and the live
    tensors it filled, hashed through the mapping it was written into and named only if
    that matched the writer's digest. A state that changed before its copy was taken
    hashes otherwise: that copy is dropped, and said (the next memory save writes it).

    Returns the wait (its deadline in seconds) that must end before the state changes or
    the node's memory is used again: the first optimizer step, a save, a resume, close."""
    records = manifest.file_map()
    done, cancel = threading.Event(), threading.Event()
    said: list[str] = []
    t0 = time.perf_counter()

    def run() -> None:
        try:
            fault_point(Phase.MEMORY_REFILL, source.rank, step)
            for name, sink in streamed.items():
                said.append(_refill_one(source, step, name, sink, records[name], cancel))
        except Exception as exc:  # never past this thread: the resume is done
            said.append(f"failed: {exc}")
        finally:
            done.set()

    thread = threading.Thread(target=run, name="dckpt-memory-refill", daemon=True)
    thread.start()

    def wait(timeout_s: float) -> None:
        t_wait = time.perf_counter()
        if not done.wait(timeout_s):
            cancel.set()  # it stops between two pieces, and drops its part file
            done.wait(timeout_s)
        waited = time.perf_counter() - t_wait
        what = ", ".join(f"{n} {w}" for n, w in zip(streamed, said, strict=False))
        line = (
            f"dckpt: memory tier: rank {source.rank} put memory step {step}'s files back "
            f"into node {source.node}'s memory behind the resume ({what}; "
            f"{time.perf_counter() - t0:.2f} s, of which the state waited {waited:.2f} s)"
        )
        if all(w == "kept" for w in said) and len(said) == len(streamed):
            log.info("%s", line)
        else:
            log.warning("%s: the next memory save writes them", line)

    return wait


def _refill_one(
    source: MemorySource,
    step: int,
    name: str,
    sink: StreamFill,
    record: FileRecord,
    cancel: threading.Event,
) -> str:
    """One file back into this node's memory: "kept", or why not."""
    path = source.place(step, name)
    part = path.with_name(f".{name}.part-in")
    try:
        claim = source.slots.open(
            part, record.bytes, spare_of=name if name in source.names else None
        )
    except OSError as exc:
        return f"not kept (this node's memory cannot hold it: {exc})"
    buf = claim.buffer
    for at, data in sink.image():
        if cancel.is_set():
            source.slots.drop(part)
            return "not kept (the state was about to change first)"
        if isinstance(data, torch.Tensor):
            if data.numel():
                dst = torch.frombuffer(buf, dtype=torch.uint8, count=data.numel(), offset=at)
                dst.copy_(data)
                del dst  # the mapping cannot close while a tensor views it
        else:
            buf[at : at + len(data)] = data
    algorithm = record.digest.split(":", 1)[0]
    hasher = new_hasher(algorithm)
    view = memoryview(buf)
    for start in range(0, record.bytes, READ_CHUNK):  # pieces: the training goes on
        hasher.update(view[start : min(start + READ_CHUNK, record.bytes)])
    del view
    if format_digest(algorithm, hasher) != record.digest:
        source.slots.drop(part)
        return "not kept (the state changed before its copy was taken)"
    try:
        source.slots.drop(path)
        source.slots.rename(part, path, key=claim.key)
    except (OSError, CheckpointError) as exc:
        source.slots.drop(part)
        return f"not kept (cannot name {path}: {exc})"
    return "kept"
