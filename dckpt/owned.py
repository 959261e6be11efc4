"""Files and directories that are the job's own: created private, never through a link, and,
under a directory every local user can write (``/dev/shm``, ``/tmp``), proven the job's.

Shared hosts are hostile: a name dckpt computes, another local user can compute first and
plant, and a path dckpt re-opens may by then be another file. The rules, each written once:

- **Modes that do not depend on the umask.** Every file dckpt creates gets ``file_mode()``
  (0600 unless ``$DCKPT_FILE_MODE`` says 0640, 0644 or 0604), every directory the same with
  the search bits (0700 by default), set with ``fchmod`` on the descriptor that created it:
  the umask can only remove bits, and a team that shares checkpoints sets the variable.
  Group or other write is never given.
- **No write follows a link, and nothing already there is written into.** A file is created
  with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a planted name, link or FIFO makes the create fail,
  never redirects it), relative to a directory descriptor opened ``O_NOFOLLOW``, and a record
  replaced whole by a rename relative to that descriptor (``write_atomic``).
- **A directory is trusted only when proven.** ``private_tree`` makes or checks every
  directory from the job's own base down, one ``openat(O_NOFOLLOW)`` at a time: each must be a
  real directory owned by the job's user that nobody else may write. Every directory above
  the base must be owned by root or the job's user and be writable by no one else unless
  sticky (``/dev/shm``, ``/tmp``: then nobody else can rename or remove the job's entries in
  it). A symlink is followed above the base only when root or the job's user owns it.
  Anything else is a ``NotOwnedError`` naming the directory and its owner. Running as root
  changes none of this: root is refused another user's directory too.
- **The root, proven at every start** (``prove_root``): the checkpoint root and each parent
  up to one the job's user owns (or a root-owned one nobody else can write) are owned by the
  job's user or root, writable by nobody else (a root-owned sticky directory only as a
  parent, never as the root), and links on the way are the user's or root's. With
  ``access="group"`` (a project directory a team shares on purpose) a directory may also be
  writable by its group, and owned by another user when its group is one of the job's.
- **Never chmod what dckpt did not make.** Only a directory dckpt's own ``mkdir`` created
  is given the private mode; one that exists is checked and, if others may write it,
  refused in words, never changed (``/dev/shm`` chmod-ed 0700 breaks every other user).

No torch; used by every layer that writes (storage, root, tiers, load).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
import uuid
from pathlib import Path
from typing import Literal

from .errors import CheckpointError

__all__ = [
    "FILE_MODE_ENV",
    "Access",
    "NotOwnedError",
    "check_ancestors",
    "create_new",
    "dir_mode",
    "file_mode",
    "make_dir",
    "open_dir",
    "owner_name",
    "private_tree",
    "prove_root",
    "write_atomic",
]

FILE_MODE_ENV = "DCKPT_FILE_MODE"
_ALLOWED = {0o600, 0o640, 0o644, 0o604}
"""Owner read and write always; read for the group and others if asked; never write or
execute for anyone else."""
Access = Literal["private", "group"]
"""Who besides the job's user may write a root's directories: nobody, or their group."""
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class NotOwnedError(CheckpointError):
    """A directory or file dckpt would use is not provably the job's own: owned by another
    user, writable by others, or a link. Nothing was written into it or read from it."""


def file_mode() -> int:
    """The mode of every file dckpt creates: ``$DCKPT_FILE_MODE`` (octal), else 0600."""
    raw = os.environ.get(FILE_MODE_ENV, "").strip()
    if not raw:
        return 0o600
    try:
        mode = int(raw, 8)
    except ValueError:
        mode = -1
    if mode not in _ALLOWED:
        raise ValueError(
            f"{FILE_MODE_ENV}={raw!r}: use 600 (the default: only the job's user reads its "
            "checkpoints), 640 (its group reads them too), 644 or 604; dckpt never gives "
            "write to anyone else"
        )
    return mode


def dir_mode() -> int:
    """The mode of every directory dckpt creates: the file mode with a search bit wherever
    it reads (0700 by default, 0750 with a file mode of 0640)."""
    mode = file_mode()
    return mode | 0o100 | (0o010 if mode & 0o040 else 0) | (0o001 if mode & 0o004 else 0)


def owner_name(uid: int) -> str:
    """``name (uid N)`` for messages."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def open_dir(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``path`` (never through a symlink at its last name)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)


