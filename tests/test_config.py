"""CheckpointConfig: every check refuses its bad value in its own words and passes the good
value beside it; an s3:// config survives ``dataclasses.replace``; the mechanics (``remote``,
``value_checks``) are read, not set; every setting is documented under its declaration."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import dckpt
from dckpt import config as config_module

URL = "s3://bucket/runs/exp1"

# (the field a case is about, the settings that pass, the settings that fail, its words):
# the good and the bad value sit on either side of the bound the check draws.
CASES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("root", {"root": "runs/x"}, {"root": ""}, "root must be a directory path or an s3:// URL"),
    ("root", {"root": URL}, {"root": 5}, "root must be a directory path or an s3:// URL"),
    ("root", {"root": URL}, {"root": "gs://bucket/x"}, "dckpt supports directory paths and s3"),
    ("mirror", {"root": URL, "mirror": Path("m")}, {"root": "d", "mirror": Path("m")},
     "mirror is for s3:// roots; a directory root is its own copy"),
    ("digest", {"digest": "sha256"}, {"digest": "md5"}, "digest must be one of"),
    ("timeout_s", {"timeout_s": 0.5}, {"timeout_s": 0}, "timeout_s must be > 0, got 0: a wait"),
    ("timeout_s", {"timeout_s": 0.5}, {"timeout_s": float("nan")}, "timeout_s must be > 0"),
    ("save_timeout_s", {"timeout_s": 10, "save_timeout_s": 10},
     {"timeout_s": 10, "save_timeout_s": 9.5},
     r"save_timeout_s \(9.5\) must be >= timeout_s \(10\): a save waits for the others"),
    ("io_threads", {"io_threads": 1}, {"io_threads": 0}, r"io_threads must be in \[1, 64\]"),
    ("io_threads", {"io_threads": 64}, {"io_threads": 65}, r"io_threads must be in \[1, 64\]"),
    ("incremental_copies", {"incremental_copies": 1}, {"incremental_copies": 0},
     "incremental_copies must be >= 1, got 0"),
    ("full_every", {"full_every": 0}, {"full_every": -1},
     r"full_every must be >= 0 \(0: a frozen file is written again only when it changes\)"),
    ("async_save", {"async_save": False}, {"async_save": "yes"},
     "async_save must be True, False or 'auto', got 'yes'"),
    ("overlap_staging", {"overlap_staging": True, "async_save": "auto"},
     {"overlap_staging": True, "async_save": False},
     r"overlap_staging=True needs a background save \(async_save True or 'auto'\)"),
    ("device_staging_bytes", {"device_staging_bytes": 0}, {"device_staging_bytes": -1},
     r"device_staging_bytes must be >= 0 \(0 turns device staging off\), got -1"),
    ("if_busy", {"if_busy": "skip"}, {"if_busy": "drop"}, "if_busy must be 'wait' or 'skip'"),
    ("read_threads", {"read_threads": 1}, {"read_threads": 0},
     r"read_threads must be in \[1, 64\]"),
    ("read_threads", {"read_threads": 64}, {"read_threads": 65},
     r"read_threads must be in \[1, 64\]"),
    ("loss_watch", {"loss_watch": "raise"}, {"loss_watch": "error"},
     "loss_watch must be warn, raise or off, got 'error'"),
    ("loss_watch_steps", {"loss_watch_steps": 1}, {"loss_watch_steps": 0},
     "loss_watch_steps must be >= 1, got 0"),
    ("replay_check", {"replay_check": "close"}, {"replay_check": "bits"},
     "replay_check must be auto, exact, close or off, got 'bits'"),
    ("replay_rtol", {"replay_rtol": 0.0}, {"replay_rtol": -0.1},
     r"replay_rtol must be in \[0, 1\)"),
    ("replay_rtol", {"replay_rtol": 0.999}, {"replay_rtol": 1.0},
     r"replay_rtol must be in \[0, 1\)"),
    ("keep_last", {"keep_last": 2}, {"keep_last": 1},
     "keep_last must be at least 2, got 1: the newest checkpoint may turn out damaged"),
    ("milestone_every", {"milestone_every": 1}, {"milestone_every": 0},
     "milestone_every must be >= 1, got 0"),
    ("best_k", {"best_k": 0, "keep_last": 3}, {"best_k": -1, "keep_last": 3},
     "best_k must be >= 0, got -1"),
    ("best_k", {"best_k": 1, "keep_last": 3}, {"best_k": 1},
     "best_k needs keep_last: with keep_last=None everything is kept"),
    ("best_mode", {"best_mode": "max"}, {"best_mode": "median"},
     "best_mode must be 'min' or 'max', got 'median'"),
    ("lock_lease_s", {"lock_lease_s": 10}, {"lock_lease_s": 9.9},
     "lock_lease_s must be >= 10 s, got 9.9"),
    ("memory_keep", {"memory_keep": 1}, {"memory_keep": 0}, "memory_keep must be >= 1, got 0"),
    ("replica_check", {"replica_check": "warn"}, {"replica_check": "raise"},
     "replica_check must be 'error', 'warn' or 'off', got 'raise'"),
    ("replica_sample", {"replica_sample": 1.0}, {"replica_sample": 1.5},
     r"replica_sample must be in \(0, 1\], got 1.5"),
    ("replica_sample", {"replica_sample": 0.01}, {"replica_sample": 0},
     r"replica_sample must be in \(0, 1\], got 0"),
    ("root_access", {"root_access": "group"}, {"root_access": "team"},
     "root_access must be 'private' or 'group', got 'team'"),
    ("key_file", {"key_file": Path("k"), "digest": "sha256"}, {"key_file": Path("k")},
     "pass digest='sha256' with a key"),
]  # fmt: skip

# Settings any value of their type passes: nothing to refuse.
UNCHECKED = {
    "direct_io",
    "incremental",
    "fallback",
    "warmup",
    "lock",
    "memory",
    "memory_dir",
    "allow_nonfinite",
}


def _config(settings: dict[str, Any]) -> dckpt.CheckpointConfig:
    return dckpt.CheckpointConfig(**{"root": "runs/x", **settings})


def _ids() -> list[str]:
    return [f"{name}-{i}" for i, (name, *_) in enumerate(CASES)]


@pytest.mark.parametrize(("name", "good", "bad", "words"), CASES, ids=_ids())
def test_each_check_passes_the_good_value_and_refuses_the_bad_in_its_words(
    name: str, good: dict[str, Any], bad: dict[str, Any], words: str
) -> None:
    config = _config(good)
    for key, value in good.items():
        if key not in ("root", "mirror"):  # an s3:// root becomes its mirror: below
            assert getattr(config, key) == value
    with pytest.raises(ValueError, match=words):
        _config(bad)


def _public_fields() -> list[str]:
    return [
        f.name for f in dataclasses.fields(dckpt.CheckpointConfig) if not f.name.startswith("_")
    ]


def test_every_public_setting_has_a_check_case_or_is_any_value_of_its_type() -> None:
    checked = {name for name, *_ in CASES}
    assert set(_public_fields()) == checked | UNCHECKED


def test_defaults_pass_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCKPT_LOCK", raising=False)
    config = dckpt.CheckpointConfig(root="runs/x")
    assert config.root == Path("runs/x") and config.remote is None and config.mirror is None
    assert config.where == Path("runs/x") and config.directory == Path("runs/x")
    assert config.lock is True and config.watchdog_s == 4 * 600.0 + 30


def test_a_bad_dckpt_lock_variable_is_refused_as_lock_s_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DCKPT_LOCK", "maybe")
    with pytest.raises(ValueError, match=r"DCKPT_LOCK='maybe': use 0 \(no run lock\) or 1"):
        dckpt.CheckpointConfig(root="runs/x")
    assert dckpt.CheckpointConfig(root="runs/x", lock=False).lock is False  # given: no variable


# -- An s3:// root: the URL kept, root its mirror, through replace() -------------------------


@pytest.mark.parametrize("given_mirror", [True, False], ids=["mirror", "default-mirror"])
def test_replace_of_an_s3_config_keeps_its_url_and_mirror(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given_mirror: bool
) -> None:
    monkeypatch.setenv("DCKPT_CACHE_DIR", str(tmp_path / "cache"))
    mirror = tmp_path / "mirror" if given_mirror else None
    config = dckpt.CheckpointConfig(root=URL, mirror=mirror, keep_last=3)
    assert config.remote == URL and config.where == URL and config.mirror == mirror
    assert isinstance(config.root, Path) and config.root == config.directory
    if mirror is not None:
        assert config.root == mirror
    else:  # $DCKPT_CACHE_DIR/s3/<bucket>/<last part>-<hash of the prefix>
        assert config.root.parent == tmp_path / "cache" / "s3" / "bucket"
        assert config.root.name.startswith("exp1-")

    copy = dataclasses.replace(config, keep_last=5)
    assert copy.keep_last == 5
    assert (copy.remote, copy.where, copy.root, copy.mirror, copy.directory) == (
        URL,
        URL,
        config.root,
        mirror,
        config.directory,
    )
    assert copy.memory_root == config.memory_root  # keyed by the URL, not the mirror
    assert dataclasses.replace(copy, keep_last=3) == config  # back again: the same value

    other = dataclasses.replace(config, root="s3://bucket/runs/exp2")  # a new URL wins
    assert other.remote == other.where == "s3://bucket/runs/exp2"
    if mirror is not None:  # a given mirror is carried along: the new URL writes through it
        assert other.root == mirror
    else:  # the new URL's own default mirror
        assert isinstance(other.root, Path) and other.root.name.startswith("exp2-")


def test_a_directory_root_stays_a_directory_through_replace(tmp_path: Path) -> None:
    config = dckpt.CheckpointConfig(root=str(tmp_path / "run"))
    copy = dataclasses.replace(config, digest="sha256")
    assert copy.root == tmp_path / "run" and copy.remote is None and copy.where == copy.root
    assert copy.memory_root == config.memory_root


def test_the_memory_root_of_an_s3_root_is_named_by_the_url(tmp_path: Path) -> None:
    a = dckpt.CheckpointConfig(root=URL, mirror=tmp_path / "a")
    b = dckpt.CheckpointConfig(root=URL, mirror=tmp_path / "b")
    assert a.memory_root == b.memory_root and a.memory_root.name.startswith("exp1-")


# -- The mechanics are not settings ------------------------------------------------------------


def test_remote_is_not_a_keyword(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="remote"):
        dckpt.CheckpointConfig(root=tmp_path, remote=URL)  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        dckpt.CheckpointConfig(root=URL).remote = "s3://other/x"  # type: ignore[misc]
    assert "remote" not in _public_fields()


def test_value_checks_is_read_not_set() -> None:
    with pytest.raises(TypeError, match="value_checks"):
        dckpt.CheckpointConfig(root="runs/x", value_checks=False)  # type: ignore[call-arg]
    assert dckpt.CheckpointConfig(root="runs/x").value_checks is True
    off = dckpt.CheckpointConfig(root="runs/x", _value_checks=False)  # the benchmarks' switch
    assert off.value_checks is False and dataclasses.replace(off, keep_last=2).value_checks is False
    assert "value_checks" not in _public_fields() and "value_checks" not in repr(off)


# -- Every setting documented under its declaration --------------------------------------------


def _class_node() -> ast.ClassDef:
    tree = ast.parse(inspect.getsource(config_module))
    return next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointConfig"
    )


def _field_docs() -> dict[str, str]:
    """Each field's attribute docstring: the string literal right after its declaration."""
    body = _class_node().body
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = ""
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                doc = after.value.value
            docs[node.target.id] = doc
    return docs


