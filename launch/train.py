"""Example trainer: a small transformer language model, checkpointed and resumed with dckpt.

Run by torchrun on CPU (gloo) or GPUs (nccl):

    python -m torch.distributed.run --standalone --nproc-per-node 2 launch/train.py \
        --ckpt-dir runs/demo --steps 12 --save-every 4

On start it resumes from the newest checkpoint that passes every check (manifest, config,
digests of every file, warmup collective) and prints the resume report; a bad newest checkpoint
is quarantined and the one before it is used. It saves after every step divisible by
``--save-every`` and after the last step (in the background unless ``--no-async``), and closes
the manager before it exits, so the last save is committed. Rank 0 appends one JSON line per
optimizer step to ``--loss-log``: ``{"step", "loss", "lr", "time", "pid"}`` (the pid tells one
run's lines from the next one's in a log they share). ``--crash-at-step N``
kills every rank with SIGKILL right after step N's optimizer update: no graceful save.
``--step-sleep S`` sleeps S seconds after each step: a job a test keeps running while it does
something else (a second job, a signal) trains slowly instead of taking the cores.

A start dckpt refuses (the run lock held by another job, or refused by a store that ignores
conditional writes; a bucket that does not exist) and a refused resume print one block on rank
0 and exit 2 on every rank, with no traceback. ``--no-lock`` (or ``DCKPT_LOCK=0``, read by
``CheckpointConfig`` itself) runs without the run lock: for such a store, when nothing else
writes the root.

Preemption: SIGTERM or SIGUSR1 to any rank (a scheduler's warning) only sets a flag; after the
step in progress the ranks agree on that step, save it synchronously within
``--preempt-deadline`` seconds and exit 0, so a requeued job resumes exactly there.

Everything that decides the next step is in the checkpoint: weights, AdamW moments, the
warmup-cosine LR schedule, the GradScaler (fp16), every rank's RNG (dropout), the data position
(a global batch sampler over a deterministic synthetic dataset), and the step. So a run that
crashed and resumed logs the same losses, bit for bit, as one that never stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import time
import warnings
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import dckpt


class TinyLM(nn.Module):
    """A decoder-only transformer: token + position embeddings, pre-norm blocks, linear head."""

    def __init__(
        self, vocab: int, d_model: int, layers: int, heads: int, seq_len: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model,
                heads,
                dim_feedforward=4 * d_model,
                dropout=dropout,
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.causal_mask: torch.Tensor
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.drop(self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device)))
        for block in self.blocks:
            x = block(x, src_mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


class SyntheticText(Dataset[torch.Tensor]):
    """Sample ``i`` is a noisy counting sequence that depends only on (seed, i)."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int) -> None:
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(0, self.vocab, (1,), generator=g))
        stride = int(torch.randint(1, 4, (1,), generator=g))
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        noise = torch.rand(self.seq_len + 1, generator=g) < 0.1
        return torch.where(noise, torch.randint(0, self.vocab, seq.shape, generator=g), seq)


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:  # LambdaLR calls it with the number of steps taken
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def say_what_the_schedule_does(
    report: dckpt.ResumeReport, args: argparse.Namespace, sched: torch.optim.lr_scheduler.LambdaLR
) -> None:
    """Training longer (or shorter) moves the end of the cosine decay: print the LR the run
    goes on with, and the one the saved schedule would have given."""
    change = next((c for c in report.config_changes if c.key == "steps"), None)
    if change is None or not isinstance(change.saved, int):
        return
    base, taken = sched.base_lrs[0], sched.last_epoch
    old = base * warmup_cosine(args.warmup, change.saved)(taken)
    new = base * warmup_cosine(args.warmup, args.steps)(taken)
    print(
        f"train: --steps {change.saved} -> {args.steps}: the warmup-cosine LR schedule now decays "
        f"to step {args.steps}; the LR after step {taken} is {new:.4g} (the saved schedule would "
        f"give {old:.4g}); the scheduler's step count comes from the checkpoint",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--ckpt-dir", required=True, help="checkpoint root of this run: a directory or s3://..."
    )
    p.add_argument("--steps", type=int, default=20, help="train until this step")
    p.add_argument("--save-every", type=int, default=5, help="save after every K-th step")
    p.add_argument(
        "--memory-every",
        type=int,
        default=None,
        help="also save to the memory tier (host memory, replicated to a partner node) after "
        "every N-th step that is not a --save-every step; resume takes the newer of the two",
    )
    p.add_argument("--memory-dir", default=None, help="the memory tier's directory (a tmpfs)")
    p.add_argument("--memory-keep", type=int, default=1, help="memory checkpoints each node keeps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds a training collective waits for every rank; dckpt waits half of it",
    )
    p.add_argument("--loss-log", default=None, help="rank 0 appends a JSON line per step")
    p.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL after this step")
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="sleep this many seconds after each step: a job that must go on running while "
        "something else happens (a test's second job, a signal) without taking the cores",
    )
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument(
        "--async",
        dest="async_save",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="save in the background, or block until each save is committed; default: "
        "decided from the measured cost (async_save='auto')",
    )
    p.add_argument(
        "--preemption",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on SIGTERM/SIGUSR1 to any rank: agree on a step, save it, exit 0",
    )
    p.add_argument(
        "--preempt-deadline", type=float, default=120.0, help="seconds for the final save"
    )
    p.add_argument(
        "--preempt-check-every",
        type=float,
        default=1.0,
        help="seconds of training between two agreements on a signal (0: every step)",
    )
    p.add_argument(
        "--lock",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hold the root's run lock, so a second job on it fails fast; --no-lock for a "
        "store that ignores conditional writes (default: on, unless DCKPT_LOCK=0)",
    )
    p.add_argument(
        "--value-checks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare replicas across ranks and refuse NaN/Inf at each save (the default); "
        "--no-value-checks measures what they cost (bench/true_cost.py)",
    )
    p.add_argument(
        "--capture-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare each tensor's bytes written with its state at save() (the default); "
        "--no-capture-check measures what it costs (bench/true_cost.py)",
    )
    p.add_argument(
        "--replica-sample",
        type=float,
        default=1.0,
        help="share of replicated tensors compared across ranks per save (default 1.0: all)",
    )
    p.add_argument("--keep-last", type=int, default=None, help="keep the N newest checkpoints")
    p.add_argument("--milestone-every", type=int, default=None, help="keep every M-th step forever")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument(
        "--batch-size", type=int, default=12, help="global batch: samples per step, all ranks"
    )
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--allow-config-change",
        action="append",
        default=[],
        metavar="KEY",
        help="accept a change of this config key on resume (repeatable; also "
        "$DCKPT_ALLOW_CONFIG_CHANGES=key,key)",
    )
    return p.parse_args(argv)


