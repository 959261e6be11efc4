"""Accelerate's checkpointing example (examples/by_feature/checkpointing.py), adopted as the
README says: the objects ``accelerator.prepare`` returns handed to dckpt as they are.

A tiny BERT built from a config (dropout on, so the RNG matters), token ids and labels made
here, 2 ranks on gloo under torchrun. Rank 0 appends ``<step> <loss.hex()>`` to ``--losses``
after every step (the mean over ranks); ``--kill-at N``: rank 1 SIGKILLs itself after step
N's loss is logged and the save before it committed (rank 0 is then stopped by torchrun).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from dckpt.integrations.accelerate import checkpoint_manager


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--losses", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=None)
    args = p.parse_args()

    accelerator = Accelerator(cpu=True)
    set_seed(42)
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=2,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (96, 12), generator=g)
    labels = torch.randint(0, 2, (96,), generator=g)
    data = TensorDataset(ids, torch.ones_like(ids), labels)
    train_dataloader = DataLoader(data, shuffle=True, batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=4, num_training_steps=len(train_dataloader) * args.epochs
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )

    # The lines dckpt takes: the prepared objects as they are.
    manager = checkpoint_manager(
        accelerator, args.root, model, optimizer, scheduler=lr_scheduler,
        data=train_dataloader, run_config={"lr": 2e-3, "epochs": args.epochs},
    )  # fmt: skip
    manager.resume()
    state = manager.state
    step = state.step
    for epoch in range(state.epoch, args.epochs):
        model.train()
        for input_ids, mask, y in train_dataloader:
            out = model(input_ids=input_ids, attention_mask=mask, labels=y)
            accelerator.backward(out.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            step += 1
            loss = accelerator.reduce(out.loss.detach(), reduction="mean").item()
            manager.observe(loss)
            if accelerator.is_main_process:
                with open(args.losses, "a") as f:
                    f.write(f"{step} {loss.hex()}\n")
            if args.kill_at == step:
                manager.wait()  # the save before the kill committed: the restart resumes it
                accelerator.wait_for_everyone()
                if accelerator.process_index == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                accelerator.wait_for_everyone()  # rank 0 waits here until torchrun stops it
            if step % args.save_every == 0:
                manager.save(step, epoch=epoch)
    manager.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
