"""dckpt on an s3:// root against the raw client's put and get of the same bytes, in one run.

What it runs. A real S3 server (moto's standalone server on 127.0.0.1, started here; or any
endpoint with ``--endpoint`` and the AWS variables), ``--world-size`` gloo ranks, the benchmark
state of ``--size`` GB (bench/_harness.build_state: DDP stack + AdamW). Per round, interleaved
and rotated like compare.py:

- ``raw_put``: each rank uploads bytes of its shard's size with boto3's managed transfer
  (``upload_fileobj``, the same part size and concurrency dckpt uses), all ranks at once;
- ``dckpt_save``: ``CheckpointManager(CheckpointConfig(root="s3://...", async_save=False))
  .save(step)``: the DCP write into the local mirror with digests, every shard uploaded and
  re-hashed as it is sent, the manifest last; timed to the commit (the manifest's PUT);
- ``raw_put_one`` (for reference): the same bytes in one ``put_object`` (no multipart);
- ``raw_get_dcp_load``: what a user would do without dckpt: each rank downloads its share of
  the committed step's objects with boto3 into a local directory, then ``dcp.load`` of model
  and optimizer from it (nothing verified);
- ``raw_get``: each rank downloads its own shard object (``download_fileobj``, same settings);
- ``dckpt_load``: ``CheckpointManager(...).load()`` on a fresh mirror (``LOCAL_RANK`` set as
  torchrun would, so each rank fetches its share): every object hashed as it arrives, the
  layout and ``.metadata`` checked, the DCP load through the verifying reader;

and, once per round, the background save's cost to a training loop, for the local directory
and the s3:// root: ``--steps`` iterations of fixed matmul work (``compute``) + ``opt.step()``,
with one ``save()`` at the first, against the same loop without a save. Reported: dckpt's own
stall (``handle.stall_s``: inside ``save()`` plus the wait before the next optimizer step) and
the loop's loss (its wall time minus the no-save loop's), each the slowest rank's.

Figures: throughput = the checkpoint's bytes / seconds (slowest rank), medians over rounds;
ratios dckpt/raw in the same run. The targets (issue 13): save >= 0.8x raw put, verified load
>= 0.8x raw get, the s3:// stall no worse than the local directory's.
"""

from __future__ import annotations

import argparse
import functools
import io
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

METHODS = ("raw_put", "dckpt_save", "raw_get", "dckpt_load", "raw_put_one", "raw_get_dcp_load")


def _save_now(mgr: Any) -> None:
    mgr.save(2).result()


