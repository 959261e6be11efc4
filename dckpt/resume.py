"""Names a user of the resume refers to, kept here because the README names them.

The resume itself is ``dckpt.load.resumer.Resumer``; the config check is
``dckpt.load.config_check``. ``OPERATIONAL_KEYS`` (also ``SAFE_CONFIG_KEYS``) only change how a
run is operated: their change passes with a warning. ``DEFAULT_STRICT_KEYS`` shape the run:
their change is refused unless allowed (``allow_config_changes=``, or without a code edit
``$DCKPT_ALLOW_CONFIG_CHANGES=key,key``).
"""

from __future__ import annotations

from .load.config_check import (
    ALLOW_ENV,
    CHECKED_DIRECTLY,
    DEFAULT_STRICT_KEYS,
    OPERATIONAL_KEYS,
    PRECISION_KEYS,
    SAFE_CONFIG_KEYS,
    ConfigChange,
    check_config,
    config_changes,
    is_allowed,
)
from .load.loss_watch import LossWatch
from .load.report import Check, ResumeReport

__all__ = [
    "ALLOW_ENV",
    "CHECKED_DIRECTLY",
    "DEFAULT_STRICT_KEYS",
    "OPERATIONAL_KEYS",
    "PRECISION_KEYS",
    "SAFE_CONFIG_KEYS",
    "Check",
    "ConfigChange",
    "LossWatch",
    "ResumeReport",
    "check_config",
    "config_changes",
    "is_allowed",
]
