"""The capture check (issue 53): what a save writes is what was trained, or nothing commits.

Every tensor a rank writes is digested from the live tensor at ``save()`` and compared, before
the commit, with the digest of the bytes written for it (dckpt.save.capture). These trials
break the staging copy and check that the save is refused on every rank, naming the tensor,
the rank and the copy, that the saves around it commit, and that what did commit verifies. Each
world is 2 real gloo ranks, once under DDP and once under FSDP2 (each rank writes its own shard
of every parameter), and runs every case in order in one spawn:

- **the project's own fault hook** (``DCKPT_FAULT=...,action=stale|torn|skip``): the staging
  buffer not refreshed (it keeps the previous save's values), changed after its copy (one
  bit), or half copied. In a background save (the copies taken in ``save()``), a synchronous
  one (the tensor handed to the writer), with ``overlap_staging`` (the deferred copies, taken
  after ``save()`` returned) and in the memory tier (the copy into the node's memory file);
- **a hostile injection of ours, not the project's hook**: ``torch.Tensor.copy_`` patched for
  one ``save()`` call, so that the staging copy of the largest parameter is skipped (stale)
  or changed after it was made (torn). Before the check, both committed under FSDP2 with every
  digest verified; under DDP they were refused only as replicas that differ, which blamed the
  model;
- **the progress note** (in-process): saves of a model whose optimizer steps with a learning
  rate of 0 say that no trainable tensor changed; they commit all the same.

Each case joins ``make faults``' table.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_world
from fault_kit import Trials

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

TAMPERS = ("stale", "torn", "skip")
REFUSED = "not the state at save()"


def _model(parallel: str, rank: int) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(7)
    body = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
    )
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model: Any = DistributedDataParallel(body)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in body:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model = fully_shard(body)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: Any, opt: Any, step: int, rank: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(step * 10 + rank)
    opt.zero_grad()
    model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
    opt.step()


class _Hostile:
    """``torch.Tensor.copy_`` patched while active: the copy whose source is ``target``'s
    storage (a staging copy of that parameter) is skipped (``stale``) or made and then
    changed (``torn``). The project's code is not told."""

    def __init__(self, target: Any, mode: str) -> None:
        import torch

        self.ptr = int(target.data_ptr())
        self.mode = mode
        self.hits = 0
        self._real = torch.Tensor.copy_

    def __enter__(self) -> _Hostile:
        import torch

        real, hostile = self._real, self

        def copy_(dst: Any, src: Any, non_blocking: bool = False) -> Any:
            if int(src.data_ptr()) == hostile.ptr and int(dst.data_ptr()) != hostile.ptr:
                hostile.hits += 1
                if hostile.mode == "stale":
                    return dst
                out = real(dst, src, non_blocking)
                dst.view(-1)[0] += 1.0
                return out
            return real(dst, src, non_blocking)

        torch.Tensor.copy_ = copy_  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.Tensor.copy_ = self._real  # type: ignore[method-assign]


def _saves(
    mgr: Any, model: Any, opt: Any, rank: int, cases: list[str], tier: str, phase: str
) -> dict[str, str]:
    """Each case in order, one save each (a step trained before it): ``clean``, a tamper of
    the project's hook at ``phase``, or ``hostile-<mode>``; what became of each save."""
    from torch.distributed.tensor import DTensor

    from dckpt.errors import SaveError

    out: dict[str, str] = {}
    for step, case in enumerate(cases, start=1):
        _step(model, opt, step, rank)
        hostile = None
        if case in TAMPERS:
            os.environ["DCKPT_FAULT"] = f"phase={phase},action={case},step={step}"
        elif case.startswith("hostile-"):
            big = max(model.parameters(), key=lambda p: p.numel())
            local = big._local_tensor if isinstance(big, DTensor) else big
            hostile = _Hostile(local, case.removeprefix("hostile-"))
        try:
            if hostile is not None:
                with hostile:
                    handle = mgr.save(step, tier=tier)
            else:
                handle = mgr.save(step, tier=tier)
            handle.result(timeout=120)
            out[f"{step}:{case}"] = "committed"
        except SaveError as exc:
            out[f"{step}:{case}"] = str(exc)
            with contextlib.suppress(SaveError):  # raised once more, as the next save() would
                mgr.wait()
        finally:
            os.environ.pop("DCKPT_FAULT", None)
        if hostile is not None:  # under DDP only the rank that writes it copies it
            out[f"{step}:{case}:hits"] = str(hostile.hits)
    return out


