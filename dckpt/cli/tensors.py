"""``dckpt diff`` and ``dckpt export``: commands that read a checkpoint's tensors (torch).

Both load through the verifying reader (dckpt.load.offline), so every file they read is checked
against its manifest first, and rebuild full, unsharded tensors from DCP's metadata in this
process's memory.

Output contract (tests and scripts read it):
- ``diff``: rows are ranked model weights first, then optimizer state, then the rest (step
  counters, RNG, progress, scalars); within each, structural changes (shape, dtype, a key on
  one side only) first, then the largest ``max_abs_diff``. ``--top`` cuts the table only;
  ``--json`` keeps every row in that order.
- ``export``: without ``--with-config``, a safetensors file of the model's tensors (metadata
  ``dckpt_step``) or a torch file of the bare ``{name: tensor}`` dict. With it, the
  safetensors metadata also holds ``dckpt_config`` (the run config as sorted JSON), and the
  torch file holds ``{"model": {name: tensor}, "config": dict, "step": int}``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from rich.table import Table

from ..errors import CheckpointError, IntegrityError, ManifestError
from ..load.config_check import config_changes
from ..root.manifest import Manifest, read_manifest
from .common import (
    EXIT_INTEGRITY,
    EXIT_OK,
    EXIT_USAGE,
    fail,
    human,
    out,
    plural,
    step_dirs,
)

__all__ = ["cmd_diff", "cmd_export", "rank_rows"]

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _load(step_dir: Path, prefix: str) -> dict[str, Any]:
    from ..load.offline import load_flat

    try:
        return load_flat(step_dir, prefix)
    except (IntegrityError, ManifestError) as exc:
        fail(EXIT_INTEGRITY, str(exc))
    except CheckpointError as exc:
        fail(EXIT_USAGE, str(exc))


def _manifest(step_dir: Path) -> Manifest:
    try:
        return read_manifest(step_dir)
    except (IntegrityError, ManifestError) as exc:
        fail(EXIT_INTEGRITY, str(exc))


# --- diff ----------------------------------------------------------------------------------

_MODEL, _OPTIMIZER, _REST = 0, 1, 2


def _tier(name: str) -> int:
    """Where a row ranks: the model's weights are what a diff is read for; the optimizer's
    moments next; then counters and scalars, whose differences are large and expected (an
    optimizer ``step`` of 4 -> 12 is a max |a-b| of 8, far above any weight's)."""
    if name.startswith("model."):
        return _MODEL
    if name.startswith("optimizer.state.") and name.rsplit(".", 1)[-1] != "step":
        return _OPTIMIZER
    return _REST


def rank_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` of ``dckpt diff`` in the order shown: by tier (model, optimizer, rest), then a
    structural change (no ``max_abs_diff``) before a numeric one, then the largest first."""

    def key(row: dict[str, Any]) -> tuple[int, int, float, str]:
        mx = row.get("max_abs_diff")
        return (_tier(row["name"]), mx is not None, -(mx or 0.0), row["name"])

    return sorted(rows, key=key)


def cmd_diff(args: argparse.Namespace) -> int:
    import torch

    with step_dirs(args, [args.a, args.b]) as (dirs, _shown):
        configs = [_manifest(d).config for d in dirs]
        a, b = (_load(d, "") for d in dirs)
    rows: list[dict[str, Any]] = []
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key), b.get(key)
        if key not in a or key not in b:
            rows.append({"name": key, "status": "only in " + ("B" if key not in a else "A"),
                         "max_abs_diff": None})  # fmt: skip
            continue
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
                rows.append({"name": key, "status": f"{x!r} -> {y!r}", "max_abs_diff": None})
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            rows.append({"name": key, "status": f"{tuple(x.shape)} {x.dtype} -> "
                         f"{tuple(y.shape)} {y.dtype}", "max_abs_diff": None})  # fmt: skip
        elif not torch.equal(x, y):
            d = (x.double() - y.double()).abs() if x.is_floating_point() else (x != y).double()
            rows.append({"name": key, "status": "changed", "max_abs_diff": float(d.max()),
                         "mean_abs_diff": float(d.mean()), "numel": x.numel()})  # fmt: skip
    rows = rank_rows(rows)
    changes = [{"key": c.key, "a": c.saved, "b": c.current} for c in config_changes(*configs)]
    tensors = sum(isinstance(v, torch.Tensor) for v in a.values())
    if args.json:
        print(json.dumps({"a": args.a, "b": args.b, "config": changes, "differences": rows,
                          "tensors_compared": tensors}, indent=1, default=str))  # fmt: skip
        return EXIT_OK
    out.print(f"config: {plural(len(changes), 'difference')}")
    for c in changes:
        out.print(f"  {c['key']}: {c['a']!r} -> {c['b']!r}")
    out.print(
        f"values: {len(rows)} of {len(a.keys() | b.keys())} differ "
        f"({plural(tensors, 'tensor')} compared)"
    )
    table = Table(
        title=f"step {args.a} vs step {args.b}: model weights, then optimizer state, then "
        "counters and scalars; largest differences first"
    )
    for col in ("name", "status", "max |a-b|", "mean |a-b|"):
        table.add_column(col)
    for r in rows[: args.top]:
        mx, mean = r.get("max_abs_diff"), r.get("mean_abs_diff")
        table.add_row(
            r["name"], r["status"], "-" if mx is None else f"{mx:.3e}",
            "-" if mean is None else f"{mean:.3e}",
        )  # fmt: skip
    out.print(table)
    if len(rows) > args.top:
        more = plural(len(rows) - args.top, "more row")
        out.print(f"{more} not shown (--top {len(rows)}, or --json for every row)")
    return EXIT_OK


# --- export --------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    out_path = Path(args.out)
    if out_path.exists() and not args.force:
        fail(EXIT_USAGE, f"{out_path} exists; pass --force to replace it")
    with step_dirs(args, [args.step]) as (dirs, shown):
        step_dir = dirs[0]
        flat = _load(step_dir, "model.")
        manifest = _manifest(step_dir)
    if not flat:
        fail(EXIT_USAGE, f"{shown}/{step_dir.name} holds no model state")
    if args.trainable:
        if "trainable" not in manifest.incremental:
            fail(
                EXIT_USAGE,
                f"{shown}/{step_dir.name} does not record which parameters required grad (it "
                f"was saved with incremental=False, or by an older dckpt); export it "
                f"whole, without --trainable",
            )
        keep = set(manifest.incremental["trainable"])
        flat = {k: v for k, v in flat.items() if k in keep}
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    tensors: dict[str, torch.Tensor] = {}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        t = value.to(dtype) if dtype is not None and value.is_floating_point() else value
        tensors[key.removeprefix("model.")] = t.contiguous()
    _write(out_path, tensors, manifest, with_config=args.with_config)
    params = sum(t.numel() for t in tensors.values())
    out.print(
        f"exported {plural(len(tensors), 'tensor')} ({plural(params, 'parameter')}, "
        f"{human(out_path.stat().st_size)}) of {step_dir.name} to {out_path}"
        + (f" as {args.dtype}" if args.dtype else "")
        + (" with the run config" if args.with_config else "")
        + (", trainable parameters only" if args.trainable else "")
        + "; no optimizer state"
    )
    return EXIT_OK


def _write(
    out_path: Path, tensors: dict[str, Any], manifest: Manifest, *, with_config: bool
) -> None:
    """Write the export beside ``out_path`` and rename it into place, so a failed or
    interrupted export never leaves a partial file under the name a script will load."""
    import torch

    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        if out_path.suffix == ".safetensors":
            from safetensors.torch import save_file

            metadata = {"dckpt_step": str(manifest.step)}
            if with_config:
                metadata["dckpt_config"] = json.dumps(manifest.config, sort_keys=True)
            save_file(tensors, str(tmp), metadata=metadata)
        elif with_config:
            # Plain types only, so torch.load(..., weights_only=True) reads it back.
            torch.save({"model": tensors, "config": manifest.config, "step": manifest.step}, tmp)
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
