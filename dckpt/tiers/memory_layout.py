"""Where the memory tier keeps its bytes on one node: names, private directories, and slots.

Each node has one directory on a memory-backed file system (``/dev/shm`` by default):
``MEMORY_DIR/node-<n>/``, mode 0700, every file in it 0600. It belongs to no process: the
job's ranks write their own files into it directly, so it outlives a worker's SIGKILL and a
torchrun restart, and is gone with the node (or with ``dckpt memory clear``).

``/dev/shm`` is writable by every local user, so the directory is the job's own only once
proven (``claim_memory_dir``, at start, on each node): every directory from the job's base
(``/dev/shm/dckpt-<uid>``, or the ``memory_dir`` given) down is made 0700 or proven owned by
the job's user, never through a link, and the parents above are writable by no one else
unless sticky (dckpt.owned). A directory that fails is refused by name and owner, and the
memory tier is off for that start (the durable tier goes on). ``MEMORY_DIR/.dckpt-root``
names the root the directory serves: a job of another root refuses it, and ``clear`` frees
only the named root's.

```
.dckpt-root                                 {"id": the root's memory identity, "root": ...}
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
import errno
import json
import mmap
import os
import re
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..owned import NotOwnedError, create_new, file_mode, open_dir, owner_name, private_tree
from ..root.layout import STEP_RE, read_small_file

__all__ = [
    "RESTORE_FILE",
    "ROOT_FILE",
    "Claim",
    "Slots",
    "Topology",
    "claim_memory_dir",
    "clean_abandoned",
    "clear",
    "file_name",
    "held",
    "held_steps",
    "memory_dir_root",
    "memory_name",
    "node_dir",
    "own_dir",
    "part_name",
    "partner_of",
    "rank_of",
    "remove_node_files",
    "replica_dir",
    "spare_dir",
]

ROOT_FILE = ".dckpt-root"
"""In the memory directory: the root whose memory tier it holds (JSON ``{"id": the root's
memory identity, "root": its path or URL}``), written at its first use; a job of another
root refuses the directory."""
RESTORE_FILE = "last-restore.json"
"""The node's last resume from the memory tier (step, seconds, bytes, from where): the
restore cost ``dckpt plan`` uses."""
FILE_RE = re.compile(r"rank-([0-9]{5,})\.mem")
PART_RE = re.compile(r"\.rank-([0-9]{5,})\.mem\.part-[0-9a-z]+")
"""A file in flight: a save's (``-<save id>``) or one arriving from another rank (``-in``)."""
NODE_RE = re.compile(r"node-([0-9]+)")
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
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


