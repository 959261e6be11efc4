"""The config check of a resume: what changed since the checkpoint was saved, and whether
that may pass.

``config_changes`` is a readable diff of two JSON-able configs (dotted keys for nested ones).
``ConfigPolicy`` sorts each changed key (by its full dotted name or its last part):

- *allowed*: named in ``allow_config_changes=`` or ``$DCKPT_ALLOW_CONFIG_CHANGES`` (a comma-
  separated list, so a changed run needs no code edit): passes, with a warning;
- *strict*: shapes the run (``DEFAULT_STRICT_KEYS``: learning rate and schedule, batch, model
  sizes, data, seed; or the user's ``strict_keys=``): refused with ``ConfigMismatchError``;
- *operational*: only changes how the run is operated (``OPERATIONAL_KEYS``: logging, eval and
  save intervals, paths, compile, resume switches, the training length): passes, with a
  warning; a changed training length also says what it means for an LR schedule;
- *checked directly*: world size and parallelism (dckpt reshards, reseeds the per-rank RNG
  and warms the new world up), and precision and dtype when the manager has a
  ``PrecisionPolicy`` to compare (without one they are strict: dckpt never sees the autocast
  dtype): passes, with a note;
- *unlisted*: any other key: passes with a warning that names it, unless ``strict_keys="all"``
  (then every key that is not allowed, operational or checked directly is refused).

No torch, no I/O (the environment variable is read by ``ConfigPolicy.build``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigMismatchError

__all__ = [
    "ALLOW_ENV",
    "CHECKED_DIRECTLY",
    "DEFAULT_STRICT_KEYS",
    "HORIZON_KEYS",
    "OPERATIONAL_KEYS",
    "PRECISION_KEYS",
    "SAFE_CONFIG_KEYS",
    "ConfigChange",
    "ConfigPolicy",
    "ConfigVerdict",
    "check_config",
    "config_changes",
    "is_allowed",
]

ALLOW_ENV = "DCKPT_ALLOW_CONFIG_CHANGES"

HORIZON_KEYS = frozenset(
    {
        "steps",
        "max_steps",
        "total_steps",
        "num_steps",
        "train_steps",
        "max_iters",
        "iters",
        "epochs",
        "num_epochs",
        "max_epochs",
    }
)
"""How long the run trains: operational, but an LR schedule may be computed from it."""

OPERATIONAL_KEYS = HORIZON_KEYS | frozenset(
    {
        # where things go
        "ckpt_dir",
        "checkpoint_dir",
        "out_dir",
        "output_dir",
        "save_dir",
        "log_dir",
        "loss_log",
        "run_name",
        "wandb_project",
        "wandb_run_name",
        "wandb_log",
        # how often things happen
        "log_every",
        "log_interval",
        "print_every",
        "print_interval",
        "eval_every",
        "eval_interval",
        "eval_iters",
        "eval_only",
        "save_every",
        "save_interval",
        "checkpoint_interval",
        "keep_last",
        "milestone_every",
        "always_save_checkpoint",
        # how the run is started and executed
        "init_from",
        "resume",
        "resume_from",
        "compile",
        "num_workers",
        "profile",
        "async_save",
        "crash_at_step",
        "preemption",
        "preempt_deadline",
    }
)
"""Config keys that only change how a run is operated: a resume passes them with a warning."""

SAFE_CONFIG_KEYS = OPERATIONAL_KEYS
"""The README's name for ``OPERATIONAL_KEYS``."""

DEFAULT_STRICT_KEYS = frozenset(
    {
        # optimisation and its schedule
        "lr",
        "learning_rate",
        "max_lr",
        "min_lr",
        "weight_decay",
        "beta1",
        "beta2",
        "betas",
        "momentum",
        "eps",
        "grad_clip",
        "warmup",
        "warmup_iters",
        "warmup_steps",
        "lr_decay_iters",
        "decay_lr",
        "schedule",
        "lr_schedule",
        "scheduler",
        # what one step sees
        "batch_size",
        "global_batch",
        "global_batch_size",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "block_size",
        "seq_len",
        "dataset",
        "dataset_size",
        "data",
        "seed",
        # the model
        "model",
        "n_layer",
        "n_layers",
        "layers",
        "n_head",
        "n_heads",
        "heads",
        "n_embd",
        "d_model",
        "dim",
        "hidden_size",
        "vocab",
        "vocab_size",
        "dropout",
        "bias",
    }
)
"""Keys that shape the run by default: a resume refuses their change (``strict_keys=``)."""

CHECKED_DIRECTLY = frozenset({"world_size", "nproc_per_node", "parallel", "device", "backend"})
"""Keys whose effect dckpt handles from the checkpoint itself (resharding, per-rank RNG, the
warmup on the new world): their names decide nothing."""
PRECISION_KEYS = frozenset({"precision", "dtype", "amp", "mixed_precision"})
"""Checked directly when the manager has a ``PrecisionPolicy`` (it compares the saved one);
without one, dckpt never sees the autocast dtype, so they are strict."""

ConfigVerdict = Literal["allowed", "strict", "operational", "checked", "unlisted"]

_MISSING = "<absent>"


@dataclass(frozen=True)
class ConfigChange:
    key: str
    saved: Any
    current: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.current!r}"


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[ConfigChange]:
    """Every key (dotted, for nested configs) whose value differs, was added or was removed."""
    a, b = _flatten(saved), _flatten(current)
    return [
        ConfigChange(k, a.get(k, _MISSING), b.get(k, _MISSING))
        for k in sorted(a.keys() | b.keys())
        if a.get(k, _MISSING) != b.get(k, _MISSING)
    ]


