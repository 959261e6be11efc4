"""Config changes that the restored state overrides, named at the resume.

A config change a resume lets pass (``allow_config_changes``, or a key dckpt does not know)
can still do nothing: when the key's value lives in the state the checkpoint restores, the
load puts the saved value back. The learning rate is the common case: the optimizer's
``param_groups`` (and an LR scheduler's ``base_lrs``) come back holding the saved LR, and the
run goes on bit-identical to the old one.

``find_overrides`` recognises a changed key by its last dotted part:

- a field of the optimizer's param groups: ``lr`` (also ``learning_rate``, ``base_lr``; with
  a scheduler, the group's ``initial_lr`` and the scheduler's ``base_lrs``), ``weight_decay``
  (``wd``), ``betas`` (``beta1``, ``beta2``: one of its two), and any other field by its own
  name (``eps``, ``momentum``, ``max_lr`` ...);
- an attribute of a restored LR scheduler, by its name (``T_max``, ``gamma``, ``eta_min`` ...);
- a GradScaler setting kept in its state: ``growth_factor``, ``backoff_factor``,
  ``growth_interval``.

It is an override when a restored value equals the checkpoint's config value, and it stands
until every such value changed (a scheduler whose ``base_lrs`` still hold it puts it back at
its next step). The resume report says so with the lines that apply the new value (an LR is
scaled by new/old, so groups keep their own multiples of it and a schedule its current
point; another field is set in the groups that hold the saved value); at the first
optimizer step after the resume (the manager's step pre-hook) each is checked again and
rank 0 logs whether the script applied it, and once more at the second (after the first
``scheduler.step()``: a schedule whose ``base_lrs`` still held the old value would have put
it back). A scheduler wrapper (Accelerate's ``AcceleratedScheduler``, anything that keeps
the real one in ``.scheduler``) is looked through: its ``base_lrs`` are probed, and the
lines name ``scheduler.scheduler.base_lrs``.
No torch, no collective: the state's objects are only read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..train.state import TrainState
from .config_check import ConfigChange

__all__ = ["Override", "find_overrides"]

_GROUP_ALIASES: dict[str, tuple[str, int | None]] = {
    "learning_rate": ("lr", None),
    "base_lr": ("lr", None),
    "lr": ("lr", None),
    "wd": ("weight_decay", None),
    "beta1": ("betas", 0),
    "beta2": ("betas", 1),
}
_SCALER_FIELDS = frozenset({"growth_factor", "backoff_factor", "growth_interval"})


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    a, b = _plain(a), _plain(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class Override:
    """One changed key whose saved value the restored state holds.

    ``probe`` reads the holders (each group's field, a scheduler's attribute, ...); the
    values at the resume are kept, and ``watched`` are those that held the saved value.
    Until each of them changed, the override stands: a group the script scaled, or one that
    held its own multiple of the LR, never counts, and a scheduler's ``base_lrs`` left as
    they were still puts the old LR back at its next step."""

    def __init__(
        self, change: ConfigChange, where: str, fix: tuple[str, ...], probe: Callable[[], list[Any]]
    ) -> None:
        self.change = change
        self.where = where
        """What holds the saved value, for the message ("the optimizer's param_groups")."""
        self.fix = fix
        """The lines that apply the new value after ``resume()``."""
        self._probe = probe
        self._at_resume = probe()
        self.watched = [i for i, v in enumerate(self._at_resume) if _same(v, change.saved)]

    def still_restored(self) -> bool:
        now = self._probe()
        if len(now) != len(self._at_resume):
            return False  # groups added or removed: the script rebuilt it
        return any(_same(now[i], self._at_resume[i]) for i in self.watched)

    def describe(self) -> str:
        c = self.change
        lines = "\n".join(f"      {line}" for line in self.fix)
        return (
            f"{c.key} changed {c.saved!r} -> {c.current!r}, but {self.where} came back from the "
            f"checkpoint holding {c.saved!r}: the new value does nothing unless the script "
            "applies it after resume() (checked again at the first optimizer step):\n" + lines
        )


def find_overrides(changes: list[ConfigChange], state: TrainState) -> list[Override]:
    """Every change in ``changes`` (those the resume let pass) that the restored ``state``
    holds in its saved value; see the module docstring."""
    found: list[Override] = []
    for change in changes:
        name = change.key.rsplit(".", maxsplit=1)[-1]
        for make in (_in_groups, _in_schedulers, _in_scaler):
            override = make(change, name, state)
            if override is not None and override.watched:
                found.append(override)
                break
    return found


def _ratio(new: Any, old: Any) -> float | None:
    """new / old for two numbers (None when it cannot scale: a zero or a non-number)."""
    if isinstance(new, bool) or isinstance(old, bool):
        return None
    if not isinstance(new, (int, float)) or not isinstance(old, (int, float)) or old == 0:
        return None
    return float(new) / float(old)


def _in_groups(change: ConfigChange, name: str, state: TrainState) -> Override | None:
    opt = state.optimizer
    if opt is None or not opt.param_groups:
        return None
    field, index = _GROUP_ALIASES.get(name.lower(), (name, None))
    groups = opt.param_groups
    if field == "params" or not all(field in g for g in groups):
        return None
    new, old = change.current, change.saved
    scheds: list[tuple[Any, str]] = [
        (s, path)
        for s, path in (_unwrapped(s, "scheduler") for s in state.schedulers)
        if isinstance(getattr(s, "base_lrs", None), list)
    ]
    ratio = _ratio(new, old)
    if field == "lr" and ratio is not None:
        scheduled = all("initial_lr" in g for g in groups)

        def probe() -> list[Any]:
            mine = [g["initial_lr"] if scheduled else g["lr"] for g in groups]
            return mine + [v for s, _ in scheds for v in getattr(s, "base_lrs", [])]

        # Scaled, not set: groups keep their own multiples of the LR, and a schedule keeps
        # its current point (setting "lr" would restart a chained schedule at its peak).
        # The bases that held the saved LR get the new one exactly, the others its ratio.
        def based(v: str) -> str:
            return f"{new!r} if {v} == {old!r} else {v} * r"

        initial, lr = 'g["initial_lr"]', 'g["lr"]'
        scale = f"{lr} *= r; {initial} = {based(initial)}" if scheduled else f"{lr} = {based(lr)}"
        fix = [f"r = {new!r} / {old!r}", f"for g in optimizer.param_groups: {scale}"]
        for path in dict.fromkeys(p for _, p in scheds):
            fix.append(f"{path}.base_lrs = [{based('b')} for b in {path}.base_lrs]")
        return Override(change, "the optimizer's param_groups", tuple(fix), probe)
    holding = f'(g for g in optimizer.param_groups if g["{field}"] == {old!r})'
    if index is not None:
        if not all(isinstance(g[field], (list, tuple)) and len(g[field]) > index for g in groups):
            return None
        other = f'g["{field}"][{1 - index}]'
        pair = f"({new!r}, {other})" if index == 0 else f"({other}, {new!r})"
        holding = f'(g for g in optimizer.param_groups if g["{field}"][{index}] == {old!r})'
        return Override(
            change,
            f"the optimizer's param_groups ({field}[{index}])",
            (f'for g in {holding}: g["{field}"] = {pair}',),
            lambda: [g[field][index] for g in groups],
        )
    every = all(_same(g[field], old) for g in groups)
    target = "optimizer.param_groups" if every else holding
    return Override(
        change,
        f"the optimizer's param_groups ({field})",
        (f'for g in {target}: g["{field}"] = {new!r}',),
        lambda: [g[field] for g in groups],
    )


def _unwrapped(obj: Any, name: str) -> tuple[Any, str]:
    """The object a wrapper holds (Accelerate's ``AcceleratedScheduler`` and the like keep
    the real scheduler in ``.scheduler``), and how a script reaches it from ``name``."""
    path = name
    for _ in range(4):  # wrappers of wrappers, never a cycle
        inner = getattr(obj, "scheduler", None)
        if inner is None or hasattr(obj, "base_lrs") or inner is obj:
            break
        obj, path = inner, f"{path}.scheduler"
    return obj, path


def _in_schedulers(change: ConfigChange, name: str, state: TrainState) -> Override | None:
    for i, wrapped in enumerate(state.schedulers):
        which = "scheduler" if len(state.schedulers) == 1 else f"schedulers[{i}]"
        sched, which = _unwrapped(wrapped, which)
        attrs = {k.lower(): k for k in vars(sched) if not k.startswith("_")}
        attr = attrs.get(name.lower())
        if attr is None or attr in ("optimizer", "base_lrs", "last_epoch", "scheduler"):
            continue
        return Override(
            change,
            f"the LR scheduler's {attr}",
            (f"{which}.{attr} = {change.current!r}",),
            lambda s=sched, a=attr: [getattr(s, a)],  # type: ignore[misc]
        )
    return None


def _in_scaler(change: ConfigChange, name: str, state: TrainState) -> Override | None:
    scaler = state.scaler
    if scaler is None or name.lower() not in _SCALER_FIELDS:
        return None
    key = name.lower()

    def probe() -> list[Any]:
        held = scaler.state_dict() if scaler is not None else {}
        return [held[key]] if key in held else []

    return Override(
        change,
        f"the GradScaler's {key}",
        (f'scaler.load_state_dict({{**scaler.state_dict(), "{key}": {change.current!r}}})',),
        probe,
    )