def claim_memory_dir(memory_dir: Path, base: Path, root_id: str, root_name: str) -> Path:
    """Make or prove ``memory_dir`` this job's, for the root whose memory identity is
    ``root_id`` (``MemoryLedger.identity``; ``root_name``: its path or URL, for people):
    every directory from ``base`` (the job's own part: ``/dev/shm/dckpt-<uid>`` by default, or
    ``memory_dir`` itself when it was given) down to it made 0700 or proven owned by the job's
    user, and the directories above it writable by no one else unless sticky
    (dckpt.owned.private_tree); then its ``.dckpt-root`` must name ``root_id`` (written at
    first use: a directory of an older dckpt, proven the user's own, is adopted). Raises
    ``NotOwnedError`` naming the directory and its owner, or the root it serves. Returns it
    on its real path."""
    real = private_tree(memory_dir, base)
    fd = open_dir(real)
    try:
        raw = read_small_file(ROOT_FILE, 4096, dir_fd=fd)
        if raw is None:  # written whole under another name, then linked: never seen half
            tmp = f".{ROOT_FILE}.tmp-{uuid.uuid4().hex}"
            with os.fdopen(create_new(tmp, dir_fd=fd), "wb") as f:
                f.write(json.dumps({"id": root_id, "root": root_name}).encode())
            try:
                with contextlib.suppress(FileExistsError):  # another node's rank was first
                    os.link(tmp, ROOT_FILE, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            finally:
                os.unlink(tmp, dir_fd=fd)
            raw = read_small_file(ROOT_FILE, 4096, dir_fd=fd)
        owner = _root_of(raw)
        st = os.stat(ROOT_FILE, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        raise NotOwnedError(
            f"{real / ROOT_FILE} belongs to {owner_name(st.st_uid)}, not to this job's user"
        )
    if owner is None or owner[0] != root_id:
        if owner is not None and owner[1] == root_name:
            # The same place, another root: `dckpt memory clear` would refuse it too (it
            # frees only this root's), and the earlier root may live on elsewhere (a move
            # keeps the identity), so nothing says its memory is garbage: the user decides.
            raise NotOwnedError(
                f"{real} holds the memory tier of an earlier root at {root_name} (memory "
                f"identity {owner[0]}; this root's is {root_id}: the root was made again "
                f"there, or moved away): two roots never share a memory directory. Give this "
                f"job a memory_dir of its own, or, if that earlier root is gone for good, "
                f"remove the directory: rm -r {real}"
            )
        name = owner[1] if owner is not None else "ROOT"
        whose = owner[1] if owner is not None else "a root its .dckpt-root does not name"
        raise NotOwnedError(
            f"{real} holds the memory tier of {whose}, not of {root_name}: two roots never "
            f"share a memory directory. Give this job a memory_dir of its own, or free that "
            f"one: dckpt memory clear {name} --memory-dir {real}"
        )
    return real


def memory_dir_root(memory_dir: Path) -> tuple[str, str] | None:
    """The root a memory directory serves (its ``.dckpt-root``): (memory identity, path or
    URL); None if it names none."""
    try:
        fd = open_dir(memory_dir)
    except OSError:
        return None
    try:
        return _root_of(read_small_file(ROOT_FILE, 4096, dir_fd=fd))
    finally:
        os.close(fd)


def _root_of(raw: bytes | None) -> tuple[str, str] | None:
    try:
        doc = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    ident, name = doc.get("id"), doc.get("root")
    return (ident, name) if isinstance(ident, str) and isinstance(name, str) else None


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
    key: tuple[int, int] = (0, 0)
    """The file's (device, inode): ``Slots.mapping`` gives its bytes back by it."""

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
    reused by another file while it is mapped: a name that stats to a mapped inode is that
    very file, whatever it was renamed to. Every file is created here (``O_EXCL``, never
    through a link) or was proven this user's own, regular, with one name, before it is
    reused; bytes are only ever read back through the mapping they were written through
    (``mapping``), never by opening a name again; renames are made relative to directory
    descriptors and checked to have moved the mapped inode.
    """

    def __init__(self, node: Path) -> None:
        self.node = Path(node)
        self.spares = spare_dir(self.node)
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}

    def _key(self, path: Path) -> tuple[int, int]:
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return st.st_dev, st.st_ino

    def _dir(self, path: Path) -> None:
        """``path`` (under this node's directory) exists, made or proven private."""
        private_tree(path, self.node)

    def open(self, path: Path, size: int, *, spare_of: str | None = None) -> Claim:
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
        return claim

    def claim(self, path: Path, size: int, *, spare_of: str | None = None) -> Claim:
        """``open`` without allocating the pages: the caller allocates each range before it
        writes into it (``Claim.allocate``), so a receive can start before the whole file is
        allocated (allocating 256 MiB of fresh tmpfs took 0.15 s here). A reused file is
        allocated and mapped already."""
        self._dir(path.parent)
        if not self._mapped(path, size) and (
            spare_of is None or not self._take_spare(spare_of, path)
        ):
            self.drop(path)
        try:
            key = self._key(path)
        except OSError:
            key = None
        if key is not None and self._current(key, size):
            fd, mm = self._maps[key]  # every file this keeps mapped is wholly allocated
            return Claim(mm, fd, ready=True, key=key)
        reused: int | None = None
        if key is not None:  # a spare of another process of this job: reused once proven
            self._forget(key)
            reused = _open_own(path, key)
            if reused is None:
                self.drop(path)
        fd = reused if reused is not None else create_new(path, flags=os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        self._maps[key] = (fd, mm)
        return Claim(mm, fd, ready=False, key=key)

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

    def mapping(self, key: tuple[int, int]) -> mmap.mmap:
        """The mapping this rank wrote the file ``key`` through (``Claim.key``): the bytes it
        wrote, whatever any name now points to. OSError when it holds none."""
        if not self._current(key):
            raise OSError(errno.ENOENT, "this rank holds no mapping of that file (freed?)")
        return self._maps[key][1]

    def mapped_at(self, path: Path) -> mmap.mmap:
        """The mapping of the file at ``path``, only if it is one this rank created or proved
        and holds mapped (never a file opened by its name now): OSError otherwise."""
        key = self._key(path)
        if not self._current(key):
            raise OSError(errno.EPERM, "not a file this rank wrote or received", str(path))
        return self._maps[key][1]

    def rename(self, src: Path, dst: Path, *, key: tuple[int, int] | None = None) -> None:
        """Move ``src`` to ``dst`` (replacing it), both in directories of this node,
        relative to their descriptors; the name must then be the inode ``key`` (the file
        this rank wrote; by default, the one at ``src`` now). ``NotOwnedError`` when it is
        not: another process swapped a file in, and it is not used."""
        self._dir(dst.parent)
        before = self._key(src) if key is None else key
        sfd, dfd = open_dir(src.parent), open_dir(dst.parent)
        try:
            os.rename(src.name, dst.name, src_dir_fd=sfd, dst_dir_fd=dfd)
            st = os.stat(dst.name, dir_fd=dfd, follow_symlinks=False)
            swapped = (st.st_dev, st.st_ino) != before
            if swapped:  # not this rank's file: it never keeps the name
                with contextlib.suppress(OSError):
                    os.unlink(dst.name, dir_fd=dfd)
        finally:
            os.close(sfd)
            os.close(dfd)
        if swapped:
            raise NotOwnedError(
                f"{dst} is not the file renamed there from {src}: another process replaced "
                "it; not used"
            )

    def _take_spare(self, name: str, into: Path) -> bool:
        found = self._spares(name)
        for extra in found[1:]:
            self.drop(extra)
        if not found:
            return False
        self.drop(into)  # whatever is there goes, and its mapping with it
        try:
            self.rename(found[0], into)
        except (OSError, NotOwnedError):
            return False
        return True

    def _spares(self, name: str) -> list[Path]:
        """The spares called ``name``: regular files (a link or directory there is never
        taken), oldest tag first."""
        try:
            entries = list(os.scandir(self.spares))
        except OSError:
            return []
        return sorted(
            Path(e.path)
            for e in entries
            if e.name.split("@", 1)[0] == name and e.is_file(follow_symlinks=False)
        )

    def retire(self, path: Path, tag: str) -> None:
        """Move ``path`` to the spares (its pages and mapping kept for the next file of its
        name: a file in flight, ``.part-``, counts as the file it was to become), or delete
        it when a spare of that name exists already; then remove its step directory if that
        was its last file. (A failed save's part kept under its own name was never reused
        nor freed: one more file per failed save.)"""
        name = memory_name(path.name)
        if self._spares(name):
            self.drop(path)
        else:
            with contextlib.suppress(OSError, NotOwnedError):
                self.rename(path, self.spares / f"{name}@{tag}")
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only once empty: the other ranks' files stay

    def reserve(self, name: str, size: int) -> None:
        """Make sure a spare called ``name`` of ``size`` bytes exists, allocated and mapped, so
        the next file of that name costs no allocation or mapping, and a memory too small for
        two copies fails now, not at some later save. Raises OSError (ENOSPC) when it cannot."""
        self._dir(self.spares)
        found = self._spares(name)
        if any(p.lstat().st_size == size for p in found):
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


def _open_own(path: Path, key: tuple[int, int]) -> int | None:
    """``path`` opened for writing if it is still the file ``key`` and provably this user's
    own (a regular file, one name, owned by the job's user): a spare an earlier process of
    this job left. None otherwise (never written into, never chmod-ed)."""
    try:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    st = os.fstat(fd)
    if (
        (st.st_dev, st.st_ino) != key
        or not stat.S_ISREG(st.st_mode)
        or st.st_uid != os.geteuid()
        or st.st_nlink != 1
    ):
        os.close(fd)
        return None
    if stat.S_IMODE(st.st_mode) != file_mode():
        os.fchmod(fd, file_mode())
    return fd


def _walk_own(top: Path) -> list[tuple[Path, os.stat_result]]:
    """Every entry under ``top``, deepest first, never through a link (each directory read
    through a descriptor opened without following one)."""
    found: list[tuple[Path, os.stat_result]] = []
    try:
        walker = os.fwalk(top, topdown=False, follow_symlinks=False)
        for dirpath, dirnames, filenames, dfd in walker:
            for name in [*filenames, *dirnames]:
                with contextlib.suppress(OSError):
                    found.append(
                        (Path(dirpath) / name, os.stat(name, dir_fd=dfd, follow_symlinks=False))
                    )
    except OSError:
        pass
    return found


def memory_name(name: str) -> str:
    """The memory file a name stands for: a file in flight (``.part-``) or a spare of either
    (``@tag``) counts as the rank's own ``rank-<r>.mem``; any other name as itself."""
    base = name.split("@", 1)[0]
    m = PART_RE.fullmatch(base)
    return file_name(int(m.group(1))) if m is not None else base


def _is_memory_file(name: str, names: set[str] | None) -> bool:
    """A file of dckpt's in a node directory: a memory file (one of ``names``, or any when
    None), in flight, or a spare of one."""
    base = memory_name(name)
    if not FILE_RE.fullmatch(base):
        return False
    return names is None or base in names


def remove_node_files(node: Path, names: set[str] | None) -> int:
    """Delete the memory files under ``node`` called one of ``names`` (every memory file when
    None; own, replica, spare, in flight), only regular files of the job's user, then every
    directory left empty; returns the bytes freed. Nothing else there is touched, and no link
    is followed."""
    freed = 0
    me = os.geteuid()
    for path, st in _walk_own(node):
        with contextlib.suppress(OSError):
            if stat.S_ISREG(st.st_mode) and st.st_uid == me and _is_memory_file(path.name, names):
                path.unlink()
                freed += st.st_size
            elif stat.S_ISDIR(st.st_mode):
                path.rmdir()  # only when empty
    with contextlib.suppress(OSError):
        node.rmdir()
    return freed


def clean_abandoned(node: Path) -> None:
    """At start, on the node's first rank: files of saves in flight when the last workers
    died (``.part-`` names) are abandoned (no save runs yet)."""
    me = os.geteuid()
    for path, st in _walk_own(node):
        in_flight = PART_RE.fullmatch(path.name.split("@", 1)[0]) is not None
        if in_flight and stat.S_ISREG(st.st_mode) and st.st_uid == me:
            with contextlib.suppress(OSError):
                path.unlink()


def clear(memory_dir: Path, root_id: str | None, root_name: str) -> int:
    """Free a root's memory directory on this host: dckpt's memory files in every node
    directory and the restore notes, then the directories left empty, and the directory's
    ``.dckpt-root`` once nothing else is left. Only when the directory is the user's own and
    serves the root whose memory identity is ``root_id`` (or names no root: an older
    dckpt's); ``NotOwnedError`` otherwise, and nothing is removed. Anything else in it
    stays. Returns the bytes freed."""
    real = private_tree(memory_dir, memory_dir)
    owner = memory_dir_root(real)
    if owner is not None and owner[0] != root_id:
        raise NotOwnedError(
            f"{real} holds the memory tier of {owner[1]}, not of {root_name}: nothing was freed"
        )
    freed = 0
    me = os.geteuid()
    for entry in sorted(os.scandir(real), key=lambda e: e.name):
        if NODE_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            node = Path(entry.path)
            freed += remove_node_files(node, None)
            freed += _remove_own(node / RESTORE_FILE, me)
            with contextlib.suppress(OSError):
                node.rmdir()
    with contextlib.suppress(OSError):
        if not [n for n in os.listdir(real) if n != ROOT_FILE]:
            freed += _remove_own(real / ROOT_FILE, me)
            real.rmdir()
    return freed


def _remove_own(path: Path, me: int) -> int:
    """Delete ``path`` if it is a regular file of user ``me``; its size (0 if not)."""
    try:
        st = path.lstat()
        if stat.S_ISREG(st.st_mode) and st.st_uid == me:
            path.unlink()
            return st.st_size
    except OSError:
        pass
    return 0
