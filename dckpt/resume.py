"""Names a user of the resume refers to, kept here because the README names them.

The resume itself is ``dckpt.load.resumer.Resumer``; the config check is
``dckpt.load.config_check``. ``SAFE_CONFIG_KEYS`` is the set of config keys whose change only
warns; pass more with ``CheckpointManager(..., allow_config_changes=[...])``.
"""

from __future__ import annotations

from .load.config_check import SAFE_CONFIG_KEYS, config_changes
from .load.loss_watch import LossWatch
from .load.report import ResumeReport

__all__ = ["SAFE_CONFIG_KEYS", "LossWatch", "ResumeReport", "config_changes"]
