"""What does a manifest key (``CheckpointConfig.key_file``) cost a save? One process, one run.

Two figures, each a ratio taken in the same run (machines are noisy; seconds are not compared
across runs):

1. **Signing alone**, on rank 0 at the commit: ``ManifestKey.sign`` (an HMAC-SHA256 over the
   canonical JSON of every field) and the check a resume makes (``refusal``), against
   ``manifest_bytes`` (the encoding every commit already does), for manifests of 2, 1024 and
   16384 files (the file count grows with the world).
2. **A whole save**, ``CheckpointManager.save(...).result()`` of the same state (``--mb`` MB of
   parameters and AdamW state, one rank, synchronous so the time is the save's), interleaved
   round by round: ``sha256`` digests with the key, ``sha256`` without, and ``xxh3_128`` (the
   default, which a key rules out: its digests could be met by crafted bytes). The key's own
   cost is ``keyed / sha256``; what a user who turns it on pays is ``keyed / xxh3``.

Usage::

    .venv/bin/python bench/key_cost.py --mb 256 --repeats 5 [--name key_cost]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dckpt
from dckpt.root.manifest import Manifest, manifest_bytes
from dckpt.root.provenance import ManifestKey
from dckpt.storage.records import FileRecord

RESULTS = Path(__file__).parent / "results"


def _manifest(files: int) -> Manifest:
    records = tuple(
        FileRecord(path=f"__{r}_0.distcp", bytes=1 << 20, digest=f"sha256:{r:064x}", rank=r)
        for r in range(files)
    )
    return Manifest(
        step=1,
        world_size=files,
        files=records,
        run_id="bench",
        save_id="s",
        created_at=0.0,
        digest_algorithm="sha256",
        config={"lr": 0.1},
    ).sealed()


def _best(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def signing(key: ManifestKey) -> list[dict[str, Any]]:
    rows = []
    for files in (2, 1024, 16384):
        m = _manifest(files)
        signed = key.sign(m)
        n = 20 if files < 16384 else 5
        encode = _best(lambda m=m: manifest_bytes(m), n)
        sign = _best(lambda m=m: key.sign(m), n)
        check = _best(lambda s=signed: key.refusal(s), n)
        rows.append(
            {
                "files": files,
                "encode_s": encode,
                "sign_s": sign,
                "check_s": check,
                "sign_over_encode": sign / encode,
                "check_over_encode": check / encode,
            }
        )
    return rows


def _state(mb: int) -> dckpt.TrainState:
    torch.manual_seed(0)
    width = 1024
    layers = max(1, int(mb * 1e6 / 3 / 4 / (width * width)))  # params + exp_avg + exp_avg_sq
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, width)).sum().backward()
    opt.step()
    return dckpt.TrainState(net, opt)


def saves(mb: int, repeats: int, key_file: Path, base: Path) -> dict[str, Any]:
    state = _state(mb)
    methods: dict[str, dict[str, Any]] = {
        "keyed_sha256": {"digest": "sha256", "key_file": key_file},
        "sha256": {"digest": "sha256"},
        "xxh3_128": {"digest": "xxh3_128"},
    }
    times: dict[str, list[float]] = {m: [] for m in methods}
    order = list(methods)
    for round_ in range(repeats + 1):  # round 0: warm-up, not counted
        for name in order if round_ % 2 else reversed(order):
            root = base / f"{name}-{round_}"
            settings = methods[name]
            config = dckpt.CheckpointConfig(root=root, async_save=False, lock=False, **settings)
            with dckpt.CheckpointManager(config, state) as mgr:
                t0 = time.perf_counter()
                mgr.save(1).result()
                took = time.perf_counter() - t0
            shutil.rmtree(root)
            if round_:
                times[name].append(took)
    med = {m: statistics.median(t) for m, t in times.items()}
    return {
        "mb": mb,
        "repeats": repeats,
        "median_s": med,
        "key_over_sha256": med["keyed_sha256"] / med["sha256"],
        "key_over_xxh3": med["keyed_sha256"] / med["xxh3_128"],
        "paired_key_over_sha256": statistics.median(
            a / b for a, b in zip(times["keyed_sha256"], times["sha256"], strict=True)
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--name", default="key_cost")
    args = p.parse_args()
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="dckpt-key-cost-"))
    try:
        key_file = base / "run.key"
        key_file.write_bytes(os.urandom(32).hex().encode())
        key_file.chmod(0o600)
        key = ManifestKey.load(key_file)
        result: dict[str, Any] = {
            "signing": signing(key),
            "save": saves(args.mb, args.repeats, key_file, base),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    for row in result["signing"]:
        print(
            f"{row['files']:>6} files: encode {row['encode_s'] * 1e3:.2f} ms, sign "
            f"{row['sign_s'] * 1e3:.2f} ms ({row['sign_over_encode']:.2f}x), check "
            f"{row['check_s'] * 1e3:.2f} ms ({row['check_over_encode']:.2f}x)"
        )
    s = result["save"]
    print(
        f"save of {s['mb']} MB: keyed/sha256 {s['key_over_sha256']:.3f} (paired "
        f"{s['paired_key_over_sha256']:.3f}), keyed/xxh3 {s['key_over_xxh3']:.3f}; medians "
        + ", ".join(f"{k} {v:.3f} s" for k, v in s["median_s"].items())
    )


if __name__ == "__main__":
    main()
