"""A 2-rank Hugging Face ``Trainer`` run checkpointed by ``DckptCallback``, under torchrun.

A tiny BERT classifier built from a config (dropout on: a resume that restores the RNG wrong
shows in the losses), seeded synthetic token ids, gloo on CPU. Rank 0 appends every logged
loss to ``--loss-log`` as ``{"step": N, "loss": float.hex}`` (``logging_steps=1``).
``--kill-at N``: rank 1 SIGKILLs itself once step N's loss is logged (torchrun then stops
rank 0); ``--term-at N``: it sends itself SIGTERM there instead (the ranks then agree on a
step, save it and end the run, exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from dckpt import CheckpointConfig
from dckpt.integrations.hf_trainer import DckptCallback


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """``n`` sequences of token ids and a label each, from a seeded generator."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class LossLog(TrainerCallback):
    """Rank 0 writes every logged loss; rank 1 kills itself after step ``kill_at``, or sends
    itself SIGTERM after step ``term_at``."""

    def __init__(self, path: str, kill_at: int | None, term_at: int | None) -> None:
        self.path, self.kill_at, self.term_at = path, kill_at, term_at
        self.rank = int(os.environ.get("RANK", "0"))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            if self.rank == 0:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"step": state.global_step, "loss": logs["loss"].hex()}))
                    f.write("\n")
            if state.global_step == self.kill_at and self.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if state.global_step == self.term_at and self.rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler preempting the job


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--loss-log", required=True)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--term-at", type=int, default=None)
    p.add_argument("--save-steps", type=int, default=3)
    a = p.parse_args()

    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=a.out,
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=1e-3,
        warmup_steps=2,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps",
        save_steps=a.save_steps,
        # An eval at every save step: opening its data loader draws from the global RNG, so a
        # save made before the eval (in on_step_end) would not resume exactly.
        eval_strategy="steps",
        eval_steps=a.save_steps,
        per_device_eval_batch_size=4,
        report_to="none",
        seed=7,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    set_seed(7)  # the same initial weights in every run
    model = BertForSequenceClassification(config)
    # Synchronous saves: a step saved is committed before the run goes on, so where a kill
    # lands decides which step the restart resumes from.
    # check_every_s=0: the ranks agree at every step whether a signal came, so that a SIGTERM
    # ends this short run at once (by default about once a second of training).
    ckpt = DckptCallback(CheckpointConfig(root=a.root, async_save=False), check_every_s=0)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(48, 16, 64),  # 6 steps per epoch at 2 x 4 a step: 12 in all
        eval_dataset=Tokens(8, 16, 64),
        callbacks=[ckpt, LossLog(a.loss_log, a.kill_at, a.term_at)],
    )
    folder = ckpt.resume(trainer)
    trainer.train(resume_from_checkpoint=folder)


if __name__ == "__main__":
    main()
