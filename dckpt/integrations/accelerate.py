"""dckpt with Hugging Face Accelerate: ``save_state``/``load_state`` replaced by a verified save
and resume, with the objects ``accelerator.prepare`` returns as they are.

In a script (Accelerate's ``examples/by_feature/checkpointing.py`` shape)::

    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(...)
    manager = checkpoint_manager(accelerator, "runs/exp1", model, optimizer,
                                 scheduler=lr_scheduler, data=train_dataloader)
    manager.resume()                         # instead of accelerator.load_state(...)
    for epoch in range(manager.state.epoch, num_epochs):
        for batch in train_dataloader:       # continues at the saved batch, same order
            ...
            manager.save(step, epoch=epoch)  # instead of accelerator.save_state(...)
    manager.close()

What the pieces below do not: ``TrainState`` itself unwraps Accelerate's optimizer (the
scheduler wrapper's state is its scheduler's already) and keeps a prepared loader's
position (dckpt.train.state, dckpt.train.loader), so ``dckpt.TrainState(model, optimizer,
...)`` with the prepared objects works without this module too. ``checkpoint_manager``
adds what only the accelerator knows: its GradScaler (fp16) in the state, and a refusal, in
words, of the setups whose state DCP cannot hold (DeepSpeed's engine, Megatron-LM, XLA):
for those, Accelerate's own ``save_state``.

Invariant: importing this module imports accelerate (an ImportError naming the extra when it
is missing); ``import dckpt`` never imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..config import CheckpointConfig
from ..manager import CheckpointManager
from ..train.state import Stateful, TrainState

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - the extra is installed by make
    raise ImportError(
        "dckpt.integrations.accelerate needs Accelerate: pip install dckpt[accelerate]"
    ) from exc

__all__ = ["checkpoint_manager"]

# Setups whose training state lives outside what DCP's state-dict helpers see.
_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed's engine keeps its own partitioned optimizer state",
    DistributedType.MEGATRON_LM: "Megatron-LM keeps its own model and optimizer state",
    DistributedType.XLA: "XLA tensors are not saved by torch.distributed.checkpoint here",
}


def checkpoint_manager(
    accelerator: Accelerator,
    config: CheckpointConfig | str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Stateful | Sequence[Stateful] | None = None,
    data: Any = None,
    extra: Mapping[str, Stateful] | None = None,
    seed: int = 0,
    run_config: dict[str, Any] | None = None,
    **manager_options: Any,
) -> CheckpointManager:
    """A ``CheckpointManager`` over the prepared objects; see the module docstring.

    ``config``: a root (a directory or ``s3://`` URL) or a ``CheckpointConfig``. ``data``: the
    prepared DataLoader (its position and order are saved) or a ``GlobalBatchSampler``.
    ``extra``: what the script registered with ``accelerator.register_for_checkpointing``.
    ``manager_options`` go to ``CheckpointManager`` (``precision``, ``allow_config_changes``...).
    The accelerator's GradScaler, when it has one (fp16), is part of the state.
    """
    kind = accelerator.distributed_type
    if kind in _UNSUPPORTED:
        raise ValueError(
            f"dckpt cannot checkpoint an Accelerate run on {kind.value}: {_UNSUPPORTED[kind]}. "
            "Use accelerator.save_state/load_state for it, or train with DDP or FSDP (FSDP2 "
            "included), whose state dckpt saves sharded and verified."
        )
    state = TrainState(
        model,
        optimizer,
        scheduler=scheduler,
        scaler=accelerator.scaler,
        data=data,
        extra=extra,
        seed=seed,
    )
    return CheckpointManager(config, state, run_config=run_config, **manager_options)
