"""TrainState: what one checkpoint holds, as a DCP state dict with named categories.

The model and optimizer go through DCP's state-dict helpers (``get_state_dict`` /
``set_state_dict``), so plain modules, DDP and FSDP2 all save sharded and load resharded.
Each top-level key of the state dict is one *category* and is listed in the manifest.

Loading is two-phase, as DCP requires: ``state_dict()`` gives the structure with tensors to
fill in place, DCP fills it, then ``load_state_dict()`` hands the values to the objects.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

__all__ = ["TrainState"]


class TrainState:
    """The model, its optimizer and the training progress of one run.

    ``step`` is kept here (and in the manifest) so a resumed run knows where it stopped.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.step = 0
        self._options = StateDictOptions(strict=True)

    def categories(self) -> list[str]:
        cats = ["model"]
        if self.optimizer is not None:
            cats.append("optimizer")
        return [*cats, "progress"]

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            sd: dict[str, Any] = {"model": get_model_state_dict(self.model, options=self._options)}
        else:
            msd, osd = get_state_dict(self.model, self.optimizer, options=self._options)
            sd = {"model": msd, "optimizer": osd}
        sd["progress"] = {"step": self.step}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, state_dict["model"], options=self._options)
        else:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optimizer"],
                options=self._options,
            )
        self.step = int(state_dict["progress"]["step"])
