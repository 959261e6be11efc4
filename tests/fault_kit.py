"""Shared pieces of the fault-injection suite (tests/faults/).

- A small DDP model whose state (parameters, AdamW moments, a scheduler, RNG, a data position)
  real gloo ranks save: ``saving_world`` saves a list of steps, optionally with a fault
  (``DCKPT_FAULT``) armed for one of them, and reports how each rank ended.
- ``resume_world`` is "a restart": on fresh ranks it resumes each given root (verified, with
  fallback), checks that the model now holds exactly the checkpoint it resumed from, and saves
  one step more, so the run demonstrably goes on.
- ``capture`` and ``check`` are the invariant check run after every fault: every committed
  checkpoint verifies, ``latest`` names a committed one, and every checkpoint that existed
  before the fault still loads bit-exact (each one that does not counts as data lost).
- ``Trials`` (the ``fault_trials`` fixture) records each trial for the table ``make faults``
  prints (tests/conftest.py).

Everything a spawned rank runs is a module-level function, so it pickles by reference.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WIDTH = 48
SEED = 1234


def build(rank: int, width: int = WIDTH, frozen: bool = True) -> tuple[Any, Any, Any]:
    """The same DDP model, AdamW and scheduler on every rank and in every run. Its first layer
    is frozen (unless ``frozen=False``: a test that sizes a disk to the state), so its saves
    are incremental: the layer goes to a file of its own, which later saves in a process
    link (with ``incremental_copies=1``, from the save before), and the faults hit it too."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(SEED)
    body = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 8))
    body[0].requires_grad_(not frozen)
    model = DistributedDataParallel(body)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train_step(model: Any, opt: Any, sched: Any, step: int, rank: int) -> float:
    gen = torch.Generator().manual_seed(step * 100 + rank)
    opt.zero_grad()
    loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def manager(root: str, model: Any, opt: Any, sched: Any, **config: Any) -> Any:
    import dckpt

    cfg = dckpt.CheckpointConfig(root=Path(root), **{"timeout_s": 15.0, **config})
    return dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt, scheduler=sched, seed=SEED))


def saving_world(
    rank: int,
    world: int,
    root: str,
    steps: list[int],
    fault: str | None = None,
    fault_step: int | None = None,
    config: dict[str, Any] | None = None,
) -> str:
    """Train and save ``steps``; ``fault`` is armed for the save of ``fault_step`` only.

    Returns "ok", or the text of the error this rank raised (a rank killed by the fault
    returns nothing; run_world reports it as "produced no result").
    """
    model, opt, sched = build(rank)
    try:
        mgr = manager(root, model, opt, sched, **(config or {}))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        for step in steps:
            train_step(model, opt, sched, step, rank)
            if fault is not None and step == fault_step:
                os.environ["DCKPT_FAULT"] = fault
            mgr.save(step)
            mgr.wait()
            os.environ.pop("DCKPT_FAULT", None)
        mgr.close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def resume_world(
    rank: int, world: int, roots: list[str], width: int = WIDTH, frozen: bool = True
) -> list[dict[str, Any]]:
    """A restart of each root in turn: resume, compare with the checkpoint, save one more."""
    from dckpt.load.offline import load_flat

    out: list[dict[str, Any]] = []
    for root in roots:
        model, opt, sched = build(rank, width, frozen)
        try:
            mgr = manager(root, model, opt, sched)
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        try:
            report = mgr.resume()
            result: dict[str, Any] = {"step": report.step, "error": None}
            if report.step is not None:
                saved = load_flat(Path(report.path), "model.")
                live = {f"model.{k}": v for k, v in model.module.state_dict().items()}
                result["exact"] = all(torch.equal(saved[k], v) for k, v in live.items())
                train_step(model, opt, sched, report.step + 1, rank)
                mgr.save(report.step + 1)
                mgr.wait()
                result["saved_next"] = True
            mgr.close()
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(Exception):
                mgr.close()
        out.append(result)
    return out


