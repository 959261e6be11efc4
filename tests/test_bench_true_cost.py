"""bench/true_cost.py's arithmetic: a cost per save read from step records, the ratios and the
verdicts, on step records whose truth is known (running it for real takes minutes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("true_cost", REPO / "bench" / "true_cost.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["true_cost"] = module
    spec.loader.exec_module(module)
    return module


def _trainer(
    extra: float, printed: float | None, save_every: int = 2, check_s: float = 0.0
) -> dict[str, Any]:
    """Step records of a loop at 1 s per step whose saves each add ``extra`` seconds, and
    manifests whose background save took 2 s, ``check_s`` of it in value checks."""
    times, t = {}, 100.0
    for step in range(1, 21):
        times[step] = t
        t += 1.0 + (extra if step % save_every == 0 else 0.0)
    saves = {s: (0.05, printed) for s in range(save_every, 21, save_every)}
    timings = {
        s: {"check_s": check_s, "to_commit_s": 2.05, "stall_s": 0.05}
        for s in range(save_every, 21, save_every)
    }
    return {
        "times": times,
        "printed": saves,
        "decision": ["kept"],
        "bytes": 1000,
        "timings": timings,
    }


def _doc(
    bench: ModuleType,
    *,
    async_extra: float,
    async_printed: float,
    unchecked_extra: float,
    check_s: float,
    uncaptured_extra: float | None = None,
) -> dict[str, Any]:
    args = bench.parse_args(["--steps", "20", "--save-every", "2"])
    first, last, saves = bench.window(args)
    rounds = [
        {
            "none": _trainer(0.0, None),
            "sync": _trainer(0.6, 0.6),
            "async": _trainer(async_extra, async_printed, check_s=check_s),
            "nocheck": _trainer(unchecked_extra, async_printed),
            "sampled": _trainer(unchecked_extra, async_printed, check_s=check_s / 4),
            "auto": _trainer(async_extra, async_printed),
            "nocapture": _trainer(
                async_extra if uncaptured_extra is None else uncaptured_extra, async_printed
            ),
            "dcp": {"seconds": [1.0, 1.2, 0.8], "disk_s": [0.5, 0.5, 0.5], "bytes": 1000},
        }
    ]
    run = bench.h.Run(base_dir="")
    return dict(bench.summarize(args, rounds, first, last, saves, run))


def test_cost_per_save_is_read_from_the_step_records(bench: ModuleType) -> None:
    args = bench.parse_args(["--steps", "20", "--save-every", "2"])
    assert bench.window(args) == (6, 20, [6, 8, 10, 12, 14, 16, 18])
    doc = _doc(bench, async_extra=0.3, async_printed=0.3, unchecked_extra=0.29, check_s=0.1)
    f = doc["figures"]
    assert f["sync_cost_s"] == pytest.approx(0.6)
    assert f["async_cost_s"] == pytest.approx(0.3)
    assert f["dcp_save_s"] == pytest.approx(1.0)
    assert f["async_per_dcp"] == pytest.approx(0.3) and f["async_per_sync"] == pytest.approx(0.5)
    assert f["reported_per_measured"] == pytest.approx(1.0)
    assert f["step_s_none"] == pytest.approx(1.0)
    assert f["checks_per_background"] == pytest.approx(0.05)
    assert f["checks_cost_s"] == pytest.approx(0.01)
    assert f["checks_per_cost"] == pytest.approx(0.01 / 0.3)
    assert f["auto_per_best"] == pytest.approx(1.0) and f["auto_per_dcp"] == pytest.approx(0.3)
    assert [t["pass"] for t in doc["targets"]] == [True] * 9
    assert f["capture_cost_rise"] == pytest.approx(0.0)
    text = bench.render(doc)
    assert "| dckpt, background | 0.300 s | 0.30 |" in text and "PASS" in text
    assert "0.100 s of the background save's 2.000 s (5.0%" in text
    assert f["sampled_checks_per_background"] == pytest.approx(0.0125)
    assert "With replica_sample=0.25 (each replica compared once every 4 saves)" in text


def test_a_cost_over_the_limits_and_a_wrong_printed_figure_fail(bench: ModuleType) -> None:
    doc = _doc(
        bench,
        async_extra=0.7,
        async_printed=0.2,
        unchecked_extra=0.5,
        check_s=0.3,
        uncaptured_extra=0.6,
    )
    verdicts = {t["target"]: t["pass"] for t in doc["targets"]}
    assert doc["figures"]["capture_cost_rise"] == pytest.approx(0.7 / 0.6 - 1)
    assert verdicts == {
        "async cost / dcp.save": False,
        "async cost / sync cost": False,
        "auto cost / min(sync, async)": False,
        "auto cost / dcp.save": False,
        "reported / measured (async)": False,
        "value checks / background time": False,
        "value checks / loop's cost (async)": False,
        "capture check: stall rise (async)": True,
        "capture check: loop's cost rise (async)": False,
    }
    assert "FAIL" in bench.render(doc)


def test_fewer_modes_judge_only_what_ran(bench: ModuleType) -> None:
    args = bench.parse_args(["--steps", "20", "--save-every", "2", "--modes", "sync,async,auto"])
    assert args.modes == ["none", "sync", "async", "auto"]
    first, last, saves = bench.window(args)
    rnd = {
        "none": _trainer(0.0, None),
        "sync": _trainer(0.3, 0.3),
        "async": _trainer(0.6, 0.6),
        "auto": _trainer(0.31, 0.3),
        "dcp": {"seconds": [1.0], "disk_s": [0.5], "bytes": 1000},
    }
    rnd["auto"]["decision"] = ["background saves cost training 0.5 s ...: saving synchronously"]
    doc = dict(bench.summarize(args, [rnd], first, last, saves, bench.h.Run(base_dir="")))
    verdicts = {t["target"]: t["pass"] for t in doc["targets"]}
    assert verdicts == {
        "async cost / dcp.save": False,
        "async cost / sync cost": False,
        "auto cost / min(sync, async)": True,
        "auto cost / dcp.save": True,
        "reported / measured (async)": True,
        "value checks / background time": True,
    }
    text = bench.render(doc)
    assert "value checks off" not in text and "1.03x" in text
    assert "- round 1 (0.310 s per save): background saves cost training 0.5 s" in text


def test_the_auto_lines_are_read_from_the_log(bench: ModuleType) -> None:
    log = "\n".join(
        [
            "dckpt: background saves cost training 0.300 s each so far (median of 1): timing",
            "dckpt: saved step 8 | x | stall 0.2 s, training slowed 0.3 s",
            "dckpt: re-decided (the cost of background saves moved from 0.3 s to 0.7 s): x",
            "dckpt: the cost of synchronous saves moved from 0.3 s to 0.9 s: timing",
        ]
    )
    found = [m.group(1) for m in bench.DECIDED.finditer(log)]
    assert [f.split()[0] for f in found] == ["background", "re-decided", "the"]
