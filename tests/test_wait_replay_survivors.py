"""Survivors of issue 58's blind mutant round, each as the behaviour it let through:

- a store that stalled once and answers again: a worker that exits within ``QUIET_S`` of the
  stall looks afresh at exit and leaves torchrun's agent alone (dckpt/collective/store.py);
- a resume whose only change is the training length (``max_steps``, whose LR schedule it
  shapes): the replay is not compared, so no difference is recorded against the checkpoint,
  and the next resume with that length compares with the run that resumed (dckpt/load/watch.py);
- a step re-saved after a restart loop set the old save aside: the old save's failures are not
  the new one's, so the next starts resume it, train one step more and resume it again
  (dckpt/load/resumer.py, dckpt/root/resume_record.py);
- the epoch restored into a loader that has its own ``set_epoch`` (Accelerate's prepared
  loader with a seedable sampler: its order is a function of the epoch), dckpt/train/loader.py;
- a Hugging Face ``Trainer`` resumed after its LR warmup (in this process): the LR the restore
  gave the optimizer's groups is put back after the Trainer's new scheduler reset it, so the
  losses after the resume are the uninterrupted run's bits (dckpt/integrations/hf_trainer.py).

(Lightning's ``last*.ckpt`` linking to the root: tests/test_lightning_paths.py.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

# --- (a) a store that comes back after a stall --------------------------------------------------

STALLS_ONCE = textwrap.dedent(
    """
    import atexit, sys, time
    import dckpt.collective.store as store
    store.AGENT_GRACE_S = 2.0
    calls = []
    # registered first, so it runs after dckpt's probe at exit: how often the store was asked
    atexit.register(lambda: open(sys.argv[1], "w").write(str(len(calls))))
    class StallsOnce:  # a link that stalled for a moment, then carried answers again
        def check(self, keys):
            calls.append(keys)
            if len(calls) == 1:
                time.sleep(60)
            return True
    try:
        store.call(StallsOnce().check, ["dckpt/marker"], deadline_s=0.5)
    except store.StoreUnreachableError:
        pass  # the stall: dckpt remembers the store for the probe at exit
    else:
        raise SystemExit("the stall was not seen")
    # and the worker exits now, well within QUIET_S of the stall
    """
)


def test_a_store_that_answers_again_after_one_stall_leaves_the_agent_alone(tmp_path: Path) -> None:
    asked = tmp_path / "asked"
    agent_code = textwrap.dedent(
        f"""
        import subprocess, sys
        code = subprocess.run([sys.executable, "-c", {STALLS_ONCE!r}, {str(asked)!r}]).returncode
        sys.exit(10 + code)  # the agent's own exit, when nothing ended it
        """
    )
    # A stand-in agent: its command line names torch.distributed.run, as torchrun's does.
    agent = subprocess.Popen([sys.executable, "-c", agent_code, "torch.distributed.run"])
    try:
        code = agent.wait(timeout=120)  # the bound only ends a hang
    finally:
        if agent.poll() is None:
            agent.kill()
    assert code != -signal.SIGTERM, "the agent was sent SIGTERM although the store answers again"
    assert code == 10, code  # the worker exited 0 and the agent by itself
    assert asked.read_text() == "2"  # the stall, then the probe at exit, which got its answer


# --- (b) a changed training length: not compared, no strike ----------------------------------


def _length_run(root: Path, max_steps: int, *, until: int, save_at: int | None) -> dict[str, Any]:
    """One start in this process: resume, train to ``until`` with an LR that decays linearly
    to ``max_steps`` (a schedule computed from the training length), observing each loss."""
    import dckpt

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / max_steps)
    state = dckpt.TrainState(model, opt, scheduler=sched)
    config = dckpt.CheckpointConfig(root=root, async_save=False, replay_check="exact")
    out: dict[str, Any] = {"losses": {}}
    with dckpt.CheckpointManager(config, state, run_config={"max_steps": max_steps}) as mgr:
        out["report"] = mgr.resume().format()
        for step in range(state.step + 1, until + 1):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(16, 8, generator=g)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            state.step = step
            out["losses"][step] = float(loss.detach()).hex()
            mgr.observe(float(loss.detach()))
            if step == save_at:
                mgr.save(step)
    return out


def test_a_changed_training_length_is_not_replayed_and_records_no_strike(tmp_path: Path) -> None:
    from dckpt.root.resume_record import REPLAY, DirectoryRecords

    root = tmp_path / "ckpt"
    first = _length_run(root, 12, until=7, save_at=4)  # saved 4, stopped after 7
    longer = _length_run(root, 24, until=9, save_at=8)  # resumed 4, trains 2x as long
    records = DirectoryRecords(root).read(4)
    assert [r for r in records if r.kind == REPLAY] == [], records  # no strike of any kind
    report = longer["report"]
    assert "config changed in operational keys: max_steps" in report
    assert "training length changed (max_steps" in report
    assert "not compared: the config changed (max_steps)" in report
    # The length shapes the LR from the first scheduler step after the resume on (step 5's
    # update still uses the restored LR), so step 7's loss differs: a replay that compared it
    # would have found a difference the run was right to make.
    assert [longer["losses"][s] == first["losses"][s] for s in (5, 6, 7)] == [True, True, False]
    # One start more, from the step saved at the new length: compared (its config is the
    # run's), the same bits, a replay that passed.
    again = _length_run(root, 24, until=9, save_at=None)
    assert "step 9 of the run that stopped to compare (exact)" in again["report"]
    assert "config changed" not in again["report"]
    assert again["losses"][9] == longer["losses"][9]
    assert [(r.kind, r.ok) for r in DirectoryRecords(root).read(8) if r.kind == REPLAY] == [
        (REPLAY, True)
    ]
    assert [r for r in DirectoryRecords(root).read(4) if r.kind == REPLAY] == []


# --- (c) a step re-saved after a restart loop: the old save's failures are not its own ----------


def _loop_start(
    root: Path, monkeypatch: pytest.MonkeyPatch, *, attempt: int, steps: int, saves: tuple[int, ...]
) -> dict[str, Any]:
    """One start of the job, in this process but a start of its own (as a new process is):
    resume, train ``steps`` steps observing each loss (NaN when it resumed the first save of
    step 8: a checkpoint whose state diverges after a load), saving at ``saves``; it stops on
    the ``LossDeviationError`` as a job stops on a NaN check."""
    import dckpt
    from dckpt.root import resume_record

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    monkeypatch.setattr(resume_record, "_STARTS", {})  # what a new process has
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    state = dckpt.TrainState(model, opt)
    config = dckpt.CheckpointConfig(
        root=root, async_save=False, loss_watch="raise", loss_watch_steps=3, keep_last=4
    )
    out: dict[str, Any] = {"raised": None}
    with dckpt.CheckpointManager(config, state) as mgr:
        report = mgr.resume()
        out["step"], out["report"] = report.step, report.format()
        diverges = report.step == 8 and attempt in (1, 2)
        try:
            for _ in range(steps):
                state.step += 1
                g = torch.Generator().manual_seed(state.step)
                x = torch.randn(16, 8, generator=g)
                loss = nn.functional.mse_loss(model(x), x @ torch.linspace(-1, 1, 8)[:, None])
                opt.zero_grad()
                loss.backward()
                opt.step()
                mgr.observe(float("nan") if diverges else float(loss.detach()))
                if state.step in saves:
                    mgr.save(state.step)
        except dckpt.LossDeviationError as exc:
            out["raised"] = str(exc)
    out["end"] = state.step
    return out


def test_a_step_re_saved_after_a_restart_loop_is_not_quarantined_for_the_old_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dckpt.root.layout import list_checkpoints
    from dckpt.root.manifest import read_manifest
    from dckpt.root.resume_record import REPLAY, DirectoryRecords

    root = tmp_path / "ckpt"
    _loop_start(root, monkeypatch, attempt=0, steps=9, saves=(4, 8))  # 9 in 8's journal
    old = read_manifest(root / "step-00000008").save_id
    for attempt in (1, 2):  # two starts resume the first save of 8, and its replay differs
        failed = _loop_start(root, monkeypatch, attempt=attempt, steps=3, saves=())
        assert failed["step"] == 8 and failed["raised"], failed
    # The third quarantines it, resumes 4 and saves step 8 again (its replay journal: step 9).
    third = _loop_start(root, monkeypatch, attempt=3, steps=5, saves=(8,))
    assert third["step"] == 4 and "restart loop: step 8 quarantined" in third["report"]
    new = read_manifest(root / "step-00000008").save_id
    assert new != old
    # The next start resumes the new save, its old failures notwithstanding, and trains one
    # optimizer step (replayed: the same bits as the run that saved it) ...
    fourth = _loop_start(root, monkeypatch, attempt=4, steps=1, saves=())
    assert fourth["step"] == 8 and "restart loop" not in fourth["report"], fourth["report"]
    assert fourth["raised"] is None and fourth["end"] == 9
    # ... and the start after it resumes it again.
    fifth = _loop_start(root, monkeypatch, attempt=5, steps=1, saves=())
    assert fifth["step"] == 8 and "restart loop" not in fifth["report"], fifth["report"]
    assert sorted((e.step, e.status) for e in list_checkpoints(root) if e.step == 8) == [
        (8, "committed"),
        (8, "quarantined"),  # the first save only
    ]
    replays = [
        (r.save_id, r.ok, r.attempt) for r in DirectoryRecords(root).read(8) if r.kind == REPLAY
    ]
    assert replays == [(old, False, 1), (old, False, 2), (new, True, 4), (new, True, 5)], replays


# --- (d) the restored epoch, handed to a loader's own set_epoch ---------------------------------


def _seedable_loader() -> Any:
    """Accelerate's prepared loader over a seedable sampler: each epoch's order is a function
    of the epoch it is told (``set_epoch``, which its ``__iter__`` calls with its own count)."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)  # the sampler's seed: the same in both runs
    plain = DataLoader(TensorDataset(torch.arange(24)), batch_size=4, shuffle=True)
    return prepare_data_loader(
        plain, put_on_device=False, use_seedable_sampler=True, num_processes=1, process_index=0
    )


