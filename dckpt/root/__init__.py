"""A checkpoint root on disk: names and discovery (``layout``), the manifest, the commit
strategy, upkeep (recovery, quarantine, deletes, pins, retention), the run lock, offline
verification.

Knows files and directories, never tensors: nothing here imports torch (a test enforces it),
so the CLI reads a root in a fraction of a second.
"""
