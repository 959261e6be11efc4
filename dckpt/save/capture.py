"""The capture check: what a save writes is what was trained, compared before the commit.

A file digest proves that the bytes read at a resume are the bytes written. It cannot prove
that the bytes written are the training state at ``save()``: a staging buffer that was never
refreshed (a cached or reused buffer), one changed after its copy, or a copy cut short is
written, digested and sealed as verified, and a resume trains on it. So every save compares,
for every tensor each rank writes, two digests made of the same values in the same form
(dckpt.storage.tensor_digest):

1. **captured**, inside ``save()``, from the live tensor: a host tensor in the same pass as
   its staging copy (the source as read, never the buffer), or alone when its copy waits (a
   deferred copy of ``overlap_staging``, a synchronous save); a GPU tensor as a fingerprint
   queued on the training stream beside its copy (dckpt.save.value_checks.Inspection);
2. **written**, by the writer, over the bytes of that tensor's storage record as they go to
   the file (dckpt.storage.item_writes), or over the tensor's span in the memory tier's file
   (dckpt.save.memory); a linked file of an incremental save (its bytes written by an
   earlier save) carries the digests its writing recorded.

A difference on any rank refuses the save on every rank (dckpt.save.findings: "the staged
copy of model.0.weight on rank 1 is not the state at save()"), nothing committed; no
setting lets it through. What cannot be compared is never a refusal (refusing every save of a
healthy run on a limit of the check would be the guard taking the run down), but it is said
and counted: a tensor whose bytes the checks cannot read (a conjugate view; a GPU with no
memory left for the fingerprint) is saved unchecked and named once a run, and one whose
written bytes the writer never saw go out (a torch that serializes differently) is counted
in the manifest (``capture.uncompared``) and named once a run.

The capture digest is also the tensor's replica digest, so the ranks' copies of a replicated
value are compared as they were at ``save()``, and a replica that differs is the model's
doing, never the save's. The manifest's ``capture`` counts the tensors compared (``dckpt
inspect``, ``dckpt verify``).

``CaptureHistory`` keeps a rank's capture digests of its trainable tensors from one save of
a tier to the next: when the optimizer stepped in between and none of them changed, the save
line says the optimizer may not be updating the model (a progress note: a learning rate of
0 or a frozen model is legitimate, and nothing is refused for it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

__all__ = ["CaptureHistory"]


class CaptureHistory:
    """One route's capture digests of the trainable tensors at its previous save, on one
    rank."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}

    def moved(
        self, captured: Mapping[str, str], trainable: Collection[str]
    ) -> tuple[int, int] | None:
        """(trainable tensors captured now and at the previous save, how many of them
        changed), and remember this save's; None when there is nothing to compare with."""
        now = {k: v for k, v in captured.items() if k in trainable}
        before, self._last = self._last, now
        both = [k for k in now if k in before]
        if not both:
            return None
        return len(both), sum(now[k] != before[k] for k in both)
