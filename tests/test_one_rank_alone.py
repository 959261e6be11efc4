"""One rank alone refuses or fails a resume (issue 58, item 2's first pattern, swept): every
rank raises the same error, or comes to the same verdict, and no rank's tensors are touched.

Each agreement the ranks make during a resume, with only rank 1 refusing or failing. The cases
that test_one_rank_refuses.py (the state's kinds), test_memory_survivors.py (a shape, memory),
test_resume_gaps.py (a dtype, durable), test_verified_resume.py (another root, a warmup, a
digest), test_resume_share.py (a share one rank sees otherwise) and
faults/test_loss_verdict.py (a loss or replay verdict) hold are not repeated here. One world of
two gloo ranks (each its own node, ``GROUP_RANK``, each with a model of its own: nothing is
shared, so each rank reads only its own file) runs every case below, each in a root of its
own; each test then reads its case's outcome:

- ``config``: only rank 1's run config changes a strict key (``lr``), durable tier: every rank
  raises rank 1's ``ConfigMismatchError``;
- ``precision``: only rank 1 resumes a bf16 step under fp16 (a GradScaler that would start from
  scratch), memory tier: every rank raises rank 1's ``ConfigMismatchError``;
- ``key``: only rank 1's key file holds another key, memory tier: every rank refuses the
  start alike, naming rank 1's key (the ranks compare their keys' ids at the start); none
  loads the step (before, rank 1 passed it over alone and rank 0 went on into the load's
  agreements with no partner there);
- ``per_rank``: a step saved by one rank, resumed by two, where only rank 1's ``PerRank``
  refuses a new world size (``on_resize="raise"``; rank 0's starts fresh): every rank raises
  rank 1's ``StateMismatchError`` (before, rank 1 raised alone and rank 0 waited in the load's
  agreement, then blamed rank 1 as frozen or gone);
- ``damage``: a bit flipped in the newest step's file only rank 1 reads: every rank sets that
  step aside and resumes the step before, every tensor that step's on every rank.

"Untouched": every model and optimizer tensor of every rank equal, bit for bit, to what it
held before the resume.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world

import dckpt
from dckpt.root.layout import QUARANTINE_DIR, committed_steps, step_dir_name

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 20.0
"""A rank waiting for a partner that refused alone gives up after this (the old code's
failure); no verdict rests on it."""


def _net(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of this rank's own, under names of its own (each rank reads its own file)."""
    torch.manual_seed(rank)
    net = torch.nn.ModuleDict({f"rank{rank}": torch.nn.Linear(16, 8)})
    return net, torch.optim.AdamW(net.parameters())


