"""Read what a checkpoint says about itself before building anything: its run config, step,
precision, loss and size, from ``manifest.json`` alone.

For the scripts that come before (or instead of) a ``CheckpointManager``: one that builds the
model from the arguments a run saved, a sampling or evaluation script that wants the step and
the config of the weights it loads::

    config = dckpt.read_config("runs/ckpt")           # the newest committed checkpoint's
    model = GPT(width=config["d_model"], layers=config["layers"])
    info = dckpt.peek("runs/ckpt", step=1200)          # CheckpointInfo: step, loss, bytes ...

Invariants:
- Only ``manifest.json`` is read, through ``read_manifest``: it is validated (schema, safe
  paths, bounds) and its self-digest checked, so a damaged manifest raises ``ManifestError``
  or ``IntegrityError`` (unchanged, never a guess from an older step). The shard files are
  neither opened nor hashed: that is ``dckpt verify``'s job, and every load does it anyway.
- "Newest" is the newest committed step directory, found the way a resume finds it (a scan,
  not the ``latest`` file), and a manifest whose step is not its directory's is refused.
- No torch, here or in anything it imports (a test enforces it): these answer in
  milliseconds, before the training stack is imported at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, ManifestError, StorageError
from .manifest import Manifest
from .protocol import Root

__all__ = ["CheckpointInfo", "info", "peek", "peek_root", "read_config", "steps_text"]

# How many committed steps an error names: enough to spot a typo, short enough to read.
_SHOWN_STEPS = 8


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """One committed checkpoint, as its manifest describes it (see ``peek``).

    ``bytes`` and ``files`` are what the manifest lists (shards and DCP's ``.metadata``; the
    manifest itself is not counted). ``state`` names the saved categories (``model``,
    ``optimizer``, ``scheduler``, ``data``, ``progress``, ``rng`` ...).
    """

    step: int
    epoch: int
    path: Path | str
    """The step's directory, or its URL in an object store."""
    world_size: int
    config: dict[str, Any]
    precision: dict[str, Any]
    loss: dict[str, Any]
    metric: dict[str, Any]
    created_at: float
    bytes: int
    files: int
    state: tuple[str, ...]
    milestone: bool
    run_id: str
    versions: dict[str, str]


def read_config(root: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """The run config saved with the newest committed checkpoint under ``root`` (or ``step``).

    It is the ``run_config`` the training run gave its ``CheckpointManager``, as JSON gave it
    back (tuples are lists). Reads and validates ``manifest.json`` only; the shards are not
    hashed (``dckpt verify ROOT`` does that). Raises ``CheckpointNotFoundError`` when there is
    no such committed checkpoint, ``ManifestError``/``IntegrityError`` when its manifest is
    damaged.
    """
    return peek(root, step).config


def peek(root: str | os.PathLike[str], step: int | None = None) -> CheckpointInfo:
    """What the newest committed checkpoint under the directory ``root`` (or ``step``)
    records about itself.

    Reads and validates ``manifest.json`` only (schema, self-digest, safe paths); the shards
    are not hashed, so a checkpoint that peeks fine can still fail ``dckpt verify ROOT`` and a
    load. Raises ``CheckpointNotFoundError`` when ``root`` does not exist or holds no committed
    checkpoint (for that ``step``), ``ManifestError``/``IntegrityError`` when the manifest is
    damaged (no fallback to an older step: pass an older ``step`` to read that one).
    ``dckpt.peek`` (dckpt.tiers.peek) takes an s3:// URL too.
    """
    from .directory import DirectoryRoot

    return peek_root(DirectoryRoot(root), step)


def peek_root(root: Root, step: int | None = None) -> CheckpointInfo:
    """``peek`` over any kind of root (dckpt.root.protocol); ``path`` is ``root.where``."""
    try:
        committed = root.committed_steps()
    except (FileNotFoundError, NotADirectoryError):
        try:
            root.expect_checkpoints()
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"checkpoint root {exc} (`dckpt ls ROOT` lists what a root holds)"
            ) from None
        raise
    except OSError as exc:
        raise StorageError(f"cannot list {root}: {exc}; the storage failed, retry") from exc
    if not committed:
        raise CheckpointNotFoundError(
            f"no committed checkpoint under {root} (a run that saved nothing yet, or the wrong "
            f"directory); see `dckpt ls {root}`"
        )
    if step is not None and step not in committed:
        raise CheckpointNotFoundError(
            f"no committed checkpoint for step {step} under {root} (committed: "
            f"{steps_text(committed)}); see `dckpt ls {root}`"
        )
    chosen = committed[-1] if step is None else step
    manifest = root.read_manifest(chosen)
    where = root.where(chosen)
    if manifest.step != chosen:
        # A manifest copied or renamed into another step's directory: its config is not
        # that step's, and a resume refuses it for the same reason.
        raise ManifestError(
            f"{where}/manifest.json says step {manifest.step}, its directory says {chosen}; "
            f"the checkpoint cannot be trusted (see `dckpt verify {root}`)"
        )
    return info(where, manifest)


def info(step_dir: Path | str, manifest: Manifest) -> CheckpointInfo:
    """The ``CheckpointInfo`` of a validated manifest found at ``step_dir``."""
    # Every call reads the manifest afresh, so the dicts are the caller's own to edit.
    return CheckpointInfo(
        step=manifest.step,
        epoch=manifest.epoch,
        path=step_dir,
        world_size=manifest.world_size,
        config=manifest.config,
        precision=manifest.precision,
        loss=manifest.loss,
        metric=manifest.metric,
        created_at=manifest.created_at,
        bytes=manifest.total_bytes,
        files=len(manifest.files),
        state=manifest.state,
        milestone=manifest.milestone,
        run_id=manifest.run_id,
        versions=manifest.versions,
    )


def steps_text(steps: list[int]) -> str:
    if len(steps) <= _SHOWN_STEPS:
        return ", ".join(map(str, steps))
    half = _SHOWN_STEPS // 2
    shown = [*map(str, steps[:half]), "...", *map(str, steps[-half:])]
    return f"{', '.join(shown)}; {len(steps)} in all"
