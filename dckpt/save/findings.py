"""What a save found about the values it saved, and rank 0's verdict on all ranks' findings.

Each rank's ``Findings`` travel in its ``RankReport`` (the gather every save already runs);
rank 0 judges them before it commits (``judge``):

- **replicas**: for every value that DCP keeps one copy of because several ranks hold it
  under one name (a plain tensor, a non-tensor value), each holder's digest of its own copy.
  Copies that differ would be committed as one rank's, silently: a device with silent data
  corruption, or ranks that reuse a name for values that differ (expert parallelism). Two
  digests of one name are compared only when made the same way (``x``: xxh3 of the bytes,
  for host tensors and non-tensor values; ``g``: a fingerprint computed on the GPU): a name
  held on the host by one rank and on a GPU by another is not compared.
- **nonfinite**: each floating-point tensor this rank wrote that holds NaN or Inf.
- **capture** (dckpt.save.capture): each tensor this rank wrote whose bytes written differ
  from what was captured of it at ``save()`` (``mismatched``), how many matched
  (``compared``), and those whose written bytes were never seen (``uncompared``). A
  mismatch always refuses the save: the checkpoint would not be the training state, and it
  is the save's own copy that went wrong, so no setting lets it through.

Every digest is of the live state at ``save()`` (dckpt.save.value_checks), so the words tell
the two failures apart: replicas that differ are the model's (a device, a per-rank value), a
capture that differs is the save's (its staging copy).

The verdict refuses the save (every rank raises the same ``SaveError``, nothing committed) for
differing replicas unless ``replica_check`` is ``"warn"``, and for non-finite values unless
``allow_nonfinite``; what it lets through is recorded in the manifest's ``integrity`` field
(``replicas_differ``, ``nonfinite``), so ``dckpt ls`` shows it and retention keeps the newest
finite step beside a non-finite one. This module knows names and digests, not tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import ReplicaCheck

__all__ = ["Findings", "Verdict", "judge"]

_LISTED = 3
"""Values named in a message; beyond them only how many more."""


@dataclass(frozen=True)
class Findings:
    """One rank's findings for one save."""

    replicas: dict[str, str] = field(default_factory=dict)
    """Name (DCP's flattened key) → digest (``kind:hex``) of this rank's copy."""
    nonfinite: dict[str, str] = field(default_factory=dict)
    """Name → what it holds (``"3 NaN, 1 Inf of 4096 values"``), for tensors this rank wrote."""
    unchecked: tuple[str, ...] = ()
    """Tensors the checks could not read (sparse, quantized; no GPU memory left)."""
    compared: int = 0
    """Tensors this rank wrote whose written bytes matched their capture digest."""
    mismatched: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    """Name → (which copy: ``staged``, ``deferred``, ``mapped`` (the memory tier's file),
    ``live``; the digest captured at ``save()``; the digest of the bytes written), for each
    that differs."""
    uncompared: tuple[str, ...] = ()
    """Tensors this rank wrote whose written bytes the writer never saw (not compared)."""
    trainable: tuple[int, int] | None = None
    """(trainable tensors whose capture this rank compared with its previous save of the
    tier, how many of them changed); None: no previous save to compare with."""


@dataclass(frozen=True)
class Verdict:
    """Rank 0's judgement of one save's findings."""

    refusal: str | None
    """Why the save must not commit, or None."""
    marks: dict[str, Any]
    """What the manifest records of what was let through (empty: nothing)."""
    warnings: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()
    """Every rank's unchecked tensors (``rank r: name``), for one warning per run."""
    capture: dict[str, Any] = field(default_factory=dict)
    """What the manifest records of the capture check (``items``: compared on all ranks;
    ``uncompared``: how many could not be); empty when it was off."""
    uncompared: tuple[str, ...] = ()
    """Every rank's tensors whose written bytes were never seen (``rank r: name``)."""


