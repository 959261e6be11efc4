"""Resume behaviours no other test pinned down, each through the real save and resume path.

- The cached second Gaussian of NumPy's legacy generator (``has_gauss``) and Python's
  ``random.gauss`` (``gauss_next``) survive a save and resume: the next ``randn``/``gauss``
  is the one the uninterrupted process would have drawn.
- After a world-size change the RNG is reseeded from (seed, step, rank), not restored: each
  rank gets its own stream, and the same resume twice gives the same draws.
- A tensor whose dtype alone changed (same names and shapes) is refused before any tensor is
  filled, on every rank, even when only one rank's tensor is off; the error says what to do.
- A root whose every checkpoint is damaged, or whose only checkpoint is already in
  quarantine/, is refused (README: "A refused resume (... every checkpoint damaged)"; the
  resumer's step 9: nothing loaded while quarantine holds checkpoints is refused rather
  than a fresh start), naming each step set aside, deleting nothing.
- A write failure on each rank in turn, rank 0 included, fails the save on every rank and
  commits nothing (rank 0 judges every rank's report, its own too).

The in-process tests run one process without a process group; the rest spawn gloo ranks
(``dist_harness.run_world``), one world per group of cases.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_harness import run_world
from torch import nn

import dckpt
from dckpt.root.layout import QUARANTINE_DIR, committed_steps, step_dir_name

# --- helpers ---------------------------------------------------------------------------------

SEED = 7
"""The run's seed (``TrainState(seed=...)``): a reseed derives from it."""


