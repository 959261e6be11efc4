"""A crash-state simulator: the on-disk states a power cut can leave, from a syscall trace.

Role: the power-loss test (tests/faults/test_power_loss.py) records a save under ``strace``;
``parse_strace`` turns the log into an ordered list of file system operations under one root,
and ``CrashSim`` builds, for every prefix of that list, the state a power cut right after it
would leave on disk, and writes any such state out as a real directory tree.

The model (a pessimistic POSIX file system; "op" is one traced syscall, in completion order):

- The initial tree (a copy taken before the traced run) is fully durable.
- File data: a file's bytes are durable up to the length it had at its last ``fsync`` or
  ``fdatasync`` before the cut; anything written after that is lost, so the file is truncated
  to that length (a file never synced is empty). With ``unsynced_data="zeros"`` the file keeps
  its full length instead and the unsynced tail reads as zeros (a size update that reached the
  disk before the data, as on XFS or ext4 ``data=writeback``).
- Namespace (create, mkdir, rename, exchange, link, unlink, rmdir): a change to a directory's
  entries becomes durable only when that directory is fsynced after it, and an fsync of a directory
  makes every earlier change to its entries durable. Changes are bound to directory *inodes*,
  not names: an op done under a directory's old name belongs to it under its new name, and the
  content of a directory whose own entry is not durable is unreachable. A rename is a removal
  in one directory and an addition in another (atomic when both are the same directory). An
  exchange (``renameat2`` with ``RENAME_EXCHANGE``) swaps two entries of one directory
  atomically: both names stay, each now naming the other's inode (so what was written under
  one name is found under the other), and the swap is durable, as a whole, once that directory
  is fsynced after it. A hard link (``link``/``linkat``) adds a name for an existing inode in
  its directory, durable with that directory's fsync; the inode's bytes are one, under every
  name, and an unlink removes one name only. The initial tree's names of one inode are one
  inode too (keyed by ``st_ino``), and ``materialize`` links them again.
- With ``metadata="ordered"`` the states of a journalling file system that wrote some pending
  namespace changes on its own, in order, are added: at every cut, every prefix of the changes
  not yet made durable by an fsync may also have reached the disk.

File contents come from the final tree (captured right after the traced run) for files created
during the run, and from the initial copy for files that existed before it; each file is
assumed to be written once, sequentially, which ``check_final`` confirms by comparing the
simulated final tree (names, kinds, sizes) with the real one.

Limits: truncation is exact at the synced length (no page granularity, no reordered blocks, no
stale data other than zeros); write(2) is taken to append (the offset of each descriptor is not
tracked; pwrite/pwritev use their explicit offset); bytes past a file's synced length may be
overwritten or cut off again before its next fsync (dckpt's direct writes pad the last block,
then truncate, and a later write rewrites that block): they were never durable, and the final
tree holds what they became; a file rewritten in place below its synced length (truncated or
overwritten) raises ``SimulationError``; so does a RENAME_EXCHANGE whose two
entries are in different directories (when each half would become durable is file-system specific)
or one of whose names is missing, and so does RENAME_WHITEOUT; symlinks, mmap writes,
copy_file_range, sendfile and fallocate are not modelled (the final-tree check catches any that
changed a size); writes through descriptors of deleted files are ignored (strace names an fd
"(deleted)" once the name it was opened by is gone, even when another link keeps the inode:
such writes to a linked inode would be missed; dckpt never writes to a linked file); syscalls
on paths outside the root are ignored, and one that crosses the root's boundary raises. Order is
strace's completion order, so two ops racing in different threads are taken in the order they
returned.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = [
    "TRACED_SYSCALLS",
    "CrashSim",
    "CrashState",
    "Op",
    "SimulationError",
    "parse_strace",
]

# The syscalls parse_strace understands ("?" marks ones a platform may lack, e.g. aarch64).
TRACED_SYSCALLS = (
    "openat,?open,?creat,write,pwrite64,writev,pwritev,pwritev2,fsync,fdatasync,?rename,"
    "renameat,renameat2,?mkdir,mkdirat,?unlink,unlinkat,?rmdir,ftruncate,truncate,?link,linkat"
)

OpKind = Literal[
    "create",
    "truncate",
    "mkdir",
    "rename",
    "exchange",
    "link",
    "unlink",
    "rmdir",
    "write",
    "fsync",
]


class SimulationError(RuntimeError):
    """The trace holds something the model does not cover; the simulation would be wrong."""


@dataclass(frozen=True)
class Op:
    """One file system operation under the root, in the order the trace completed them."""

    index: int
    kind: OpKind
    path: str
    dest: str = ""  # rename and link target; exchange: the other entry
    nbytes: int = 0  # write: bytes written; truncate: the new length
    offset: int | None = None  # pwrite/pwritev: explicit offset; None: append
    trunc: bool = False  # create: O_TRUNC
    line: int = 0  # line number in the strace log

    def describe(self) -> str:
        if self.kind == "rename":
            return f"rename {self.path} -> {self.dest}"
        if self.kind == "exchange":
            return f"exchange {self.path} <-> {self.dest}"
        if self.kind == "link":
            return f"link {self.path} as {self.dest}"
        if self.kind == "write":
            return f"write {self.nbytes} B to {self.path}"
        return f"{self.kind} {self.path}"


# --- parsing ------------------------------------------------------------------------------------

_LINE_RE = re.compile(r"^(\d+)\s+(.*)$")
_CALL_RE = re.compile(r"^(\w+)\((.*)\)\s+=\s+(.*)$", re.S)
_UNFINISHED = " <unfinished ...>"
_RESUMED_RE = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$", re.S)
_FD_RE = re.compile(r"^(?:-?\d+|AT_FDCWD)<(.*)>$", re.S)


def _split_args(text: str) -> list[str]:
    """Split strace's argument text at top-level commas (strings, brackets, <paths> kept)."""
    args: list[str] = []
    depth = 0
    i = 0
    start = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "<" and depth == 0:
            # a -y annotation: up to the '>' that ends the argument
            j = i + 1
            while j < n and not (text[j] == ">" and (j + 1 == n or text[j + 1] in ",)")):
                j += 1
            i = j
        elif c == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1
    tail = text[start:].strip()
    if tail:
        args.append(tail)
    return args


