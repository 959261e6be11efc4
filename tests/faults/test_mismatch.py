"""A model that does not fit the checkpoint (fault 12): a clear error naming the tensor.

Each trial resumes a private copy of a root where 2 real ranks saved steps 1 and 2 into a
model built differently from the one that saved it: wider, cast to another dtype, or with one
layer cast. On both ranks the resume must raise ``StateMismatchError`` naming the tensor and
both shapes or dtypes; nothing may be quarantined or fall back (a mismatch is not damage: an
older checkpoint of the same run does not fit either). The same world then resumes every root
with the right model: step 2, bit-exact, and it saves step 3; ``fault_kit.check`` holds with
nothing lost. One spawn serves every trial.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from fault_kit import (
    Trials,
    build,
    capture,
    check,
    failed,
    fresh_root,
    manager,
    resume_world,
    saving_world,
)

from dckpt.root.layout import QUARANTINE_DIR, committed_steps

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

FAULT = "shape/dtype mismatch"

# case -> (width, dtype of the whole model, dtype of the last layer only, what the error says)
CASES: dict[str, tuple[int, torch.dtype | None, torch.dtype | None, list[str]]] = {
    "wider model (48 -> 64)": (64, None, None, ["model.0.weight", "(48, 16)", "(64, 16)"]),
    "narrower model (48 -> 32)": (32, None, None, ["model.0.weight", "(48, 16)", "(32, 16)"]),
    "model cast to float64": (
        48,
        torch.float64,
        None,
        ["model.0.weight", "torch.float32", "torch.float64"],
    ),
    "last layer cast to bfloat16": (
        48,
        None,
        torch.bfloat16,
        ["model.2.weight", "torch.float32", "torch.bfloat16"],
    ),
}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mismatch") / "root"
    results = run_world(saving_world, 2, str(root), [1, 2])
    assert results == ["ok", "ok"], results
    assert committed_steps(root) == [1, 2]
    return root


def mismatch_world(rank: int, world: int, roots: list[str]) -> dict[str, Any]:
    """Per root, resume into the mismatched model of its case; then the right model."""
    errors: list[str] = []
    for root, (width, dtype, last, _says) in zip(roots, CASES.values(), strict=True):
        model, opt, sched = build(rank, width)
        if dtype is not None:
            model.to(dtype)
        if last is not None:
            model.module[2].to(last)
        mgr = manager(root, model, opt, sched)
        try:
            report = mgr.resume()
            errors.append(f"resumed step {report.step} without an error")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            mgr.close()
    # Every rank has raised by now; what rank 0 sees is what the restart below starts from.
    seen = [(committed_steps(r), (Path(r) / QUARANTINE_DIR).exists()) for r in roots]
    return {"errors": errors, "seen": seen, "resumed": resume_world(rank, world, roots)}


def test_a_model_that_does_not_fit_is_named_and_nothing_is_quarantined(
    template: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    baseline = capture(template)
    roots = [fresh_root(template, tmp_path / f"trial-{i}") for i in range(len(CASES))]
    results = run_world(mismatch_world, 2, [str(r) for r in roots], timeout=180)
    ok = True
    for i, (case, (*_, says)) in enumerate(CASES.items()):
        why: list[str] = []
        for rank in range(2):
            error = results[rank]["errors"][i]
            if not error.startswith("StateMismatchError:") or not all(s in error for s in says):
                why.append(f"rank {rank}: {error!r} is not a StateMismatchError saying {says}")
            got = results[rank]["resumed"][i]
            if got.get("error") or got.get("step") != 2 or not got.get("exact"):
                why.append(f"restart with the right model on rank {rank}: {got} (expected 2)")
        steps, quarantined = results[0]["seen"][i]
        if steps != [1, 2] or quarantined:
            why.append(f"after the mismatch: committed {steps}, quarantine/ exists: {quarantined}")
        if (roots[i] / QUARANTINE_DIR).exists():
            why.append("quarantine/ exists after the restart")
        outcome = check(roots[i], baseline)
        fault_trials.record_check(FAULT, case, outcome, survived=not why, detail="; ".join(why))
        ok = ok and not why and outcome.ok
    assert ok, failed(fault_trials._sink)