def _two_layers(seed: int) -> nn.Sequential:
    """Two layers, so DCP reads one tensor before the other (the second can be made wrong)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))


def _manager(root: Path | str, model: nn.Module, **config: Any) -> dckpt.CheckpointManager:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = dckpt.CheckpointConfig(root=Path(root), timeout_s=30, **config)
    return dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt, seed=SEED))


def _scramble() -> None:
    """Leave every generator somewhere no checkpoint put it (and no Gaussian cached)."""
    entropy = int.from_bytes(os.urandom(4), "little")
    random.seed(entropy)
    np.random.seed(entropy)
    torch.manual_seed(entropy)


def _flip_a_byte(step_dir: Path) -> None:
    shard = sorted(step_dir.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes, but the run lock, the resume records and
    ``latest`` (a pointer, rewritten as steps come and go)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and p.name not in (".dckpt-lock", "latest")
        and ".dckpt-resumes" not in p.parts
    }


# --- 1. the cached Gaussians -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("numpy_draws", "python_draws"),
    [(3, 1), (3, 2), (2, 1)],
    ids=["both cached", "numpy's only", "python's only"],
)
def test_the_cached_numpy_and_python_gaussians_survive_a_save_and_resume(
    tmp_path: Path, numpy_draws: int, python_draws: int
) -> None:
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    # An odd number of Gaussians leaves the second of the last pair cached in a generator;
    # one generator cached and the other not tells their flags apart.
    np.random.randn(numpy_draws)
    for _ in range(python_draws):
        random.gauss(0.0, 1.0)
    assert np.random.get_state(legacy=True)[3] == numpy_draws % 2  # type: ignore[index]
    assert (random.getstate()[2] is not None) == bool(python_draws % 2)
    mgr = _manager(tmp_path, _two_layers(0))
    mgr.save(1).result()
    expected = (float(np.random.randn()), random.gauss(0.0, 1.0), float(np.random.rand()))
    _scramble()
    report = mgr.resume()
    got = (float(np.random.randn()), random.gauss(0.0, 1.0), float(np.random.rand()))
    mgr.close()
    assert "restored on every rank" in report.rng, report.rng
    assert got == expected


# --- 2. the reseed after a world-size change -------------------------------------------------


def _draws() -> list[float]:
    return [
        random.random(),
        float(np.random.rand()),
        float(np.random.randn()),
        float(torch.rand(1)),
    ]


def _save_one(rank: int, world: int, root: str) -> None:
    random.seed(rank), np.random.seed(rank), torch.manual_seed(rank)
    with _manager(root, _two_layers(0)) as mgr:
        mgr.save(4).result()


def _resume_reseeded(rank: int, world: int, root: str) -> dict[str, Any]:
    _scramble()  # whatever the generators held before must not show through
    with _manager(root, _two_layers(1)) as mgr:
        report = mgr.resume()
        draws = _draws()
    from dckpt.train import rng

    rng.reseed(SEED, 4, rank)  # what the resume says it did: the seed, the step, this rank
    return {"draws": draws, "rng": report.rng, "documented": _draws()}


@pytest.mark.multiproc
def test_a_world_size_change_reseeds_each_rank_distinctly_and_deterministically(
    tmp_path: Path,
) -> None:
    run_world(_save_one, 2, str(tmp_path))
    # The same resume twice, each a fresh start (new processes, as a restart is).
    first = run_world(_resume_reseeded, 3, str(tmp_path))
    second = run_world(_resume_reseeded, 3, str(tmp_path))
    for rank, (a, b) in enumerate(zip(first, second, strict=True)):
        assert "reseeded" in a["rng"] and "from 2 to 3" in a["rng"], a["rng"]
        assert a["draws"] == b["draws"], f"rank {rank} drew differently: not deterministic"
        assert a["draws"] == a["documented"], f"rank {rank}: not reseeded from ({SEED}, 4, {rank})"
    streams = [tuple(r["draws"]) for r in first]
    # Each generator apart on every pair of ranks, not just one of them.
    for kind in range(4):
        assert len({s[kind] for s in streams}) == 3, f"ranks share generator {kind}: {streams}"


# --- 3. a dtype changed alone ----------------------------------------------------------------


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("cast", ["last layer", "whole model"])
def test_a_tensor_whose_dtype_alone_changed_is_refused_before_any_tensor_is_filled(
    tmp_path: Path, cast: str
) -> None:
    with _manager(tmp_path, _two_layers(0)) as mgr:
        mgr.save(1).result()
    model = _two_layers(1)  # other weights than the checkpoint's: a fill would show
    (model[2] if cast == "last layer" else model).to(torch.bfloat16)
    before = _tensors(model)
    with _manager(tmp_path, model) as mgr, pytest.raises(dckpt.StateMismatchError) as raised:
        mgr.resume()
    after = _tensors(model)
    assert all(torch.equal(after[k], v) for k, v in before.items()), (
        "tensors were filled before the dtype was refused"
    )
    message = str(raised.value)
    which = "2.weight" if cast == "last layer" else "0.weight"
    assert which in message and "torch.float32" in message and "torch.bfloat16" in message
    assert "built differently" in message and "nothing was loaded" in message, message
    assert "Only the dtype differs: build the model in torch.float32" in message, message
    assert committed_steps(tmp_path) == [1] and not (tmp_path / QUARANTINE_DIR).exists()


def _resume_one_rank_cast(rank: int, world: int, root: str) -> dict[str, Any]:
    model = _two_layers(1)
    if rank == 1:  # only this rank's copy is off: rank 0's own check passes
        model[2].to(torch.bfloat16)
    before = _tensors(model)
    with _manager(root, model) as mgr:
        try:
            mgr.resume()
            error = None
        except dckpt.CheckpointError as exc:
            error = f"{type(exc).__name__}: {exc}"
    after = _tensors(model)
    return {"error": error, "untouched": all(torch.equal(after[k], v) for k, v in before.items())}


@pytest.mark.multiproc
def test_a_dtype_off_on_one_rank_is_refused_on_every_rank_before_any_fill(tmp_path: Path) -> None:
    run_world(_save_one, 2, str(tmp_path))
    results = run_world(_resume_one_rank_cast, 2, str(tmp_path), timeout=60)
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["error"].startswith("StateMismatchError"), (rank, r)
        assert "2.weight" in r["error"] and "torch.bfloat16" in r["error"], (rank, r)
        assert r["untouched"], f"rank {rank}: tensors were filled before the refusal"
    assert committed_steps(tmp_path) == [4] and not (tmp_path / QUARANTINE_DIR).exists()


# --- 4. nothing left to resume ---------------------------------------------------------------


def test_a_root_whose_every_checkpoint_is_damaged_is_refused_naming_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _two_layers(0)
    with _manager(tmp_path, model) as mgr:
        for step in (1, 2, 3):
            mgr.save(step).result()
    (tmp_path / "pins").mkdir(exist_ok=True)
    (tmp_path / "pins" / step_dir_name(2)).touch()  # a pin: upkeep of the root must keep it
    for step in (1, 2, 3):
        _flip_a_byte(tmp_path / step_dir_name(step))
    damaged = _tree(tmp_path)
    with (
        caplog.at_level(logging.ERROR, logger="dckpt"),
        _manager(tmp_path, _two_layers(1)) as mgr,
        pytest.raises(dckpt.CheckpointError) as raised,
    ):
        # allow_fresh does not train on a state the failed loads may have written into
        mgr.resume(allow_fresh=True)
    message = str(raised.value)
    assert "rebuild the model and the optimizer" in message, message
    assert "none of the 3 committed checkpoints" in message and "quarantine/" in message, message
    assert "Restore a good copy, or start a new run elsewhere" in message, message
    for step in (1, 2, 3):  # each step's verdict in the error itself, not only in the log
        assert f"step {step}: IntegrityError: digest mismatch" in message, message
    assert "manager.resume(allow_fresh=True)" in message, message
    refusal = "\n".join(r.getMessage() for r in caplog.records if "REFUSED" in r.getMessage())
    for step in (1, 2, 3):
        assert f"skipped step {step} (quarantined): IntegrityError: digest mismatch" in refusal, (
            refusal
        )
    assert committed_steps(tmp_path) == []
    # Quarantine keeps the bytes: every file is still there, moved, not changed; the pin stays.
    after = _tree(tmp_path)
    for name, data in damaged.items():
        step_name, _, rest = name.partition("/")
        moved = f"{QUARANTINE_DIR}/{name}" if step_name.startswith("step-") and rest else name
        assert after.get(moved) == data, f"{name} lost or changed (looked for {moved})"
    for step in (1, 2, 3):
        reason = tmp_path / QUARANTINE_DIR / f"{step_dir_name(step)}.reason.txt"
        assert "digest mismatch" in reason.read_text(), reason
    assert (tmp_path / "pins" / step_dir_name(2)).exists()

    # The next start meets a root that holds only quarantine/: refused again, not a fresh start.
    fresh = _two_layers(1)
    before = _tensors(fresh)
    with _manager(tmp_path, fresh) as mgr, pytest.raises(dckpt.CheckpointError) as again:
        mgr.resume()
    assert "no committed checkpoint but 3 in quarantine/" in str(again.value), again.value
    assert "restore one (dckpt restore " in str(again.value)
    assert "or remove quarantine/ to really start over" in str(again.value)
    assert all(torch.equal(_tensors(fresh)[k], v) for k, v in before.items())
    assert _tree(tmp_path) == after  # looking deleted nothing

    # On purpose: allow_fresh=True starts from scratch, says what it sets aside, keeps it all.
    with caplog.at_level(logging.WARNING, logger="dckpt"), _manager(tmp_path, fresh) as mgr:
        report = mgr.resume(allow_fresh=True)
        assert not report.resumed
        mgr.save(1).result()
    said = [r.getMessage() for r in caplog.records if "from scratch (allow_fresh" in r.getMessage()]
    assert len(said) == 1 and "3 in quarantine/" in said[0], said
    assert committed_steps(tmp_path) == [1]
    assert all(
        after[n] == d for n, d in _tree(tmp_path).items() if n in after and "quarantine" in n
    )


def test_a_root_whose_only_checkpoint_sits_in_quarantine_is_refused_not_resumed(
    tmp_path: Path,
) -> None:
    """The only step was set aside by an earlier start (here, as that start's resume would,
    through the root's quarantine): its bytes are intact, but it must not be resumed."""
    from dckpt.root.upkeep import quarantine

    with _manager(tmp_path, _two_layers(0)) as mgr:
        mgr.save(5).result()
    quarantine(tmp_path, tmp_path / step_dir_name(5), "set aside by a test")
    kept = _tree(tmp_path)
    model = _two_layers(1)
    before = _tensors(model)
    with _manager(tmp_path, model) as mgr, pytest.raises(dckpt.CheckpointError) as raised:
        mgr.resume()
    assert "has no committed checkpoint but 1 in quarantine/" in str(raised.value), raised.value
    assert all(torch.equal(_tensors(model)[k], v) for k, v in before.items()), "it was resumed"
    assert _tree(tmp_path) == kept


# --- 5. a rank's failure, on each rank in turn -----------------------------------------------


# (phase, rank): a failure inside DCP's write reaches the other ranks through DCP itself; one
# after DCP returned (dcp_finish) reaches them only through rank 0's reading of the reports.
FAILURES = [("write_shards", 0), ("write_shards", 1), ("dcp_finish", 0), ("dcp_finish", 1)]


def _fail_each_rank(rank: int, world: int, root: str) -> list[dict[str, Any]]:
    model = _two_layers(0)
    out: list[dict[str, Any]] = []
    with _manager(root, model) as mgr:
        mgr.save(1).result()
        for i, (phase, who) in enumerate(FAILURES):
            step = 2 * i + 2
            os.environ["DCKPT_FAULT"] = f"phase={phase},rank={who},action=raise,step={step}"
            try:
                mgr.save(step)
                mgr.wait()
                raised = ""
            except dckpt.SaveError as exc:
                raised = str(exc)
            os.environ.pop("DCKPT_FAULT")
            torch.distributed.barrier()  # rank 0 has decided; the root is what it left
            entry = {"raised": raised, "committed": committed_steps(Path(root))}
            entry["tmp_left"] = [p.name for p in Path(root).glob("*.tmp-*")]
            mgr.save(step + 1).result()  # the next save commits
            out.append(entry)
    return out


@pytest.mark.multiproc
def test_a_write_failing_on_each_rank_in_turn_fails_the_save_on_every_rank(
    tmp_path: Path,
) -> None:
    results = run_world(_fail_each_rank, 2, str(tmp_path), timeout=120)
    for i, (phase, who) in enumerate(FAILURES):
        step = 2 * i + 2
        for rank in (0, 1):
            entry = results[rank][i]
            said = entry["raised"]
            assert f"save of step {step} failed" in said, (phase, who, rank, said)
            assert f"rank {who}: " in said and f"injected fault at phase {phase}" in said, said
            assert step not in entry["committed"], (phase, who, entry)
            assert not entry["tmp_left"], entry
    assert committed_steps(tmp_path) == [1, *(2 * i + 3 for i in range(len(FAILURES)))]
