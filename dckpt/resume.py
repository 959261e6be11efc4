"""Names a user of the resume refers to, kept here because the README names them.

The resume itself is ``dckpt.load.resumer.Resumer``; the config check is
``dckpt.load.config_check``. ``SAFE_CONFIG_KEYS`` is the set of config keys whose change only
warns; pass more with ``CheckpointManager(..., allow_config_changes=[...])``.
"""

from __future__ import annotations

from .load.config_check import (
    SAFE_CONFIG_KEYS,
    ConfigChange,
    check_config,
    config_changes,
    is_allowed,
)
from .load.loss_watch import LossWatch
from .load.report import Check, ResumeReport

__all__ = [
    "SAFE_CONFIG_KEYS",
    "Check",
    "ConfigChange",
    "LossWatch",
    "ResumeReport",
    "check_config",
    "config_changes",
    "is_allowed",
]