def test_an_accelerate_loader_resumed_in_a_later_epoch_draws_that_epoch_s_order() -> None:
    pytest.importorskip("accelerate")
    from test_loader_position import _load, _save

    from dckpt.train.loader import position_of

    def batches(loader: Any, stop: tuple[int, int] | None) -> tuple[list[list[int]], Any]:
        """Epochs from the position's to 4 (the script calls no set_epoch: Accelerate's
        loader counts them), and the state saved after batch ``stop[1]`` of epoch ``stop[0]``."""
        position, seen, saved = position_of(loader), [], None
        for epoch in range(position.epoch, 4):
            for i, (batch,) in enumerate(loader):
                seen.append(batch.tolist())
                if (epoch, i + 1) == stop:
                    saved = _save(position)
        return seen, saved

    full, saved = batches(_seedable_loader(), (2, 2))  # saved in epoch 2, 2 batches in
    assert saved is not None and saved[0] == {"kind": "loader", "epoch": 2, "batches": 2}
    resumed = _seedable_loader()
    _load(position_of(resumed), saved)
    after, _ = batches(resumed, None)
    assert after == full[6 * 2 + 2 :]  # 6 batches an epoch: epoch 2's third batch on
    assert resumed.iteration == 4  # Accelerate's own count went on from the restored epoch


