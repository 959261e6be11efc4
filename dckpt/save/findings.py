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


def judge(
    reports: Iterable[tuple[int, Findings | None]],
    *,
    step: int,
    replica_check: ReplicaCheck,
    allow_nonfinite: bool,
) -> Verdict:
    """The verdict on every rank's findings (rank, findings); see the module docstring."""
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
    if differ:
        said = _describe_replicas(differ)
        if replica_check == "error":
            refusals.append(
                f"the ranks' copies of {len(differ)} replicated value(s) differ: {said}. DCP "
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
    return Verdict(refusal=refusal, marks=marks, warnings=tuple(warnings), unchecked=unchecked)
