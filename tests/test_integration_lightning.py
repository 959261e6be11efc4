"""dckpt under Lightning (dckpt.integrations.lightning): a real 2-rank ``Trainer`` on gloo under
torchrun, ``strategy=DckptStrategy(...)`` (and ``DckptModelParallelStrategy`` with FSDP2),
``ModelCheckpoint(every_n_train_steps=4, save_last=True)`` and ``fit(ckpt_path="last")``
(tests/integrations/lightning_train.py).

Invariants checked, each against one uninterrupted run of the same seeded script (shared):

- the ModelCheckpoint's cadence decides the saves, and they are dckpt checkpoints: its
  ``.ckpt`` names are links into the dckpt root, no Lightning pickle is written anywhere;
- a rank SIGKILLed at a step drawn at random (in epoch 0, and in epoch 1) and restarted
  with ``ckpt_path="last"`` resumes the newest checkpoint (in the middle of epoch 0; at the
  end of it), verified (dckpt's resume report), across DDP and FSDP2 both ways,
  and every loss logged after the restart equals the uninterrupted run's, bit for bit
  (float.hex): model, optimizer, scheduler, loops, data position and RNG all came back;
  dckpt's own replay check agrees;
- a flipped bit in the newest checkpoint's shard file: the restart quarantines it, falls back
  to the one before, and is exact from there.

The runs are shared (one module fixture, six torchrun launches, each costing every rank
seconds of importing torch and Lightning) and chained on one root: killed with nothing
committed -> restarted fresh, killed in epoch 0 -> resumed under FSDP2, killed in epoch 1 ->
resumed to the end; each restart is the next scenario's killed run. The uninterrupted run goes
beside the chain, and the flipped copy's restart beside the last resume.

``DCKPT_LIGHTNING_TEST_STRATEGY=ddp`` runs the script with Lightning's plain ``DDPStrategy``:
every test then fails (checked once by hand: the proof that they test the strategy).
"""

from __future__ import annotations

import importlib
import os
import random
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import torchrun_job

from dckpt.root.layout import committed_steps, step_dir_name

SCRIPT = Path(__file__).resolve().parent / "integrations" / "lightning_train.py"
MAX_STEPS, EVERY, STEPS_PER_EPOCH = 20, 4, 8  # 64 samples / (2 ranks x 4): 8 steps an epoch
STRATEGY = os.environ.get("DCKPT_LIGHTNING_TEST_STRATEGY", "dckpt")


@dataclass
class Run:
    root: Path
    rc: int
    output: str  # torchrun's and both ranks' stdout and stderr
    losses: dict[int, str]  # step -> float.hex of the mean loss over the ranks


