"""A 2-rank training loop with dropout for the replay and override tests, run under torchrun.

``--eval after`` runs an eval that draws from the global RNG right after ``save()`` (the trap
of nanoGPT and minGPT-ddp: a resumed run's dropout stream is then shifted); ``--eval before``
runs it before ``save()``. ``--kill-after N``: every rank SIGKILLs itself after step N.
``--lr`` with ``--allow lr`` changes the learning rate on a resume; ``--apply-lr`` sets it
after ``resume()`` as the report says to.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

import dckpt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--kill-after", type=int, default=None)
    p.add_argument("--eval", choices=("before", "after", "none"), default="none")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--allow", action="append", default=[])
    p.add_argument("--apply-lr", action="store_true")
    p.add_argument("--loss-watch", default="warn")
    args = p.parse_args()

    rank, world, _device = dckpt.init_distributed(timeout_s=60)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
    )
    torch.manual_seed(1000 + rank)  # each rank its own dropout stream
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    state = dckpt.TrainState(model, opt, seed=0)
    config = dckpt.CheckpointConfig(
        root=args.root, async_save=False, loss_watch=args.loss_watch, loss_watch_steps=2
    )
    with dckpt.CheckpointManager(
        config, state, run_config={"lr": args.lr}, allow_config_changes=args.allow
    ) as mgr:
        try:
            mgr.resume()
        except dckpt.CheckpointError:
            raise SystemExit(2) from None
        if args.apply_lr:
            for g in opt.param_groups:
                g["lr"] = args.lr

        def evaluate() -> None:
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 16))  # a batch drawn from the global RNG
            model.train()

        for step in range(state.step + 1, args.steps + 1):
            g = torch.Generator().manual_seed(step * 10 + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            try:
                mgr.observe(float(mean) / world)
            except dckpt.LossDeviationError:
                raise SystemExit(3) from None
            if step % args.save_every == 0:
                if args.eval == "before":
                    evaluate()
                mgr.save(step)
                if args.eval == "after":
                    evaluate()
            if step == args.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
