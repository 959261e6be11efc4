"""Cross-version compatibility: write checkpoints with one torch, read them with another.

What it runs (``make compat``; not part of ``make test``). For each interpreter given with
``--python`` (the project's ``.venv`` with torch 2.13 and ``.venv-compat`` with torch 2.14.1),
``tests/fixtures/make_fixtures.py --out`` writes the six fixture checkpoints (DDP and FSDP2;
fp32, bf16 autocast, fp16 with a GradScaler; 2 gloo ranks each) with that interpreter's torch
and records every tensor's sha256 and every other value of the state. Then every interpreter
reads every interpreter's checkpoints back (``--check``: ``CheckpointManager.resume`` on 2
ranks, every tensor, scheduler, scaler, data position, counter, per-rank value and generator
draw compared with the record), in both directions and against itself as a control; the
committed frozen fixtures (tests/fixtures/format1/) are read by each interpreter too. With
``--pytest``, tests/test_compat_fixtures.py and tests/test_cross_version.py also run under
each interpreter after the first (the refusal of a torch 2.15 ``.metadata`` included).

The interpreters run with this checkout on ``PYTHONPATH``, so each reads and writes with the
same dckpt and only torch differs. Prints one table (written by, read by, fixtures loaded bit
for bit, the first error) and, with ``--json``, writes the rows there. Exit status 1 if any
pair failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
MAKE = FIXTURES / "make_fixtures.py"
FROZEN = FIXTURES / "format1"


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""),
        "OMP_NUM_THREADS": "1",
    }


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=timeout, check=False
    )


def torch_version(python: str) -> str:
    done = _run([python, "-c", "import torch; print(torch.__version__)"], 300)
    if done.returncode != 0:
        raise SystemExit(f"{python} cannot import torch:\n{done.stderr[-2000:]}")
    return done.stdout.strip()


def write(python: str, out: Path) -> str | None:
    """The fixtures written by ``python`` into ``out``; None, or why it failed."""
    done = _run([python, str(MAKE), "--out", str(out)], 900)
    if done.returncode != 0:
        return f"write failed (exit {done.returncode}): {_tail(done)}"
    return None


def read(python: str, directory: Path) -> dict[str, Any]:
    """``python`` resumes every fixture under ``directory``: {name: outcome} or {"": why}."""
    done = _run([python, str(MAKE), "--check", str(directory)], 900)
    outcomes: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            outcomes[row["fixture"]] = row
    if not outcomes:
        outcomes[""] = {"ok": False, "error": f"exit {done.returncode}: {_tail(done)}"}
    return outcomes


def _tail(done: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[-600:]


def summarise(outcomes: dict[str, Any]) -> tuple[int, int, str]:
    """(fixtures loaded bit for bit, fixtures, the first failure in words or "")."""
    ok = sum(1 for o in outcomes.values() if o["ok"])
    first = ""
    for name, o in sorted(outcomes.items()):
        if not o["ok"]:
            why = o.get("error") or "; ".join(o.get("mismatches", [])[:2])
            first = f"{name}: {why}"[:300]
            break
    return ok, len([n for n in outcomes if n]), first


def run_pytest(python: str) -> tuple[bool, str]:
    tests = ["tests/test_compat_fixtures.py", "tests/test_cross_version.py"]
    done = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], 900)
    lines = [ln for ln in done.stdout.splitlines() if " passed" in ln or " failed" in ln]
    return done.returncode == 0, (lines[-1].strip("= ") if lines else _tail(done))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python", action="append", required=True, help="an interpreter (give two or more)"
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--pytest", action="store_true", help="also run the compat tests")
    args = parser.parse_args(argv)
    pythons: list[str] = args.python
    versions = {py: torch_version(py) for py in pythons}
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dckpt-compat-") as tmp:
        written: dict[str, Path] = {}
        for py in pythons:
            out = Path(tmp) / f"by-{len(written)}"
            failed = write(py, out)
            if failed is not None:
                rows.append(
                    {"writer": versions[py], "reader": "-", "ok": 0, "of": 0, "first": failed}
                )
                continue
            written[py] = out
        sources = [(f"{versions[w]}", d) for w, d in written.items()]
        sources.append((f"frozen format1 ({_frozen_torch()})", FROZEN))
        for writer, directory in sources:
            for reader in pythons:
                ok, of, first = summarise(read(reader, directory))
                rows.append(
                    {"writer": writer, "reader": versions[reader], "ok": ok, "of": of,
                     "first": first}
                )  # fmt: skip
    tests: list[dict[str, Any]] = []
    if args.pytest:
        for py in pythons[1:]:
            passed, line = run_pytest(py)
            tests.append({"torch": versions[py], "passed": passed, "summary": line})
    print(table(rows, tests, time.monotonic() - t0))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "pytest": tests}, indent=1) + "\n")
    bad = any(r["ok"] != r["of"] or r["of"] == 0 for r in rows) or any(
        not t["passed"] for t in tests
    )
    return 1 if bad else 0


def _frozen_torch() -> str:
    records = sorted(FROZEN.glob("*.expected.json"))
    if not records:
        return "none"
    return str(json.loads(records[0].read_text())["written_by"]["torch"])


def table(rows: list[dict[str, Any]], tests: list[dict[str, Any]], seconds: float) -> str:
    head = ("written by torch", "read by torch", "bit for bit", "first failure")
    body = [(r["writer"], r["reader"], f"{r['ok']}/{r['of']}", r["first"] or "-") for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(3)]
    lines = [
        "dckpt compat: checkpoints written with one torch, resumed with another "
        "(DDP and FSDP2 x fp32, bf16, fp16+GradScaler; 2 gloo ranks)",
        "  ".join(h.ljust(w) for h, w in zip(head, [*widths, 0], strict=True)),
    ]
    for b in body:
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(b, [*widths, 0], strict=True)))
    for t in tests:
        lines.append(
            f"pytest under torch {t['torch']} (test_compat_fixtures, test_cross_version): "
            f"{'passed' if t['passed'] else 'FAILED'} ({t['summary']})"
        )
    lines.append(f"({seconds:.0f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
