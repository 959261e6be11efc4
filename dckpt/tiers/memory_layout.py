"""Where the memory tier keeps its bytes on one node: names, private directories, and slots.

Each node has one directory on a memory-backed file system (``/dev/shm`` by default):
``MEMORY_DIR/node-<n>/``, mode 0700, every file in it 0600. It belongs to no process: the
job's ranks write their own files into it directly, so it outlives a worker's SIGKILL and a
torchrun restart, and is gone with the node (or with ``dckpt memory clear``).

```
node-<n>/
  own/step-XXXXXXXX/rank-<r>.mem            this node's ranks' files of memory step X
  own/step-XXXXXXXX/.rank-<r>.mem.part-<id> one in flight, or abandoned: never read (also
                                            ``.part-in``: a file arriving from another rank)
  replica/node-<k>/step-XXXXXXXX/rank-<r>.mem
                                            node k's files, kept for it: each renamed in
                                            only once it hashed to the writer's digest as it
                                            arrived from node k over torch.distributed
  spare/rank-<r>.mem@<tag>                  retired files whose pages the next file of that
                                            name reuses (one spare per name)
  last-restore.json                         the node's last memory resume (``dckpt plan``)
```

No manifest lives here: a memory checkpoint's manifest is in the durable root's ledger
(dckpt.root.memory_ledger), and a file here is only ever read after it hashed to the digest
that manifest records. So a file planted here, or left by a save that never committed, can
take up room but can never be restored.

``Slots`` is one rank's view of its files: each file is mapped once and stays mapped while
it is renamed between ``own/``, ``replica/`` and ``spare/``, so a save copies into pages that
are allocated and mapped already (mapping 128 MiB of tmpfs anew cost as long as copying into
it). Its footprint after the first save (which reserves a spare for each file) is its steady
state: ``memory_keep + 1`` copies of each file.

Knows files only, never tensors (no torch).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from ..root.layout import STEP_RE

__all__ = [
    "RESTORE_FILE",
    "Claim",
    "Slots",
    "Topology",
    "clean_abandoned",
    "clear",
    "file_name",
    "held",
    "held_steps",
    "node_dir",
    "own_dir",
    "part_name",
    "partner_of",
    "private_dir",
    "rank_of",
    "remove_node_files",
    "replica_dir",
    "spare_dir",
]

RESTORE_FILE = "last-restore.json"
"""The node's last resume from the memory tier (step, seconds, bytes, from where): the
restore cost ``dckpt plan`` uses."""
FILE_RE = re.compile(r"rank-([0-9]{5,})\.mem")
PART_RE = re.compile(r"\.rank-([0-9]{5,})\.mem\.part-[0-9a-z]+")
"""A file in flight: a save's (``-<save id>``) or one arriving from another rank (``-in``)."""
NODE_RE = re.compile(r"node-([0-9]+)")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Map every page in one call: faulting them in one by one as the copy touches them took
three times as long as the copy (128 MiB on /dev/shm: 0.044 s against 0.013 s)."""
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""madvise(MADV_POPULATE_WRITE), Linux 5.14+: the same for a mapping made already."""


def file_name(rank: int) -> str:
    return f"rank-{rank:05d}.mem"


def rank_of(name: str) -> int:
    m = FILE_RE.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a memory file name")
    return int(m.group(1))


def part_name(name: str, save_id: str) -> str:
    return f".{name}.part-{save_id}"


def node_dir(memory_dir: Path, node: int) -> Path:
    return Path(memory_dir) / f"node-{node}"


def own_dir(node: Path) -> Path:
    return node / "own"


def replica_dir(node: Path, of_node: int) -> Path:
    return node / "replica" / f"node-{of_node}"


def spare_dir(node: Path) -> Path:
    return node / "spare"


def partner_of(node: int, nodes: int) -> int | None:
    """The node that keeps ``node``'s replica: the next one on a ring over the node indices
    (with two nodes, each other's; with one, none). A ring, not fixed pairs, so an odd node
    count works and losing any one node leaves every other node's copies whole."""
    return None if nodes < 2 else (node + 1) % nodes


def private_dir(path: Path) -> Path:
    """Make ``path`` (and any missing parent) a directory only its owner may enter (0700),
    whatever the umask; an existing one is narrowed to 0700 too. Returns it."""
    missing: list[Path] = []
    probe = Path(path)
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another rank of the node made it
            d.mkdir(mode=0o700)
    for d in [*missing, Path(path)]:
        st = d.lstat()
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{d} is not a directory")
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o700:
            d.chmod(0o700)
    return Path(path)


def held(node: Path, step: int) -> dict[str, int]:
    """The files of memory step ``step`` this node holds, by name: their sizes (its own
    ranks' under ``own/``, other nodes' under ``replica/``). Regular files only."""
    return {name: size for s, _, name, size in held_steps(node) if s == step}


