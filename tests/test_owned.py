"""dckpt.owned on a shared host, in one process: what another local user plants is refused,
never followed, never written into; what dckpt creates is private whatever the umask.

"Another user" is a uid that is not this process's: the tests run as root (as CI does), and
``os.chown`` gives a directory or a link to uid ``OTHER`` exactly as if that user had made it
(the kernel keeps no other record of who made a file). Each rule is tested on both sides: a
directory of the job's own passes and one of another user is refused; a sticky shared parent
passes and a plain world-writable one is refused; a link of root's is followed and one of
another user's is not. ``test_a_squatter_cannot_enter_the_proven_directory`` runs a real
process as that uid against the directory dckpt proved.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dckpt.owned import (
    FILE_MODE_ENV,
    NotOwnedError,
    check_ancestors,
    create_new,
    dir_mode,
    file_mode,
    make_dir,
    private_tree,
    prove_root,
    write_atomic,
)

OTHER = 4242  # a uid that is not this process's (no passwd entry needed)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A directory like /dev/shm: world-writable and sticky."""
    d = tmp_path / "shm"
    d.mkdir()
    d.chmod(0o1777)
    return d


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_jobs_own_tree_is_made_private_under_a_sticky_shared_parent(shared: Path) -> None:
    old = os.umask(0)  # whatever the umask, the modes are dckpt's
    try:
        top = private_tree(shared / "dckpt-0" / "run-ab" / "node-0", shared / "dckpt-0")
    finally:
        os.umask(old)
    assert top == (shared / "dckpt-0" / "run-ab" / "node-0").resolve()
    for d in (shared / "dckpt-0", shared / "dckpt-0" / "run-ab", top):
        assert _mode(d) == 0o700 and d.lstat().st_uid == os.geteuid(), d


def test_an_existing_directory_is_never_chmod_ed_and_refused_if_others_may_write_it(
    shared: Path,
) -> None:
    """dckpt changes the mode of no directory it did not make: one the user made 0755 is
    taken as it is, one others may write is refused in words, its mode as it was."""
    (shared / "dckpt-0").mkdir(mode=0o755)
    private_tree(shared / "dckpt-0" / "x", shared / "dckpt-0")
    assert _mode(shared / "dckpt-0") == 0o755  # left as the user made it
    assert _mode(shared / "dckpt-0" / "x") == 0o700  # dckpt's own: private
    (shared / "dckpt-0").chmod(0o777)
    with pytest.raises(NotOwnedError, match=r"writable by others \(mode 0777\).*chmod go-w"):
        private_tree(shared / "dckpt-0" / "y", shared / "dckpt-0")
    assert _mode(shared / "dckpt-0") == 0o777 and not (shared / "dckpt-0" / "y").exists()


def test_a_shared_sticky_directory_is_refused_as_the_memory_directory_itself(
    shared: Path,
) -> None:
    """A root job given /dev/shm itself (root-owned, 1777) as its memory directory: refused,
    and /dev/shm keeps its mode (a chmod to 0700 broke every other user's programs)."""
    os.chown(shared, 0, 0)
    with pytest.raises(NotOwnedError, match=r"writable by others \(mode 1777\)"):
        private_tree(shared, shared)
    with pytest.raises(NotOwnedError, match=r"mode 1777"):
        private_tree(shared / "node-0", shared)
    assert _mode(shared) == 0o1777 and list(shared.iterdir()) == []


def test_a_squatted_base_is_refused_naming_its_owner(shared: Path) -> None:
    squat = shared / "dckpt-0"
    squat.mkdir()
    squat.chmod(0o777)
    os.chown(squat, OTHER, OTHER)
    with pytest.raises(NotOwnedError, match=rf"{squat}.*uid {OTHER}"):
        private_tree(squat / "run" / "node-0", squat)
    assert list(squat.iterdir()) == []  # nothing made in it
    assert _mode(squat) == 0o777  # and nothing changed on it: it is not the job's


