"""Where a checkpoint lives beyond a local directory: an object store (s3:// roots).

Modules: ``url`` (parsing a root URL, no dependencies), ``s3_store`` (the S3 client: retries,
multipart, digests while the bytes move), ``object_root`` (listing, reading, deleting,
pinning and quarantining checkpoints in a bucket), ``object_lock`` (the run lock as a
conditional put), ``object_commit`` (the manifest-last commit strategy) and ``object_source``
(fetching a committed checkpoint into the local mirror, verified, for a load).

No torch here, and boto3 is imported only when an s3:// root is used (``pip install dckpt[s3]``).
"""