# Flags that do not change the math: they may differ between a run and its resume.
NOT_CONFIG = (
    "ckpt_dir",
    "value_checks",
    "capture_check",
    "replica_sample",
    "loss_log",
    "crash_at_step",
    "step_sleep",
    "async_save",
    "keep_last",
    "lock",
    "milestone_every",
    "memory_every",
    "memory_dir",
    "memory_keep",
    "preemption",
    "preempt_deadline",
    "preempt_check_every",
    "allow_config_change",
    "timeout",
)


def refused(rank: int, exc: dckpt.CheckpointError, *, said: bool = False) -> NoReturn:
    """Exit 2 on every rank, without a traceback per rank, after a start or a resume dckpt
    refused. Rank 0 prints a refused start as one block, in the shape dckpt gives a refused
    resume (``said``: dckpt logged it already), naming this script's ``--no-lock`` where dckpt
    names the config field."""
    if rank == 0 and not said:
        text = str(exc).replace("CheckpointConfig(lock=False)", "--no-lock")
        lines = [f"dckpt start: REFUSED ({type(exc).__name__})"]
        lines += [f"  {line}" for line in text.splitlines()]
        logging.getLogger("dckpt").error("%s", "\n".join(lines))
    dist.destroy_process_group()
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # dckpt's waits get half the training group's: a rank that stalls in a save or a resume
    # is named by dckpt before the loop's own collective gives up on it
    rank, world, device = dckpt.init_distributed(timeout_s=args.timeout)
    policy = dckpt.PrecisionPolicy(mode=args.precision).for_device(device)
    policy.apply()

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: nn.Module = TinyLM(
        args.vocab, args.d_model, args.layers, args.heads, args.seq_len, args.dropout
    ).to(device)
    if args.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mp = policy.fsdp_mixed_precision()  # params fp32; all-gathered in bf16; fp32 grads
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(args.seed * 7919 + rank + 1)  # each rank its own dropout stream
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    # ShardedGradScaler's own all-reduce of its one-element overflow flag warns every step
    warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
    scaler = (
        policy.make_scaler(device.type, sharded=args.parallel == "fsdp")
        if policy.needs_scaler
        else None
    )
    sampler = dckpt.GlobalBatchSampler(
        args.dataset_size, args.batch_size, rank=rank, world_size=world, seed=args.seed
    )
    loader = DataLoader(
        SyntheticText(args.dataset_size, args.seq_len, args.vocab, args.seed),
        batch_sampler=sampler,
        # Its own generator: creating an iterator draws a worker seed, and drawing it from the
        # global RNG would shift every dropout mask after a resume.
        generator=torch.Generator().manual_seed(args.seed),
    )

    state = dckpt.TrainState(
        model, opt, scheduler=sched, scaler=scaler, data=sampler, seed=args.seed
    )
    config = dckpt.CheckpointConfig(
        root=args.ckpt_dir,  # a directory or s3://bucket/prefix
        timeout_s=args.timeout / 2,
        async_save="auto" if args.async_save is None else args.async_save,
        keep_last=args.keep_last,
        milestone_every=args.milestone_every,
        memory=args.memory_every is not None,
        memory_dir=args.memory_dir,
        memory_keep=args.memory_keep,
        _value_checks=args.value_checks,  # not a setting: the benchmarks' switch
        _capture_check=args.capture_check,  # the same
        replica_sample=args.replica_sample,
        **({} if args.lock is None else {"lock": args.lock}),  # None: DCKPT_LOCK decides
    )
    run_config = {k: v for k, v in vars(args).items() if k not in NOT_CONFIG}
    try:  # a refused start (the run lock, a missing bucket) has released dckpt's groups
        manager = dckpt.CheckpointManager(
            config,
            state,
            run_config=run_config,
            precision=policy,
            allow_config_changes=args.allow_config_change,
        )
    except dckpt.CheckpointError as exc:
        refused(rank, exc)
    if args.preemption:  # SIGTERM/SIGUSR1: agree on a step, save it, exit 0
        manager.watch_preemption(
            deadline_s=args.preempt_deadline, check_every_s=args.preempt_check_every
        )
    try:
        report = manager.resume()  # logs the report; a fresh start when there is nothing to resume
    except dckpt.CheckpointError as exc:
        manager.close()  # dckpt logged why, once, on rank 0: every rank exits without a traceback
        refused(rank, exc, said=True)
    if any(c.key == "lr" for c in report.config_changes):  # an allowed --lr change
        # The restored optimizer and scheduler hold the saved LR (the report says so): apply
        # the new one, at the point of the schedule the run resumes at.
        sched.base_lrs = [args.lr] * len(opt.param_groups)
        for group in opt.param_groups:
            group["initial_lr"] = args.lr
            group["lr"] = args.lr * warmup_cosine(args.warmup, args.steps)(sched.last_epoch)
    if rank == 0:
        say_what_the_schedule_does(report, args, sched)
    if rank == 0:
        print(
            f"train: {world} ranks, starting after step {state.step}, to {args.steps}", flush=True
        )

    log_file = open(args.loss_log, "a", encoding="utf-8") if (rank == 0 and args.loss_log) else None  # noqa: SIM115
    batches = iter(loader)
    for step in range(state.step + 1, args.steps + 1):
        try:
            tokens = next(batches)
        except StopIteration:  # end of an epoch: the sampler moved on to the next one
            batches = iter(loader)
            tokens = next(batches)
        tokens = tokens.to(device)
        with policy.autocast(device.type):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(
                logits.reshape(-1, args.vocab).float(), tokens[:, 1:].reshape(-1)
            )
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        lr = sched.get_last_lr()[0]
        sched.step()
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        state.epoch, state.samples_seen = sampler.epoch, step * args.batch_size
        manager.observe(float(mean_loss))
        if log_file is not None:
            record = {
                "step": step,
                "loss": float(mean_loss),
                "lr": lr,
                "time": time.time(),
                "pid": os.getpid(),
            }
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        if args.crash_at_step == step:
            print(f"train: rank {rank} crashing on purpose after step {step} (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.save_every == 0 or step == args.steps:
            manager.save(step)
        elif args.memory_every and step % args.memory_every == 0:
            manager.save(step, tier="memory")
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)
        if manager.preempted(step):
            if rank == 0:
                print(f"train: preempted after step {step}; checkpoint committed", flush=True)
            break
    manager.close()
    if log_file is not None:
        log_file.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