def _matches(key: str, names: frozenset[str]) -> bool:
    return key in names or key.rsplit(".", maxsplit=1)[-1] in names


def is_allowed(change: ConfigChange, allowed: frozenset[str]) -> bool:
    """Whether a changed key is in ``allowed`` (by its full dotted name or its last part)."""
    return _matches(change.key, allowed)


@dataclass(frozen=True)
class ConfigPolicy:
    """Which config changes a resume accepts; see the module docstring."""

    allowed: frozenset[str] = frozenset()
    strict: frozenset[str] | Literal["all"] = DEFAULT_STRICT_KEYS
    from_env: frozenset[str] = field(default=frozenset())
    """The part of ``allowed`` that came from ``$DCKPT_ALLOW_CONFIG_CHANGES``."""
    precision_checked: bool = False
    """Whether a ``PrecisionPolicy`` is compared on resume (then precision keys pass)."""

    @classmethod
    def build(
        cls,
        allow: Iterable[str] = (),
        strict_keys: Iterable[str] | Literal["all"] | None = None,
        environ: dict[str, str] | None = None,
        precision_checked: bool = False,
    ) -> ConfigPolicy:
        env = (os.environ if environ is None else environ).get(ALLOW_ENV, "")
        from_env = frozenset(k for k in re.split(r"[,\s]+", env) if k)  # "a,b" or "a b"
        if strict_keys == "all":
            strict: frozenset[str] | Literal["all"] = "all"
        elif strict_keys is None:
            strict = DEFAULT_STRICT_KEYS
        elif isinstance(strict_keys, str):
            raise ValueError(
                f'strict_keys must be "all", None or a collection, got {strict_keys!r}'
            )
        else:
            strict = frozenset(strict_keys)
        return cls(frozenset(allow) | from_env, strict, from_env, precision_checked)

    def verdict(self, key: str) -> ConfigVerdict:
        if _matches(key, self.allowed):
            return "allowed"
        if self.strict != "all" and _matches(key, self.strict):
            return "strict"
        if _matches(key, CHECKED_DIRECTLY):
            return "checked"
        if _matches(key, PRECISION_KEYS):
            return "checked" if self.precision_checked else "strict"
        if _matches(key, OPERATIONAL_KEYS):
            return "operational"
        return "strict" if self.strict == "all" else "unlisted"

    def check(
        self, saved: dict[str, Any], current: dict[str, Any], checkpoint: str
    ) -> list[tuple[ConfigChange, ConfigVerdict]]:
        """Raise ConfigMismatchError on a refused change; return every change with its
        verdict (for the report's warnings)."""
        judged = [(c, self.verdict(c.key)) for c in config_changes(saved, current)]
        refused = [c for c, v in judged if v == "strict"]
        if refused:
            diff = "\n".join(
                f"    {c}{'   <- refused' if v == 'strict' else ''}" for c, v in judged
            )
            keys = ",".join(c.key for c in refused)
            raise ConfigMismatchError(
                f"the config differs from the one {checkpoint} was saved with:\n{diff}\n"
                f"{', '.join(c.key for c in refused)} shape the run: resuming would silently "
                "train a different run than the checkpoint's. Restore the saved values, start "
                "a new run in a new directory, or accept the change: "
                f"{ALLOW_ENV}={keys} (no code change), or "
                f"CheckpointManager(..., allow_config_changes=[...])."
            )
        return judged

    def describe(self, judged: list[tuple[ConfigChange, ConfigVerdict]]) -> list[str]:
        """The report's warnings for the changes that passed, grouped by why they passed."""
        lines: list[str] = []
        groups: dict[ConfigVerdict, list[ConfigChange]] = {}
        for change, verdict in judged:
            groups.setdefault(verdict, []).append(change)

        def listed(changes: list[ConfigChange]) -> str:
            return "; ".join(str(c) for c in changes)

        if "operational" in groups:
            lines.append(f"config changed in operational keys: {listed(groups['operational'])}")
            horizon = [c for c in groups["operational"] if _matches(c.key, HORIZON_KEYS)]
            if horizon:
                lines.append(
                    f"training length changed ({listed(horizon)}): the LR scheduler's own "
                    "state (its step count) is restored from the checkpoint; a schedule "
                    "computed from this value (warmup then cosine decay to the last step, "
                    "say) now follows the new length from the current step on"
                )
        if "allowed" in groups:
            env = [c for c in groups["allowed"] if _matches(c.key, self.from_env)]
            code = [c for c in groups["allowed"] if not _matches(c.key, self.from_env)]
            if env:
                lines.append(f"config changed, allowed by ${ALLOW_ENV}: {listed(env)}")
            if code:
                lines.append(f"config changed, allowed by allow_config_changes: {listed(code)}")
        if "checked" in groups:
            lines.append(
                f"config changed in keys dckpt checks directly ({listed(groups['checked'])}): "
                "see the precision, world size and state lines"
            )
        if "unlisted" in groups:
            lines.append(
                f"config changed in keys dckpt does not know: {listed(groups['unlisted'])}. "
                "Passed, because shapes, dtypes, precision and world size are checked "
                "directly; if such a key shapes the run, name it in strict_keys to refuse it"
            )
        return lines


def check_config(
    saved: dict[str, Any], current: dict[str, Any], allowed: frozenset[str], checkpoint: str
) -> list[ConfigChange]:
    """Raise ConfigMismatchError on any change outside ``allowed``, the operational keys and
    the world-size keys (the policy of ``strict_keys="all"``); return the changes that pass."""
    policy = ConfigPolicy(allowed=allowed, strict="all")
    return [c for c, _ in policy.check(saved, current, checkpoint)]
