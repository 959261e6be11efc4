"""PrecisionPolicy: how the math is done, recorded in every manifest.

``bf16`` (the default) runs matmuls under autocast in bfloat16 while weights, gradients and
optimizer state stay float32; it needs no loss scaling. ``fp16`` does the same in float16 with a
GradScaler (its state is part of the checkpoint). ``fp32`` uses no autocast. ``tf32`` switches
TensorFloat-32 matmuls on CUDA on or off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PrecisionPolicy"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    mode: str = "bf16"
    tf32: bool = False

    def __post_init__(self) -> None:
        if self.mode not in _DTYPES:
            raise ValueError(f"precision mode must be one of {sorted(_DTYPES)}, got {self.mode!r}")

    @property
    def compute_dtype(self) -> torch.dtype:
        return _DTYPES[self.mode]

    @property
    def needs_scaler(self) -> bool:
        return self.mode == "fp16"

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        """Autocast to the compute dtype on ``device_type`` (nothing for fp32)."""
        if self.mode == "fp32":
            yield
            return
        with torch.autocast(device_type=device_type, dtype=self.compute_dtype):
            yield

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler:
        """A GradScaler, enabled only for fp16 (a disabled one is a no-op with empty state)."""
        return torch.amp.GradScaler(device_type, enabled=self.needs_scaler)

    def apply(self) -> None:
        """Set the process-wide TF32 switches this policy asks for."""
        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32

    def describe(self) -> dict[str, Any]:
        """What the manifest records."""
        return {
            "mode": self.mode,
            "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
            "weights_dtype": "float32",
            "tf32": self.tf32,
            "grad_scaler": self.needs_scaler,
        }