def create_new(
    name: str | os.PathLike[str], *, dir_fd: int | None = None, flags: int = os.O_WRONLY
) -> int:
    """A new file ``name`` (relative to ``dir_fd`` when given), created here and now with the
    private mode: ``FileExistsError`` when anything is at that name (a planted file, a
    symlink, a hard link to a file elsewhere), so nothing there is ever written into."""
    fd = os.open(
        name, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, file_mode(), dir_fd=dir_fd
    )
    try:
        os.fchmod(fd, file_mode())  # the umask removed nothing the job asked for
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomic(
    directory: str | os.PathLike[str], name: str, data: bytes, *, sync: bool = True
) -> None:
    """Replace ``directory/name`` with ``data`` whole: a fresh temporary name created
    exclusively through a descriptor of ``directory`` (opened without following a link),
    fsynced when ``sync``, renamed over ``name`` relative to that descriptor. A symlink,
    FIFO or hard link planted at either name is never written through."""
    dfd = open_dir(directory)
    try:
        tmp = f"{name}.tmp-{uuid.uuid4().hex}"
        fd = create_new(tmp, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if sync:
            os.fsync(dfd)
    finally:
        os.close(dfd)


def make_dir(path: str | os.PathLike[str], *, parents: bool = False) -> Path:
    """``path`` as a directory (an existing one is left as it is), each directory made here
    with the private mode, whatever the umask."""
    path = Path(path)
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        if not parents or probe.parent == probe:
            break
        probe = probe.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, dir_mode())
        except FileExistsError:  # another rank made it: not ours to change
            continue
        with contextlib.suppress(OSError):
            fd = open_dir(d)
            try:
                os.fchmod(fd, dir_mode())
            finally:
                os.close(fd)
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    return path


def _shared(st: os.stat_result) -> bool:
    """Writable by someone other than its owner."""
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def check_ancestors(path: str | os.PathLike[str]) -> Path:
    """The real path of the existing directory ``path``, after proving that no other user
    (root aside) can move anything on the way to it: each directory on its real path is owned
    by root or the job's user, and one that others may write is sticky; a symlink on the way
    is owned by root or the job's user. ``NotOwnedError`` otherwise."""
    me = os.geteuid()
    given = Path(os.path.abspath(path))
    _check_links(given, "decides where it leads")
    real = Path(os.path.realpath(given))
    for d in [*reversed(real.parents), real]:
        st = os.lstat(d)
        if st.st_uid not in (0, me):
            raise NotOwnedError(
                f"{d} belongs to {owner_name(st.st_uid)}, not to this job's user "
                f"{owner_name(me)} or root"
            )
        if _shared(st) and not st.st_mode & stat.S_ISVTX:
            raise NotOwnedError(
                f"{d} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}) and not "
                "sticky: any user with that access can replace what is in it"
            )
    return real


def _check_links(given: Path, words: str) -> None:
    """Every symlink on ``given`` (as written, up to the first missing part) is owned by
    root or the job's user: another user's link would decide where dckpt goes."""
    me = os.geteuid()
    for prefix in [*reversed(given.parents), given]:
        try:
            st = os.lstat(prefix)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, me):
            raise NotOwnedError(
                f"{prefix} is a symlink owned by {owner_name(st.st_uid)}: another user {words}"
            )


def private_tree(top: str | os.PathLike[str], base: str | os.PathLike[str]) -> Path:
    """Make or prove every directory from ``base`` (``top`` or one of its parents) down to
    ``top`` the job's own: created with the private mode, or, when it exists, a real
    directory (not a link) owned by the job's user that nobody else may write (never
    chmod-ed: a directory dckpt did not make is not dckpt's to change). The parents of
    ``base`` must pass ``check_ancestors``. Returns ``top`` on its real path.
    ``NotOwnedError`` names the first directory that fails and its owner."""
    top, base = Path(os.path.abspath(top)), Path(os.path.abspath(base))
    if top != base and base not in top.parents:
        raise ValueError(f"{base} is not {top} or one of its parents")
    parent = check_ancestors(_existing(base.parent))
    for missing in _between(parent, base.parent):  # parents of base that do not exist yet
        make_dir(missing)
        parent = missing
    me = os.geteuid()
    fd = open_dir(parent)
    try:
        for name in [base.name, *top.relative_to(base).parts]:
            made = False
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, dir_mode(), dir_fd=fd)
                made = True
            try:
                child = open_dir(name, dir_fd=fd)
            except OSError as exc:
                where = os.path.join(_fd_path(fd), name)
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotOwnedError(
                        f"{where} is not a directory (a symlink or a file put there): dckpt "
                        "neither follows nor replaces it"
                    ) from None
                raise
            os.close(fd)
            fd = child
            st = os.fstat(fd)
            if st.st_uid != me:
                raise NotOwnedError(
                    f"{_fd_path(fd)} belongs to {owner_name(st.st_uid)}, not to this job's user "
                    f"{owner_name(me)}: another user may have made it to read or replace what "
                    "dckpt keeps there"
                )
            if made:  # ours: the umask may have removed what the job asked for
                os.fchmod(fd, dir_mode())
            elif _shared(st) or st.st_mode & stat.S_ISVTX:
                # Not dckpt's to narrow (a chmod of /dev/shm breaks every other user's
                # programs): a directory others may write is refused, never changed.
                where = _fd_path(fd)
                raise NotOwnedError(
                    f"{where} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                    "dckpt keeps a job's files only in a directory of the job's own, and "
                    "never changes the mode of one it did not make; pass a directory under "
                    f"it (e.g. {os.path.join(where, f'dckpt-{me}')}, which dckpt makes "
                    f"private) or run `chmod go-w {where}` if it is yours alone"
                )
        return Path(_fd_path(fd))
    finally:
        os.close(fd)