def _differing(reports: Iterable[tuple[int, Findings]]) -> dict[str, dict[str, list[int]]]:
    """Each replicated name whose copies differ: digest → the ranks that hold it."""
    held: dict[str, dict[str, list[int]]] = {}
    for rank, found in reports:
        for name, digest in found.replicas.items():
            held.setdefault(name, {}).setdefault(digest, []).append(rank)
    differ: dict[str, dict[str, list[int]]] = {}
    for name, by_digest in held.items():
        kinds: dict[str, set[str]] = {}
        for digest in by_digest:
            kinds.setdefault(digest.split(":", 1)[0], set()).add(digest)
        if any(len(same_kind) > 1 for same_kind in kinds.values()):
            differ[name] = by_digest
    return dict(sorted(differ.items()))


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return f"[{shown}{', …' if len(ranks) > 8 else ''}]"


def _describe_replicas(differ: Mapping[str, dict[str, list[int]]]) -> str:
    parts = []
    for name, by_digest in list(differ.items())[:_LISTED]:
        # the majority first: the odd rank out is what a user looks for
        told = sorted(by_digest.items(), key=lambda kv: (-len(kv[1]), kv[1]))
        holders = "; ".join(f"ranks {_ranks(r)} hold {d}" for d, r in told)
        parts.append(f"{name} ({holders})")
    more = len(differ) - _LISTED
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _describe_nonfinite(found: Mapping[str, tuple[int, str]]) -> str:
    listed = list(found.items())[:_LISTED]
    parts = [f"{name} on rank {rank}: {what}" for name, (rank, what) in listed]
    more = len(found) - _LISTED
    return "; ".join(parts) + (f"; and {more} more tensor(s)" if more > 0 else "")


_COPIES = {
    "staged": "the staged copy of {name} on rank {rank} is not the state at save()",
    "deferred": (
        "{name} on rank {rank} changed between save() and its deferred copy "
        "(overlap_staging=True): the copy is not the state at save()"
    ),
    "mapped": "the memory file's copy of {name} on rank {rank} is not the state at save()",
    "live": (
        "the bytes written for {name} on rank {rank} are not the state at save() (the "
        "tensor changed while the synchronous save wrote it)"
    ),
}
"""How a mismatch is said, by which copy differed."""
_CAPTURE_HINT = {
    "deferred": (
        "something wrote the tensor outside optimizer.step() before its copy was taken, "
        "through .data or another alias that version counters do not see: call "
        "manager.before_optimizer_step() before such a write, or keep overlap_staging=False"
    ),
    "live": "another thread changed the model during the save: save while nothing trains",
}


def _describe_capture(found: Mapping[str, tuple[int, tuple[str, str, str]]]) -> str:
    parts = []
    for name, (rank, (copy, captured, wrote)) in list(found.items())[:_LISTED]:
        said = _COPIES.get(copy, _COPIES["staged"]).format(name=name, rank=rank)
        parts.append(f"{said} (captured {captured} at save(), wrote {wrote})")
    more = len(found) - _LISTED
    return "; ".join(parts) + (f"; and {more} more tensor(s)" if more > 0 else "")


def _capture_refusal(found: Mapping[str, tuple[int, tuple[str, str, str]]]) -> str:
    copies = {copy for _, (copy, _, _) in found.values()}
    hint = "; ".join(_CAPTURE_HINT[c] for c in sorted(copies) if c in _CAPTURE_HINT)
    return (
        f"{_describe_capture(found)}. The checkpoint would hold something other than the "
        "training state, so it is refused: this is the save's own copy that went wrong (a "
        "staging buffer not refreshed, changed after its copy, or copied in part), not the "
        "model, and the previous checkpoints are intact. "
        + (f"Here: {hint}. " if hint else "")
        + "If it repeats, report it with this message; the next save copies afresh"
    )