def _rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    import dckpt
    from dckpt.tiers.s3_store import S3Store
    from dckpt.tiers.url import parse_url

    ranks = h.Ranks(cfg["settle_s"])
    rank, world = ranks.rank, ranks.world_size
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)
    model, opt, _ = h.build_state(cfg["size"])
    state = dckpt.TrainState(model, opt)
    base = Path(cfg["base_dir"])
    bucket = cfg["bucket"]
    store = S3Store(parse_url(f"s3://{bucket}/x"))  # the settings dckpt uses, for the raw client
    transfer = TransferConfig(
        multipart_threshold=store.part_bytes,
        multipart_chunksize=store.part_bytes,
        max_concurrency=store.concurrency,
    )
    client = boto3.client("s3")
    logging.getLogger("dckpt").setLevel(logging.WARNING)  # one line per save is noise here

    # One warm-up save, untimed: the shard sizes, and every pool and buffer made once.
    warm = f"s3://{bucket}/warm"
    with dckpt.CheckpointManager(
        dckpt.CheckpointConfig(root=warm, mirror=base / "warm", async_save=False, lock=False),
        state,
    ) as mgr:
        saved = mgr.save(1).result()
    share = ranks.gather(saved.bytes)[0] // world  # the checkpoint's bytes per rank
    payload = os.urandom(share)
    ranks.prefault = int(share * h.PREFAULT_FACTOR)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    loops: dict[str, list[dict[str, float]]] = {"none": [], "local": [], "s3": []}

    for rnd in range(cfg["repeats"]):
        tag = f"r{rnd}"
        key = f"raw/{tag}/{rank}"
        # Untimed: what the reads of this round read (the raw object, a committed step).
        client.upload_fileobj(io.BytesIO(payload), bucket, f"{key}-get", Config=transfer)
        load_root = f"s3://{bucket}/{tag}-load"
        conf = dckpt.CheckpointConfig(
            root=load_root, mirror=base / f"prep-{rank}", async_save=False, lock=False
        )
        with dckpt.CheckpointManager(conf, state) as mgr:
            mgr.save(2).result()
        for method in h.round_order(METHODS, rnd):
            if method == "raw_put":
                put = functools.partial(
                    client.upload_fileobj, io.BytesIO(payload), bucket, key, Config=transfer
                )
                times[method].append(ranks.timed(put))
            elif method == "raw_put_one":  # for reference: one PUT, no multipart
                one = functools.partial(client.put_object, Bucket=bucket, Key=key, Body=payload)
                times[method].append(ranks.timed(one))
            elif method == "raw_get":
                get = functools.partial(
                    client.download_fileobj, bucket, f"{key}-get", io.BytesIO(), Config=transfer
                )
                times[method].append(ranks.timed(get))
            elif method == "dckpt_save":
                conf = dckpt.CheckpointConfig(
                    root=f"s3://{bucket}/{tag}-save",
                    mirror=base / f"save-{rank}",
                    async_save=False,
                    lock=False,
                )
                with dckpt.CheckpointManager(conf, state) as mgr:
                    times[method].append(ranks.timed(functools.partial(_save_now, mgr)))
            elif method == "raw_get_dcp_load":  # what a user would do without dckpt
                into = base / f"rawload-{tag}"
                ranks.on_rank0(functools.partial(into.mkdir, parents=True, exist_ok=True))
                job = functools.partial(
                    h.raw_get_then_dcp_load, client, bucket, f"{tag}-load", into, state, transfer
                )
                times[method].append(ranks.timed(job))
                ranks.cleanup(into)
            else:  # dckpt_load, into a mirror that holds nothing yet
                fresh = base / f"load-{tag}"
                conf = dckpt.CheckpointConfig(root=load_root, mirror=fresh, lock=False)
                with dckpt.CheckpointManager(conf, state) as mgr:
                    times[method].append(ranks.timed(mgr.load))
                ranks.cleanup(fresh)
        # The background save's cost to a training loop: none, local directory, s3:// root.
        for number, kind in enumerate(h.round_order(("none", "local", "s3"), rnd)):
            where = str(base / f"local-{tag}") if kind != "s3" else f"s3://{bucket}/bg-{tag}"
            conf = dckpt.CheckpointConfig(
                root=where, mirror=None if kind != "s3" else base / f"bg-{rank}", lock=False
            )
            with dckpt.CheckpointManager(conf, state) as mgr:
                ranks.prepare()
                step = None if kind == "none" else 1000 * (rnd + 1) + number
                got = h.save_loop(mgr, opt, cfg["steps"], cfg["matmul"], step)
            worst = max(ranks.gather(got["loop_s"])), max(ranks.gather(got["stall_s"]))
            loops[kind].append({"loop_s": worst[0], "stall_s": worst[1]})
            if kind != "s3":
                ranks.cleanup(Path(where))
    return {"share_bytes": share, "bytes": saved.bytes, "times": times, "loops": loops}