# --- (d) the Trainer's restored LR, put back into the optimizer's groups ---------------------


def _trainer_run(root: Path, out: Path, crash_at: int | None) -> dict[int, str]:
    """A Hugging Face ``Trainer`` in this process (a tiny BERT, 6 steps, LR warmed up over 2
    steps then decaying linearly, saved by ``DckptCallback`` every 3 steps): resumed from
    ``root`` when it holds a step; raises out of the run after logging ``crash_at``. Returns
    every loss it logged, by step."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    import dckpt
    from dckpt.integrations.hf_trainer import DckptCallback

    losses: dict[int, str] = {}

    class Log(TrainerCallback):  # after the checkpoint's callback: a crash after its save
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"]).hex()
            if state.global_step == crash_at:
                raise RuntimeError("crashed")

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, 64, (24, 8), generator=g)
    data = [{"input_ids": ids[i], "labels": ids[i, 0] % 2} for i in range(24)]
    args = TrainingArguments(
        output_dir=str(out), use_cpu=True, per_device_train_batch_size=4, max_steps=6,
        learning_rate=1e-2, warmup_steps=2, lr_scheduler_type="linear", logging_steps=1,
        save_strategy="steps", save_steps=3, report_to="none", seed=7, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    set_seed(7)
    model = BertForSequenceClassification(
        BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=32, max_position_embeddings=16, num_labels=2)
    )  # fmt: skip
    ckpt = DckptCallback(dckpt.CheckpointConfig(root=root, async_save=False))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ckpt, Log()])
    try:
        trainer.train(resume_from_checkpoint=ckpt.resume(trainer))
    except RuntimeError as exc:
        assert str(exc) == "crashed"
    finally:
        ckpt.close()
    return losses


def test_a_trainer_resumed_after_warmup_trains_on_at_the_restored_lr(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    full = _trainer_run(tmp_path / "full", tmp_path / "out-full", None)
    crashed = _trainer_run(tmp_path / "ckpt", tmp_path / "out-1", crash_at=4)  # saved 3
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and sorted(crashed) == [1, 2, 3, 4]
    resumed = _trainer_run(tmp_path / "ckpt", tmp_path / "out-2", None)
    # The scheduler the resumed Trainer builds sets the LR to its warmup's start (0): the
    # step after the resume trains at the restored LR only when it is put back.
    assert resumed == {s: full[s] for s in (4, 5, 6)}
