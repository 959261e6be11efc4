"""Where a checkpoint lives beyond a local directory: an object store (s3:// roots) and the
memory tier's torch-free parts.

Any root: ``roots`` (``open_root``: the one place a path or a URL becomes the ``Root`` of its
kind, dckpt.root.protocol) and ``url`` (``parse_root``: the one test of path vs URL; root
URLs and the local mirror, no dependencies).

Object store: ``s3_store`` (the S3 client: retries, multipart, digests while the bytes
move), ``object_root`` (``ObjectRoot``, the bucket's ``Root``: listing, reading, verifying
in place, deleting, pinning and quarantining checkpoints, recovery, and the locks, commit
strategy, source and ledger of a job on it), ``object_lock`` (the run lock as
a conditional put), ``object_commit`` (the manifest-last commit strategy), ``object_source``
(fetching a committed checkpoint into the local mirror, verified, for a load), ``object_ledger``
(the memory tier's ledger in a bucket), ``peek`` (a checkpoint's config for any root).

Memory tier: ``memory_layout`` (a node's private memory directory, its names and the partner
ring; ``Slots``, each rank's files mapped once) and ``memory_commit`` (``MemoryCommit``, the
commit strategy that puts a memory save's manifest into the root's ledger; ``Lineage``). Its
save route and its resume, which copy tensors and move bytes over dckpt's group, are
dckpt.save.memory and dckpt.load.memory.

No torch here, and boto3 is imported only when an s3:// root is used (``pip install dckpt[s3]``).
"""
