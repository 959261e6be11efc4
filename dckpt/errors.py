"""Exceptions a dckpt user can catch, each saying what happened and what to do next.

Every error carries enough context (path, step, rank) to act on without reading a traceback.
`IntegrityError` and `ManifestError` mean "these bytes must not be loaded"; the CLI maps them to
exit code 3. `CheckpointNotFoundError` maps to exit code 2.
"""

from __future__ import annotations

import errno
import os
import shutil

from .units import human_bytes

__all__ = [
    "MEDIA_ERRNOS",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigMismatchError",
    "ForeignStepError",
    "IncompatibleCheckpointError",
    "IntegrityError",
    "LockError",
    "LossDeviationError",
    "ManifestError",
    "SaveError",
    "StateMismatchError",
    "StorageError",
    "UnloadableItemError",
    "UnreadableError",
    "WorldError",
    "add_note",
    "describe_os_error",
    "read_failed",
    "unwrap_dcp_error",
    "with_rank",
]


class CheckpointError(RuntimeError):
    """Base class of every error dckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError):
    """The root or the requested step does not exist, or holds no committed checkpoint."""


class ForeignStepError(CheckpointNotFoundError):
    """A committed step this job cannot prove its own: its directory or one of its files
    belongs to another user, or, with a key (``CheckpointConfig.key_file``), its manifest is
    unsigned or signed with another key. A resume passes it over and names it; it is never
    quarantined, deleted or retained away (it is not the job's to move)."""


class ManifestError(CheckpointError):
    """A manifest is missing, unreadable, of an unknown schema, or describes unsafe paths."""


class IntegrityError(CheckpointError):
    """A file's bytes do not match the digest or size its manifest recorded.

    ``divergent`` marks the case where the ranks read different bytes for one checkpoint (a
    manifest, a file's digest, or a file one rank has and another lacks): they do not share
    one root, or the storage served them different data. The checkpoint is not known to be
    damaged, so a resume neither quarantines it nor falls back past it (that would quietly
    pick one rank's view).
    """

    def __init__(
        self,
        path: str,
        expected: str,
        actual: str,
        detail: str = "",
        divergent: bool = False,
        note: str = "",
    ) -> None:
        self.path = path
        self.expected = expected
        self.actual = actual
        self.detail = detail or "digest mismatch"
        self.divergent = divergent
        self.note = note
        """What the failed load left behind, said after the advice (a state it filled)."""
        advice = (
            "The ranks do not see the same checkpoint: every rank must read one shared "
            "directory (not a disk of its own per node), with the same contents. Nothing was "
            "loaded from it and nothing was quarantined; fix the storage and start again."
            if divergent
            else "The file is damaged or was changed after commit; do not load it. Resume "
            "from an older checkpoint (dckpt ls) or re-save, and check the storage for bit rot."
        )
        text = f"{self.detail} in {path}: expected {expected}, got {actual}. {advice}"
        super().__init__(f"{text} {note}" if note else text)

    def __reduce__(self) -> tuple[type[IntegrityError], tuple[str, str, str, str, bool, str]]:
        # Errors cross ranks pickled (DCP gathers failures); keep the fields intact.
        fields = (self.path, self.expected, self.actual, self.detail, self.divergent, self.note)
        return (IntegrityError, fields)


class SaveError(CheckpointError):
    """A save failed on some rank; nothing was committed and older checkpoints are intact."""

    agreed = True
    """Every rank reached this outcome together (False: this rank's own words for a
    collective that failed, so dckpt's group is lost and the outcome is not shared)."""


class ConfigMismatchError(CheckpointError):
    """The run's config differs from the checkpoint's in a key that changes the training math."""


class LossDeviationError(CheckpointError):
    """After a resume, the loss left the band recorded at save time, or the replay differed
    from the run that stopped (``loss_watch="raise"``)."""

    kind = ""
    """The verdict that raised it, where known: ``"loss_watch"`` or ``"replay"``
    (dckpt.root.resume_record's kinds); an instance's own travels with it to other ranks."""


class WorldError(CheckpointError):
    """The process group could not be formed, or a rank did not answer the warmup collective."""


class StateMismatchError(CheckpointError):
    """The objects being restored do not fit the checkpoint (a tensor's shape or dtype, or a
    whole category of state): the model or setup changed, the checkpoint is not damaged."""


class LockError(CheckpointError):
    """Another live job holds the checkpoint root."""


class StorageError(CheckpointError):
    """The storage failed to serve a file (EIO, EMFILE, ESTALE, EACCES ...): the checkpoint
    is not known to be damaged, so it is never quarantined for this; retry or fix the storage."""

    path = ""
    """The file a read failed on, where one did (``read_failed``)."""
    media = False
    """The storage said the bytes are gone (EIO, EBADMSG, EUCLEAN: a sector, a checksum of
    the file system), not that it is busy or forbidden: a resume reads such a file once more,
    afresh, before it counts (``UnreadableError``)."""


class UnreadableError(StorageError):
    """The same file of a step failed to read twice, the second time afresh, with a media
    error: the storage cannot serve it (a lost sector, a file system's checksum). Proof of
    damage for this start: a resume with fallback sets the step aside, with the command that
    restores it, and resumes the step before (dckpt.load.resumer)."""


MEDIA_ERRNOS = frozenset(
    e for e in (errno.EIO, errno.EBADMSG, getattr(errno, "EUCLEAN", None)) if e is not None
)
"""What a storage answers for bytes it cannot return (not: busy, forbidden, gone stale)."""


def read_failed(message: str, path: str, exc: OSError) -> StorageError:
    """A StorageError for a read of ``path`` that failed with ``exc``, carrying the path and
    whether the bytes are gone (``StorageError.media``)."""
    error = StorageError(message)
    error.path, error.media = path, exc.errno in MEDIA_ERRNOS
    return error


class IncompatibleCheckpointError(ManifestError):
    """The checkpoint was written by a newer dckpt (a newer ``schema_version``), or by another
    torch release whose DCP ``.metadata`` this torch cannot read (torch 2.15's, say, on 2.13):
    upgrade dckpt or torch to read it, or load an older step explicitly. Not damage: a resume
    stops with it (no quarantine, no fallback past it)."""


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc``: shown under its traceback (Python 3.11+ ``add_note``); on
    3.10, where tracebacks show no notes, appended to a one-argument message instead."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    elif len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} {note}",)