def held_steps(node: Path) -> list[tuple[int, str, str, int]]:
    """Every file this node holds: (step, where ("own" or "replica of node k"), name, bytes),
    for ``dckpt ls``."""
    rows: list[tuple[int, str, str, int]] = []
    places = [(own_dir(node), "own")]
    with contextlib.suppress(OSError):
        places += [
            (d, f"replica of node {m.group(1)}")
            for d in sorted((node / "replica").iterdir())
            if (m := NODE_RE.fullmatch(d.name))
        ]
    for parent, where in places:
        with contextlib.suppress(OSError):
            for step_entry in os.scandir(parent):
                m = STEP_RE.fullmatch(step_entry.name)
                if m is None or not step_entry.is_dir(follow_symlinks=False):
                    continue
                for entry in os.scandir(step_entry.path):
                    if FILE_RE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                        size = entry.stat(follow_symlinks=False).st_size
                        rows.append((int(m.group(1)), where, entry.name, size))
    return sorted(rows)


@dataclass
class Claim:
    """A file's mapping from ``Slots.claim``, and the allocation of its pages."""

    buffer: mmap.mmap
    fd: int
    ready: bool
    """Every page is allocated already (a file reused from an earlier save)."""

    def allocate(self, start: int, end: int) -> None:
        """Allocate the pages of ``[start, end)`` before anything is written there: OSError
        (ENOSPC) now, never SIGBUS in a writer later."""
        if not self.ready and end > start:
            os.posix_fallocate(self.fd, start, end - start)