def judge(
    reports: Iterable[tuple[int, Findings | None]],
    *,
    step: int,
    replica_check: ReplicaCheck,
    allow_nonfinite: bool,
    stepped: int = 0,
    capture_on: bool = False,
) -> Verdict:
    """The verdict on every rank's findings (rank, findings); see the module docstring.
    ``stepped``: optimizer steps since this tier's previous save (the progress note);
    ``capture_on``: the capture check ran (the manifest records it, even at 0 tensors)."""
    given = [(rank, f) for rank, f in reports if f is not None]
    differ = _differing(given) if replica_check != "off" else {}
    nonfinite: dict[str, tuple[int, str]] = {}
    for rank, found in sorted(given, key=lambda rf: rf[0]):
        for name, what in found.nonfinite.items():
            nonfinite.setdefault(name, (rank, what))
    nonfinite = dict(sorted(nonfinite.items()))
    refusals: list[str] = []
    warnings: list[str] = []
    marks: dict[str, Any] = {}
    mismatched: dict[str, tuple[int, tuple[str, str, str]]] = {}
    for rank, found in sorted(given, key=lambda rf: rf[0]):
        for name, copied in found.mismatched.items():
            mismatched.setdefault(name, (rank, copied))
    if mismatched:  # first: it is the save's fault, and it says so
        refusals.append(_capture_refusal(dict(sorted(mismatched.items()))))
    capture: dict[str, Any] = {}
    compared = sum(f.compared for _, f in given)
    uncompared = tuple(f"rank {rank}: {name}" for rank, f in given for name in f.uncompared)
    if capture_on or compared or uncompared:
        capture = {"items": compared, **({"uncompared": len(uncompared)} if uncompared else {})}
    moved = [f.trainable for _, f in given if f.trainable is not None]
    if stepped and moved and sum(n for n, _ in moved) and not sum(c for _, c in moved):
        warnings.append(
            f"dckpt: step {step}: the optimizer stepped {stepped} time(s) since the previous "
            f"save, but none of the {sum(n for n, _ in moved)} trainable tensor(s) changed "
            "(their values at save() are bit-identical to the previous save's). The optimizer "
            "may not be updating the model's parameters (a learning rate of 0, frozen layers "
            "or an optimizer built over other tensors than the model's); the step is saved "
            "as it is"
        )
    if differ:
        said = _describe_replicas(differ)
        if replica_check == "error":
            refusals.append(
                f"the ranks' copies of {len(differ)} replicated value(s) differ: {said}. The "
                "digests were taken from each rank's live state at save(), so the ranks' "
                "training state itself differs (not the save's copy of it). DCP "
                "keeps one copy of a value that several ranks hold under one name, so this "
                "checkpoint would hold one rank's copy and lose the others. A rank whose copy "
                "is the odd one out may have a faulty device (silent data corruption); if the "
                "values are meant to differ per rank (experts, per-rank counters), save them "
                "as DTensor shards or in a dckpt.PerRank. CheckpointConfig(replica_check="
                "'warn') saves anyway and marks the step"
            )
        else:
            warnings.append(
                f"dckpt: step {step} is committed although the ranks' copies of {len(differ)} "
                f"replicated value(s) differ (replica_check='warn'): {said}. The checkpoint "
                "holds one rank's copy of each; the step is marked in its manifest"
            )
            marks["replicas_differ"] = {
                name: {d: r for d, r in by_digest.items()}
                for name, by_digest in list(differ.items())[:64]
            }
    if nonfinite:
        said = _describe_nonfinite(nonfinite)
        if not allow_nonfinite:
            refusals.append(
                f"{len(nonfinite)} tensor(s) hold values that are not finite: {said}. Saved, "
                "this step would become the newest and push finite checkpoints out; the run "
                "has likely diverged (check the learning rate, the loss scale, the data). "
                "Resume from the last finite step, or set CheckpointConfig(allow_nonfinite=True) "
                "to save such a step anyway (it is marked, and retention keeps the newest "
                "finite step beside it)"
            )
        else:
            warnings.append(
                f"dckpt: step {step} is committed with non-finite values (allow_nonfinite): "
                f"{said}. It is marked in its manifest, and retention keeps the newest finite "
                "step beside it"
            )
            marks["nonfinite"] = {name: what for name, (_, what) in list(nonfinite.items())[:64]}
    refusal = "; and ".join(refusals) if refusals else None
    unchecked = tuple(f"rank {rank}: {name}" for rank, f in given for name in f.unchecked)
    return Verdict(
        refusal=refusal,
        marks=marks,
        warnings=tuple(warnings),
        unchecked=unchecked,
        capture=capture,
        uncompared=uncompared,
    )
