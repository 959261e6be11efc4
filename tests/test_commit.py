"""The commit protocol, `latest`, crash recovery, discovery and quarantine, on real directories."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from dckpt.root.commit import RenameCommit
from dckpt.root.durable import publish_latest
from dckpt.root.layout import (
    LATEST_FILE,
    QUARANTINE_DIR,
    TMP_RE,
    committed_steps,
    is_committed_dir,
    list_checkpoints,
    read_latest,
    step_dir_name,
)
from dckpt.root.manifest import MANIFEST_FILE, Manifest, read_manifest, write_manifest
from dckpt.root.upkeep import quarantine, recover
from dckpt.storage.digest import hash_file
from dckpt.storage.records import FileRecord

HEX = "0123456789abcdef" * 2


def stage(root: Path, step: int, payload: bytes = b"shard", *, manifest: bool = True) -> Path:
    """A tmp dir as the coordinator leaves it just before commit: shard files, then manifest."""
    tmp = RenameCommit().tmp_location(root, step, uuid.uuid4().hex)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload)
    digest, size = hash_file(tmp / "__0_0.distcp", "xxh3_128")
    if manifest:
        m = Manifest(
            step=step,
            world_size=1,
            files=(FileRecord(path="__0_0.distcp", bytes=size, digest=digest, rank=0),),
            run_id="run",
            save_id=tmp.name.rsplit("-", 1)[1],
            created_at=1.0,
            config={"payload": payload.decode(errors="replace")},
        ).sealed()
        write_manifest(tmp, m)
    return tmp


def commit(root: Path, step: int, payload: bytes = b"shard") -> Path:
    tmp = stage(root, step, payload)
    final = RenameCommit().finalize(root, tmp, step)
    assert not tmp.exists()
    return final


def names(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


def latest_text(root: Path) -> str:
    return (root / LATEST_FILE).read_text(encoding="utf-8")


# --- layout names -----------------------------------------------------------------------------


def test_step_dir_name() -> None:
    assert step_dir_name(0) == "step-00000000"
    assert step_dir_name(1200) == "step-00001200"
    assert step_dir_name(123_456_789) == "step-123456789"
    with pytest.raises(ValueError):
        step_dir_name(-1)


def test_tmp_location_is_named_for_step_and_save() -> None:
    assert RenameCommit().tmp_location(Path("/r"), 7, HEX) == Path(f"/r/step-00000007.tmp-{HEX}")


# --- commit -----------------------------------------------------------------------------------


def test_committed_dir_appears_only_after_commit(tmp_path: Path) -> None:
    tmp = stage(tmp_path, 1, b"one")
    final = tmp_path / "step-00000001"
    assert not final.exists()
    assert committed_steps(tmp_path) == []
    assert read_latest(tmp_path) is None
    assert [(e.step, e.status) for e in list_checkpoints(tmp_path)] == [(1, "incomplete")]
    strategy = RenameCommit()
    assert TMP_RE.fullmatch(tmp.name) and not is_committed_dir(tmp)

    result = strategy.finalize(tmp_path, tmp, 1)

    assert result == final
    assert is_committed_dir(final) and not TMP_RE.fullmatch(final.name)
    assert not tmp.exists()
    assert sorted(p.name for p in final.iterdir()) == ["__0_0.distcp", MANIFEST_FILE]
    assert (final / "__0_0.distcp").read_bytes() == b"one"
    assert read_manifest(final).step == 1
    assert committed_steps(tmp_path) == [1]
    assert read_latest(tmp_path) == "step-00000001"
    assert latest_text(tmp_path) == "step-00000001\n"
    assert names(tmp_path) == {"step-00000001", LATEST_FILE}  # no latest.tmp-* left behind


def test_a_step_directory_dckpt_did_not_name_is_never_listed_committed(tmp_path: Path) -> None:
    """``step-000000003`` (nine digits) holds a manifest, but every reader rebuilds step 3's
    directory as ``step-00000003``: listed committed, it would be read from another place."""
    RenameCommit().finalize(tmp_path, stage(tmp_path, 2, b"two"), 2)
    odd = tmp_path / "step-000000003"
    shutil.copytree(tmp_path / "step-00000002", odd)
    assert not is_committed_dir(odd)
    assert committed_steps(tmp_path) == [2]
    listed = {(e.step, e.status, e.path.name) for e in list_checkpoints(tmp_path)}
    assert listed == {(2, "committed", "step-00000002"), (3, "incomplete", odd.name)}


def test_latest_names_newest_committed_step(tmp_path: Path) -> None:
    commit(tmp_path, 1)
    assert read_latest(tmp_path) == "step-00000001"
    commit(tmp_path, 3)
    assert read_latest(tmp_path) == "step-00000003"
    commit(tmp_path, 123_456_789)  # more than 8 digits sorts numerically, not by name
    assert read_latest(tmp_path) == "step-123456789"
    assert committed_steps(tmp_path) == [1, 3, 123_456_789]


def test_a_rollback_moves_the_abandoned_newer_branch_to_quarantine(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        commit(tmp_path, step)
    commit(tmp_path, 2)  # the run went back to step 1 and saved step 2 again
    assert committed_steps(tmp_path) == [1, 2]
    assert read_latest(tmp_path) == "step-00000002"
    assert (tmp_path / "quarantine" / "step-00000003").is_dir()
    reason = (tmp_path / "quarantine" / "step-00000003.reason.txt").read_text()
    assert "superseded" in reason and "step 2" in reason
    assert not [n for n in names(tmp_path) if n.startswith(f"{LATEST_FILE}.tmp")]


@pytest.mark.parametrize("swap", ["exchange", "rename-aside"])
def test_commit_same_step_twice_replaces_whole(
    tmp_path: Path, swap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dckpt.root.commit

    swapped: list[bool] = []
    real_exchange = dckpt.root.commit.exchange

    def spy(a: Path, b: Path) -> bool:
        swapped.append(real_exchange(a, b) if swap == "exchange" else False)
        return swapped[-1]

    monkeypatch.setattr(dckpt.root.commit, "exchange", spy)
    first = commit(tmp_path, 5, b"first")
    (first / "only-in-first.bin").write_bytes(b"x")  # stands for a file the re-save lacks
    old_save_id = read_manifest(first).save_id
    inode_before = os.stat(first).st_ino

    second = commit(tmp_path, 5, b"second")

    assert second == first
    assert (second / "__0_0.distcp").read_bytes() == b"second"
    assert not (second / "only-in-first.bin").exists()  # replaced, never written into
    assert read_manifest(second).save_id != old_save_id
    assert os.stat(second).st_ino != inode_before
    assert names(tmp_path) == {"step-00000005", LATEST_FILE}  # no .replaced- or tmp dir
    assert read_latest(tmp_path) == "step-00000005"
    assert committed_steps(tmp_path) == [5]
    assert swapped == [swap == "exchange"]  # this file system can swap (Linux, renameat2)


def test_exchange_swaps_two_directories(tmp_path: Path) -> None:
    from dckpt.root.commit import exchange

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    assert exchange(a, b)
    assert (b / "x").read_text() == "from a" and not (a / "x").exists()
    with pytest.raises(OSError, match="cannot swap"):
        exchange(a, tmp_path / "missing")


def test_commit_refuses_tmp_dir_without_manifest(tmp_path: Path) -> None:
    commit(tmp_path, 1)
    tmp = stage(tmp_path, 2, manifest=False)
    with pytest.raises(ValueError, match=MANIFEST_FILE):
        RenameCommit().finalize(tmp_path, tmp, 2)
    assert tmp.is_dir()  # left for recover, not renamed
    assert not (tmp_path / "step-00000002").exists()
    assert committed_steps(tmp_path) == [1]
    assert read_latest(tmp_path) == "step-00000001"  # latest never points ahead of a commit


def test_commit_refuses_manifest_that_is_a_directory(tmp_path: Path) -> None:
    tmp = stage(tmp_path, 2, manifest=False)
    (tmp / MANIFEST_FILE).mkdir()
    with pytest.raises(ValueError, match=MANIFEST_FILE):
        RenameCommit().finalize(tmp_path, tmp, 2)
    assert not (tmp_path / "step-00000002").exists()


def test_commit_refuses_dirs_that_are_not_tmp_dirs_of_this_root(tmp_path: Path) -> None:
    other_root = tmp_path / "other"
    root = tmp_path / "root"
    root.mkdir()
    foreign = stage(other_root, 1)
    with pytest.raises(ValueError, match="not a dckpt tmp dir"):
        RenameCommit().finalize(root, foreign, 1)
    plain = root / "step-00000001"
    plain.mkdir()
    with pytest.raises(ValueError, match="not a dckpt tmp dir"):
        RenameCommit().finalize(root, plain, 1)
    assert foreign.is_dir()
    assert committed_steps(root) == []


def test_publish_latest_removes_latest_when_nothing_committed(tmp_path: Path) -> None:
    (tmp_path / LATEST_FILE).write_text("step-00000009\n")
    publish_latest(tmp_path)
    assert not (tmp_path / LATEST_FILE).exists()


def test_read_latest_ignores_non_step_content(tmp_path: Path) -> None:
    assert read_latest(tmp_path) is None
    for content in ("../../etc", "step-1", "", "step-00000001/..", "notes"):
        (tmp_path / LATEST_FILE).write_text(content)
        assert read_latest(tmp_path) is None, content
    (tmp_path / LATEST_FILE).write_bytes(b"\xff\xfe")
    assert read_latest(tmp_path) is None
    (tmp_path / LATEST_FILE).write_text("  step-00000004 \n")
    assert read_latest(tmp_path) == "step-00000004"


# --- recover ----------------------------------------------------------------------------------


def test_recover_removes_only_abandoned_tmp_dirs(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    root = tmp_path / "root"  # the checkpoint root; `outside` is beside it
    root.mkdir()
    commit(root, 1)
    abandoned = [stage(root, 2), stage(root, 3, manifest=False)]
    (root / "step-00000004").mkdir()  # final name, no manifest: incomplete, not ours to delete
    keep_dirs = [
        "step-foo",
        "notes",
        "step-00000001.tmp-xyz",  # not 32 hex
        f"step-00000001.tmp-{HEX.upper()}",  # uppercase hex is not ours
        f"step-1.tmp-{HEX}",  # fewer than 8 digits
        f"step-00000001.tmp-{HEX}0",  # 33 hex
        f"xstep-00000001.tmp-{HEX}",
        "quarantine",
    ]
    for name in keep_dirs:
        (root / name).mkdir()
        (root / name / "keep.txt").write_text("mine")
    (root / f"step-00000009.tmp-{HEX}").write_text("a file, not a dir")
    os.symlink(outside, root / f"step-00000008.tmp-{HEX}")  # a symlink is never followed

    actions = recover(root)

    link = f"removed the symlink step-00000008.tmp-{HEX}"  # the link only, never its target
    assert sorted(actions) == sorted(
        [link] + [f"removed abandoned save {p.name}" for p in abandoned]
    )
    for path in abandoned:
        assert not path.exists()
    for name in keep_dirs:
        assert (root / name / "keep.txt").read_text() == "mine", name
    assert (root / f"step-00000009.tmp-{HEX}").read_text() == "a file, not a dir"
    assert not os.path.lexists(root / f"step-00000008.tmp-{HEX}")
    assert (outside / "keep.txt").read_text() == "mine"
    assert (root / "step-00000004").is_dir()
    assert committed_steps(root) == [1]
    assert read_latest(root) == "step-00000001"
    assert recover(root) == []  # idempotent


@pytest.mark.parametrize(
    "name",
    [
        f"step-00000001.tmp-{HEX}\n",  # trailing newline
        "step-" + "\u0660" * 7 + "\u0661" + f".tmp-{HEX}",  # ARABIC-INDIC digits
    ],
    ids=["trailing-newline", "unicode-digits"],
)
def test_recover_leaves_lookalike_names_alone(tmp_path: Path, name: str) -> None:
    (tmp_path / name).mkdir()
    (tmp_path / name / "keep.txt").write_text("mine")
    recover(tmp_path)
    assert (tmp_path / name / "keep.txt").exists()


def test_recover_removes_stale_latest_tmp_files(tmp_path: Path) -> None:
    commit(tmp_path, 1)
    stale = tmp_path / f"{LATEST_FILE}.tmp-{uuid.uuid4().hex}"
    stale.write_text("step-00000002\n")
    recover(tmp_path)
    assert not stale.exists()
    assert read_latest(tmp_path) == "step-00000001"


def test_recover_restores_replaced_copy_when_final_missing(tmp_path: Path) -> None:
    commit(tmp_path, 1, b"one")
    final = commit(tmp_path, 2, b"two")
    # crash between "rename final aside" and "rename tmp to final"
    replaced = tmp_path / f"step-00000002.replaced-{uuid.uuid4().hex}"
    os.rename(final, replaced)
    stage(tmp_path, 2, b"never committed")
    assert committed_steps(tmp_path) == [1]

    actions = recover(tmp_path)

    assert "restored step-00000002: its re-save never committed" in actions
    assert (final / "__0_0.distcp").read_bytes() == b"two"
    assert read_manifest(final).step == 2
    assert not replaced.exists()
    assert names(tmp_path) == {"step-00000001", "step-00000002", LATEST_FILE}
    assert read_latest(tmp_path) == "step-00000002"


def test_recover_deletes_replaced_copy_when_final_exists(tmp_path: Path) -> None:
    old = commit(tmp_path, 2, b"old")
    replaced = tmp_path / f"step-00000002.replaced-{uuid.uuid4().hex}"
    shutil.copytree(old, replaced)
    (old / "__0_0.distcp").write_bytes(b"new")  # stands for the committed re-save

    actions = recover(tmp_path)

    assert actions == [f"removed superseded copy {replaced.name}"]
    assert not replaced.exists()
    assert (old / "__0_0.distcp").read_bytes() == b"new"
    assert read_latest(tmp_path) == "step-00000002"


def test_recover_deletes_replaced_copy_without_manifest(tmp_path: Path) -> None:
    replaced = tmp_path / f"step-00000003.replaced-{uuid.uuid4().hex}"
    replaced.mkdir()
    (replaced / "__0_0.distcp").write_bytes(b"half")
    recover(tmp_path)
    assert not replaced.exists()
    assert not (tmp_path / "step-00000003").exists()  # never becomes a checkpoint


def test_recover_repoints_dangling_latest(tmp_path: Path) -> None:
    commit(tmp_path, 1)
    commit(tmp_path, 2)
    shutil.rmtree(tmp_path / "step-00000002")
    assert read_latest(tmp_path) == "step-00000002"  # dangling
    assert recover(tmp_path) == []
    assert read_latest(tmp_path) == "step-00000001"

    (tmp_path / LATEST_FILE).write_text("garbage")
    recover(tmp_path)
    assert read_latest(tmp_path) == "step-00000001"

    (tmp_path / LATEST_FILE).unlink()
    recover(tmp_path)
    assert read_latest(tmp_path) == "step-00000001"

    # latest pointing at a final name without manifest is dangling too
    (tmp_path / "step-00000007").mkdir()
    (tmp_path / LATEST_FILE).write_text("step-00000007\n")
    recover(tmp_path)
    assert read_latest(tmp_path) == "step-00000001"

    shutil.rmtree(tmp_path / "step-00000001")
    recover(tmp_path)
    assert not (tmp_path / LATEST_FILE).exists()  # nothing committed: no latest at all


def test_recover_on_clean_root_changes_nothing(tmp_path: Path) -> None:
    assert recover(tmp_path) == []
    assert names(tmp_path) == set()
    commit(tmp_path, 4)
    mtime = (tmp_path / LATEST_FILE).stat().st_mtime_ns
    assert recover(tmp_path) == []
    assert (tmp_path / LATEST_FILE).stat().st_mtime_ns == mtime


# --- discovery --------------------------------------------------------------------------------


def test_list_checkpoints_reports_every_status(tmp_path: Path) -> None:
    commit(tmp_path, 1)
    tmp = stage(tmp_path, 2)
    (tmp_path / "step-00000003").mkdir()  # final name without manifest
    quarantined = commit(tmp_path, 4)
    q = quarantine(tmp_path, quarantined, "bad digest")
    commit(tmp_path, 5)
    # noise that is not a checkpoint
    (tmp_path / "notes").mkdir()
    (tmp_path / "step-foo").mkdir()
    (tmp_path / "step-00000006").write_text("a file")
    os.symlink(tmp_path / "step-00000001", tmp_path / "step-00000007")
    (tmp_path / "step-00000008.tmp-xyz").mkdir()

    found = [(e.step, e.status, e.path) for e in list_checkpoints(tmp_path)]

    assert found == [
        (1, "committed", tmp_path / "step-00000001"),
        (2, "incomplete", tmp),
        (3, "incomplete", tmp_path / "step-00000003"),
        (4, "quarantined", q),
        (5, "committed", tmp_path / "step-00000005"),
    ]
    assert committed_steps(tmp_path) == [1, 5]


def test_list_checkpoints_sorts_same_step_by_status(tmp_path: Path) -> None:
    q = quarantine(tmp_path, commit(tmp_path, 1), "first")
    commit(tmp_path, 1)
    tmp = stage(tmp_path, 1)
    found = [(e.status, e.path) for e in list_checkpoints(tmp_path)]
    assert found == [
        ("committed", tmp_path / "step-00000001"),
        ("incomplete", tmp),
        ("quarantined", q),
    ]


# --- quarantine -------------------------------------------------------------------------------


def test_quarantine_moves_dir_and_repoints_latest(tmp_path: Path) -> None:
    commit(tmp_path, 1)
    newest = commit(tmp_path, 2, b"bad")
    assert read_latest(tmp_path) == "step-00000002"

    target = quarantine(tmp_path, newest, "digest mismatch in __0_0.distcp")

    assert target == tmp_path / QUARANTINE_DIR / "step-00000002"
    assert not newest.exists()
    assert (target / "__0_0.distcp").read_bytes() == b"bad"  # kept for forensics
    reason = tmp_path / QUARANTINE_DIR / "step-00000002.reason.txt"
    assert reason.read_text() == "digest mismatch in __0_0.distcp\n"
    assert read_latest(tmp_path) == "step-00000001"
    assert committed_steps(tmp_path) == [1]

    # quarantining the same step name again keeps both copies
    again = quarantine(tmp_path, commit(tmp_path, 2, b"bad again"), "again")
    assert again != target and again.parent == target.parent
    assert (again / "__0_0.distcp").read_bytes() == b"bad again"
    assert (target / "__0_0.distcp").read_bytes() == b"bad"
    assert [e.status for e in list_checkpoints(tmp_path) if e.step == 2] == ["quarantined"] * 2

    # quarantining the last committed checkpoint removes latest
    quarantine(tmp_path, tmp_path / "step-00000001", "also bad")
    assert committed_steps(tmp_path) == []
    assert not (tmp_path / LATEST_FILE).exists()


def test_quarantine_refuses_non_step_dirs(tmp_path: Path) -> None:
    tmp = stage(tmp_path, 1)
    with pytest.raises(ValueError):
        quarantine(tmp_path, tmp, "not committed")
    assert tmp.is_dir()
    assert not (tmp_path / QUARANTINE_DIR).exists()


def test_a_symlink_planted_at_a_step_name_is_replaced_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not dckpt's")
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-00000004").symlink_to(outside)
    (root / f"step-00000009.tmp-{uuid.uuid4().hex}").symlink_to(outside)

    final = commit(root, 4, b"mine")
    assert not final.is_symlink() and (final / "__0_0.distcp").read_bytes() == b"mine"
    recover(root)
    assert not [p for p in root.iterdir() if p.is_symlink()]
    assert (outside / "keep.txt").read_text() == "not dckpt's"  # nothing outside was touched


@pytest.mark.parametrize(
    "holds",
    [("latest",), (".dckpt-lock",), ("step-00000003",), ("quarantine",), ()],
    ids=["only latest", "only the lock", "a step", "only quarantine", "nothing"],
)
def test_a_root_is_dckpt_s_by_any_one_of_its_marks(tmp_path: Path, holds: tuple[str, ...]) -> None:
    # A job that started and has not saved yet leaves only its lock; `dckpt ls` must still
    # read that root as dckpt's (and say it holds no checkpoint), not refuse the path.
    from dckpt.root.layout import is_dckpt_root

    (tmp_path / "notes.txt").write_text("a user's file")
    for name in holds:
        if name.startswith("step-") or name == "quarantine":
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_text("x")
    assert is_dckpt_root(tmp_path) is bool(holds)


@pytest.mark.parametrize("resave", [False, True], ids=["new step", "re-save"])
def test_a_cancelled_save_never_lands_new_or_replacing(tmp_path: Path, resave: bool) -> None:
    # The watchdog declares a save stuck and sets its flag; when the stuck thread wakes up at
    # the commit it must give up before the rename: by then the root may be the next job's.
    import threading

    if resave:
        commit(tmp_path, 4, b"committed")
    tmp = stage(tmp_path, 4, b"late")
    flag = threading.Event()
    flag.set()
    with pytest.raises(RuntimeError, match="cancelled before its commit"):
        RenameCommit().finalize(tmp_path, tmp, 4, cancelled=flag)
    assert committed_steps(tmp_path) == ([4] if resave else [])
    if resave:
        assert (tmp_path / "step-00000004" / "__0_0.distcp").read_bytes() == b"committed"


@pytest.mark.parametrize("resave", [False, True], ids=["new step", "re-save"])
def test_a_commit_rename_that_failed_and_did_not_happen_is_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resave: bool
) -> None:
    # An answered error is looked at (a lost reply may hide a rename that happened), and only
    # the very manifest of this save under the final name says it landed: a re-save's final
    # name holds the committed copy's manifest, which must not pass for this save's.
    import errno

    import dckpt.root.commit

    if resave:
        commit(tmp_path, 4, b"committed")

    def refused(*args: object) -> bool:
        raise OSError(errno.EIO, "Input/output error (the rename did not happen)")

    monkeypatch.setattr(dckpt.root.commit, "exchange", refused)
    monkeypatch.setattr(dckpt.root.commit.os, "rename", refused)
    tmp = stage(tmp_path, 4, b"new")
    with pytest.raises(OSError, match="did not happen"):
        RenameCommit().finalize(tmp_path, tmp, 4)
    monkeypatch.undo()
    assert committed_steps(tmp_path) == ([4] if resave else [])
    if resave:
        assert (tmp_path / "step-00000004" / "__0_0.distcp").read_bytes() == b"committed"