@dataclass(frozen=True)
class Topology:
    """The nodes of this world, as learned at start by an all-gather: each rank's node."""

    node_of: tuple[int, ...]

    @property
    def nodes(self) -> int:
        return len(set(self.node_of))

    def ranks_of(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def partner(self, node: int) -> int | None:
        return partner_of(node, self.nodes)

    def replica_holder(self, rank: int) -> int | None:
        """The rank that keeps ``rank``'s replica: on the partner node, the rank at the same
        place among its node's ranks (modulo, when the nodes differ in size)."""
        node = self.node_of[rank]
        partner = self.partner(node)
        if partner is None:
            return None
        mates, holders = self.ranks_of(node), self.ranks_of(partner)
        return holders[mates.index(rank) % len(holders)]

    def kept_by(self, rank: int) -> list[int]:
        """The ranks whose replicas ``rank`` keeps."""
        return [r for r in range(len(self.node_of)) if self.replica_holder(r) == rank]

    def names_of(self, rank: int) -> set[str]:
        """The files ``rank`` looks after: its own and the replicas it keeps (only these may
        reuse its spares: the node's ranks share one ``spare/``)."""
        return {file_name(r) for r in [rank, *self.kept_by(rank)]}

    def replicas(self) -> dict[str, int]:
        """node -> the node that keeps its replica (JSON keys), for the manifest."""
        pairs = {n: self.partner(n) for n in sorted(set(self.node_of))}
        return {str(n): p for n, p in pairs.items() if p is not None}


class Slots:
    """One rank's files in its node's memory, each mapped once; see the module docstring.

    A mapping is keyed by its file's inode and holds the file open, so the inode cannot be
    reused by another file while it is mapped: a path that stats to a mapped inode is that
    very file, whatever it was renamed to.
    """

    def __init__(self, node: Path) -> None:
        self.node = Path(node)
        self.spares = spare_dir(self.node)
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}

    def _key(self, path: Path) -> tuple[int, int]:
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        return st.st_dev, st.st_ino

    def open(self, path: Path, size: int, *, spare_of: str | None = None) -> mmap.mmap:
        """A writable, fully allocated mapping of ``size`` bytes at ``path`` (made here): a
        spare called ``spare_of`` moved there if there is one (its pages reused), else a new
        file. Raises OSError (ENOSPC) when the memory file system cannot hold it, before a
        byte is written, so a full memory fails here and never with SIGBUS in a copy."""
        claim = self.claim(path, size, spare_of=spare_of)
        try:
            claim.allocate(0, size)
        except BaseException:
            self.drop(path)
            raise
        if not claim.ready:  # map every page now, in one call, not a fault per page later
            with contextlib.suppress(OSError, ValueError):  # before Linux 5.14: faults it is
                claim.buffer.madvise(_POPULATE_WRITE)
        return claim.buffer

    def claim(self, path: Path, size: int, *, spare_of: str | None = None) -> Claim:
        """``open`` without allocating the pages: the caller allocates each range before it
        writes into it (``Claim.allocate``), so a receive can start before the whole file is
        allocated (allocating 256 MiB of fresh tmpfs took 0.15 s here). A reused file is
        allocated and mapped already."""
        private_dir(path.parent)
        if not self._mapped(path, size) and (
            spare_of is None or not self._take_spare(spare_of, path)
        ):
            self.drop(path)
        try:
            key = self._key(path)
        except FileNotFoundError:
            key = None
        if key is not None and self._current(key, size):
            fd, mm = self._maps[key]  # every file this keeps mapped is wholly allocated
            return Claim(mm, fd, ready=True)
        if key is not None:
            self._forget(key)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        st = os.fstat(fd)
        self._maps[(st.st_dev, st.st_ino)] = (fd, mm)
        return Claim(mm, fd, ready=False)

    def _mapped(self, path: Path, size: int) -> bool:
        """Whether ``path`` is a file of ``size`` bytes this already maps (made ready ahead)."""
        try:
            key = self._key(path)
        except OSError:
            return False
        return self._current(key, size)

    def _current(self, key: tuple[int, int], size: int | None = None) -> bool:
        """Whether the mapping of ``key`` is there and still spans its whole file (of ``size``
        bytes): a file another process truncated is mapped again, never read past its end."""
        got = self._maps.get(key)
        if got is None:
            return False
        length = os.fstat(got[0]).st_size
        return len(got[1]) == length and (size is None or length == size)

    def view(self, path: Path) -> mmap.mmap:
        """The mapping of an existing file of this rank's (mapped now if it is not yet, or
        again if its size changed)."""
        key = self._key(path)
        if not self._current(key):
            self._forget(key)
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            try:
                mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | _POPULATE)
            except BaseException:
                os.close(fd)
                raise
            self._maps[key] = (fd, mm)
        return self._maps[key][1]

    def _take_spare(self, name: str, into: Path) -> bool:
        try:
            found = sorted(p for p in self.spares.iterdir() if p.name.split("@", 1)[0] == name)
        except OSError:
            return False
        for extra in found[1:]:
            self.drop(extra)
        if not found:
            return False
        self.drop(into)  # whatever is there goes, and its mapping with it
        try:
            os.rename(found[0], into)
        except OSError:
            return False
        return True

    def retire(self, path: Path, tag: str) -> None:
        """Move ``path`` to the spares (its pages and mapping kept for the next file of its
        name), or delete it when a spare of that name exists already; then remove its step
        directory if that was its last file."""
        name = path.name
        try:
            taken = any(p.name.split("@", 1)[0] == name for p in self.spares.iterdir())
        except OSError:
            taken = False
        if taken:
            self.drop(path)
        else:
            private_dir(self.spares)
            with contextlib.suppress(OSError):
                os.rename(path, self.spares / f"{name}@{tag}")
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only once empty: the other ranks' files stay

    def reserve(self, name: str, size: int) -> None:
        """Make sure a spare called ``name`` of ``size`` bytes exists, allocated and mapped, so
        the next file of that name costs no allocation or mapping, and a memory too small for
        two copies fails now, not at some later save. Raises OSError (ENOSPC) when it cannot."""
        private_dir(self.spares)
        found = [p for p in self.spares.iterdir() if p.name.split("@", 1)[0] == name]
        if any(p.stat().st_size == size for p in found):
            return
        for extra in found:  # the size changed (the first save wrote every tensor)
            self.drop(extra)
        self.open(self.spares / f"{name}@reserved", size)

    def drop(self, path: Path) -> None:
        """Delete ``path`` and let go of its mapping (its memory is freed)."""
        with contextlib.suppress(OSError):
            self._forget(self._key(path))
        with contextlib.suppress(OSError):
            path.unlink()

    def _forget(self, key: tuple[int, int]) -> None:
        got = self._maps.pop(key, None)
        if got is not None:
            fd, mm = got
            with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it
                mm.close()
            os.close(fd)

    def close(self) -> None:
        for key in list(self._maps):
            self._forget(key)


def remove_node_files(node: Path, names: set[str]) -> int:
    """Delete every file called one of ``names`` under ``node`` (own, replica, spare, parts),
    then every directory left empty; returns the bytes freed. For a job that ended with its
    newest checkpoint in the durable root (its memory is superseded)."""
    freed = 0
    for path in sorted(node.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        base = path.name.split("@", 1)[0]
        m = PART_RE.fullmatch(path.name)
        owned = base in names or (m is not None and file_name(int(m.group(1))) in names)
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink() and owned:
                freed += path.stat().st_size
                path.unlink()
            elif path.is_dir() and not path.is_symlink():
                path.rmdir()  # only when empty
    with contextlib.suppress(OSError):
        node.rmdir()
    return freed


def clean_abandoned(node: Path) -> None:
    """At start, on the node's first rank: files of saves in flight when the last workers
    died (``.part-`` names) are abandoned (no save runs yet)."""
    for path in node.rglob(".rank-*"):
        if PART_RE.fullmatch(path.name):
            with contextlib.suppress(OSError):
                path.unlink()


def clear(memory_dir: Path) -> int:
    """Remove a run's whole memory directory on this host; returns the bytes freed."""
    freed = 0
    for path in Path(memory_dir).rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                freed += path.stat().st_size
    shutil.rmtree(memory_dir, ignore_errors=True)
    return freed