def test_every_field_is_documented_under_its_declaration() -> None:
    docs = _field_docs()
    assert list(docs) == [f.name for f in dataclasses.fields(dckpt.CheckpointConfig)]
    undocumented = [name for name, doc in docs.items() if len(doc.split()) < 5]
    assert not undocumented, f"fields without an attribute docstring: {undocumented}"


def test_the_class_docstring_is_an_overview_not_a_field_list() -> None:
    doc = inspect.getdoc(dckpt.CheckpointConfig) or ""
    assert "Attributes:" not in doc and len(doc.splitlines()) <= 12
    listed = [name for name in _public_fields() if re.search(rf"^\s*{name}:", doc, re.M)]
    assert not listed


def test_each_fields_check_sits_in_its_themes_method() -> None:
    """A check that names a field is in the ``_check_*`` method after that field's group."""
    body = _class_node().body
    group: list[str] = []
    owner: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            group.append(node.target.id)
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("_check_"):
            owner.update(dict.fromkeys(group, node.name))
            group = []
    checks = {
        n.name: ast.get_source_segment(inspect.getsource(config_module), n) or ""
        for n in body
        if isinstance(n, ast.FunctionDef) and n.name.startswith("_check_")
    }
    for name, *_ in CASES:
        assert name in owner, f"{name} has no check method after its group"
        # keep_last, best_k and best_mode: RetentionPolicy checks them, built by the method
        held = "self.retention" if name in ("keep_last", "best_k", "best_mode") else name
        assert held in checks[owner[name]], f"{name}'s check is not in {owner[name]}"


def test_the_root_access_and_key_file_variables_are_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DCKPT_ROOT_ACCESS", "group")
    monkeypatch.setenv("DCKPT_KEY_FILE", "/keys/run.key")
    config = dckpt.CheckpointConfig(root="runs/x", digest="sha256")
    assert config.root_access == "group" and config.key_file == Path("/keys/run.key")
    monkeypatch.setenv("DCKPT_ROOT_ACCESS", "world")
    with pytest.raises(ValueError, match=r"DCKPT_ROOT_ACCESS='world': use private"):
        dckpt.CheckpointConfig(root="runs/x", digest="sha256")
