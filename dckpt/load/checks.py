"""The checks of a load and a resume, each done once, in the order the resumer runs them.

Each check either passes (adding its line to the candidate's report) or raises the error that
says what is wrong and what to do. The checks that compare ranks run collectives on dckpt's
control group (``Comm``); the rest are local. The resume protocol that orders them is stated in
``dckpt.load.resumer``.

Error kinds decide what a resume does next: ``IntegrityError``/``ManifestError`` are damage
(quarantine, fall back to an older checkpoint) unless ``divergent`` (ranks see different
checkpoints: refused, never fallen back past); ``ConfigMismatchError``/``StateMismatchError``
are a different run or model (refused, the checkpoint is fine). ``IncompatibleCheckpointError``
(a newer format, or a ``.metadata`` another torch release wrote that this one cannot read) is
not damage either: refused, never quarantined, never fallen back past (a fallback would train
on from an older step and, saving again, replace the newer work under the same step numbers).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..collective.comm import Comm, Failed
from ..errors import (
    CheckpointError,
    ConfigMismatchError,
    IncompatibleCheckpointError,
    IntegrityError,
    ManifestError,
    StateMismatchError,
    StorageError,
    add_note,
    with_rank,
)
from ..faults import fault_point
from ..phases import Phase
from ..root.layout import read_small_file
from ..root.manifest import (
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    SCHEMA_VERSION,
    Manifest,
    check_layout,
    read_manifest,
)
from ..root.provenance import FileClaim, Provenance
from ..root.source import Fetched, Fetcher
from ..storage.safe_unpickle import public_version, torch_release
from ..storage.verified_files import open_verified
from ..storage.verifying_reader import READ_THREADS, VerifyingReader
from ..train.precision import PrecisionPolicy, check_scaler
from ..train.state import DATA_ORDER, TrainState
from ..units import plural
from ..version import __version__
from .config_check import ConfigPolicy
from .report import CandidateReport

__all__ = [
    "CandidateChecks",
    "agree_on_manifest",
    "check_config_and_precision",
    "check_grad_scaler",
    "check_shapes",
    "check_state_kinds",
    "check_versions",
    "raise_first",
    "read_candidate",
    "resolve_per_rank",
    "verify_rest",
]


class CandidateChecks:
    """The checks every tier's candidate passes before any byte of it is loaded: whose it is
    (``provenance``, claimed by the tier's reader with the manifest), the config and
    precision (every rank judges; all raise the first refusal together), the kinds of state,
    the GradScaler record."""

    def __init__(
        self,
        *,
        comm: Comm,
        run_config: dict[str, Any],
        precision: PrecisionPolicy | None,
        policy: ConfigPolicy,
        state: TrainState,
        provenance: Provenance | None = None,
    ) -> None:
        self.comm = comm
        self.run_config = run_config
        self.precision = precision
        self.policy = policy
        self.state = state
        self.provenance = provenance or Provenance()
        """What the job takes as its own: its user's files, or what its key signs."""

    def run(self, manifest: Manifest, report: CandidateReport, *, with_config: bool) -> None:
        name = report.path.name
        if with_config:
            refused: CheckpointError | None = None
            try:
                check_config_and_precision(
                    manifest, self.run_config, self.precision, self.policy, name, report
                )
            except CheckpointError as exc:
                refused = exc
            raise_first(self.comm, refused)
        # A state built differently on one rank (a scheduler only rank 1 has) refuses on that
        # rank: every rank raises that refusal, where the others would otherwise wait for it
        # in the load's collectives and name it as gone.
        refused = None
        try:
            check_state_kinds(manifest, self.state, name, report)
            check_grad_scaler(manifest, self.state, name, report)
        except CheckpointError as exc:
            refused = exc
        raise_first(self.comm, refused)


def fetch_candidate(
    comm: Comm,
    fetcher: Fetcher,
    local: Path,
    step: int,
    report: CandidateReport | None,
    files: frozenset[str] | None = None,
) -> None:
    """Every rank brings its share of ``step`` into ``local``, where it is read (an object
    store's mirror); any rank's failure is raised on every rank.

    Each part (this rank's share, then what its mirror still lacks) ends in an agreement
    (``Comm.first_failure``) that every rank reaches whatever happened on its side: a
    download refused for good, retries spent, even an error nobody foresaw, so no rank
    waits at the next collective for one that gave up. Every rank then raises the same
    error, naming the rank that failed and (in the store's own message) the object. A
    damaged object is evidence of damage: raised as it is, so the resume falls back past
    the step; anything else (a ``StorageError``: the checkpoint is not known to be bad)
    refuses the resume on every rank.

    ``files``: only those (the files this rank's load reads).
    ``report`` None: nothing is reported (a first fetch of ``.metadata`` alone).
    """
    done: list[Fetched] = []
    for step_part in (fetcher.fetch, fetcher.complete):  # this rank's share, then any gaps
        failure: CheckpointError | None = None
        try:
            got = step_part(step, files)
            if got is not None:
                done.append(got)
        except CheckpointError as exc:
            failure = exc
        except OSError as exc:  # the local mirror: a full disk, no permission
            failure = StorageError(f"writing into the mirror {local}: {exc}")
        except Exception as exc:  # unforeseen: still every rank's error, not this rank's hang
            failure = CheckpointError(f"{type(exc).__name__}: {exc}")
        failed = comm.first_failure(failure)
        if failed is not None:
            raise _failed_fetch(failed, step, comm.rank)
    mine = "; then what this rank's mirror lacked: ".join(
        line for d in done if (line := d.line()) is not None
    )
    if report is None:
        return
    # Only rank 0's line is reported: two small collectives, whatever the world's size.
    first = comm.broadcast(mine or None)
    if comm.any(bool(mine)):
        report.check("fetch", True, f"rank 0: {first}" if comm.world_size > 1 else str(first))
    # A read damaged on the way is rare and worth a word whichever rank met it: only then
    # are the names gathered (to rank 0, whose report is printed).
    reread = sorted({name for d in done for name in d.reread})
    if comm.any(bool(reread)):
        told = comm.gather(reread)
        for rank, names in enumerate(told or []):
            if names:
                report.warn(
                    f"rank {rank} re-read {', '.join(names)}: the first download differed "
                    "from the writer's digest, a fresh read matched (damaged on the way, not "
                    "in the store; nothing quarantined)"
                )


def _failed_fetch(failed: Failed, step: int, rank: int) -> BaseException:
    """The one error every rank raises for a failed fetch. Damage (an object whose bytes
    are not its writer's) is raised as it is: its message names the object, and the resume
    quarantines the step by it, whichever rank read it. Any other error is made again with
    the failing rank in its text, of the same kind (a StorageError stays one)."""
    exc = failed.error
    if isinstance(exc, (IntegrityError, ManifestError)) or not isinstance(exc, CheckpointError):
        if rank != failed.rank:
            add_note(exc, f"(raised on rank {failed.rank})")
        return exc
    where = (
        f"rank {failed.rank}"
        if failed.count == 1
        else f"{failed.count} ranks, first on rank {failed.rank}"
    )
    text = f"fetching step {step} failed on {where} (every rank stopped): {exc}"
    try:
        made = type(exc)(text)
    except Exception:  # a kind whose constructor wants other arguments
        made = CheckpointError(text)
    return made


def read_candidate(
    comm: Comm,
    path: Path,
    step: int,
    report: CandidateReport,
    files: frozenset[str] | None = None,
    read_threads: int = READ_THREADS,
    provenance: Provenance | None = None,
) -> tuple[Manifest, VerifyingReader]:
    """The manifest (schema, safe paths, self-digest), the layout (regular files of the
    recorded sizes) and the verified ``.metadata``, on every rank; any rank's failure is
    raised on every rank.

    The layout is split: each rank stats its share of the files (``Manifest.share``: the
    files its rank wrote, in the same world), and one agreement says all shares passed, so a
    rank's cost does not grow with the world. A failure found there is one rank's view, so a
    second rank stats that share before it counts as damage (``_raise_witnessed``). With
    ``files`` (the few this node holds before the load plan, for a source that brings only
    what a rank reads) every rank checks those, with the manifest, as each node holds its
    own copies.

    Before any of it is read, the step is claimed as the job's (``provenance``, default: its
    files must be the job's user's): another user's step, or with a key one it does not sign,
    is a ``ForeignStepError`` on every rank, passed over, never quarantined.
    """
    manifest: Manifest | None = None
    failure: CheckpointError | None = None
    manifest_path = path / MANIFEST_FILE
    laid_out = 0
    claim = provenance or Provenance()
    owned: FileClaim | None = None
    try:
        manifest = read_manifest(path)
        owned = claim.files(step, path, claim.claim(path, manifest))
        if files is not None:
            laid_out = check_layout(path, manifest, only=files, owned=owned)
    except IncompatibleCheckpointError as exc:
        failure = _newer_format(path, step, exc)
    except CheckpointError as exc:
        failure = exc
    raise_first(comm, failure, manifest_path)
    assert manifest is not None
    if files is None:
        try:  # this rank's share; every rank learns whether all passed (one all-reduce)
            laid_out = check_layout(path, manifest, part=(comm.rank, comm.world_size), owned=owned)
        except CheckpointError as exc:
            failure = exc
        _raise_witnessed(comm, failure, path, manifest)
    reader: VerifyingReader | None = None
    try:
        # Given who wrote it: .metadata another torch release cannot read is incompatible.
        # A rank proves its share whole and, of other ranks' files, the items it reads (by
        # their item digests). A source that brings a node only what it reads (``files``)
        # has hashed each of those whole on arrival: the reader hashes them whole too.
        mine = (
            frozenset(f.path for f in manifest.share(comm.rank, comm.world_size))
            if files is None
            else None
        )
        reader = VerifyingReader(
            path, manifest.file_map(), versions=manifest.versions, owned=mine,
            read_threads=read_threads,
        )  # fmt: skip
        reader.load_metadata()
        if manifest.step != step:
            raise ManifestError(
                f"{path}/manifest.json says step {manifest.step}, its directory says {step}"
            )
    except CheckpointError as exc:
        failure = exc
    raise_first(comm, failure, manifest_path)
    assert reader is not None
    check_versions(manifest.versions, report)
    report.world_size_saved = manifest.world_size
    if files is None:  # every share passed the agreement above: every file is laid out
        total = len(manifest.files)
        laid = f"{total} of {plural(total, 'file')} laid out at their recorded sizes" + (
            f" (each of {comm.world_size} ranks checked its share)" if comm.world_size > 1 else ""
        )
        ok = True
    else:  # the others come to the node that reads them, each checked as it arrives
        laid = f"{plural(laid_out, 'file')} here before the load plan, at their sizes"
        ok = laid_out == len(files & set(manifest.file_map()))
    report.check("manifest", ok, f"schema {manifest.schema_version}, self-digest ok, {laid}")
    return manifest, reader


def check_versions(versions: Mapping[str, object], report: CandidateReport) -> None:
    """A checkpoint that another torch release wrote, and that this one read: a warning in
    the report (kernels may round differently, so the resumed run may not be bit-exact with
    an uninterrupted one). Nothing when the release is the same: a local build tag
    (``+cpu``, ``+cu130``) is the same release."""
    theirs, ours = versions.get("torch"), str(torch.__version__)
    if not isinstance(theirs, str) or public_version(theirs) == public_version(ours):
        return
    wrote, runs = torch_release(theirs), torch_release(ours)
    which = "another"
    if wrote is not None and runs is not None and wrote != runs:
        which = "an older" if wrote < runs else "a newer"
    report.warn(
        f"written by torch {theirs}, read by torch {ours} ({which} release; its metadata "
        "read and checked fine): numerics may differ from an uninterrupted run on the torch "
        "that saved it"
    )


def _newer_format(
    path: Path, step: int, exc: IncompatibleCheckpointError
) -> IncompatibleCheckpointError:
    """The refusal of a manifest of a newer format (``root.manifest`` raised ``exc``), naming
    the versions that wrote it (read from the JSON as it is: it is not this format's) and
    the way out."""
    raw = read_small_file(path / MANIFEST_FILE, MAX_MANIFEST_BYTES)
    try:
        obj = json.loads(raw) if raw is not None else {}
    except (ValueError, RecursionError):
        obj = {}
    versions = obj.get("versions") if isinstance(obj, dict) else None
    if not isinstance(versions, dict):
        versions = {}
    dckpt, torch_ = versions.get("dckpt"), versions.get("torch")
    by = (
        f"dckpt {dckpt if isinstance(dckpt, str) else '(unrecorded)'} with torch "
        f"{torch_ if isinstance(torch_, str) else '(unrecorded)'}"
    )
    return IncompatibleCheckpointError(
        f"{exc}. Step {step} was written by {by}; this is dckpt {__version__} (format "
        f"{SCHEMA_VERSION}) with torch {torch.__version__}. Or load an older step "
        "explicitly (manager.load(step=N)); nothing was loaded from it and nothing was "
        "quarantined."
    )


def agree_on_manifest(comm: Comm, manifest: Manifest, path: Path, report: CandidateReport) -> None:
    """Every rank read the same manifest (its digest of digests), or all refuse, naming who
    differs: ranks that see different roots must never train on.

    One all-reduce of the digest's hash (``Comm.all_equal``) when they agree, whatever the
    world's size; only when they do not are the digests gathered to rank 0, which names the
    ranks that differ from its own, and its words are broadcast, so every rank raises the
    same error."""
    digest = manifest.files_digest
    agree = comm.all_equal(digest)
    if not agree:
        told = comm.gather(digest)
        words: tuple[str, str] | None = None
        if told is not None:
            odd = [r for r, d in enumerate(told) if d != told[0]]
            words = (told[0], ", ".join(f"rank {r}: {told[r]}" for r in odd[:_NAMED]))
            if len(odd) > _NAMED:
                words = (words[0], f"{words[1]} and {len(odd) - _NAMED} more ranks")
        expected, got = comm.broadcast(words) or ("", "")
        raise IntegrityError(
            str(path / MANIFEST_FILE),
            expected,
            got,
            detail="ranks read different manifests",
            divergent=True,
        )
    who = "the one rank" if comm.world_size == 1 else f"all {comm.world_size} ranks"
    report.check("one manifest", agree, f"{who} read {digest}")


_NAMED = 16
"""How many ranks an error that names ranks lists (then how many more): at thousands of
ranks, a list of every one is neither readable nor cheap to send."""


def _ranks(ranks: list[int]) -> str:
    if len(ranks) <= _NAMED:
        return str(ranks)
    return f"{ranks[:_NAMED]} and {len(ranks) - _NAMED} more"


def check_config_and_precision(
    manifest: Manifest,
    run_config: dict[str, Any],
    precision: PrecisionPolicy | None,
    policy: ConfigPolicy,
    name: str,
    report: CandidateReport,
) -> None:
    """The saved run config against this one (``ConfigPolicy``: refused changes raise, the
    rest are warned about, grouped by why they pass), then the precision policy."""
    judged = policy.check(manifest.config, run_config, name)
    report.config_changes = [c for c, _ in judged]
    for line in policy.describe(judged):
        report.warn(line)
    report.check(
        "config",
        all(v != "strict" for _, v in judged),
        "identical" if not judged else f"{len(judged)} change(s) passed (see warnings)",
    )
    saved_mode = manifest.precision.get("mode")
    if precision is None or saved_mode is None or saved_mode == precision.mode:
        return
    fresh_scaler = precision.mode == "fp16" and not manifest.precision.get("grad_scaler")
    if fresh_scaler and "precision" not in policy.allowed:
        raise ConfigMismatchError(
            f"{name} was saved under {saved_mode} without GradScaler state; resuming it "
            "under fp16 would start loss scaling from scratch. Resume with the saved "
            "precision, or pass allow_config_changes=['precision'] to accept that (e.g. "
            "a GPU without bf16)."
        )
    report.warn(
        f"precision changed from {saved_mode} to {precision.mode}: numerics differ "
        "from an uninterrupted run"
    )


def check_state_kinds(
    manifest: Manifest, state: TrainState, name: str, report: CandidateReport
) -> None:
    """The checkpoint holds every kind of state this run restores (model, optimizer, ...)."""
    saved = set(manifest.state)
    missing = [c for c in state.categories() if c not in saved]
    if missing:
        # a DataLoader as data= keeps its order in extra: the one extra a GlobalBatchSampler's
        # checkpoint lacks is that, and the words say which object differs
        loader_only = missing == ["extra"] and set(state.extra) == {DATA_ORDER}
        why = (
            _MISSING_WHY["data"]
            if loader_only
            else f"it was saved by a run set up differently ({_why_missing(missing)})"
        )
        raise StateMismatchError(
            f"{name} holds no {', '.join(missing)} state (it holds "
            f"{', '.join(manifest.state)}): {why}"
        )
    unused = sorted(saved - set(state.categories()) - {"rng"})
    if unused:
        report.warn(f"checkpoint state not restored (no such object now): {unused}")


def check_grad_scaler(
    manifest: Manifest, state: TrainState, name: str, report: CandidateReport
) -> None:
    """The GradScaler state as recorded at save time, checked before anything is loaded."""
    recorded = manifest.precision.get("scaler")
    if state.scaler is None or not isinstance(recorded, dict):
        return
    try:
        scale = float(recorded.get("scale", 1.0))
        concern = check_scaler({"scale": scale})
    except (TypeError, ValueError) as exc:
        raise StateMismatchError(f"{name}: {exc}") from None
    report.check("grad scaler", math.isfinite(scale) and scale > 0, f"scale {scale:g}")
    if concern:
        report.warn(concern)


def resolve_per_rank(
    state: TrainState,
    state_dict: dict[str, Any],
    saved_world: int,
    name: str,
    report: CandidateReport,
) -> None:
    """After a world-size change, per-rank values (``PerRank``) do not map to the new ranks:
    refuse, unless each was built with ``on_resize="fresh"`` (then it is left out of the load
    and keeps its current value, with a warning)."""
    per_rank = state.per_rank()
    if not per_rank:
        return
    refused = sorted(n for n, p in per_rank.items() if p.on_resize == "raise")
    if refused:
        raise StateMismatchError(
            f"{name} was saved by {saved_world} rank(s) and this run has a different number: "
            f"the per-rank value(s) {', '.join(refused)} (dckpt.PerRank) do not map to the new "
            f"ranks. Resume with {saved_world} ranks, or build them with "
            "PerRank(..., on_resize='fresh') to keep each rank's current value."
        )
    for key in per_rank:
        state_dict["extra"].pop(key, None)
    report.warn(
        f"per-rank value(s) {', '.join(sorted(per_rank))} not restored: saved by {saved_world} "
        "rank(s), now a different number; each rank keeps its current value "
        "(on_resize='fresh')"
    )


_MISSING_WHY = {
    "model": "the model has parts the run that saved it did not have (check the config)",
    "optimizer": "the optimizer has state or groups the run that saved it did not have "
    "(another optimizer, or other parameter groups: check the config)",
    "scheduler": "this run has a scheduler the run that saved it did not have",
    "scaler": "this run has a GradScaler the run that saved it did not have",
    "data": "the data object is another kind than the one the run that saved it passed (a "
    "DataLoader for a GlobalBatchSampler's checkpoint, or the reverse): pass the same kind "
    "as data=",
    "extra": "this run has an extra object (TrainState(extra=...)) the run that saved it did "
    "not have",
    "progress": "the progress counters are another dckpt's",
}
"""Why a category's keys are missing from a checkpoint, in words (``check_shapes``)."""


def _why_missing(parts: list[str]) -> str:
    return "; ".join(
        _MISSING_WHY.get(part, f"{part} holds parts the run that saved it did not have")
        for part in sorted(parts, key=_missing_order)
    )


def _missing_order(part: str) -> int:
    return [*_MISSING_WHY, part].index(part)


def check_shapes(state_dict: dict[str, Any], reader: VerifyingReader, name: str) -> None:
    """Every tensor to restore has the shape and dtype the checkpoint's metadata records,
    checked before any tensor is read. (The reader's own comparison per chunk only guards the
    copy against a file that disagrees with its metadata.)"""
    saved = reader.load_metadata().state_dict_metadata
    flat, _ = flatten_state_dict(state_dict)
    missing = sorted(k for k in flat if k not in saved)
    if missing:
        parts = sorted({k.split(".", 1)[0] for k in missing})
        raise StateMismatchError(
            f"{name} has no value for {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + f": {_why_missing(parts)}; the checkpoint is not damaged."
        )
    for fqn, value in flat.items():
        meta = saved.get(fqn)
        if not isinstance(value, torch.Tensor) or not isinstance(meta, TensorStorageMetadata):
            continue
        if tuple(meta.size) != tuple(value.shape) or meta.properties.dtype != value.dtype:
            # A dtype changed alone is most often a cast (``model.to(torch.bfloat16)``): say
            # so, and what the saving run did instead.
            hint = (
                f" Only the dtype differs: build the model in {meta.properties.dtype} as the "
                "run that saved it did (for lower-precision math use autocast, e.g. "
                "dckpt.PrecisionPolicy, with the weights left as they were saved)."
                if tuple(meta.size) == tuple(value.shape)
                else ""
            )
            raise StateMismatchError(
                f"tensor {fqn}: {name} holds {tuple(meta.size)} {meta.properties.dtype}, "
                f"the object being restored has {tuple(value.shape)} {value.dtype}. The "
                "model or optimizer is built differently from the run that saved it "
                "(check the config); the checkpoint is not damaged; nothing was loaded." + hint
            )


def verify_rest(
    comm: Comm,
    path: Path,
    manifest: Manifest,
    reader: VerifyingReader,
    elsewhere: Callable[[str], str] | None = None,
) -> tuple[int, int]:
    """Every file of the step hashed by some rank, and every digest a rank computed matched
    against the manifest the ranks agreed on; the same error on every rank otherwise.

    Each file is one rank's to prove: the one ``Manifest.share`` gives it to (the rank that
    wrote it, in the same world), which hashes it unless its load already did (``elsewhere``:
    hashed where it lives, for a source whose nodes hold only what they read). Each rank
    then checks everything it hashed, its load's files and its share, against the manifest,
    whose digest of digests every rank agreed on (``agree_on_manifest``): ranks that each
    match one agreed manifest agree with each other, and no rank receives another's list.
    Two agreements (``Comm.first_failure``: one int all-reduced when nothing failed): the
    hashing, whose failure is damage, then the check, whose failure (a rank that hashed
    other bytes than the manifest's, though its load let them through) is divergent.
    Returns the files hashed and matched, and the ranks that checked theirs."""
    records = manifest.file_map()
    mine = dict(reader.verified)
    share = manifest.share(comm.rank, comm.world_size)
    failure: CheckpointError | None = None
    for owned in share:
        if owned.path in mine:  # hashed and matched by this rank's own load
            continue
        try:  # hashes the whole file, keeps none of it; no symlink or FIFO is followed
            if elsewhere is not None:
                mine[owned.path] = elsewhere(owned.path)
                continue
            with open_verified(str(path / owned.path), owned) as f:
                mine[owned.path] = f.digest
            reader.hashed_bytes += owned.bytes
        except CheckpointError as exc:
            failure = failure or exc
    raise_first(comm, failure)
    if fault_point(Phase.VERIFY, comm.rank) and mine:  # act as a rank that read other bytes
        name = min(mine)
        mine[name] = mine[name][:-1] + ("0" if mine[name][-1] != "0" else "1")
    wrong: CheckpointError | None = None
    for name, digest in sorted(mine.items()):
        record = records.get(name)
        if record is None or digest != record.digest:
            wrong = IntegrityError(
                str(path / name),
                record.digest if record is not None else "a file the manifest lists",
                f"{digest} on rank {comm.rank}",
                detail=f"rank {comm.rank} hashed different bytes",
                divergent=True,
            )
            break
    unproven = [r.path for r in share if r.path not in mine]
    if wrong is None and unproven:  # its share is this rank's alone: nobody else hashes it
        wrong = IntegrityError(
            str(path / unproven[0]),
            "hashed by some rank",
            f"{len(unproven)} file(s) hashed by none (rank {comm.rank}'s share)",
            detail="file not verified",
        )
    raise_first(comm, wrong)
    return len(records), comm.world_size


def _raise_witnessed(
    comm: Comm, failure: CheckpointError | None, path: Path, manifest: Manifest
) -> None:
    """The layout agreement: a share's failure is one rank's view of the files, so before
    it counts as damage (and the resume quarantines the step) a second rank, the witness,
    stats the same share: rank 0, or rank 1 for rank 0's share. Both seeing it is damage,
    raised as it is; the witness finding the share laid out means the ranks do not see the
    same checkpoint (a node's stale view of a shared file system): a divergent error, never
    quarantined. The witness's stats, a broadcast and one all-reduce: only on failure."""
    failed = comm.first_failure(failure)
    if failed is None:
        return
    first = failed.error
    if isinstance(first, StorageError):  # the storage failed one rank: say which
        raise with_rank(first, failed.rank)
    if comm.world_size > 1 and isinstance(first, IntegrityError):
        witness = 1 if failed.rank == 0 else 0
        seen: str | None = None
        if comm.rank == witness:
            try:
                check_layout(path, manifest, part=(failed.rank, comm.world_size))
                seen = "laid out"
            except CheckpointError:
                seen = None  # the witness sees it too
        if comm.broadcast(seen, src=witness) is not None:
            raise IntegrityError(
                str(path),
                f"the same checkpoint on every rank (rank {witness} finds rank "
                f"{failed.rank}'s share of the files laid out at their recorded sizes)",
                f"rank {failed.rank}: {str(first).split('. ')[0]}",
                detail="ranks see different checkpoints",
                divergent=True,
            )
    if failed.rank != comm.rank:
        add_note(first, f"(raised on rank {failed.rank})")
    raise first


def raise_first(comm: Comm, failure: CheckpointError | None, what: Path | None = None) -> None:
    """All ranks raise the lowest failing rank's failure (so every rank names the same
    file); nothing when no rank failed. One int all-reduced when none did
    (``Comm.first_failure``), whatever the world's size.

    With ``what`` (the file every rank just read): when only some ranks failed with evidence
    of damage, the ranks do not see the same checkpoint, and they all raise a divergent
    ``IntegrityError`` naming both sides instead (never quarantined). Only then are the
    ranks' outcomes gathered, to rank 0, which words the error for all.
    """
    failed = comm.first_failure(failure)
    if failed is None:
        return
    first = failed.error
    if isinstance(first, StorageError):  # the storage failed one rank: say which
        raise with_rank(first, failed.rank)
    damage = (IntegrityError, ManifestError)
    if (
        what is not None
        and failed.count < comm.world_size
        and isinstance(first, damage)
        and not isinstance(first, IncompatibleCheckpointError)
    ):
        flags = comm.gather(failure is not None)
        words: tuple[str, str] | None = None
        if flags is not None:
            fine = [r for r, failed_here in enumerate(flags) if not failed_here]
            odd = [r for r, failed_here in enumerate(flags) if failed_here]
            words = (
                f"the same checkpoint on every rank (rank(s) {_ranks(fine)} read it)",
                f"rank(s) {_ranks(odd)}: {type(first).__name__}: {str(first).split('. ')[0]}",
            )
        expected, got = comm.broadcast(words) or ("", "")
        raise IntegrityError(
            str(what), expected, got, detail="ranks see different checkpoints", divergent=True
        )
    if failed.rank != comm.rank:
        add_note(first, f"(raised on rank {failed.rank})")
    raise first
