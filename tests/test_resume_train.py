"""Verified resume of the example trainer under torchrun: a crashed run equals an uninterrupted
one, loss for loss; a corrupted newest checkpoint falls back; a changed config is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import crash_and_resume_matches, losses, torchrun_train, torchrun_train_beside

from dckpt.root.layout import committed_steps, list_checkpoints

pytestmark = pytest.mark.multiproc


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


# Each way of training and each precision once (the checkpoint's contents differ by both:
# DDP's replicated tensors and FSDP2's shards; fp16's GradScaler): the full product of the
# two would repeat what these three prove, at about 22 s a run.
@pytest.mark.parametrize(
    ("parallel", "precision"), [("ddp", "fp32"), ("fsdp", "bf16"), ("fsdp", "fp16")]
)
def test_crashed_and_resumed_run_equals_uninterrupted_run(
    tmp_path: Path, parallel: str, precision: str
) -> None:
    crash_and_resume_matches(tmp_path, ["--parallel", parallel, "--precision", precision])


def test_corrupted_newest_checkpoint_is_quarantined_and_the_previous_one_used(
    tmp_path: Path,
) -> None:
    args = ["--steps", "9", "--save-every", "3", "--no-async"]
    first = torchrun_train(tmp_path / "ckpt", *args, "--loss-log", str(tmp_path / "a.jsonl"))
    assert first.returncode == 0, first.stderr
    assert committed_steps(tmp_path / "ckpt") == [3, 6, 9]
    _flip_bit(tmp_path / "ckpt" / "step-00000009" / "__0_0.distcp")
    # Ask for more steps than were run: resume must come from step 6, not 9. The config must
    # match, so resume the same 9-step run and compare the re-run steps 7-9.
    again = torchrun_train(tmp_path / "ckpt", *args, "--loss-log", str(tmp_path / "b.jsonl"))
    assert again.returncode == 0, again.stderr
    assert "dckpt resume: step 6" in again.stderr
    assert "skipped step 9 (quarantined)" in again.stderr and "__0_0.distcp" in again.stderr
    statuses = {(e.step, e.status) for e in list_checkpoints(tmp_path / "ckpt")}
    assert (9, "quarantined") in statuses and (9, "committed") in statuses  # re-saved
    reason = tmp_path / "ckpt" / "quarantine" / "step-00000009.reason.txt"
    assert "digest mismatch" in reason.read_text()
    a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert [b[s] for s in (7, 8, 9)] == [a[s] for s in (7, 8, 9)]


def test_changed_config_is_refused_with_a_diff_and_safe_keys_only_warn(tmp_path: Path) -> None:
    base = ["--steps", "4", "--save-every", "2", "--no-async"]
    assert torchrun_train(tmp_path / "ckpt", *base).returncode == 0
    # The two refused runs at once, each on its own copy of the root (one root would refuse
    # the second job for the first one's lock, not for its config).
    shutil.copytree(tmp_path / "ckpt", tmp_path / "copy", symlinks=True)
    with torchrun_train_beside(tmp_path / "copy", *base, "--d-model", "96") as pending:
        lr = torchrun_train(tmp_path / "ckpt", *base, "--lr", "0.01")
    width = pending.result()
    assert lr.returncode != 0
    # One readable block, once, from rank 0; no rank prints a traceback through dckpt's code.
    assert lr.stderr.count("dckpt resume: REFUSED (ConfigMismatchError)") == 1, lr.stderr
    assert "lr: 0.003 -> 0.01   <- refused" in lr.stderr and "dckpt/load/" not in lr.stderr
    assert width.returncode != 0 and "d_model: 64 -> 96" in width.stderr
    for root in (tmp_path / "ckpt", tmp_path / "copy"):
        assert committed_steps(root) == [2, 4]  # refused runs touched nothing
    longer = ["--steps", "6", "--save-every", "1", "--no-async", "--lr", "0.01"]
    passed = torchrun_train(tmp_path / "ckpt", *longer, "--allow-config-change", "lr")
    assert passed.returncode == 0, passed.stderr
    assert "config changed in operational keys: save_every: 2 -> 1; steps: 4 -> 6" in passed.stderr
    assert "config changed, allowed by allow_config_changes: lr: 0.003 -> 0.01" in passed.stderr
    # The restored optimizer put 0.003 back; the trainer applies 0.01, and dckpt sees it did.
    assert "lr changed 0.003 -> 0.01, but the optimizer's param_groups came back" in passed.stderr
    assert "dckpt: lr 0.01 is applied (the optimizer's param_groups)" in passed.stderr
    assert "train: --steps 4 -> 6: the warmup-cosine LR schedule now decays to step 6" in (
        passed.stdout + passed.stderr
    )
    assert committed_steps(tmp_path / "ckpt")[-1] == 6
