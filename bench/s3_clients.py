"""Which S3 client dckpt uses, by measurement: boto3 against s3fs, same bytes, same server.

Starts moto's S3 server on 127.0.0.1 (or uses ``--endpoint`` and the AWS variables), then puts
and gets ``--mb`` MiB of random bytes with each client, ``--repeats`` times interleaved, and
prints the best MB/s of each. s3fs is optional (``pip install s3fs``): without it only boto3's
figures are printed. The result chose boto3 for ``dckpt[s3]`` (README, "Dependencies").
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h


def _best(fn: Callable[[], object], mb: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return mb / best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--endpoint", default=None)
    args = p.parse_args(argv)
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        server, endpoint = h.start_moto()
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
        )
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        import boto3
        from boto3.s3.transfer import TransferConfig

        client = boto3.client("s3")
        bucket = f"clients-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        data = os.urandom(args.mb << 20)
        parts = TransferConfig(multipart_chunksize=32 << 20, multipart_threshold=32 << 20)
        rows = {
            "boto3 put_object": lambda: client.put_object(Bucket=bucket, Key="a", Body=data),
            # a new GET each call, not one body read twice
            "boto3 get_object": lambda: client.get_object(Bucket=bucket, Key="a")["Body"].read(),  # noqa: PLW0108
            "boto3 upload_fileobj (32 MiB parts)": lambda: client.upload_fileobj(
                io.BytesIO(data), bucket, "b", Config=parts
            ),
            "boto3 download_fileobj (32 MiB parts)": lambda: client.download_fileobj(
                bucket, "b", io.BytesIO(), Config=parts
            ),
        }
        try:
            import s3fs  # type: ignore[import-not-found, unused-ignore]

            fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
            rows["s3fs pipe"] = lambda: fs.pipe(f"{bucket}/c", data)
            rows["s3fs cat"] = lambda: fs.cat(f"{bucket}/c")
        except ImportError:
            print("s3fs is not installed: boto3 only (pip install s3fs to compare)")
        for name, fn in rows.items():
            print(f"{name:<40} {_best(fn, args.mb, args.repeats):7.0f} MB/s")
    finally:
        if server is not None:
            server.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