def summarize(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    total = raw["bytes"]
    gbps = {m: total / h.median(ts) / h.GB for m, ts in raw["times"].items()}
    loops = raw["loops"]
    base, cost = h.loop_costs(loops, ("local", "s3"))
    return {
        **h.run_header(args.name, args.torch_threads),
        "server": args.endpoint or "moto (python -m moto.server) on 127.0.0.1",
        "bytes": total,
        "world_size": args.world_size,
        "rounds": args.repeats,
        "seconds": raw["times"],
        "gb_per_s": {m: round(v, 4) for m, v in gbps.items()},
        "ratios": {
            "save_vs_raw_put": round(gbps["dckpt_save"] / gbps["raw_put"], 3),
            "verified_load_vs_raw_get": round(gbps["dckpt_load"] / gbps["raw_get"], 3),
            "verified_load_vs_raw_get_then_dcp_load": round(
                gbps["dckpt_load"] / gbps["raw_get_dcp_load"], 3
            ),
            "stall_s3_vs_local": round(
                cost["s3"]["stall_s"] / max(cost["local"]["stall_s"], 1e-9), 3
            ),
        },
        **h.loop_record(base, cost, loops),
    }


def render(doc: dict[str, Any]) -> str:
    r, g, c = doc["ratios"], doc["gb_per_s"], doc["background_save_cost"]
    lines = [
        f"# s3:// root: dckpt against the raw client ({doc['date']})",
        "",
        f"`{doc['command']}`; {doc['server']}; {doc['bytes'] / 1e9:.2f} GB checkpoint, "
        f"{doc['world_size']} ranks, {doc['rounds']} rounds, medians.",
        "",
        "| figure | dckpt | raw client | ratio | target |",
        "|---|---:|---:|---:|---|",
        f"| save (to the manifest's PUT) | {g['dckpt_save']:.3f} GB/s | {g['raw_put']:.3f} GB/s"
        f" | {r['save_vs_raw_put']:.2f}x | >= 0.8x |",
        f"| verified load | {g['dckpt_load']:.3f} GB/s | {g['raw_get']:.3f} GB/s"
        f" | {r['verified_load_vs_raw_get']:.2f}x | >= 0.8x |",
        f"| verified load vs raw get + `dcp.load` | {g['dckpt_load']:.3f} GB/s | "
        f"{g['raw_get_dcp_load']:.3f} GB/s | {r['verified_load_vs_raw_get_then_dcp_load']:.2f}x"
        " | (what a user does without dckpt: no digest) |",
        "",
        f"For reference, the raw client's single PUT (no multipart) of the same bytes: "
        f"{g['raw_put_one']:.3f} GB/s. Both save rows use multipart uploads of the same part "
        "size and concurrency; moto assembles a multipart object by copying its parts in "
        "Python at CompleteMultipartUpload, a cost both pay and AWS does not.",
        "",
        "| background save, one per loop | dckpt stall | loop's loss (vs no save) |",
        "|---|---:|---:|",
        f"| local directory | {c['local']['stall_s']:.3f} s | {c['local']['loop_loss_s']:.3f} s |",
        f"| s3:// root | {c['s3']['stall_s']:.3f} s | {c['s3']['loop_loss_s']:.3f} s |",
        "",
        f"stall s3/local: {r['stall_s3_vs_local']:.2f}x (target: no worse). The loop's loss "
        "counts every cost of the background save to the loop (CPU taken by the write, the "
        "upload and, here, the S3 server itself, which runs on the same 2 cores).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    h.add_loop_args(p)
    p.add_argument("--endpoint", default=None, help="an S3 endpoint (default: start moto)")
    p.add_argument("--bucket", default=None, help="an existing bucket (default: a new one)")
    h.add_common_args(p, "s3")
    args = p.parse_args(argv)
    server = None
    if args.endpoint is None:
        server, endpoint = h.start_moto()
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )
    else:
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    try:
        import boto3

        bucket = args.bucket or f"dckpt-bench-{uuid.uuid4().hex[:12]}"
        if args.bucket is None:
            boto3.client("s3").create_bucket(Bucket=bucket)
        with h.bench_run(args.dir) as run:
            cfg = h.loop_config(args, run.base_dir, bucket=bucket)
            raw = h.spawn(args.world_size, args.torch_threads, _rank_main, cfg)
        doc = summarize(raw, args)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
    h.publish(args.name, doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