def _train(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model = next(iter(net.values()))
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snap(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def _same(want: dict[str, torch.Tensor], net: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    got = _snap(net, opt)
    return set(got) == set(want) and all(torch.equal(want[k], got[k]) for k in want)


def _config(case: Path, **extra: Any) -> dckpt.CheckpointConfig:
    return dckpt.CheckpointConfig(
        root=case / "ckpt", lock=False, memory_dir=case / "mem", loss_watch="off",
        timeout_s=TIMEOUT_S, replica_check="off", **extra,
    )  # fmt: skip


def _resume(
    rank: int,
    conf: dckpt.CheckpointConfig,
    state: dckpt.TrainState,
    **kwargs: Any,
) -> dict[str, Any]:
    """Resume into ``state``; what came of it, and whether its tensors are as they were."""
    net, opt = state.model, state.optimizer
    assert opt is not None
    before = _snap(net, opt)
    got: dict[str, Any] = {}
    try:
        with dckpt.CheckpointManager(conf, state, **kwargs) as mgr:
            report = mgr.resume()
            got = {"got": f"resumed {report.step}", "report": report.format()}
    except dckpt.CheckpointError as exc:
        # the lowest failing rank's error, with "(raised on rank 1)" added on the others
        got = {"got": f"{type(exc).__name__}: {str(exc).split(' (raised on rank')[0]}"}
    got["untouched"] = _same(before, net, opt)
    return got


def _save_then_change(rank: int, conf: dckpt.CheckpointConfig, **kwargs: Any) -> None:
    """Step 2 of each rank's model (its tier as ``conf`` says), then a state that differs
    from it (so a load into the next model shows)."""
    net, opt = _net(rank)
    _train(net, opt)
    with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt), **kwargs) as mgr:
        mgr.save(2, tier="memory" if conf.memory else "durable").result()


def _changed(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net, opt = _net(rank)
    _train(net, opt)
    _train(net, opt)  # not the saved state: a copy would show
    return net, opt


def _config_case(rank: int, case: Path) -> dict[str, Any]:
    conf = _config(case)
    _save_then_change(rank, conf, run_config={"lr": 0.1})
    net, opt = _changed(rank)
    lr = 0.1 if rank == 0 else 0.2  # rank 1 alone was started with another learning rate
    return _resume(rank, conf, dckpt.TrainState(net, opt), run_config={"lr": lr})


def _precision_case(rank: int, case: Path) -> dict[str, Any]:
    conf = _config(case, memory=True)
    _save_then_change(rank, conf, precision=dckpt.PrecisionPolicy(mode="bf16"))
    net, opt = _changed(rank)
    if rank == 0:
        return _resume(rank, conf, dckpt.TrainState(net, opt), precision=dckpt.PrecisionPolicy())
    scaler = torch.amp.GradScaler("cpu")  # fp16 on rank 1 alone: its scaler starts from scratch
    state = dckpt.TrainState(net, opt, scaler=scaler)
    return _resume(rank, conf, state, precision=dckpt.PrecisionPolicy(mode="fp16"))


def _key(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def _key_case(rank: int, case: Path) -> dict[str, Any]:
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    keys = case / f"keys-{rank}"
    keys.mkdir(mode=0o700, parents=True)
    job = _key(keys / "job.key", "k" * 32)
    conf = _config(case, memory=True, digest="sha256", key_file=job)
    _save_then_change(rank, conf)
    net, opt = _changed(rank)
    if rank == 1:  # this node alone was handed another key
        conf = _config(
            case, memory=True, digest="sha256", key_file=_key(keys / "other.key", "o" * 32)
        )
    return _resume(rank, conf, dckpt.TrainState(net, opt))


def save_one_rank(root: Path) -> None:
    """Step 1 saved by a world of one rank (in the test's process): a plain model, and a
    ``PerRank`` value."""
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    state = dckpt.TrainState(net, opt, extra={"pending": dckpt.PerRank(7)})
    conf = dckpt.CheckpointConfig(root=root, lock=False, loss_watch="off")
    with warnings.catch_warnings():  # DCP's word that it saves in one process: it does
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with dckpt.CheckpointManager(conf, state) as mgr:
            mgr.save(1).result()


def _per_rank_case(rank: int, case: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(net.parameters())
    torch.manual_seed(10 + rank)
    for _ in range(2):  # other values than the saved step's
        net(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    on_resize = "fresh" if rank == 0 else "raise"  # rank 1 alone refuses a new world size
    state = dckpt.TrainState(net, opt, extra={"pending": dckpt.PerRank(3, on_resize=on_resize)})
    return _resume(rank, _config(case), state)


def _damage_case(rank: int, case: Path) -> dict[str, Any]:
    import torch.distributed as dist

    conf = _config(case)
    net, opt = _net(rank)
    _train(net, opt)
    with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt)) as mgr:
        mgr.save(1).result()
        first = _snap(net, opt)
        _train(net, opt)
        mgr.save(2).result()
    dist.barrier()
    if rank == 1:  # a bit of rank 1's own file of step 2, which only rank 1 reads
        path = case / "ckpt" / step_dir_name(2) / "__1_0.distcp"
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    dist.barrier()
    net, opt = _changed(rank)
    got = _resume(rank, conf, dckpt.TrainState(net, opt))
    got["at_step_1"] = _same(first, net, opt)
    return got


CASES = {
    "config": _config_case,
    "precision": _precision_case,
    "key": _key_case,
    "per_rank": _per_rank_case,
    "damage": _damage_case,
}


def _world(rank: int, world: int, base: str) -> dict[str, dict[str, Any]]:
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    out: dict[str, dict[str, Any]] = {}
    for name, case in CASES.items():
        try:
            out[name] = case(rank, Path(base) / name)
        except Exception as exc:  # one case's failure is that test's, not every case's
            out[name] = {"got": f"{type(exc).__name__}: {exc}", "untouched": None}
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("alone")
    save_one_rank(base / "per_rank" / "ckpt")
    return base, run_world(_world, 2, str(base), timeout=300)


def _alike(got: list[dict[str, Any]], case: str, starts: str) -> None:
    """Every rank raised the same error, beginning with ``starts``, its tensors untouched."""
    for rank, r in enumerate(got):
        assert r[case]["got"].startswith(starts), (rank, r[case]["got"])
        assert r[case]["untouched"] is True, (rank, "tensors changed", r[case])
    assert got[0][case]["got"] == got[1][case]["got"], (got[0][case], got[1][case])


def test_a_config_changed_on_one_rank_alone_is_refused_on_every_rank(
    outcomes: tuple[Path, list[dict[str, Any]]],
) -> None:
    base, got = outcomes
    _alike(got, "config", "ConfigMismatchError: ")
    assert "lr" in got[0]["config"]["got"], got[0]["config"]
    assert committed_steps(base / "config" / "ckpt") == [2]  # a refusal moves nothing


def test_a_precision_changed_on_one_rank_alone_is_refused_on_every_rank(
    outcomes: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, got = outcomes
    _alike(got, "precision", "ConfigMismatchError: step-00000002 was saved under bf16 without")


def test_a_key_that_differs_on_one_rank_alone_refuses_the_memory_step_on_every_rank(
    outcomes: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, got = outcomes
    _alike(got, "key", "CheckpointError: rank 1's key file")
    assert "holds another key" in got[0]["key"]["got"], got[0]["key"]


def test_a_per_rank_value_refused_on_one_rank_alone_is_refused_on_every_rank(
    outcomes: tuple[Path, list[dict[str, Any]]],
) -> None:
    base, got = outcomes
    _alike(got, "per_rank", "StateMismatchError: step-00000001 was saved by 1 rank(s)")
    assert "pending" in got[0]["per_rank"]["got"], got[0]["per_rank"]
    assert committed_steps(base / "per_rank" / "ckpt") == [1]


def test_a_file_only_one_rank_reads_damaged_sets_the_step_aside_on_every_rank(
    outcomes: tuple[Path, list[dict[str, Any]]],
) -> None:
    base, got = outcomes
    for rank, r in enumerate(got):
        assert r["damage"]["got"] == "resumed 1", (rank, r["damage"])
        assert r["damage"]["at_step_1"], (rank, "a tensor is not step 1's", r["damage"])
        assert "skipped step 2" in r["damage"]["report"], r["damage"]["report"]
    root = base / "damage" / "ckpt"
    assert committed_steps(root) == [1]
    assert (root / QUARANTINE_DIR / step_dir_name(2)).is_dir()
