"""Bit rot, truncation and missing files in a committed checkpoint (fault 4), end to end.

Each trial damages step 2, the newest, of a private copy of a root where 2 real ranks saved
steps 1 and 2: a truncated shard, a flipped bit in a shard, in ``.metadata`` and in
``manifest.json``, a missing file, and bits flipped at random offsets of random files (seeded).
Then, per trial, in this process:

- ``dckpt verify ROOT --json`` (the command, as a user runs it) exits 3 and names the damaged
  file, and step 1 still verifies;
- the offline loader (``load_flat``, behind ``dckpt diff/export``) fails closed, naming it
  (and, for one trial, ``dckpt diff`` exits 3 naming it).

One restart then resumes every trial's root (a single spawn, to keep the suite fast): each must
fall back to step 1, move step 2 to ``quarantine/`` with a reason naming the damaged file, load
step 1 bit-exact and save a new step 2; ``fault_kit.check`` then holds with step 2 the only step
allowed to be gone (the damage was injected: it is not data lost).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import dckpt_cli
from dist_harness import run_world
from fault_kit import Trials, capture, check, failed, fresh_root, resume_world, saving_world
from torch.distributed.checkpoint.api import CheckpointException

from dckpt.errors import CheckpointError
from dckpt.load.offline import load_flat
from dckpt.root.layout import QUARANTINE_DIR, committed_steps, step_dir_name
from dckpt.root.manifest import MANIFEST_FILE, read_manifest, write_manifest

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

FAULT = "bit rot, truncation, missing file"
DAMAGED = 2
RANDOM_TRIALS = 12
RANDOM_SEED = 20240604
# A created_at whose repr ends in a digit that one flipped bit changes without changing the
# float it parses to: ...0977 and ...0976 are the same double (spacing 2.4e-7 there).
SAME_VALUE_CREATED_AT = 1796042707.9120977


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corruption") / "root"
    results = run_world(saving_world, 2, str(root), [1, 2])
    assert results == ["ok", "ok"], results
    assert committed_steps(root) == [1, 2]
    return root


def flip(path: Path, offset: int, bit: int) -> None:
    """Flip one bit in place (as bit rot does: no rewrite, same size)."""
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ (1 << bit)]), offset)
    finally:
        os.close(fd)


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def flip_in_value(step: Path, pattern: bytes, bit: int) -> None:
    """Flip a bit in the first byte of manifest.json that ``pattern``'s group 1 matches."""
    path = step / MANIFEST_FILE
    m = re.search(pattern, path.read_bytes())
    assert m is not None, pattern
    flip(path, m.start(1), bit)


def flip_keeping_values(step: Path) -> None:
    """A flip in manifest.json that parses to exactly the same values (so the self-digest,
    which covers values, holds): the last digit of a float that has two spellings."""
    write_manifest(step, dataclasses.replace(read_manifest(step), created_at=SAME_VALUE_CREATED_AT))
    path = step / MANIFEST_FILE
    before = path.read_bytes()
    flip_in_value(step, rb'"created_at": [0-9.]*(7),', 0)
    after = path.read_bytes()
    assert after != before and json.loads(after) == json.loads(before), "precondition"


@dataclass(frozen=True)
class Damage:
    case: str
    file: str
    apply: Callable[[Path], None]
    diff: bool = False
    """Also run `dckpt diff 1 2` (the offline loader as a command; it imports torch: ~2 s)."""


NAMED = [
    Damage("truncated shard", "__1_0.distcp", lambda s: truncate(s / "__1_0.distcp")),
    Damage(
        "flipped bit in a shard",
        "__0_0.distcp",
        lambda s: flip(s / "__0_0.distcp", 20000, 3),
        diff=True,
    ),
    Damage("flipped bit in .metadata", ".metadata", lambda s: flip(s / ".metadata", 5000, 6)),
    Damage(
        "flipped bit in manifest.json (step 2 -> 3)",
        MANIFEST_FILE,
        lambda s: flip_in_value(s, rb'\n "step": (2)', 0),
    ),
    Damage(
        "flipped bit in manifest.json (schema_version 1 -> 3)",
        MANIFEST_FILE,
        lambda s: flip_in_value(s, rb'"schema_version": (1)', 1),
    ),
    Damage("flipped bit in manifest.json, same values", MANIFEST_FILE, flip_keeping_values),
    Damage("missing shard", "__0_0.distcp", lambda s: (s / "__0_0.distcp").unlink()),
    Damage("missing .metadata", ".metadata", lambda s: (s / ".metadata").unlink()),
]