def _unquote(arg: str) -> str:
    if not (arg.startswith('"') and arg.endswith('"')):
        raise SimulationError(f"expected a quoted path, got {arg!r}")
    raw = codecs.escape_decode(arg[1:-1].encode("utf-8"))[0]
    return bytes(raw).decode("utf-8", "surrogateescape")


def _fd_path(arg: str) -> tuple[str, bool] | None:
    """The path of an fd argument printed by ``-y`` (and whether it was deleted), else None."""
    m = _FD_RE.match(arg)
    if m is None:
        return None
    path = m.group(1)
    deleted = path.endswith(" (deleted)")
    return (path.removesuffix(" (deleted)") if deleted else path), deleted


def _at(dirfd: str, path_arg: str) -> str:
    path = _unquote(path_arg)
    if os.path.isabs(path):
        return os.path.normpath(path)
    base = _fd_path(dirfd)
    if base is None:
        raise SimulationError(f"relative path {path!r} against an unknown directory {dirfd!r}")
    return os.path.normpath(os.path.join(base[0], path))


def _logical_lines(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, pid, completed call text), joining <unfinished ...> with its resumption."""
    pending: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        m = _LINE_RE.match(raw)
        if m is None:
            continue
        pid, rest = m.group(1), m.group(2)
        if rest.endswith(_UNFINISHED):
            pending[pid] = rest[: -len(_UNFINISHED)]
            continue
        r = _RESUMED_RE.match(rest)
        if r is not None:
            head = pending.pop(pid, None)
            if head is None:
                continue  # started before tracing began
            rest = head + r.group(2)
        yield lineno, pid, rest


def parse_strace(text: str, root: str | os.PathLike[str]) -> list[Op]:
    """The successful file system operations on paths under ``root``, in completion order.

    ``text`` is the log of ``strace -f -y -qq -e trace=TRACED_SYSCALLS -o LOG``. Failed calls
    are dropped. A call through a descriptor of a deleted file is dropped (see the limits).
    """
    base = os.path.normpath(os.fspath(root))

    def inside(path: str) -> bool:
        return path == base or path.startswith(base + os.sep)

    ops: list[Op] = []

    def add(op: Op) -> None:
        if not inside(op.path) and not (op.dest and inside(op.dest)):
            return
        if op.dest and inside(op.path) != inside(op.dest):
            raise SimulationError(f"line {op.line}: {op.kind} across the root's boundary")
        ops.append(dataclasses.replace(op, index=len(ops)))

    for lineno, _pid, call in _logical_lines(text):
        m = _CALL_RE.match(call)
        if m is None:
            continue
        name, argtext, ret = m.groups()
        rm = re.match(r"-?\d+", ret)
        if rm is None or int(rm.group(0)) < 0:
            continue  # failed, or interrupted (= ?)
        retval = int(rm.group(0))
        args = _split_args(argtext)
        if name in ("openat", "open", "creat"):
            if name == "creat":
                flags = "O_CREAT|O_TRUNC"
            else:
                flags = args[2] if name == "openat" else args[1]
            if "O_CREAT" not in flags and "O_TRUNC" not in flags:
                continue
            got = _fd_path(ret.strip())
            if got is not None:
                path = got[0]
            elif name == "openat":
                path = _at(args[0], args[1])
            else:
                path = os.path.normpath(_unquote(args[0]))
            add(Op(0, "create", path, trunc="O_TRUNC" in flags, line=lineno))
        elif name in ("write", "writev", "pwrite64", "pwritev", "pwritev2"):
            fd = _fd_path(args[0])
            if fd is None or fd[1] or retval == 0:
                continue
            offset = None
            if name in ("pwrite64", "pwritev"):
                offset = int(args[-1], 0)
            elif name == "pwritev2":
                offset = int(args[3], 0)
                offset = None if offset == -1 else offset
            add(Op(0, "write", fd[0], nbytes=retval, offset=offset, line=lineno))
        elif name in ("fsync", "fdatasync"):
            fd = _fd_path(args[0])
            if fd is not None and not fd[1]:
                add(Op(0, "fsync", fd[0], line=lineno))
        elif name in ("ftruncate", "truncate"):
            if name == "ftruncate":
                fd = _fd_path(args[0])
                if fd is None or fd[1]:
                    continue
                path = fd[0]
            else:
                path = os.path.normpath(_unquote(args[0]))
            add(Op(0, "truncate", path, nbytes=int(args[1], 0), line=lineno))
        elif name in ("mkdir", "mkdirat"):
            path = _at(args[0], args[1]) if name == "mkdirat" else _at("", args[0])
            add(Op(0, "mkdir", path, line=lineno))
        elif name in ("rename", "renameat", "renameat2"):
            if name == "rename":
                src, dst = _at("", args[0]), _at("", args[1])
            else:
                src, dst = _at(args[0], args[1]), _at(args[2], args[3])
            flags = args[4] if name == "renameat2" and len(args) > 4 else ""
            if "RENAME_WHITEOUT" in flags and (inside(src) or inside(dst)):
                raise SimulationError(f"line {lineno}: RENAME_WHITEOUT is not modelled")
            swap = "RENAME_EXCHANGE" in flags
            add(Op(0, "exchange" if swap else "rename", src, dest=dst, line=lineno))
        elif name in ("link", "linkat"):
            if name == "link":
                src, dst = _at("", args[0]), _at("", args[1])
            else:
                src, dst = _at(args[0], args[1]), _at(args[2], args[3])
            if "AT_SYMLINK_FOLLOW" in (args[4] if len(args) > 4 else ""):
                raise SimulationError(f"line {lineno}: a link that follows symlinks")
            add(Op(0, "link", src, dest=dst, line=lineno))
        elif name in ("unlink", "unlinkat", "rmdir"):
            if name == "unlinkat":
                path = _at(args[0], args[1])
                kind: OpKind = "rmdir" if "AT_REMOVEDIR" in args[2] else "unlink"
            else:
                path = _at("", args[0])
                kind = "rmdir" if name == "rmdir" else "unlink"
            add(Op(0, kind, path, line=lineno))
    return ops


# --- simulation ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One object of a crash state: a directory, or a file with its durable bytes."""

    path: str  # relative to the root, "/"-separated
    node: int  # inode id in the simulation; -1 for directories
    length: int = 0  # bytes present
    zeros_from: int | None = None  # bytes from here on read as zeros (unsynced_data="zeros")

    @property
    def is_dir(self) -> bool:
        return self.node < 0