def unwrap_dcp_error(exc: BaseException) -> BaseException:
    """The first dckpt error inside DCP's CheckpointException (which wraps every rank's), if
    any; otherwise ``exc`` itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        inner_errors = [(rank, inner) for rank, (inner, _trace) in sorted(exc.failures.items())]
        for kind in (CheckpointError, OSError):
            for rank, inner in inner_errors:
                if isinstance(inner, StorageError):
                    return with_rank(inner, rank)
                if isinstance(inner, kind):
                    return inner
    return exc


def with_rank(exc: StorageError, rank: int) -> StorageError:
    """``exc`` naming the rank it happened on (every rank raises it: it must say whose); of
    the same kind, with the same path."""
    text = str(exc)
    if text.startswith("rank "):
        return exc
    named = type(exc)(f"rank {rank}: {text}")
    named.path, named.media = exc.path, exc.media
    return named


def describe_os_error(exc: BaseException, root: str | os.PathLike[str]) -> str:
    """``exc`` in words a user can act on: a full disk or a read-only root says so, with the
    free space left on ``root``'s file system."""
    if not isinstance(exc, OSError):
        return repr(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = human_bytes(shutil.disk_usage(root).free)
        except OSError:
            free = "unknown"
        return (
            f"no space left on the device of {root} ({free} free now; {exc.strerror}): free "
            "space, lower keep_last, or save to a larger volume"
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{root} is not writable ({exc.strerror}: {exc.filename or root})"
    return repr(exc)


class UnloadableItemError(IntegrityError):
    """A tensor item whose bytes matched every digest does not load as the tensor its
    metadata records (a weights-only refusal, a storage larger than the bytes that hold it,
    no tensor, another shape or dtype). No save of a tensor writes such an item, so the step
    was sealed with it (a broken writer, or a step re-sealed by someone who can write the
    root): the same bytes fail the same way on every read and every rank, which is the proof
    of damage. Never ``divergent``: a resume with fallback quarantines the step and resumes
    the one before (dckpt.load.resumer). Raised by dckpt.storage.verifying_reader, with
    ``detail`` naming the step and the item, ``expected`` the tensor the metadata records,
    ``actual`` what failed."""

    def __init__(
        self,
        path: str,
        expected: str,
        actual: str,
        detail: str = "",
        divergent: bool = False,
        note: str = "",
    ) -> None:
        del divergent  # the signature of IntegrityError (pickling); never divergent
        super().__init__(
            path, expected, actual, detail or "an item that does not load", False, note
        )
        text = (
            f"{self.detail} of {path} does not load: it should hold {expected}, as its metadata "
            f"records; {actual}. Its bytes match the digests the manifest records, so the step "
            "was sealed with this item, which no save of a tensor writes (a broken writer, or "
            "the step re-sealed by someone who can write the root). The step is damaged: do "
            "not load it; resume() (with fallback, the default) moves it to quarantine/ and "
            "resumes the step before. Any value this load already put in the state is from "
            "this step: load another checkpoint into it before training."
        )
        self.args = (f"{text} {note}" if note else text,)

    def __reduce__(self) -> tuple[type[IntegrityError], tuple[str, str, str, str, bool, str]]:
        # Crosses ranks pickled (DCP gathers failures): the rank that reads it gets this kind.
        fields = (self.path, self.expected, self.actual, self.detail, False, self.note)
        return (UnloadableItemError, fields)
