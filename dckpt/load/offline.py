"""Reading a checkpoint's tensors without the model that wrote it (for ``dckpt diff/export``).

The state dict is rebuilt from DCP's metadata (full, unsharded shapes), optionally only the
keys under a prefix, and loaded through the verifying reader: every file read is checked
against the manifest first, and the metadata against the files before any tensor is
allocated from it (``VerifyingReader.load_metadata``). A failure raises the reader's own
error (``IntegrityError`` naming the file, ``ManifestError``), never DCP's wrapper.
Everything lands in this process's memory: meant for one process on one machine, for
inspection and export, not for resuming training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ..errors import CheckpointError, unwrap_dcp_error
from ..root.manifest import check_layout, read_manifest
from ..storage.verifying_reader import SafeLoadPlanner, VerifyingReader, open_verified

__all__ = ["load_flat"]


def load_flat(step_dir: Path, prefix: str = "") -> dict[str, Any]:
    """Every value under ``prefix`` (dotted fqn) in one checkpoint, verified, as a flat dict.
    With no prefix, every file the manifest lists is proven, those no value came from too."""
    manifest = read_manifest(step_dir)
    check_layout(step_dir, manifest)
    reader = VerifyingReader(step_dir, manifest.file_map(), versions=manifest.versions)
    state: dict[str, Any] = {}
    for fqn, meta in reader.load_metadata().state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        if isinstance(meta, TensorStorageMetadata):
            state[fqn] = torch.zeros(meta.size, dtype=meta.properties.dtype)  # never garbage
        else:
            state[fqn] = None  # a pickled value; DCP fills it in (weights_only)
    try:
        dcp_load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointException as exc:
        # DCP wraps what the reader raised (an IntegrityError naming the damaged file):
        # raise that, as a load does, not DCP's wrapper and its traceback text.
        inner = unwrap_dcp_error(exc)
        if inner is not exc:
            raise inner from None
        raise CheckpointError(f"loading {step_dir} failed: {exc}") from None
    if not prefix:  # everything was asked for: the files no value came from are proven too
        for record in manifest.files:  # (the item digests beside each data file, for one)
            if record.path not in reader.verified:
                open_verified(str(step_dir / record.path), record).close()
    return state
