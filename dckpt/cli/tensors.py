"""``dckpt diff`` and ``dckpt export``: commands that read a checkpoint's tensors (torch).

Both load through the verifying reader (dckpt.load.offline), so every file they read is checked
against its manifest first, and rebuild full, unsharded tensors from DCP's metadata in this
process's memory.
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
from ..root.manifest import read_manifest
from .common import EXIT_INTEGRITY, EXIT_OK, EXIT_USAGE, committed_dir, fail, human, out, root_arg

__all__ = ["cmd_diff", "cmd_export"]

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _load(step_dir: Path, prefix: str) -> dict[str, Any]:
    from ..load.offline import load_flat

    try:
        return load_flat(step_dir, prefix)
    except (IntegrityError, ManifestError) as exc:
        fail(EXIT_INTEGRITY, str(exc))
    except CheckpointError as exc:
        fail(EXIT_USAGE, str(exc))


def cmd_diff(args: argparse.Namespace) -> int:
    import torch

    root = root_arg(args.root)
    dirs = [committed_dir(root, args.a), committed_dir(root, args.b)]
    try:
        configs = [read_manifest(d).config for d in dirs]
    except (IntegrityError, ManifestError) as exc:
        fail(EXIT_INTEGRITY, str(exc))
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
    changes = [{"key": c.key, "a": c.saved, "b": c.current} for c in config_changes(*configs)]
    tensors = sum(isinstance(v, torch.Tensor) for v in a.values())
    if args.json:
        print(json.dumps({"a": args.a, "b": args.b, "config": changes, "differences": rows,
                          "tensors_compared": tensors}, indent=1, default=str))  # fmt: skip
        return EXIT_OK
    out.print(f"config: {len(changes)} difference(s)")
    for c in changes:
        out.print(f"  {c['key']}: {c['a']!r} -> {c['b']!r}")
    changed = [r for r in rows if r["status"] == "changed"]
    out.print(f"values: {len(rows)} of {len(a.keys() | b.keys())} differ ({tensors} tensors)")
    table = Table(title=f"step {args.a} vs step {args.b}, largest differences first")
    for col in ("name", "status", "max |a-b|", "mean |a-b|"):
        table.add_column(col)
    ordered = sorted(changed, key=lambda r: -r["max_abs_diff"]) + [
        r for r in rows if r["status"] != "changed"
    ]
    for r in ordered[: args.top]:
        mx, mean = r.get("max_abs_diff"), r.get("mean_abs_diff")
        table.add_row(
            r["name"], r["status"], "-" if mx is None else f"{mx:.3e}",
            "-" if mean is None else f"{mean:.3e}",
        )  # fmt: skip
    out.print(table)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    root = root_arg(args.root)
    step_dir = committed_dir(root, args.step)
    out_path = Path(args.out)
    if out_path.exists() and not args.force:
        fail(EXIT_USAGE, f"{out_path} exists; pass --force to replace it")
    flat = _load(step_dir, "model.")
    if not flat:
        fail(EXIT_USAGE, f"{step_dir} holds no model state")
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    tensors: dict[str, torch.Tensor] = {}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        t = value.to(dtype) if dtype is not None and value.is_floating_point() else value
        tensors[key.removeprefix("model.")] = t.contiguous()
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    if out_path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(tmp), metadata={"dckpt_step": str(read_manifest(step_dir).step)})
    else:
        torch.save(tensors, tmp)
    os.replace(tmp, out_path)
    params = sum(t.numel() for t in tensors.values())
    out.print(
        f"exported {len(tensors)} tensors ({params:,} parameters, "
        f"{human(out_path.stat().st_size)}) of {step_dir.name} to {out_path}"
        + (f" as {args.dtype}" if args.dtype else "")
        + "; no optimizer state"
    )
    return EXIT_OK