def _run(root: Path, name: str, *args: str) -> Run:
    """The script under torchrun, 2 ranks on gloo; ``name`` names its loss log; ``args``
    come last, so they override (``--strategy fsdp2``)."""
    log = root.parent / f"{root.name}-{name}.losses"
    script_args = ["--root", str(root), "--loss-log", str(log), "--max-steps", str(MAX_STEPS),
                   "--every", str(EVERY), "--strategy", STRATEGY, *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = torchrun_job(SCRIPT, script_args, env=env, timeout=150, flavor="lightning")
    losses: dict[int, str] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            step, value = line.split()
            assert int(step) not in losses, f"step {step} logged twice in one run"
            losses[int(step)] = value
    return Run(root, done.returncode, done.stdout + done.stderr, losses)


def _no_pickles(root: Path) -> None:
    """Every ``.ckpt`` under ``root`` is a link into the dckpt root; no pickle anywhere."""
    ckpts = list(root.rglob("*.ckpt"))
    assert ckpts, f"ModelCheckpoint named no file under {root}"
    for path in ckpts:
        assert path.is_symlink(), f"{path} is a file Lightning wrote, not a dckpt link"
        assert path.resolve().is_relative_to((root / "dckpt").resolve()), path
    dckpt_root = (root / "dckpt").resolve()
    for path in root.rglob("*"):  # Lightning wrote no file of its own: only dckpt did
        if path.is_file() and not path.is_symlink():
            assert path.resolve().is_relative_to(dckpt_root), f"{path}: not dckpt's"


def _resumed_from(restart: Run, step: int, *, killed: bool = False) -> None:
    """The restart's report: it resumed ``step``, verified, and the replay found it exact;
    it ran to the end (or, ``killed``, was SIGKILLed again)."""
    out = restart.output
    assert (restart.rc != 0) if killed else (restart.rc == 0), out[-4000:]
    assert f"dckpt resume: step {step} from {restart.root / 'dckpt' / step_dir_name(step)}" in out
    assert "[ok  ] digests:" in out and "[ok  ] manifest:" in out, out[-4000:]
    assert "[FAIL]" not in out and "REFUSED" not in out, out[-4000:]


def _exact_after(restart: Run, step: int, reference: Run) -> None:
    """Every step after ``step`` was logged by the restart, with the reference's loss."""
    assert sorted(restart.losses) == list(range(step + 1, MAX_STEPS + 1)), restart.losses
    for s, value in restart.losses.items():
        assert value == reference.losses[s], f"step {s}: {value} now, {reference.losses[s]} then"


def _shards(root: Path, step: int) -> int:
    """How many pieces the checkpoint of ``step`` holds the first layer's weight in: 1 as DDP
    saves it (replicated), one a rank as FSDP2 does."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(root / "dckpt" / step_dir_name(step)).read_metadata()
    return len(meta.state_dict_metadata["model.net.0.weight"].chunks)


def _kill_step(epoch: int) -> int:
    """A step drawn at random (seeded) after ``epoch``'s first save and before the next
    one: a restart from epoch 0 resumes in the middle of the epoch (step 4), one from epoch
    1 at the end of epoch 0 (step 8, the last batch: the next epoch's order, a new iterator).
    A save asked for after step N is taken as step N+1 starts: one of N+1 is committed."""
    first = max(epoch * STEPS_PER_EPOCH, EVERY) + 1
    return random.Random(44 + epoch).randint(first, first + EVERY - 1)


def _newest_before(kill: int) -> int:
    """The newest step committed when every rank died at the end of step ``kill``."""
    return (kill - 1) // EVERY * EVERY


@dataclass
class Chain:
    """One root killed three times: as step 4 ends, with nothing committed yet; in epoch 0
    (under DDP), then, restarted under FSDP2, in epoch 1; restarted under DDP again to the
    end. A copy of it as the epoch 1 kill left it, its newest checkpoint's shard flipped,
    restarted to the end beside it."""

    nothing: Run  # killed as step 4 ends: nothing committed, last.ckpt a link to the root
    first: Run  # DckptStrategy (DDP), starts fresh as without the link, killed in epoch 0
    second: Run  # the first resume, DckptModelParallelStrategy (FSDP2), killed later
    third: Run  # the second resume, DckptStrategy, to the end
    after: Run  # the restart of the copy with a flipped bit, to the end
    kills: tuple[int, int]
    at_second_kill: Path  # a copy of the root as the second kill left it, then flipped
    last_link_after_nothing: bool  # checkpoints/last.ckpt a link once `nothing` was killed
    committed: dict[str, list[int]]  # the steps committed once each killed run ended


@dataclass
class Runs:
    reference: Run
    chain: Chain


def _committed(root: Path) -> list[int]:
    """The steps committed in the dckpt root under ``root`` (none where it was never made: the
    fixture runs every launch, whatever an earlier one did; the tests judge)."""
    return committed_steps(root / "dckpt") if (root / "dckpt").is_dir() else []


def _flip_newest(root: Path, newest: int) -> None:
    shard = max((root / "dckpt" / step_dir_name(newest)).glob("*.distcp"), key=os.path.getsize)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every launch of the file, six: the uninterrupted run (saving in the background, dckpt's
    default) beside a chain of runs on one root, each restart the next scenario's killed run;
    the restart of the flipped copy beside the chain's last. Saves commit before training goes
    on (``--sync``) in the runs that are killed, so which step each restart resumes is known;
    the last restarts run as a user's would."""
    base = tmp_path_factory.mktemp("lightning")
    root = base / "killed"
    kills = (_kill_step(0), _kill_step(1))
    committed: dict[str, list[int]] = {}
    with ThreadPoolExecutor(2) as pool:  # each job alone keeps the 2 cores about half busy
        reference_job = pool.submit(_run, base / "reference", "all")
        nothing = _run(root, "nothing", "--sync", "--kill-at", str(EVERY))
        last_link = (root / "checkpoints" / "last.ckpt").is_symlink()
        # the restart of `nothing`, killed in epoch 0
        first = _run(root, "first", "--sync", "--kill-at", str(kills[0]))
        committed["first"] = _committed(root)
        # FSDP2 (fully_shard over both ranks) resumes what DDP saved and saves shards itself;
        # on the CPU its averaged gradient shards are DDP's averaged gradients, bit for bit,
        # so the one reference serves every strategy. (Lightning's FSDPStrategy, FSDP1,
        # refuses accelerator="cpu" in Lightning 2.6.)
        fsdp2 = "fsdp2" if STRATEGY == "dckpt" else STRATEGY
        second = _run(root, "second", "--sync", "--kill-at", str(kills[1]), "--strategy", fsdp2)
        committed["second"] = _committed(root)
        copy = base / "at-second-kill"
        if root.is_dir():
            shutil.copytree(root, copy, symlinks=True)
        if committed["second"]:
            _flip_newest(copy, committed["second"][-1])
        after_job = pool.submit(_run, copy, "after")
        third = _run(root, "third")
        reference, after = reference_job.result(), after_job.result()
    chain = Chain(nothing, first, second, third, after, kills, copy, last_link, committed)
    return Runs(reference, chain)


@pytest.fixture(scope="module")
def reference(runs: Runs) -> Run:
    """The uninterrupted run."""
    run = runs.reference
    assert run.rc == 0, run.output[-4000:]
    assert sorted(run.losses) == list(range(1, MAX_STEPS + 1)), run.losses
    return run


@pytest.fixture(scope="module")
def chain(runs: Runs) -> Chain:
    """The chain, each killed run killed where it was to be, with the newest step committed
    that the next restart is to resume."""
    chain, kills = runs.chain, runs.chain.kills
    first, second = chain.first, chain.second
    assert first.rc != 0 and max(first.losses) == kills[0], first.output[-4000:]
    assert chain.committed["first"][-1:] == [_newest_before(kills[0])], chain.committed
    assert second.rc != 0 and max(second.losses) == kills[1], second.output[-4000:]
    assert chain.committed["second"][-1:] == [_newest_before(kills[1])], chain.committed
    return chain


@pytest.mark.multiproc
def test_model_checkpoint_cadence_writes_dckpt_checkpoints_and_no_pickles(
    reference: Run,
) -> None:
    # ckpt_path="last" with nothing saved yet starts fresh: Lightning finds no last file.
    assert "there is no last checkpoint available" in reference.output
    assert "dckpt resume:" not in reference.output
    # every 4th step; the save asked for at the last step is taken as training ends
    assert committed_steps(reference.root / "dckpt") == list(range(EVERY, MAX_STEPS + 1, EVERY))
    links = reference.root / "checkpoints"
    assert (links / "last.ckpt").resolve() == (reference.root / "dckpt").resolve()
    step8 = (reference.root / "dckpt" / step_dir_name(8)).resolve()
    assert (links / "epoch=0-step=8.ckpt").resolve() == step8
    _no_pickles(reference.root)


@pytest.mark.multiproc
def test_sigkill_in_epoch_0_resumes_last_exactly(reference: Run, chain: Chain) -> None:
    kill = chain.kills[0]
    newest = _newest_before(kill)
    _resumed_from(chain.second, newest, killed=True)
    # dckpt's replay check agrees: the steps the run that stopped took after the save
    replayed = f"step {kill}" if kill == newest + 1 else f"steps {newest + 1}..{kill}"
    assert f"[ok  ] replay: {replayed} identical" in chain.second.output
    # exact from the resumed step to where it was killed again, in a later epoch
    assert sorted(chain.second.losses) == list(range(newest + 1, chain.kills[1] + 1))
    for s, value in chain.second.losses.items():
        assert value == reference.losses[s], f"step {s}: {value} now, {reference.losses[s]} then"
    _no_pickles(chain.second.root)


@pytest.mark.multiproc
def test_sigkill_in_a_later_epoch_resumes_last_exactly(reference: Run, chain: Chain) -> None:
    kill = chain.kills[1]
    assert kill > STEPS_PER_EPOCH  # killed in epoch 1
    newest = _newest_before(kill)
    if STRATEGY == "dckpt":  # DDP resumes what FSDP2 saved in shards
        assert (
            _shards(chain.third.root, _newest_before(chain.kills[0])),
            _shards(chain.third.root, newest),
        ) == (1, 2)
    _resumed_from(chain.third, newest)
    _exact_after(chain.third, newest, reference)
    _no_pickles(chain.third.root)


@pytest.mark.multiproc
def test_flipped_bit_in_the_newest_falls_back_and_stays_exact(reference: Run, chain: Chain) -> None:
    restart = chain.after  # the copy at the second kill, its newest shard flipped
    newest = _newest_before(chain.kills[1])
    before = newest - EVERY
    assert f"skipped step {newest} (quarantined): IntegrityError" in restart.output, restart.output[
        -4000:
    ]
    _resumed_from(restart, before)
    _exact_after(restart, before, reference)


@pytest.mark.multiproc
def test_last_link_with_nothing_committed_starts_fresh_as_without_it(
    reference: Run, runs: Runs
) -> None:
    """Killed as step 4 ends: ModelCheckpoint named ``last.ckpt`` (a link to the root) and
    asked for a save that was to be taken as step 5 started. The restart resumes nothing and
    is the fresh run, step for step (no RNG of a resume put back), up to where the chain's
    epoch 0 scenario kills it (step 8: past step 6, where this scenario's own run once ended)."""
    chain = runs.chain  # not the `chain` fixture: its checks are of the later scenarios
    killed, restart = chain.nothing, chain.first
    assert killed.rc != 0 and chain.last_link_after_nothing, killed.output[-4000:]
    assert max(killed.losses) == EVERY, killed.losses  # killed as step 4 ended
    assert "dckpt resume: no committed checkpoint; starting from scratch" in restart.output
    # it ran, with no error, to its kill: every step logged up to it, the fresh run's losses
    kill = chain.kills[0]
    assert kill >= 6 and max(restart.losses) == kill, restart.output[-4000:]
    assert restart.losses == {s: reference.losses[s] for s in range(1, kill + 1)}


def test_dckpt_imports_no_lightning_and_a_missing_one_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code = (
        "import sys, dckpt, dckpt.integrations; "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('lightning', "
        "'pytorch_lightning')], 'imported lightning'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    monkeypatch.delitem(sys.modules, "dckpt.integrations.lightning", raising=False)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install dckpt\[lightning\]"):
        importlib.import_module("dckpt.integrations.lightning")


def test_a_link_is_made_under_a_name_of_its_own(tmp_path: Path) -> None:
    """ModelCheckpoint's file becomes a link to the dckpt step through a temporary link
    renamed over it. That name is a fresh one each time: a name fixed in advance can be taken
    first by something ``unlink`` cannot remove (a directory; in a shared directory, another
    user's file), which stopped the save."""
    from dckpt.integrations.lightning import _link

    target = tmp_path / "ckpt" / step_dir_name(7)
    target.mkdir(parents=True)
    links = tmp_path / "checkpoints"
    links.mkdir()
    (links / ".last.ckpt.dckpt-link").mkdir()  # the name the link once took, taken
    _link(links / "last.ckpt", target)
    _link(links / "last.ckpt", target)  # and over an existing link
    assert (links / "last.ckpt").resolve() == target.resolve()
    assert os.readlink(links / "last.ckpt") == os.path.join("..", "ckpt", step_dir_name(7))
    assert sorted(p.name for p in links.iterdir()) == [".last.ckpt.dckpt-link", "last.ckpt"]