def _world(rank: int, world: int, root: str, parallel: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    import dckpt

    model, opt = _model(parallel, rank)
    base = Path(root) / parallel
    names = {
        p.data_ptr() if not isinstance(p, DTensor) else p._local_tensor.data_ptr(): n
        for n, p in model.named_parameters()
    }
    big = max(model.parameters(), key=lambda p: p.numel())
    biggest = names[big._local_tensor.data_ptr() if isinstance(big, DTensor) else big.data_ptr()]
    results: dict[str, Any] = {"biggest": biggest.removeprefix("module.")}
    every = ["clean", *TAMPERS, "clean"]
    plans = [  # (run, config, cases, tier, the phase a tamper names)
        (
            "background",
            {},
            [*every, "hostile-stale", "hostile-torn", "clean"],
            "durable",
            "prepare",
        ),
        ("synchronous", {"async_save": False}, every, "durable", "prepare"),
        ("overlap", {"overlap_staging": True}, every, "durable", "stage"),
        ("memory", {"memory": True, "memory_dir": base / "mem"}, every, "memory", "memory_copy"),
    ]
    for run, config, cases, tier, phase in plans:
        cfg = dckpt.CheckpointConfig(root=base / run, timeout_s=30, lock=False, **config)
        with dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt)) as mgr:
            results[run] = _saves(mgr, model, opt, rank, cases, tier, phase)
    return results


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_a_stale_torn_or_cut_staging_copy_never_commits_and_names_the_tensor(
    parallel: str, tmp_path: Path, fault_trials: Trials, caplog: pytest.LogCaptureFixture
) -> None:
    from dckpt.root.layout import committed_steps
    from dckpt.root.manifest import read_manifest
    from dckpt.root.verify import verify_checkpoint

    results = run_world(_world, 2, str(tmp_path), parallel, timeout=300)
    problems: list[str] = []
    for run in ("background", "synchronous", "overlap", "memory"):
        for case_key in results[0][run]:
            if case_key.endswith(":hits"):
                continue
            step, case = case_key.split(":")
            said = [r[run][case_key] for r in results]
            why: list[str] = []
            if case == "clean" and said != ["committed", "committed"]:
                why.append(f"a clean save did not commit: {said}")
            if case != "clean":
                if "committed" in said:
                    why.append(f"committed: {said}")
                elif not all(REFUSED in s and "on rank" in s for s in said):
                    why.append(f"refused, but not as a capture mismatch: {said[0][:600]}")
                elif said[0] != said[1]:
                    why.append("the ranks raised different errors")
            if case.startswith("hostile"):
                if not sum(int(r[run][f"{case_key}:hits"]) for r in results):
                    why.append("the hostile copy_ was never called")
                if f"{results[0]['biggest']} on rank" not in said[0]:
                    why.append(f"the error does not name {results[0]['biggest']}: {said[0][:400]}")
            with fault_trials.trial(f"capture check ({parallel})", f"{run}: {case}"):
                assert not why, why
            problems.extend(f"{run} step {step} {case}: {w}" for w in why)
        if run == "memory":
            continue
        root = tmp_path / parallel / run
        clean = [int(k.split(":")[0]) for k, v in results[0][run].items() if v == "committed"]
        clean = [s for s in clean if s]
        if committed_steps(root) != clean:
            problems.append(f"{run}: committed {committed_steps(root)}, expected {clean}")
        for step in committed_steps(root):
            manifest = read_manifest(root / f"step-{step:08d}")
            if not manifest.capture.get("items"):
                problems.append(f"{run} step {step}: the manifest records no capture check")
            if not verify_checkpoint(root / f"step-{step:08d}").ok:
                problems.append(f"{run} step {step} does not verify")
    assert not problems, "\n".join(problems)


def test_lr_zero_saves_say_no_trainable_tensor_changed(tmp_path: Path) -> None:
    """Kept small and in-process: the progress note's words (the 2-rank run above saves the
    same way; a one-rank manager shows the note in this process's log)."""
    import logging

    import torch
    from torch import nn

    import dckpt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("dckpt").addHandler(handler)
    try:
        cfg = dckpt.CheckpointConfig(root=tmp_path / "ckpt", lock=False, async_save=False)
        with dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt)) as mgr:
            for step in (1, 2, 3):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                mgr.save(step)
            for group in opt.param_groups:
                group["lr"] = 0.1
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            mgr.save(4)
    finally:
        logging.getLogger("dckpt").removeHandler(handler)
    notes = [r for r in records if "none of the 4 trainable tensor(s) changed" in r]
    assert [n.split(":")[1].strip() for n in notes] == ["step 2", "step 3"], records
    assert "optimizer stepped 1 time(s)" in notes[0]
    assert all(f"saved step {s}" in " ".join(records) for s in (1, 2, 3, 4))


def test_tensors_in_another_memory_order_tied_weights_and_conjugate_views_commit_compared(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A review of the check found healthy saves it refused or could not compare: a
    ``channels_last`` weight in a synchronous save (torch.save writes a storage in its own
    order, the capture hashed row-major values: refused every time), two names on one
    storage (tied weights) written by two writer threads (one of them went uncompared), and
    a conjugate view (the fused copy raised out of ``save()``). Each now commits, every
    tensor but the one the checks cannot read compared, and resumes bit for bit."""
    import logging

    import torch
    from torch import nn

    import dckpt
    from dckpt.load.offline import load_flat
    from dckpt.root.manifest import read_manifest

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight  # tied: two names, one storage
            self.register_buffer("t", torch.randn(8, 6).t())  # a transposed view
            self.register_buffer("z", torch.randn(4, dtype=torch.complex64).conj())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x).mean() + self.head(self.emb.weight).mean()

    for run, config in (("sync", {"async_save": False}), ("async", {"async_save": True})):
        torch.manual_seed(0)
        model = Odd()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = dckpt.CheckpointConfig(root=tmp_path / run, lock=False, io_threads=2, **config)
        with (
            caplog.at_level(logging.WARNING, logger="dckpt"),
            dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt)) as mgr,
        ):
            for step in (1, 2):
                model(torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)).backward()
                opt.step()
                mgr.save(step).result()  # a refusal raises here
        manifest = read_manifest(tmp_path / run / "step-00000002")
        assert manifest.capture["items"] > 0 and "uncompared" not in manifest.capture, run
        saved = load_flat(tmp_path / run / "step-00000002", "model.")
        for name, value in model.state_dict().items():
            assert torch.equal(saved[f"model.{name}"], value), (run, name)
    assert not [r for r in caplog.records if "without their written bytes" in r.getMessage()]