def random_damage(template: Path) -> list[Damage]:
    """Bits flipped at random offsets of random files of the damaged step (seeded)."""
    step = template / step_dir_name(DAMAGED)
    files = sorted(p.name for p in step.iterdir())
    rng = random.Random(RANDOM_SEED)
    out = []
    for i in range(RANDOM_TRIALS):
        name = rng.choice(files)
        offset, bit = rng.randrange((step / name).stat().st_size), rng.randrange(8)
        out.append(
            Damage(
                f"random flip {i}: {name} byte {offset} bit {bit}",
                name,
                lambda s, n=name, o=offset, b=bit: flip(s / n, o, b),
            )
        )
    return out


def _names(text: str, path: Path) -> bool:
    return str(path) in text


def check_verify(root: Path, damaged: Path) -> list[str]:
    """`dckpt verify --json` exits 3, step 1 verifies, step 2 fails naming ``damaged``."""
    proc = dckpt_cli("verify", str(root), "--json")
    if proc.returncode != 3:
        return [f"dckpt verify exited {proc.returncode}, not 3: {proc.stdout} {proc.stderr}"]
    report = json.loads(proc.stdout)
    by_dir = {Path(c["path"]).name: c for c in report["checkpoints"]}
    why = []
    if not by_dir.get(step_dir_name(1), {}).get("ok"):
        why.append(f"dckpt verify: step 1 does not verify: {by_dir.get(step_dir_name(1))}")
    bad = by_dir.get(step_dir_name(DAMAGED))
    if bad is None or bad["ok"]:
        why.append(f"dckpt verify passed step {DAMAGED}: {bad}")
    elif not any(p["path"] == str(damaged) for p in bad["problems"]):
        why.append(f"dckpt verify does not name {damaged}: {bad['problems']}")
    return why


def check_offline(root: Path, damaged: Path, diff: bool) -> list[str]:
    """The offline loader fails closed with dckpt's own error naming the file (and so does
    `dckpt diff`, which uses it: exit 3, no traceback)."""
    why = []
    try:
        load_flat(root / step_dir_name(DAMAGED))
        why.append("load_flat loaded the damaged checkpoint")
    except CheckpointError as exc:
        if not _names(str(exc), damaged):
            why.append(f"load_flat's error misses the file: {exc}")
    except (Exception, CheckpointException) as exc:  # not dckpt's own (DCP's is a BaseException)
        why.append(f"load_flat raised {type(exc).__name__}, not dckpt's error: {exc}"[:500])
    if diff:
        proc = dckpt_cli("diff", str(root), "1", str(DAMAGED))
        if proc.returncode != 3 or not _names(proc.stderr, damaged) or "Traceback" in proc.stderr:
            why.append(f"dckpt diff exited {proc.returncode}: {proc.stderr[-500:]!r}")
    return why


def test_damaged_files_fail_closed_and_resume_falls_back(
    template: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    baseline = capture(template)
    trials = NAMED + random_damage(template)
    roots: list[Path] = []
    for i, damage in enumerate(trials):
        root = fresh_root(template, tmp_path / f"trial-{i:02d}")
        damage.apply(root / step_dir_name(DAMAGED))
        roots.append(root)
    paths = [r / step_dir_name(DAMAGED) / d.file for r, d in zip(roots, trials, strict=True)]

    # The command, a real process per trial (a few at once: they are I/O and startup bound).
    with ThreadPoolExecutor(4) as pool:
        verify_why = list(pool.map(check_verify, roots, paths))
    why = {
        i: verify_why[i] + check_offline(roots[i], paths[i], trials[i].diff)
        for i in range(len(trials))
    }

    # The restart: every root at once, in one world.
    resumed = run_world(resume_world, 2, [str(r) for r in roots], timeout=300)
    for i, (damage, root) in enumerate(zip(trials, roots, strict=True)):
        for rank in range(2):
            got = resumed[rank][i]
            if got.get("error") or got.get("step") != 1 or not got.get("exact"):
                why[i].append(f"restart on rank {rank}: {got} (expected step 1, exact)")
        reason = root / QUARANTINE_DIR / f"{step_dir_name(DAMAGED)}.reason.txt"
        if not reason.is_file():
            why[i].append(f"step {DAMAGED} was not quarantined")
        elif not _names(reason.read_text(), paths[i]):
            why[i].append(f"the quarantine reason misses the file: {reason.read_text()!r}")
        if committed_steps(root) != [1, 2]:  # step 1, and the restart's new step 2
            why[i].append(f"committed after the restart: {committed_steps(root)}, not [1, 2]")
        outcome = check(root, baseline, may_drop=frozenset({DAMAGED}))
        fault_trials.record_check(
            FAULT, damage.case, outcome, survived=not why[i], detail="; ".join(why[i])
        )
    assert all(not w for w in why.values()), failed(fault_trials._sink)
