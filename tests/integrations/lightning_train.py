"""A tiny Lightning run for tests/test_integration_lightning.py, under torchrun (2 ranks, gloo).

``Trainer(accelerator="cpu", devices=2, strategy=DckptStrategy(root))`` with a
``ModelCheckpoint(every_n_train_steps=...)`` and ``fit(ckpt_path="last")``, as a user writes
it; ``--strategy ddp`` runs Lightning's plain ``DDPStrategy`` instead (the test proves it
fails the checks). The model has dropout and the loader shuffles (Lightning's
DistributedSampler), so an exact resume needs the RNG and the data position. Rank 0 appends
``step float.hex(loss)`` per step to ``--loss-log`` (the mean over ranks); ``--kill-at N``:
every rank SIGKILLs itself at the end of step N.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dckpt
from dckpt.integrations.lightning import DckptModelParallelStrategy, DckptStrategy

FEATURES, SAMPLES, BATCH = 8, 64, 4  # 64 samples, 2 ranks, 4 a rank: 8 steps an epoch


class Tiny(pl.LightningModule):
    def __init__(self, lr: float, loss_log: str, kill_at: int, fsdp2: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters("lr")
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1)
        )
        self.loss_log = loss_log
        self.kill_at = kill_at
        self.fsdp2 = fsdp2

    def configure_model(self) -> None:
        if self.fsdp2:  # FSDP2 over the data-parallel ranks: the model saved sharded
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        mean = outputs["loss"].detach().clone()
        dist.all_reduce(mean)
        if self.global_rank == 0:
            with open(self.loss_log, "a") as f:
                f.write(f"{self.global_step} {(float(mean) / 2).hex()}\n")
        if self.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--loss-log", required=True)
    p.add_argument("--strategy", choices=("dckpt", "fsdp2", "ddp"), default="dckpt")
    p.add_argument("--sync", action="store_true", help="saves commit before training goes on")
    args = p.parse_args()

    root = Path(args.root)
    pl.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    model = Tiny(0.05, args.loss_log, args.kill_at, fsdp2=args.strategy == "fsdp2")

    # --sync: a kill finds every requested save committed, so the test knows which step the
    # restart resumes from (in the background, a kill may land before the last commit).
    config = dckpt.CheckpointConfig(root=root / "dckpt", async_save=False if args.sync else "auto")
    strategy: Strategy
    if args.strategy == "dckpt":
        strategy = DckptStrategy(config)
    elif args.strategy == "fsdp2":  # data parallel over both ranks, no tensor parallel
        strategy = DckptModelParallelStrategy(config, data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = DDPStrategy()
    checkpoint = ModelCheckpoint(
        dirpath=root / "checkpoints", every_n_train_steps=args.every, save_top_k=-1,
        save_last=True,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.max_steps,
        callbacks=[checkpoint], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(model, loader, ckpt_path="last")


if __name__ == "__main__":
    main()