@dataclass(frozen=True)
class CrashState:
    """The disk after a power cut: ``entries`` once ``after`` ops had completed."""

    after: int  # ops completed before the cut (the first cut point that gives this state)
    pending: int  # ordered metadata: how many ops' pending namespace changes also survived
    entries: tuple[Entry, ...]

    def paths(self) -> set[str]:
        return {e.path for e in self.entries}


@dataclass
class _Node:
    ident: int
    is_dir: bool
    source: Path | None = None  # where its final bytes can be read
    initial_length: int = 0


@dataclass
class _Change:
    seq: int  # index of the op
    dir: int
    name: str
    target: int | None  # None: the name is removed
    durable_at: int = 1 << 62  # index of the first fsync of ``dir`` after it


@dataclass
class _Replay:
    nodes: dict[int, _Node] = field(default_factory=dict)
    initial: dict[int, dict[str, int]] = field(default_factory=dict)
    volatile: dict[int, dict[str, int]] = field(default_factory=dict)
    length: dict[int, int] = field(default_factory=dict)
    changes: list[_Change] = field(default_factory=list)
    file_syncs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    lengths: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


ROOT_NODE = 0


class CrashSim:
    """Every crash state of one traced run; see the module docstring for the model.

    ``root`` is the root as the trace names it, ``initial`` the durable copy taken before the
    run. Call ``check_final`` with the tree the run left before ``materialize``: it confirms
    the replay and tells where the bytes of the files created during the run can be read.
    """

    def __init__(self, root: str | os.PathLike[str], initial: Path, ops: Iterable[Op]) -> None:
        self.root = os.path.normpath(os.fspath(root))
        self.initial = initial
        # Re-numbered, so that a filtered list (a negative control) is still 0..n-1.
        self.ops = [dataclasses.replace(op, index=i) for i, op in enumerate(ops)]
        self._r = _Replay()
        self._scan_initial()
        for op in self.ops:
            self._apply(op)
        syncs: dict[int, list[int]] = {}
        for op in self.ops:
            if op.kind == "fsync":
                node = self._synced_dirs.get(op.index)
                if node is not None:
                    syncs.setdefault(node, []).append(op.index)
        for ch in self._r.changes:
            later = [s for s in syncs.get(ch.dir, []) if s > ch.seq]
            if later:
                ch.durable_at = later[0]
        self._cache: dict[Path, bytes] = {}

    # -- replay of the ops against the volatile (page cache) view --

    _synced_dirs: dict[int, int]

    def _new(self, is_dir: bool, source: Path | None = None, length: int = 0) -> int:
        ident = len(self._r.nodes)
        self._r.nodes[ident] = _Node(ident, is_dir, source, length)
        if is_dir:
            self._r.volatile[ident] = {}
        else:
            self._r.length[ident] = length
        return ident

    def _scan_initial(self) -> None:
        self._synced_dirs = {}
        self._new(True)

        inodes: dict[tuple[int, int], int] = {}  # the names of one inode are one node

        def walk(path: Path, node: int) -> None:
            for child in sorted(path.iterdir()):
                if child.is_symlink():
                    raise SimulationError(f"symlink {child} in the initial tree is not modelled")
                if child.is_dir():
                    ident = self._new(True)
                    walk(child, ident)
                else:
                    st = child.stat()
                    key = (st.st_dev, st.st_ino)
                    if key not in inodes:
                        inodes[key] = self._new(False, child, st.st_size)
                    ident = inodes[key]
                self._r.volatile[node][child.name] = ident

        walk(self.initial, ROOT_NODE)
        self._r.initial = {d: dict(e) for d, e in self._r.volatile.items()}

    def _rel(self, path: str) -> list[str]:
        if path == self.root:
            return []
        return path[len(self.root) + 1 :].split(os.sep)

    def _resolve(self, path: str, op: Op) -> int:
        node = ROOT_NODE
        for part in self._rel(path):
            entries = self._r.volatile.get(node)
            if entries is None or part not in entries:
                raise SimulationError(f"op {op.index} (log line {op.line}): {path} not found")
            node = entries[part]
        return node

    def _parent(self, path: str, op: Op) -> tuple[int, str]:
        parts = self._rel(path)
        if not parts:
            raise SimulationError(f"op {op.index} (log line {op.line}) changes the root itself")
        parent = self._resolve(os.path.dirname(path), op)
        if not self._r.nodes[parent].is_dir:
            raise SimulationError(f"op {op.index}: parent of {path} is not a directory")
        return parent, parts[-1]

    def _set(self, op: Op, parent: int, name: str, target: int | None) -> None:
        entries = self._r.volatile[parent]
        if target is None:
            entries.pop(name, None)
        else:
            entries[name] = target
        self._r.changes.append(_Change(op.index, parent, name, target))

    def _set_length(self, op: Op, node: int, length: int) -> None:
        self._r.length[node] = length
        self._r.lengths.setdefault(node, []).append((op.index, length))

    def _apply(self, op: Op) -> None:
        r = self._r
        if op.kind == "create":
            parent, name = self._parent(op.path, op)
            existing = r.volatile[parent].get(name)
            if existing is None:
                self._set(op, parent, name, self._new(False))
            elif op.trunc and r.length[existing] > 0:
                raise SimulationError(f"op {op.index}: {op.path} is rewritten in place")
        elif op.kind == "mkdir":
            parent, name = self._parent(op.path, op)
            self._set(op, parent, name, self._new(True))
        elif op.kind == "rename":
            sp, sn = self._parent(op.path, op)
            dp, dn = self._parent(op.dest, op)
            node = r.volatile[sp].get(sn)
            if node is None:
                raise SimulationError(f"op {op.index}: rename of missing {op.path}")
            self._set(op, sp, sn, None)
            self._set(op, dp, dn, node)
        elif op.kind == "exchange":
            ap, an = self._parent(op.path, op)
            bp, bn = self._parent(op.dest, op)
            if ap != bp:
                raise SimulationError(
                    f"op {op.index} (log line {op.line}): exchange across directories "
                    f"({op.path} <-> {op.dest}) is not modelled"
                )
            a, b = r.volatile[ap].get(an), r.volatile[bp].get(bn)
            if a is None or b is None:
                raise SimulationError(f"op {op.index}: exchange with a missing entry")
            # Two changes of one directory with one seq: durable together (fsync of that
            # directory after it, or an ordered prefix through this op), never one alone.
            self._set(op, ap, an, b)
            self._set(op, bp, bn, a)
        elif op.kind == "link":
            node = self._resolve(op.path, op)
            if self._r.nodes[node].is_dir:
                raise SimulationError(f"op {op.index}: a hard link to directory {op.path}")
            dp, dn = self._parent(op.dest, op)
            if dn in r.volatile[dp]:
                raise SimulationError(f"op {op.index}: link onto existing {op.dest}")
            self._set(op, dp, dn, node)
        elif op.kind in ("unlink", "rmdir"):
            parent, name = self._parent(op.path, op)
            if name not in r.volatile[parent]:
                raise SimulationError(f"op {op.index}: {op.kind} of missing {op.path}")
            self._set(op, parent, name, None)
        elif op.kind == "write":
            node = self._resolve(op.path, op)
            old = r.length[node]
            if op.offset is None:
                self._set_length(op, node, old + op.nbytes)
            else:
                if op.offset < self._synced_length(node):
                    raise SimulationError(f"op {op.index}: {op.path} is overwritten in place")
                self._set_length(op, node, max(old, op.offset + op.nbytes))
        elif op.kind == "truncate":
            node = self._resolve(op.path, op)
            if op.nbytes < self._synced_length(node):
                raise SimulationError(f"op {op.index}: {op.path} is truncated in place")
            self._set_length(op, node, op.nbytes)
        elif op.kind == "fsync":
            node = self._resolve(op.path, op)
            if r.nodes[node].is_dir:
                self._synced_dirs[op.index] = node
            else:
                r.file_syncs.setdefault(node, []).append((op.index, r.length[node]))

    def _synced_length(self, node: int) -> int:
        """The length a file had at its last fsync so far (its initial length if it existed
        before the run): the bytes below it are durable and must not change."""
        syncs = self._r.file_syncs.get(node)
        if syncs:
            return syncs[-1][1]
        source = self._r.nodes[node].source
        return self._r.nodes[node].initial_length if source is not None else 0

    # -- crash states --

    def _length_before(self, history: list[tuple[int, int]], cut: int, default: int) -> int:
        value = default
        for seq, length in history:
            if seq >= cut:
                break
            value = length
        return value

    def _render(
        self, durable: list[_Change], cut: int, zeros: bool, *, complete: bool = False
    ) -> tuple[Entry, ...]:
        r = self._r
        dirs = {d: dict(e) for d, e in r.initial.items()}
        for ch in durable:
            dirs.setdefault(ch.dir, {})
            if ch.target is None:
                dirs[ch.dir].pop(ch.name, None)
            else:
                dirs[ch.dir][ch.name] = ch.target
        out: list[Entry] = []
        seen: set[int] = set()

        def walk(node: int, prefix: str) -> None:
            if node in seen:
                raise SimulationError(f"directory {prefix or '.'} is reachable twice")
            seen.add(node)
            for name, child in sorted(dirs.get(node, {}).items()):
                path = f"{prefix}{name}"
                if r.nodes[child].is_dir:
                    out.append(Entry(path, -1))
                    walk(child, path + "/")
                    continue
                initial = r.nodes[child].initial_length
                if complete:
                    out.append(Entry(path, child, r.length[child]))
                    continue
                synced = self._length_before(r.file_syncs.get(child, []), cut, initial)
                if zeros:
                    current = self._length_before(r.lengths.get(child, []), cut, initial)
                    tail = synced if current > synced else None
                    out.append(Entry(path, child, current, tail))
                else:
                    out.append(Entry(path, child, synced))

        walk(ROOT_NODE, "")
        return tuple(out)

    def state_at(
        self, cut: int, *, pending: int = 0, unsynced_data: Literal["lost", "zeros"] = "lost"
    ) -> CrashState:
        """The state a cut after ``cut`` ops leaves; ``pending`` > 0: the namespace changes of
        the first ``pending`` ops reached the disk too (ordered metadata)."""
        if not 0 <= cut <= len(self.ops) or not 0 <= pending <= cut:
            raise ValueError(f"cut {cut}, pending {pending} out of range")
        durable = [ch for ch in self._r.changes if ch.durable_at < cut or ch.seq < pending]
        return CrashState(cut, pending, self._render(durable, cut, unsynced_data == "zeros"))

    def states(
        self,
        *,
        metadata: Literal["synced", "ordered"] = "synced",
        unsynced_data: Literal["lost", "zeros"] = "lost",
    ) -> list[CrashState]:
        """The distinct crash states over every cut point 0..len(ops), in the order of the
        first cut point that gives each (duplicates dropped)."""
        seen: dict[tuple[Entry, ...], CrashState] = {}
        changes = self._r.changes
        for cut in range(len(self.ops) + 1):
            if metadata == "synced":
                pendings = [0]
            else:  # only the cut points just after a change can add one
                pendings = sorted({0} | {ch.seq + 1 for ch in changes if ch.seq < cut})
            for pending in pendings:
                state = self.state_at(cut, pending=pending, unsynced_data=unsynced_data)
                seen.setdefault(state.entries, state)
        return list(seen.values())

    def final_state(self) -> tuple[Entry, ...]:
        """The tree as the run left it (every change applied, every byte present)."""
        return self._render(list(self._r.changes), len(self.ops), False, complete=True)

    def check_final(self, final: Path) -> None:
        """Raise unless the simulated final tree matches ``final`` (names, kinds, sizes, and
        which names are one inode), and record where each file created during the run can be
        read."""
        simulated = {e.path: (e.is_dir, 0 if e.is_dir else e.length) for e in self.final_state()}
        real: dict[str, tuple[bool, int]] = {}
        real_links: dict[tuple[int, int], list[str]] = {}
        for dirpath, dirnames, filenames in os.walk(final):
            rel = os.path.relpath(dirpath, final)
            prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for d in dirnames:
                real[prefix + d] = (True, 0)
            for f in filenames:
                st = os.lstat(os.path.join(dirpath, f))
                real[prefix + f] = (False, st.st_size)
                real_links.setdefault((st.st_dev, st.st_ino), []).append(prefix + f)
        if simulated != real:
            diff = sorted(set(simulated.items()) ^ set(real.items()))
            raise SimulationError(f"simulated final tree differs from the real one: {diff}")
        sim_links: dict[int, list[str]] = {}
        for e in self.final_state():
            if not e.is_dir:
                sim_links.setdefault(e.node, []).append(e.path)
        if sorted(map(sorted, sim_links.values())) != sorted(map(sorted, real_links.values())):
            raise SimulationError("the simulated final tree links other names than the real one")
        for e in self.final_state():
            node = self._r.nodes.get(e.node)
            if node is not None and not node.is_dir and node.source is None:
                node.source = final / e.path

    # -- materializing --

    def _bytes(self, node: int, length: int) -> bytes:
        source = self._r.nodes[node].source
        if source is None:
            if length == 0:
                return b""
            raise SimulationError(f"no source for {length} durable bytes of inode {node}")
        data = self._cache.get(source)
        if data is None:
            data = self._cache[source] = source.read_bytes()
        if len(data) < length:
            raise SimulationError(f"{source} has {len(data)} bytes, {length} are durable")
        return data[:length]

    def materialize(self, state: CrashState, dest: Path) -> Path:
        """Write ``state`` out as a real tree at ``dest`` (which must not exist); the names of
        one inode are hard links of one file."""
        dest.mkdir(parents=True)
        written: dict[int, Path] = {}
        for e in state.entries:
            target = dest / e.path
            if e.is_dir:
                target.mkdir()
                continue
            if e.node in written:
                os.link(written[e.node], target)
                continue
            written[e.node] = target
            if e.zeros_from is None:
                data = self._bytes(e.node, e.length)
            else:
                data = self._bytes(e.node, e.zeros_from) + bytes(e.length - e.zeros_from)
            target.write_bytes(data)
        return dest

    def describe(self, state: CrashState) -> str:
        """Where the cut fell, in words."""
        if state.after == 0:
            where = "before the first op"
        else:
            op = self.ops[state.after - 1].describe().replace(self.root + os.sep, "")
            op = re.sub(rf"{re.escape(self.root)}(?=$| )", ".", op)
            where = f"after op {state.after}/{len(self.ops)} ({op})"
        if state.pending:
            where += f", namespace changes up to op {state.pending} also written"
        return where
