"""dckpt with the Hugging Face ``Trainer`` (dckpt.integrations.hf_trainer), under torchrun.

Role: the issue's checks of ``DckptCallback`` with a real 2-rank ``Trainer`` on gloo
(tests/integrations/hf_trainer_train.py: a tiny BERT from a config, dropout on, seeded),
killed with SIGKILL and restarted as a job would be.

Invariants checked:
- a run killed at a step drawn from a seeded random, once in epoch 0 and once in epoch 1
  (each resumed in the middle of an epoch), restarts from dckpt's newest checkpoint,
  verified, and every loss it logs after the restart equals the uninterrupted run's bit for
  bit (float.hex), the replay check agreeing; an eval runs at every save step (it draws from
  the RNG: the save must come after it);
- with a bit flipped in the newest checkpoint's shard, the restart quarantines it, falls back
  to the one before (the end of epoch 0: a resume at an epoch boundary), and is still exact;
- SIGTERM to one rank ends the run at a step the ranks agree on, saved by the callback, exit
  0; the restart resumes from that step and is exact;
- the Trainer writes no ``checkpoint-*`` folder of its own, in any of these runs;
- ``import dckpt`` does not import transformers; without it the module says what to install.

The runs are shared (module-scoped): the uninterrupted run and the three interrupted ones
start side by side, then the four restarts (each job alone keeps the 2 cores about half busy).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "integrations" / "hf_trainer_train.py"
STEPS = 12  # 48 samples, 4 a rank, 2 ranks: 6 steps an epoch, 2 epochs
SAVE_STEPS = 3  # the script's default: saves at 3, 6 (an epoch's end), 9, 12
# Seeded draws: a kill after a save in each epoch (never on a save step, so that some
# steps are replayed): 4 and 11 (resumed inside epoch 0 and inside epoch 1; the bit flip then
# falls back from 9 to 6, the end of epoch 0).
_DRAW = random.Random(46)
KILL_EPOCH0 = _DRAW.choice([4, 5])
KILL_EPOCH1 = _DRAW.choice([7, 8, 10, 11])
TERM_AT = 8  # rank 1 gets SIGTERM after step 8: the ranks agree on a later step, not a save step


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONFAULTHANDLER": "1",
    }


@dataclass
class Run:
    """One torchrun of the training script: its output and the losses rank 0 logged."""

    proc: subprocess.CompletedProcess[str]
    losses: dict[int, str]  # step -> float.hex, in the order logged
    out: Path

    @property
    def err(self) -> str:
        return self.proc.stdout + self.proc.stderr


def _train(where: Path, name: str, root: Path, *args: str) -> Run:
    """The script under torchrun, 2 ranks on gloo; ``name`` names its loss log."""
    log, out = where / f"{name}.jsonl", where / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(SCRIPT), "--root", str(root), "--out", str(out), "--loss-log", str(log),
           *args]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env=_env(), check=False, cwd=where
    )
    losses: dict[int, str] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            row = json.loads(line)
            losses[int(row["step"])] = str(row["loss"])
    return Run(proc, losses, out)


def _flip_a_bit(step_dir: Path) -> Path:
    """Flip one bit in the middle of the step's largest shard file; returns the file."""
    shard = max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    return shard


def _parallel(*jobs: Callable[[], Run]) -> list[Run]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return [f.result() for f in [pool.submit(job) for job in jobs]]


@dataclass
class Runs:
    full: Run
    killed: dict[str, Run]
    restarts: dict[str, Run]
    flipped: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("hf_trainer")
    dirs = {n: base / n for n in ("full", "epoch0", "epoch1", "bitflip", "sigterm")}
    for d in dirs.values():
        d.mkdir()
    full, k0, k1, term = _parallel(
        lambda: _train(dirs["full"], "run", dirs["full"] / "root"),
        lambda: _train(
            dirs["epoch0"], "killed", dirs["epoch0"] / "root", "--kill-at", str(KILL_EPOCH0)
        ),
        lambda: _train(
            dirs["epoch1"], "killed", dirs["epoch1"] / "root", "--kill-at", str(KILL_EPOCH1)
        ),
        lambda: _train(
            dirs["sigterm"], "killed", dirs["sigterm"] / "root", "--term-at", str(TERM_AT)
        ),
    )
    # The bit flip: a copy of epoch 1's killed run, its newest checkpoint damaged.
    shutil.copytree(dirs["epoch1"] / "root", dirs["bitflip"] / "root", symlinks=True)
    newest = max((dirs["bitflip"] / "root").glob("step-*"))
    flipped = _flip_a_bit(newest)
    r0, r1, rf, rt = _parallel(
        lambda: _train(dirs["epoch0"], "restart", dirs["epoch0"] / "root"),
        lambda: _train(dirs["epoch1"], "restart", dirs["epoch1"] / "root"),
        lambda: _train(dirs["bitflip"], "restart", dirs["bitflip"] / "root"),
        lambda: _train(dirs["sigterm"], "restart", dirs["sigterm"] / "root"),
    )
    killed = {"epoch0": k0, "epoch1": k1, "sigterm": term}
    return Runs(full, killed, {"epoch0": r0, "epoch1": r1, "bitflip": rf, "sigterm": rt}, flipped)


