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

The runs are shared (module-scoped) and chained, six torchrun launches for the four
scenarios (each launch costs every rank seconds of importing torch and transformers):

    fresh, killed in epoch 0 ──> restart (epoch 0's) killed in epoch 1 ──> restart (epoch 1's)
                                  └─ a copy, its newest shard flipped ──> restart (the bit
                                     flip's) SIGTERMed ──> restart (the SIGTERM's)

so a restart is also the next scenario's interrupted run: the epoch 0 restart is exact up to
the epoch 1 kill, the bit flip's up to the step the SIGTERM stopped it at, and the restarts after
them are exact from there to the end. The uninterrupted run goes beside the chain (each job
alone keeps the 2 cores about half busy), and so do the two branches after the copy.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import torchrun_job

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
    tmp: Path
    """Its TMPDIR."""

    @property
    def err(self) -> str:
        return self.proc.stdout + self.proc.stderr


def _train(where: Path, name: str, root: Path, *args: str) -> Run:
    """The script under torchrun, 2 ranks on gloo; ``name`` names its loss log."""
    log, out = where / f"{name}.jsonl", where / "out"
    tmp = where / f"tmp-{name}"  # its own TMPDIR: what it leaves there is seen
    tmp.mkdir(exist_ok=True)
    script_args = ["--root", str(root), "--out", str(out), "--loss-log", str(log), *args]
    env = {**_env(), "TMPDIR": str(tmp)}
    proc = torchrun_job(SCRIPT, script_args, env=env, timeout=240, cwd=where, flavor="hf")
    losses: dict[int, str] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            row = json.loads(line)
            losses[int(row["step"])] = str(row["loss"])
    return Run(proc, losses, out, tmp)


def _flip_a_bit(step_dir: Path) -> Path:
    """Flip one bit in the middle of the step's largest shard file; returns the file."""
    shard = max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    return shard


@dataclass
class Runs:
    full: Run
    killed: dict[str, Run]  # each scenario's interrupted run
    restarts: dict[str, Run]  # each scenario's restart (the same Run as the next one's killed)
    ends: dict[str, int]  # the step each restart ran to: STEPS, or where the next scenario's
    # SIGKILL or SIGTERM stopped it
    flipped: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("hf_trainer")
    full_dir, chain, flip = base / "full", base / "chain", base / "bitflip"
    for d in (full_dir, chain, flip):
        d.mkdir()
    with ThreadPoolExecutor(2) as pool:  # the uninterrupted run, beside the chain
        full_job = pool.submit(_train, full_dir, "run", full_dir / "root")
        k0 = _train(chain, "killed", chain / "root", "--kill-at", str(KILL_EPOCH0))
        # epoch 0's restart, killed in epoch 1: the epoch 1 scenario's interrupted run
        r0 = _train(chain, "restart0", chain / "root", "--kill-at", str(KILL_EPOCH1))
        # The bit flip: a copy of the root as the epoch 1 kill left it, its newest damaged.
        shutil.copytree(chain / "root", flip / "root", symlinks=True)
        flipped = _flip_a_bit(max((flip / "root").glob("step-*")))
        r1_job = pool.submit(_train, chain, "restart1", chain / "root")
        # the bit flip's restart, rank 1 SIGTERMed: the SIGTERM scenario's interrupted run
        rf = _train(flip, "restart", flip / "root", "--term-at", str(TERM_AT))
        rt = _train(flip, "restart-term", flip / "root")
        full, r1 = full_job.result(), r1_job.result()
    # where the SIGTERM ended the bit flip's restart: the step the ranks agreed on (the last
    # step if they agreed on none: the SIGTERM scenario's test fails then, not this one)
    agreed = re.search(r"the ranks agreed on step (\d+),", rf.err)
    stopped = int(agreed[1]) if agreed else STEPS
    return Runs(
        full,
        killed={"epoch0": k0, "epoch1": r0, "sigterm": rf},
        restarts={"epoch0": r0, "epoch1": r1, "bitflip": rf, "sigterm": rt},
        ends={"epoch0": KILL_EPOCH1, "epoch1": STEPS, "bitflip": stopped, "sigterm": STEPS},
        flipped=flipped,
    )


def _resumed_from(run: Run) -> int:
    line = next(x for x in run.err.splitlines() if x.startswith("dckpt resume: step "))
    return int(line.split()[3])


def _assert_exact_after(run: Run, full: Run, resumed: int, end: int = STEPS) -> None:
    """Every loss logged after the restart is the uninterrupted run's, bit for bit, and the
    restart logged every step from the one after the checkpoint to ``end`` (where it ended:
    the last step, or where the chain's next scenario stopped it)."""
    assert list(run.losses) == list(range(resumed + 1, end + 1)), (run.losses, run.err[-3000:])
    differ = {s: (v, full.losses[s]) for s, v in run.losses.items() if v != full.losses[s]}
    assert not differ, (
        f"losses after resuming step {resumed} differ (now, then): {differ}; the chain: a "
        "restart after the first resumes what earlier restarts saved, so an earlier scenario "
        "that failed may be the cause (epoch0, then epoch1 and bitflip, then sigterm)"
    )


def _assert_ran_to_its_end(run: Run, end: int, scenario: str) -> None:
    """The restart ran without an error to ``end``: the last step, exit 0; or, as the next
    scenario's interrupted run, every step logged until rank 1's SIGKILL after step ``end``."""
    if end == STEPS:
        assert run.proc.returncode == 0, f"{scenario}'s restart: {run.err[-5000:]}"
    else:
        assert "Signal 9 (SIGKILL)" in run.err and max(run.losses, default=0) == end, (
            f"{scenario}'s restart did not run to the kill after step {end}: {run.err[-5000:]}"
        )


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
    _assert_ran_to_its_end(restart, runs.ends[epoch], epoch)
    resumed = _resumed_from(restart)
    assert resumed == kill - kill % SAVE_STEPS, restart.err  # the newest save before the kill
    err = restart.err
    assert "[ok  ] digests:" in err and "[ok  ] state: model, optimizer, progress, extra" in err
    span = f"steps {resumed + 1}..{kill}" if kill > resumed + 1 else f"step {kill}"
    assert f"[ok  ] replay: {span} identical to the run that stopped" in err, err
    assert "[FAIL]" not in err and "[warn]" not in err, err
    _assert_exact_after(restart, runs.full, resumed, runs.ends[epoch])


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
    # exact to the step the SIGTERM of the next scenario stopped it at (exit 0, as checked)
    _assert_exact_after(restart, runs.full, resumed, runs.ends["bitflip"])


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
    # The folder resume() writes for train() to read goes once read (or at close): none is
    # left in any run's TMPDIR.
    left = [p for run in every for p in run.tmp.glob("dckpt-hf-resume-*")]
    assert left == [], left


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
