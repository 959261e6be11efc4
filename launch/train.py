"""Example trainer: a small transformer language model, checkpointed with dckpt.

Run by torchrun on CPU (gloo) or GPUs (nccl):

    python -m torch.distributed.run --standalone --nproc-per-node 2 launch/train.py \
        --ckpt-dir runs/demo --steps 12 --save-every 4

On start it resumes from the newest committed checkpoint in ``--ckpt-dir`` (verified: every
file's digest is checked before any tensor is loaded). It saves after every step divisible by
``--save-every`` and after the last step. Rank 0 appends one JSON line per optimizer step to
``--loss-log``: ``{"step", "loss", "lr", "time"}``. ``--crash-at-step N`` kills the process with
SIGKILL right after step N's optimizer update, to show that a crash loses nothing committed.

The data is synthetic and deterministic: batch ``i`` of rank ``r`` depends only on the seed,
``i`` and ``r``, so the data position after a resume is simply the step counter.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dckpt


class TinyLM(nn.Module):
    """A decoder-only transformer: token + position embeddings, pre-norm blocks, linear head."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        block = nn.TransformerEncoderLayer(
            d_model,
            heads,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.causal_mask: torch.Tensor
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        x = self.blocks(x, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def batch(seed: int, step: int, rank: int, size: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Batch ``step`` of ``rank``: a deterministic function of (seed, step, rank) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    # Sequences with structure (a noisy counting pattern) so the loss visibly falls.
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    noise = torch.rand(size, seq_len + 1, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)


def lr_at(step: int, base: float, warmup: int, total: int) -> float:
    if step <= warmup:
        return base * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ckpt-dir", required=True, help="checkpoint root of this run")
    p.add_argument("--steps", type=int, default=20, help="train until this step")
    p.add_argument("--save-every", type=int, default=5, help="save after every K-th step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-log", default=None, help="rank 0 appends a JSON line per step")
    p.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL after this step")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--async",
        dest="async_save",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="save in the background (default) or block until each save is committed",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" else None
    )
    if device is not None:
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = TinyLM(args.vocab, args.d_model, args.layers, args.heads, args.seq_len).to(device)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)

    # Everything that must match for a resume to be exact goes in the stored config.
    run_config = {
        k: v
        for k, v in vars(args).items()
        if k not in ("ckpt_dir", "loss_log", "crash_at_step", "async_save")
    }
    state = dckpt.TrainState(ddp, opt)
    config = dckpt.CheckpointConfig(root=Path(args.ckpt_dir), async_save=args.async_save)
    manager = dckpt.CheckpointManager(config, state, run_config=run_config)
    start = 0
    if manager.latest_step() is not None:
        start = manager.load().step
    if rank == 0:
        print(
            f"train: rank 0 of {world}, starting after step {start}, training to {args.steps}",
            flush=True,
        )

    log_file = open(args.loss_log, "a", encoding="utf-8") if (rank == 0 and args.loss_log) else None  # noqa: SIM115
    for step in range(start + 1, args.steps + 1):
        tokens = batch(args.seed, step, rank, args.batch_size, args.seq_len, args.vocab).to(device)
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        logits = ddp(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        if log_file is not None:
            record = {"step": step, "loss": float(mean_loss), "lr": lr, "time": time.time()}
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        if args.crash_at_step == step:
            print(f"train: rank {rank} crashing on purpose after step {step} (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.save_every == 0 or step == args.steps:
            manager.save(step)
    manager.close()
    if log_file is not None:
        log_file.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