def _resumed_from(run: Run) -> int:
    line = next(x for x in run.err.splitlines() if x.startswith("dckpt resume: step "))
    return int(line.split()[3])


def _assert_exact_after(run: Run, full: Run, resumed: int) -> None:
    """Every loss logged after the restart is the uninterrupted run's, bit for bit, and the
    restart logged every step from the one after the checkpoint to the end."""
    assert list(run.losses) == list(range(resumed + 1, STEPS + 1)), (run.losses, run.err[-3000:])
    differ = {s: (v, full.losses[s]) for s, v in run.losses.items() if v != full.losses[s]}
    assert not differ, f"losses after resuming step {resumed} differ (now, then): {differ}"


@pytest.mark.multiproc
def test_uninterrupted_run_saves_at_the_trainers_cadence_and_logs_every_loss(runs: Runs) -> None:
    full = runs.full
    assert full.proc.returncode == 0, full.err[-5000:]
    assert list(full.losses) == list(range(1, STEPS + 1))
    saved = sorted(p.name for p in (full.out.parent / "root").glob("step-*"))
    assert saved == [f"step-{s:08d}" for s in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS)]
    assert "dckpt resume: no committed checkpoint; starting from scratch" in full.err


@pytest.mark.multiproc
@pytest.mark.parametrize("epoch", ["epoch0", "epoch1"])
def test_a_sigkilled_run_restarts_verified_and_exact(runs: Runs, epoch: str) -> None:
    killed, restart = runs.killed[epoch], runs.restarts[epoch]
    kill = KILL_EPOCH0 if epoch == "epoch0" else KILL_EPOCH1
    assert killed.proc.returncode != 0 and "Signal 9 (SIGKILL)" in killed.err, killed.err[-3000:]
    assert max(killed.losses) == kill  # rank 1 died right after step `kill` was logged
    assert restart.proc.returncode == 0, restart.err[-5000:]
    resumed = _resumed_from(restart)
    assert resumed == kill - kill % SAVE_STEPS, restart.err  # the newest save before the kill
    err = restart.err
    assert "[ok  ] digests:" in err and "[ok  ] state: model, optimizer, progress, extra" in err
    span = f"steps {resumed + 1}..{kill}" if kill > resumed + 1 else f"step {kill}"
    assert f"[ok  ] replay: {span} identical to the run that stopped" in err, err
    assert "[FAIL]" not in err and "[warn]" not in err, err
    _assert_exact_after(restart, runs.full, resumed)


@pytest.mark.multiproc
def test_a_flipped_bit_in_the_newest_checkpoint_falls_back_and_stays_exact(runs: Runs) -> None:
    restart = runs.restarts["bitflip"]
    assert restart.proc.returncode == 0, restart.err[-5000:]
    newest = int(runs.flipped.parent.name.split("-")[1])
    err = restart.err
    assert f"skipped step {newest} (quarantined): IntegrityError: digest mismatch in" in err, err
    assert runs.flipped.name in err
    resumed = _resumed_from(restart)
    assert resumed == newest - SAVE_STEPS
    assert "[ok  ] digests:" in err and "[FAIL]" not in err
    _assert_exact_after(restart, runs.full, resumed)


@pytest.mark.multiproc
def test_sigterm_ends_the_run_at_an_agreed_step_saved_and_the_restart_is_exact(
    runs: Runs,
) -> None:
    term, restart = runs.killed["sigterm"], runs.restarts["sigterm"]
    assert term.proc.returncode == 0, term.err[-5000:]  # a clean end: the job is requeued
    stopped = max(term.losses)
    assert TERM_AT < stopped < STEPS and stopped % SAVE_STEPS, term.err  # not a save step
    line = next(x for x in term.err.splitlines() if "dckpt: preempted (SIGTERM on rank 1)" in x)
    assert f"the ranks agreed on step {stopped}," in line, line
    # a save of the callback's own, not at the Trainer's cadence
    assert f"final checkpoint {term.out.parent / 'root'}/step-{stopped:08d} in" in line, line
    assert restart.proc.returncode == 0, restart.err[-5000:]
    assert _resumed_from(restart) == stopped and "[ok  ] digests:" in restart.err
    assert "[FAIL]" not in restart.err and "[warn]" not in restart.err, restart.err
    _assert_exact_after(restart, runs.full, stopped)


@pytest.mark.multiproc
def test_the_trainer_writes_no_checkpoint_folder_of_its_own(runs: Runs) -> None:
    every = [runs.full, *runs.killed.values(), *runs.restarts.values()]
    written = [p for run in every if run.out.exists() for p in run.out.rglob("checkpoint-*")]
    assert written == []
    for run in every:  # nor does anything else look for one
        assert "Can't find a valid checkpoint" not in run.err
        assert "missing keys" not in run.err


def test_import_dckpt_does_not_import_transformers_and_a_missing_one_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code = "import sys, dckpt, dckpt.integrations; print('transformers' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.strip() == "False"
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "dckpt.integrations.hf_trainer", raising=False)
    with pytest.raises(ImportError, match=r"pip install dckpt\[hf\]"):
        importlib.import_module("dckpt.integrations.hf_trainer")