def prove_root(path: str | os.PathLike[str], *, access: Access = "private") -> Path:
    """Make ``path`` (with its missing parents, private) after proving the existing part of
    the way to it, then prove the root itself: the root and each parent up to one the job's
    user owns (or a root-owned one nobody else can write) are real directories owned by the
    job's user or root that nobody else may write, a root-owned sticky directory (``/tmp``)
    counting only as a parent; a link on the given path is followed only when the job's user
    or root owns it. ``access="group"`` also admits a directory writable by its group (never
    by others), owned by another user only when that group is one of the job's. Returns the
    root's real path; ``NotOwnedError`` names the first directory that fails, its owner and
    mode, and the command that makes the run start. Nothing is changed on a directory that
    exists."""
    given = Path(os.path.abspath(path))
    existing = _existing(given)
    if existing != given:  # prove the way before anything is made on it
        _prove_way(existing, access, is_root=False)
        make_dir(given, parents=True)
    return _prove_way(given, access, is_root=True)


def _prove_way(path: Path, access: Access, *, is_root: bool) -> Path:
    me = os.geteuid()
    groups = {os.getegid(), *os.getgroups()} if access == "group" else set()
    _check_links(path, "decides where the checkpoints go; give the real directory instead")
    real = Path(os.path.realpath(path))
    for d in [real, *real.parents]:
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise NotOwnedError(f"{d} is not a directory")
        mode = stat.S_IMODE(st.st_mode)
        teams = access == "group" and st.st_gid in groups and not st.st_mode & stat.S_IWOTH
        if st.st_uid not in (0, me) and not teams:
            raise NotOwnedError(
                f"{d} belongs to {owner_name(st.st_uid)}, not to this job's user "
                f"{owner_name(me)} or root: its owner can put checkpoints there or move the "
                f"job's away; {_use_own(real)}"
            )
        root_self = is_root and d == real
        sticky_parent = st.st_uid == 0 and st.st_mode & stat.S_ISVTX and not root_self
        if _shared(st) and not sticky_parent and not teams:
            if root_self and st.st_mode & stat.S_ISVTX:
                raise NotOwnedError(
                    f"{d} is a directory every user may write (mode {mode:04o}): other users "
                    f"could put checkpoints in it; {_use_own(real)}"
                )
            fix = f"run `chmod go-w {d}` if it is yours alone"
            if access == "private" and not st.st_mode & stat.S_IWOTH:
                fix += (
                    ", or set root_access='group' (DCKPT_ROOT_ACCESS=group) if the team's group "
                    "writes it on purpose"
                )
            raise NotOwnedError(
                f"{d} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                f"(mode {mode:04o}) and {'is the root' if root_self else 'not sticky'}: "
                "another user could put checkpoints there or move the job's away; " + fix
            )
        if d != real and st.st_uid in (0, me) and not _shared(st):
            break  # a parent only its owner (the job's user, or root) can change
    return real


def _use_own(real: Path) -> str:
    home = os.path.expanduser("~")
    return (
        f"pass a root under a directory of your own (e.g. {home}/checkpoints/{real.name}, "
        "which dckpt makes private)"
    )


def _existing(path: Path) -> Path:
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def _between(real_existing: Path, wanted: Path) -> list[Path]:
    """The directories from below ``real_existing`` down to ``wanted`` that do not exist."""
    have = _existing(wanted)
    rest = wanted.relative_to(have).parts
    out: list[Path] = []
    cur = real_existing
    for part in rest:
        cur = cur / part
        out.append(cur)
    return out


def _fd_path(fd: int) -> str:
    """The path the kernel knows a directory descriptor by (for messages and the result)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"
