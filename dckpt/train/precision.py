"""PrecisionPolicy: how the math is done, recorded in every manifest and checked on resume.

``bf16`` (the default) runs matmuls under autocast in bfloat16 while weights, gradients and
optimizer state stay float32; it needs no loss scaling. ``fp16`` does the same in float16 with a
GradScaler (its state is part of the checkpoint and its scale is checked on resume). ``fp32``
uses no autocast. ``tf32`` switches TensorFloat-32 matmuls on CUDA on or off.

Invariants:
- weights stay float32: ``check_model`` refuses a model cast with ``.half()``/``.bfloat16()``
  for training (autocast keeps the sensitive reductions in float32; a half model does not);
- a GradScaler exists only for fp16 (``make_scaler``);
- ``for_device`` never silently changes the numerics: where the hardware lacks bf16 it falls
  back to fp16 with a warning, and the manifest records both what was asked and what ran;
- under FSDP2, parameters are stored float32, gathered in the compute dtype for the forward
  and backward, and gradients are reduced in float32 (``fsdp_mixed_precision``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PrecisionPolicy", "check_scaler"]

log = logging.getLogger("dckpt")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """How a run does its math; see the module docstring.

    Attributes:
        mode: ``bf16`` (default), ``fp16`` (with a GradScaler) or ``fp32``.
        tf32: allow TensorFloat-32 matmuls and convolutions on CUDA.
        allow_low_precision_weights: warn instead of refusing a model whose trainable
            parameters are float16/bfloat16 (for runs that keep fp32 master weights elsewhere).
        requested: the mode the user asked for, when ``for_device`` had to fall back.
    """

    mode: str = "bf16"
    tf32: bool = False
    allow_low_precision_weights: bool = False
    requested: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in _DTYPES:
            raise ValueError(f"precision mode must be one of {sorted(_DTYPES)}, got {self.mode!r}")

    @property
    def compute_dtype(self) -> torch.dtype:
        return _DTYPES[self.mode]

    @property
    def needs_scaler(self) -> bool:
        return self.mode == "fp16"

    def for_device(self, device: torch.device | str) -> PrecisionPolicy:
        """This policy, or fp16 with a warning where ``device`` cannot do bf16 (older GPUs)."""
        device = torch.device(device)
        if self.mode != "bf16" or device.type != "cuda" or torch.cuda.is_bf16_supported():
            return self
        log.warning(
            "dckpt: %s has no bfloat16 support: falling back to fp16 autocast with a "
            "GradScaler (weights stay float32). The manifest records the fallback.",
            torch.cuda.get_device_name(device),
        )
        return dataclasses.replace(self, mode="fp16", requested="bf16")

    @contextlib.contextmanager
    def autocast(self, device_type: str | torch.device) -> Iterator[None]:
        """Autocast to the compute dtype on ``device_type`` (nothing for fp32)."""
        kind = torch.device(device_type).type if not isinstance(device_type, str) else device_type
        if self.mode == "fp32":
            yield
            return
        with torch.autocast(device_type=kind, dtype=self.compute_dtype):
            yield

    def make_scaler(self, device_type: str, *, sharded: bool = False) -> torch.amp.GradScaler:
        """A GradScaler, enabled only for fp16 (a disabled one is a no-op with empty state).

        ``sharded=True`` under FSDP: a ShardedGradScaler, whose overflow check is all-reduced
        across ranks, so every rank skips (or takes) the same steps and keeps the same scale;
        a plain one sees only its own shards' gradients, and the ranks' scales drift apart.
        """
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device_type, enabled=self.needs_scaler)
        return torch.amp.GradScaler(device_type, enabled=self.needs_scaler)

    def fsdp_mixed_precision(self) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` for this mode: parameters stay float32 in the
        optimizer; they are all-gathered in the compute dtype; gradients reduce in float32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mode == "fp32":
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse (or warn about) trainable parameters that are not float32."""
        low = [
            (name, p.dtype)
            for name, p in model.named_parameters()
            if p.requires_grad and p.dtype in _LOW
        ]
        if not low:
            return
        name, dtype = low[0]
        message = (
            f"{len(low)} trainable parameter(s) are {str(dtype).replace('torch.', '')} (first: "
            f"{name}): the model was cast (e.g. with .half()) for training. Updates smaller "
            "than the weight's precision are lost and reductions overflow. Keep the weights "
            f"float32 and let autocast do the math in {self.mode} (PrecisionPolicy.autocast)"
        )
        if not self.allow_low_precision_weights:
            raise ValueError(message + "; or pass allow_low_precision_weights=True.")
        log.warning("dckpt: %s.", message)

    def apply(self) -> None:
        """Set the process-wide TF32 switches this policy asks for."""
        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32

    def describe(self) -> dict[str, Any]:
        """What the manifest records."""
        out: dict[str, Any] = {
            "mode": self.mode,
            "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
            "weights_dtype": "float32",
            "tf32": self.tf32,
            "grad_scaler": self.needs_scaler,
        }
        if self.requested is not None:
            out["requested"] = self.requested
        return out


def check_scaler(state: dict[str, Any]) -> str | None:
    """Sanity of a restored GradScaler state: raise on a scale that cannot work (not finite,
    not positive); return a warning for one that says the run was overflowing; else None."""
    if not state:  # a disabled scaler has an empty state
        return None
    scale = float(state.get("scale", 1.0))
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(
            f"the GradScaler's scale is {scale}: every step would be skipped or overflow. The "
            "run diverged before this save; resume from an earlier checkpoint "
            "(manager.load(step)) or reset the scaler."
        )
    if scale < 1.0:
        return (
            f"the GradScaler's scale is {scale:g} (below 1): fp16 gradients were overflowing "
            "again and again before this save; watch the loss"
        )
    if scale > 2.0**40:
        return f"the GradScaler's scale is {scale:g}: unusually large, gradients may be tiny"
    return None