Baseline = dict[int, dict[str, Any]]
"""Per committed step, every value of the checkpoint as loaded (verified) before a fault."""


def capture(root: Path) -> Baseline:
    from dckpt.load.offline import load_flat
    from dckpt.root.layout import committed_steps, step_dir_name

    return {s: load_flat(root / step_dir_name(s)) for s in committed_steps(root)}


@dataclass
class Check:
    """The outcome of the invariant check on one root."""

    lost: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


def check(root: Path, baseline: Baseline, *, may_drop: frozenset[int] = frozenset()) -> Check:
    """The invariants that must hold after any fault; see the module docstring.

    ``may_drop``: steps the fault's scenario deletes on purpose (retention victims).
    """
    from dckpt.load.offline import load_flat
    from dckpt.root.layout import committed_steps, read_latest, step_dir_name
    from dckpt.root.verify import verify_checkpoint

    result = Check()
    committed = committed_steps(root)
    for step in committed:
        verified = verify_checkpoint(root / step_dir_name(step))
        if not verified.ok:
            result.problems.append(f"committed step {step} does not verify: {verified.problems}")
    latest = read_latest(root)
    if latest is not None and latest not in {step_dir_name(s) for s in committed}:
        result.problems.append(f"latest names {latest!r}, which is not committed")
    for step, before in baseline.items():
        if step in may_drop:
            continue
        if step not in committed:
            result.lost += 1
            result.problems.append(f"step {step}, committed before the fault, is gone")
            continue
        try:
            after = load_flat(root / step_dir_name(step))
        except Exception as exc:
            result.lost += 1
            result.problems.append(f"step {step} no longer loads: {exc}")
            continue
        if after.keys() != before.keys() or not all(_same(after[k], before[k]) for k in before):
            result.lost += 1
            result.problems.append(f"step {step} loads, but not bit-exact")
    return result


def fresh_root(template: Path, dst: Path) -> Path:
    """A private copy of a prepared root (its lock was released when its job closed), with
    its hard links (an incremental save's shared files) kept as links."""
    copy_tree(template, dst)
    return dst


def copy_tree(src: Path, dst: Path) -> None:
    """``src`` copied to ``dst`` as ``cp -a`` copies it: symlinks as symlinks, and the names
    of one inode as links of one file (``shutil.copytree`` makes each a file of its own)."""
    subprocess.run(["cp", "-a", "--", str(src), str(dst)], check=True, capture_output=True)


@dataclass
class Trial:
    fault: str
    case: str
    survived: bool
    lost: int
    detail: str = ""


class Trials:
    """What ``make faults`` tabulates: one record per trial of each fault."""

    def __init__(self, sink: list[Trial]) -> None:
        self._sink = sink

    def record(
        self, fault: str, case: str, *, survived: bool, lost: int = 0, detail: str = ""
    ) -> None:
        self._sink.append(Trial(fault, case, survived, lost, detail))

    @contextlib.contextmanager
    def trial(self, fault: str, case: str) -> Iterator[None]:
        """A trial that is a test's own assertions: survived when the block passes, and
        recorded either way (the assertion's text as the detail)."""
        try:
            yield
        except AssertionError as exc:
            self.record(fault, case, survived=False, detail=str(exc)[:500])
            raise
        self.record(fault, case, survived=True)

    def record_check(
        self,
        fault: str,
        case: str,
        outcome: Check,
        *,
        survived: bool | None = None,
        detail: str = "",
    ) -> None:
        """Record a trial whose invariant check ran: it survived only if the check is clean
        and (unless ``survived`` says otherwise) nothing went wrong (``detail`` is empty)."""
        problems = "; ".join(outcome.problems)
        self.record(
            fault,
            case,
            survived=(not detail if survived is None else survived) and outcome.ok,
            lost=outcome.lost,
            detail="; ".join(x for x in (detail, problems) if x),
        )


def failed(trials: list[Trial]) -> str:
    """Text for an assertion: every trial that did not survive, with why."""
    return "\n".join(f"{t.fault} / {t.case}: {t.detail}" for t in trials if not t.survived)