def test_a_squatted_directory_deeper_down_is_refused(shared: Path) -> None:
    base = shared / "dckpt-0"
    private_tree(base, base)
    planted = base / "run"
    planted.mkdir()
    os.chown(planted, OTHER, OTHER)  # as root could plant it in the job's own base
    with pytest.raises(NotOwnedError, match=f"uid {OTHER}"):
        private_tree(planted / "node-0", base)


def test_a_link_at_the_base_is_neither_followed_nor_replaced(shared: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (shared / "dckpt-0").symlink_to(target)
    with pytest.raises(NotOwnedError, match="not a directory"):
        private_tree(shared / "dckpt-0" / "node-0", shared / "dckpt-0")
    assert list(target.iterdir()) == [] and (shared / "dckpt-0").is_symlink()


def test_a_link_above_the_base_counts_only_when_root_or_the_user_owns_it(
    shared: Path, tmp_path: Path
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    mine = shared / "mine"
    mine.symlink_to(real)
    assert private_tree(mine / "dckpt" / "n", mine / "dckpt") == (real / "dckpt" / "n")
    theirs = shared / "theirs"
    theirs.symlink_to(real)
    os.lchown(theirs, OTHER, OTHER)
    with pytest.raises(NotOwnedError, match=f"symlink owned by uid {OTHER}"):
        private_tree(theirs / "dckpt2", theirs / "dckpt2")


def test_a_parent_others_may_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # not sticky: anyone may rename the job's directory away
    with pytest.raises(NotOwnedError, match="writable by others"):
        private_tree(open_dir / "dckpt", open_dir / "dckpt")
    open_dir.chmod(0o1777)
    private_tree(open_dir / "dckpt", open_dir / "dckpt")


def test_a_parent_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(NotOwnedError, match=f"{theirs} belongs to uid {OTHER}"):
        check_ancestors(theirs)


def test_create_new_never_writes_through_a_planted_link_or_file(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_new(tmp_path / "link")
    (tmp_path / "plant").write_bytes(b"theirs")
    with pytest.raises(FileExistsError):
        create_new(tmp_path / "plant")
    assert victim.read_bytes() == b"precious"


def test_write_atomic_replaces_a_planted_link_and_leaves_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "record.json").symlink_to(victim)
    write_atomic(tmp_path, "record.json", b"{}")
    assert victim.read_bytes() == b"precious"
    assert not (tmp_path / "record.json").is_symlink()
    assert (tmp_path / "record.json").read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "victim"]


@pytest.mark.parametrize(
    ("env", "want_file", "want_dir"), [(None, 0o600, 0o700), ("640", 0o640, 0o750)]
)
def test_modes_are_private_by_default_and_as_set_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str | None, want_file: int, want_dir: int
) -> None:
    if env is None:
        monkeypatch.delenv(FILE_MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(FILE_MODE_ENV, env)
    for umask in (0o000, 0o022, 0o077):
        old = os.umask(umask)
        try:
            d = make_dir(tmp_path / f"d{umask:o}" / "sub", parents=True)
            os.close(create_new(d / "f"))
            write_atomic(d, "g", b"x")
        finally:
            os.umask(old)
        assert _mode(d) == _mode(d.parent) == want_dir, umask
        assert _mode(d / "f") == _mode(d / "g") == want_file, umask
    assert (file_mode(), dir_mode()) == (want_file, want_dir)


@pytest.mark.parametrize("bad", ["666", "660", "700", "rw", "0o600x"])
def test_a_mode_that_gives_others_write_or_execute_is_refused(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv(FILE_MODE_ENV, bad)
    with pytest.raises(ValueError, match=FILE_MODE_ENV):
        file_mode()


def test_a_squatter_cannot_enter_the_proven_directory(shared: Path) -> None:
    """A real process of another uid, against the directory dckpt proved: it can neither
    list it, nor plant a file, nor rename one away (the sticky parent and 0700 keep it out)."""
    base = shared / "dckpt-0"
    node = private_tree(base / "run" / "node-0", base)
    (node / "rank-00000.mem").write_bytes(b"weights")
    probe = (
        "import os, sys\n"
        f"os.setgid({OTHER}); os.setuid({OTHER})\n"
        "out = []\n"
        "for act in ('list', 'plant', 'rename', 'remove-base'):\n"
        "    try:\n"
        "        if act == 'list': os.listdir(sys.argv[1])\n"
        "        if act == 'plant': open(sys.argv[1] + '/x', 'w').close()\n"
        "        if act == 'rename': os.rename(sys.argv[2], sys.argv[2] + '.gone')\n"
        "        if act == 'remove-base': os.rename(sys.argv[2], sys.argv[2] + '2')\n"
        "        out.append(act + ':done')\n"
        "    except OSError as exc:\n"
        "        out.append(act + ':' + exc.__class__.__name__)\n"
        "print(' '.join(out))\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", probe, str(node), str(base)],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    assert got == [
        "list:PermissionError",
        "plant:PermissionError",
        "rename:PermissionError",
        "remove-base:PermissionError",
    ], got
    assert (node / "rank-00000.mem").read_bytes() == b"weights"


@pytest.mark.parametrize(
    ("env", "want_file", "want_dir"), [(None, 0o600, 0o700), ("640", 0o640, 0o750)]
)
def test_every_file_and_directory_a_job_makes_in_its_root_has_the_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str | None, want_file: int, want_dir: int
) -> None:
    """A save, a verify record, a resume (its records and the replay journal), a pin and a
    memory save, under umask 0: the root's files and directories, and the memory tier's,
    have dckpt's modes, not the umask's (the review: shards, manifests, the ledger and the
    replay journals were 0644, readable by every local user)."""
    import logging

    import torch

    import dckpt
    from dckpt.cli import main as cli

    if env is None:
        monkeypatch.delenv(FILE_MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(FILE_MODE_ENV, env)
    logging.getLogger("dckpt").setLevel(logging.WARNING)
    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    old = os.umask(0)
    try:
        net = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        config = dckpt.CheckpointConfig(root=root, memory=True, memory_dir=memory)
        for step in (1, 2):
            with dckpt.CheckpointManager(config, dckpt.TrainState(net, opt)) as mgr:
                mgr.resume()
                mgr.observe(1.0)
                net(torch.randn(2, 8)).sum().backward()
                opt.step()
                mgr.save(step).result()
                mgr.observe(0.5)
                mgr.save(step + 10, tier="memory").result()
        assert cli(["verify", str(root)]) == 0
        assert cli(["pin", str(root), "1"]) == 0
    finally:
        os.umask(old)
    seen = {"file": 0, "dir": 0}
    for top in (root, memory):
        for path in [top, *top.rglob("*")]:
            st = path.lstat()
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
            seen[kind] += 1
            want = want_dir if kind == "dir" else want_file
            assert stat.S_IMODE(st.st_mode) == want, f"{path}: {stat.S_IMODE(st.st_mode):o}"
    names = {p.name for p in root.rglob("*")}
    assert {"manifest.json", ".metadata", "latest", ".dckpt-replay", ".dckpt-verified"} <= names
    assert seen["file"] > 15 and seen["dir"] > 6, seen


# --- the durable root, proven at every start (prove_root) -----------------------------------


def test_a_missing_root_under_a_sticky_parent_is_made_private(shared: Path) -> None:
    old = os.umask(0)
    try:
        real = prove_root(shared / "runs" / "exp1")
    finally:
        os.umask(old)
    assert real == (shared / "runs" / "exp1").resolve()
    assert _mode(shared / "runs") == _mode(real) == 0o700


def test_a_root_another_user_made_first_is_refused_and_left_alone(shared: Path) -> None:
    """The squatted root: made first, mode 0777, by another user, in a sticky directory."""
    squat = shared / "exp1"
    squat.mkdir()
    squat.chmod(0o777)
    os.chown(squat, OTHER, OTHER)
    with pytest.raises(NotOwnedError, match=rf"{squat} belongs to uid {OTHER}.*own"):
        prove_root(squat)
    assert list(squat.iterdir()) == [] and _mode(squat) == 0o777


def test_a_root_under_a_parent_another_user_made_is_refused_before_anything_is_made(
    shared: Path,
) -> None:
    """The squatted parent: the root is missing, its parent is another user's (who could
    rename the job's root away and put her own in its place)."""
    theirs = shared / "team"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(NotOwnedError, match=rf"{theirs} belongs to uid {OTHER}"):
        prove_root(theirs / "exp1")
    assert not (theirs / "exp1").exists()


def test_a_root_others_may_write_is_refused_unless_the_group_is_trusted(tmp_path: Path) -> None:
    root = tmp_path / "exp1"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(NotOwnedError, match=rf"writable by others.*chmod go-w {root}"):
        prove_root(root)
    with pytest.raises(NotOwnedError, match="writable by others"):
        prove_root(root, access="group")  # the group switch never admits others
    root.chmod(0o770)
    with pytest.raises(NotOwnedError, match=r"its group.*DCKPT_ROOT_ACCESS=group"):
        prove_root(root)
    assert prove_root(root, access="group") == root.resolve()
    assert _mode(root) == 0o770  # nothing changed on it either way


def test_the_group_switch_admits_a_team_directory_of_another_user_in_the_jobs_group(
    tmp_path: Path,
) -> None:
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o2770)
    os.chown(team, OTHER, os.getegid())  # the team lead's, in the job's group
    with pytest.raises(NotOwnedError, match=f"belongs to uid {OTHER}"):
        prove_root(team / "exp1")
    assert prove_root(team / "exp1", access="group") == (team / "exp1").resolve()
    os.chown(team, OTHER, OTHER)  # a group the job is not in: not the team's
    with pytest.raises(NotOwnedError, match=f"belongs to uid {OTHER}"):
        prove_root(team / "exp2", access="group")


def test_a_sticky_shared_directory_is_a_parent_never_the_root(shared: Path) -> None:
    os.chown(shared, 0, 0)
    with pytest.raises(NotOwnedError, match="every user may write"):
        prove_root(shared)
    prove_root(shared / "exp1")  # as a parent it is fine: nobody else can move exp1


def test_a_link_to_the_root_counts_only_when_the_user_or_root_owns_it(
    shared: Path, tmp_path: Path
) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    mine = shared / "mine"
    mine.symlink_to(real)
    assert prove_root(mine) == real.resolve()
    theirs = shared / "theirs"
    theirs.symlink_to(real)
    os.lchown(theirs, OTHER, OTHER)
    with pytest.raises(NotOwnedError, match=f"symlink owned by uid {OTHER}"):
        prove_root(theirs)


def test_the_walk_up_stops_at_a_directory_only_its_owner_can_change(tmp_path: Path) -> None:
    """Above a parent the job's user owns (and nobody else writes), nothing is asked: a home
    directory under a /home another admin runs is fine."""
    top = tmp_path / "top"
    top.mkdir(mode=0o777)  # above the stop: would be refused if it were looked at
    home = top / "home"
    home.mkdir(mode=0o755)
    assert prove_root(home / "runs" / "exp1") == (home / "runs" / "exp1").resolve()


def test_an_existing_root_is_refused_under_a_parent_another_user_controls(tmp_path: Path) -> None:
    """The root is there already, the job's own and private, but its parent is another
    user's (or anyone's, not sticky): that user can rename the root away and put hers in its
    place, so the parents are walked for an existing root as for a missing one."""
    theirs = tmp_path / "team"
    theirs.mkdir(mode=0o755)
    (theirs / "exp1").mkdir(mode=0o700)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(NotOwnedError, match=f"{theirs} belongs to uid {OTHER}"):
        prove_root(theirs / "exp1")
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    (open_parent / "exp1").mkdir(mode=0o700)
    open_parent.chmod(0o777)
    with pytest.raises(NotOwnedError, match=f"{open_parent} is writable by others"):
        prove_root(open_parent / "exp1")
