"""Lightning's checkpoint paths under dckpt's strategy are the job's own (issue 54 item 3):
what another local user plants where ModelCheckpoint looks is refused in words before
Lightning loads anything, and the directories it looks in are proven as the root is.

The review's attack, reproduced: a plain ``last-v9.ckpt`` (a real Lightning checkpoint, its
weights zeroed) planted beside the strategy's ``last.ckpt`` with a newer modification time,
so that ``fit(ckpt_path="last")`` picks it. Before, Lightning loaded it (``Restored all
states``) and the next save sealed its weights as a verified dckpt step. Now the fit is
refused naming the file, its owner and the fix; nothing is trained, saved or loaded (the
model keeps the weights it had); once it is removed, the same fit resumes the strategy's own
link as before. The same for a ``last.ckpt`` link leading out of the root, a link of another
user, and a ModelCheckpoint directory another user made or every user can write.

"Another user" is a uid that is not this process's (the tests run as root, as CI does):
``os.chown`` gives a file, a link or a directory to uid ``OTHER`` exactly as if that user had
made it. The trainer runs are real (``Trainer`` with ``DckptStrategy``, one gloo rank of
tests/dist_harness.py, each scenario one ``fit`` after the other in that rank: Lightning is
imported once); two ranks refuse a planted file together (rank 0 decides, every rank raises
its words: none waits in a collective for one that stopped); the path rules are also tested
one by one in this process. Each test fails on the code before (the fits were not refused:
her step 2 resumed and was sealed as verified step 6).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_world

from dckpt.owned import NotOwnedError
from dckpt.root.layout import committed_steps, step_dir_name

OTHER = 4242  # a uid that is not this process's (no passwd entry needed)
FUTURE = 4_000_000_000  # an mtime (2096) no link of the strategy's has: ckpt_path="last" picks it

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


# --- the trainer runs (in one gloo rank) ------------------------------------------------------


def _fit(
    base: Path,
    name: str,
    *,
    max_steps: int,
    ckpt_path: str | None = "last",
    dirpath: Path | None = None,
    save_last: bool | str = True,
    plain: bool = False,
    devices: int = 1,
) -> dict[str, Any]:
    """One ``fit`` of a tiny model, ModelCheckpoint every 2 steps into ``dirpath`` (default
    ``base/name/checkpoints``), dckpt's root ``base/name/dckpt`` (``plain``: Lightning's own
    strategy, saving a real ``.ckpt``). What happened, as plain values."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import dckpt
    from dckpt.integrations.lightning import DckptStrategy

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)
            self.steps_run = 0

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            self.steps_run += 1
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    pl.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    model = Tiny()
    before = [p.detach().clone() for p in model.parameters()]
    root = base / name / "dckpt"
    strategy: Any = (
        "auto" if plain else DckptStrategy(dckpt.CheckpointConfig(root=root, async_save=False))
    )
    checkpoint = ModelCheckpoint(
        dirpath=dirpath or base / name / "checkpoints", every_n_train_steps=2, save_top_k=-1,
        save_last=save_last,  # type: ignore[arg-type]
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
        callbacks=[checkpoint], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=base / name,
    )  # fmt: skip
    error: tuple[str, str] | None = None
    try:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    if plain:
        trainer.save_checkpoint(base / name / "plain.ckpt")
    after = [p.detach() for p in model.parameters()]
    return {
        "error": error,
        "steps_run": model.steps_run,
        "global_step": trainer.global_step,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "zero": all(not a.any() for a in after),
        "committed": committed_steps(root) if root.is_dir() else [],
    }


def _planted_pickle(base: Path) -> Path:
    """A real Lightning checkpoint, as another user would make one (her run of the same
    model, with Lightning's own strategy), its weights zeroed and saved again."""
    import torch

    _fit(base, "hers", max_steps=2, ckpt_path=None, plain=True)  # on one device
    path = base / "hers" / "plain.ckpt"
    ckpt = torch.load(path, weights_only=False)
    ckpt["state_dict"] = {k: torch.zeros_like(v) for k, v in ckpt["state_dict"].items()}
    torch.save(ckpt, path)
    return path


def _lightning_world(rank: int, world_size: int, base_dir: str) -> dict[str, Any]:
    """Every trainer scenario of the file, one after the other (one import of Lightning)."""
    base = Path(base_dir)
    out: dict[str, Any] = {}
    hers = _planted_pickle(base)

    # The job's own run: saves at steps 2 and 4, last.ckpt a link to the root.
    out["own"] = _fit(base, "job", max_steps=4)
    links = base / "job" / "checkpoints"
    out["own_last"] = os.readlink(links / "last.ckpt")

    # Planted beside it, newer: ckpt_path="last" picks it, and it is refused.
    planted = links / "last-v9.ckpt"
    shutil.copy(hers, planted)
    os.chown(planted, OTHER, OTHER)
    os.utime(planted, (FUTURE, FUTURE))
    out["planted"] = _fit(base, "job", max_steps=6)
    out["planted_still_there"] = planted.is_file()
    # Removed: the same fit resumes the strategy's own link, step 4, and goes on to 6.
    planted.unlink()
    out["resumed"] = _fit(base, "job", max_steps=6)

    # last.ckpt a link of the job's user's, but to a pickle outside the root.
    last = links / "last.ckpt"
    last.unlink()
    last.symlink_to(os.path.relpath(hers, links))
    out["outside"] = _fit(base, "job", max_steps=8)
    # ... and to a directory elsewhere named like a step.
    elsewhere = base / "elsewhere" / step_dir_name(6)
    elsewhere.mkdir(parents=True)
    last.unlink()
    last.symlink_to(elsewhere)
    out["elsewhere"] = _fit(base, "job", max_steps=8)
    # The right target, but another user's link.
    last.unlink()
    last.symlink_to(os.path.relpath(base / "job" / "dckpt", links))
    os.lchown(last, OTHER, OTHER)
    out["their_link"] = _fit(base, "job", max_steps=8)
    out["committed_at_end"] = committed_steps(base / "job" / "dckpt")

    # A ModelCheckpoint directory another user made first (mode 0755: only she writes it).
    theirs = base / "theirs" / "checkpoints"
    theirs.mkdir(parents=True)
    os.chown(theirs, OTHER, OTHER)
    out["their_dir"] = _fit(base, "theirs", max_steps=4)
    out["their_dir_entries"] = sorted(p.name for p in theirs.iterdir())
    # One of the job's user's that every user can write.
    open_dir = base / "open" / "checkpoints"
    open_dir.mkdir(parents=True)
    open_dir.chmod(0o777)
    out["open_dir"] = _fit(base, "open", max_steps=4)

    # ModelCheckpoint(save_last="link"): last.ckpt a link to the newest top-k link (Lightning
    # makes it), which is the strategy's link to its step: a chain of the job's own links.
    out["chain_first"] = _fit(base, "chain", max_steps=4, save_last="link")
    out["chain_last"] = os.readlink(base / "chain" / "checkpoints" / "last.ckpt")
    out["chain"] = _fit(base, "chain", max_steps=6, save_last="link")
    # ... and one whose middle link (the top-k file last.ckpt leads to) is another user's.
    middle = base / "chain" / "checkpoints" / "epoch=0-step=6.ckpt"
    out["chain_middle_last"] = os.readlink(base / "chain" / "checkpoints" / "last.ckpt")
    os.lchown(middle, OTHER, OTHER)
    out["their_middle"] = _fit(base, "chain", max_steps=8, save_last="link")
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("lightning-paths")
    (result,) = run_world(_lightning_world, 1, str(base), timeout=300)
    assert isinstance(result, dict)
    result["base"] = base
    return result


def _refused(run: dict[str, Any], *words: str) -> str:
    """The fit was refused in words (a NotOwnedError naming each of ``words``) before
    anything was trained or loaded: no step ran, the weights are the model's own."""
    assert run["error"] is not None, f"not refused: {run}"
    kind, message = run["error"]
    assert kind == "NotOwnedError", run["error"]
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    assert run["steps_run"] == 0 and run["unchanged"] and not run["zero"], run
    return str(message)


def test_a_planted_last_ckpt_is_refused_before_lightning_loads_it(world: dict[str, Any]) -> None:
    """The review's Medium finding: her plain last-v9.ckpt, newest by mtime, is what
    ckpt_path="last" hands over; it is refused naming it, its owner and the fix, her zeroed
    weights are never in the model, and nothing is saved (a save would seal them)."""
    own = world["own"]  # the job's own run: saves at 2 and 4, last.ckpt its link to the root
    assert own["error"] is None and own["steps_run"] == 4 and own["committed"] == [2, 4], own
    assert world["own_last"] == "../dckpt"
    planted = world["base"] / "job" / "checkpoints" / "last-v9.ckpt"
    message = _refused(
        world["planted"], str(planted), "a file owned by uid 4242", f"rm {planted}",
        "ckpt_path=", str(world["base"] / "job" / "dckpt"), "Nothing was loaded",
    )  # fmt: skip
    assert "not a link dckpt's strategy made" in message
    assert world["planted"]["committed"] == [2, 4]  # nothing sealed after the refusal
    assert world["planted_still_there"]  # refused, not deleted: not dckpt's to remove
    # Removed, the same fit resumes the strategy's own link: step 4, then steps 5 and 6.
    resumed = world["resumed"]
    assert resumed["error"] is None, resumed
    assert resumed["steps_run"] == 2 and resumed["global_step"] == 6, resumed
    assert resumed["committed"] == [2, 4, 6] and not resumed["zero"], resumed


def test_a_last_link_leading_out_of_the_root_is_refused(world: dict[str, Any]) -> None:
    last = world["base"] / "job" / "checkpoints" / "last.ckpt"
    hers = (world["base"] / "hers" / "plain.ckpt").resolve()
    message = _refused(
        world["outside"], str(last), str(hers), "neither the dckpt root nor one of its step"
    )
    assert "a file owned by" in message
    elsewhere = (world["base"] / "elsewhere" / step_dir_name(6)).resolve()
    _refused(world["elsewhere"], str(last), str(elsewhere), "a directory owned by")


def test_a_link_of_another_user_is_refused_even_to_the_root(world: dict[str, Any]) -> None:
    last = world["base"] / "job" / "checkpoints" / "last.ckpt"
    _refused(world["their_link"], str(last), "a symbolic link owned by uid 4242")
    # None of the refused fits saved anything.
    assert world["committed_at_end"] == [2, 4, 6]


def test_a_checkpoint_directory_another_user_made_is_refused(world: dict[str, Any]) -> None:
    theirs = world["base"] / "theirs" / "checkpoints"
    _refused(world["their_dir"], f"ModelCheckpoint's directory {theirs}", "uid 4242",
             "ModelCheckpoint(dirpath=")  # fmt: skip
    assert world["their_dir"]["committed"] == [] and world["their_dir_entries"] == []


def test_a_checkpoint_directory_every_user_can_write_is_refused(world: dict[str, Any]) -> None:
    opened = world["base"] / "open" / "checkpoints"
    _refused(world["open_dir"], f"ModelCheckpoint's directory {opened}", "every user may write",
             "mode 0777", "chmod go-w")  # fmt: skip
    assert world["open_dir"]["committed"] == []


def test_save_last_link_chains_resume_only_through_the_jobs_own_links(
    world: dict[str, Any],
) -> None:
    """ModelCheckpoint(save_last="link"): last.ckpt is Lightning's link to the newest top-k
    link, the strategy's link to its step. That chain resumes; with its middle link another
    user's, it is refused naming that link."""
    first, chain = world["chain_first"], world["chain"]
    assert first["error"] is None and first["committed"] == [2, 4], first
    assert world["chain_last"] == "epoch=0-step=4.ckpt"  # Lightning's link to the top-k link
    assert chain["error"] is None and chain["steps_run"] == 2, chain
    assert chain["committed"] == [2, 4, 6], chain
    links = world["base"] / "chain" / "checkpoints"
    assert world["chain_middle_last"] == "epoch=0-step=6.ckpt"
    _refused(world["their_middle"], str(links / "last.ckpt"),
             f"leads to {links.resolve() / 'epoch=0-step=6.ckpt'}, which is a symbolic link "
             "owned by uid 4242")  # fmt: skip
    assert world["their_middle"]["committed"] == [2, 4, 6]


# --- the path rules, one by one (in this process) ----------------------------------------------


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """A dckpt root with two steps and a ModelCheckpoint directory beside it (both private)."""
    root = tmp_path / "dckpt"
    for step in (2, 4):
        (root / step_dir_name(step)).mkdir(parents=True)
    links = tmp_path / "checkpoints"
    links.mkdir(mode=0o700)
    return root, links


def test_own_target_reads_the_strategys_links_and_the_root_itself(
    layout: tuple[Path, Path],
) -> None:
    from dckpt.integrations.lightning import _own_target

    root, links = layout
    (links / "last.ckpt").symlink_to("../dckpt")
    (links / "epoch=0-step=4.ckpt").symlink_to(f"../dckpt/{step_dir_name(4)}")
    (links / "last-v1.ckpt").symlink_to("epoch=0-step=4.ckpt")  # save_last="link"
    assert _own_target(links / "last.ckpt", root) is None
    assert _own_target(links / "epoch=0-step=4.ckpt", root) == 4
    assert _own_target(links / "last-v1.ckpt", root) == 4
    assert _own_target(root, root) is None  # ckpt_path=<the root>
    assert _own_target(root / step_dir_name(2), root) == 2


def test_own_target_refuses_what_is_not_the_strategys(layout: tuple[Path, Path]) -> None:
    from dckpt.integrations.lightning import _own_target

    root, links = layout
    (links / "last.ckpt").write_bytes(b"a pickle")  # the job's user's own file: still no
    with pytest.raises(NotOwnedError, match=r"is a file owned by .* not a link dckpt's strategy"):
        _own_target(links / "last.ckpt", root)
    (links / "gone.ckpt").symlink_to("../dckpt/step-00000009")
    with pytest.raises(NotOwnedError, match="which does not exist"):
        _own_target(links / "gone.ckpt", root)
    (links / "up.ckpt").symlink_to("..")  # the directory above the root
    with pytest.raises(NotOwnedError, match="neither the dckpt root nor one of its step"):
        _own_target(links / "up.ckpt", root)
    (links / "loop.ckpt").symlink_to("loop.ckpt")
    with pytest.raises(NotOwnedError, match="chain of more than"):
        _own_target(links / "loop.ckpt", root)
    (links / "quarantined.ckpt").symlink_to("../dckpt/quarantine")
    (root / "quarantine").mkdir()
    with pytest.raises(NotOwnedError, match="neither the dckpt root nor one of its step"):
        _own_target(links / "quarantined.ckpt", root)


def test_a_link_in_a_directory_of_another_user_is_refused(layout: tuple[Path, Path]) -> None:
    """The job's own link to the root, but in her directory: she decides what is found."""
    from dckpt.integrations.lightning import _own_target

    root, links = layout
    (links / "last.ckpt").symlink_to("../dckpt")
    os.chown(links, OTHER, OTHER)
    with pytest.raises(NotOwnedError, match=r"ModelCheckpoint's directory .* uid 4242"):
        _own_target(links / "last.ckpt", root)


def test_links_dir_is_proven_as_the_root_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dckpt.integrations.lightning import _prove_links_dir

    # Missing: made private (whatever the umask), the way to it proven first.
    old = os.umask(0)
    try:
        made = _prove_links_dir(tmp_path / "a" / "checkpoints", make=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE(made.parent.stat().st_mode) == 0o700
    # A link to the job's own directory is still a link: refused.
    (tmp_path / "alias").symlink_to(made)
    with pytest.raises(NotOwnedError, match="is a symbolic link"):
        _prove_links_dir(tmp_path / "alias", make=False)
    # A sticky directory every user can write (as /tmp) is a parent, never the directory.
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    with pytest.raises(NotOwnedError, match="mode 1777"):
        _prove_links_dir(sticky, make=False)
    assert _prove_links_dir(sticky / "mine", make=True).parent == sticky.resolve()
    # Group-writable: refused too (the group could plant).
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o770)
    with pytest.raises(NotOwnedError, match="its group may write it"):
        _prove_links_dir(group, make=False)
    # Nothing is made inside another user's directory.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(NotOwnedError, match="uid 4242"):
        _prove_links_dir(theirs / "sub" / "checkpoints", make=True)
    assert list(theirs.iterdir()) == []
    # A plain world-writable parent (not sticky): anyone can rename the directory away.
    shared = tmp_path / "shared"
    (shared / "checkpoints").mkdir(parents=True, mode=0o700)
    shared.chmod(0o777)
    with pytest.raises(NotOwnedError, match="not sticky"):
        _prove_links_dir(shared / "checkpoints", make=False)
    # An fsspec URL (ModelCheckpoint takes them): nothing local is made of it.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotOwnedError, match="not on a local file system"):
        _prove_links_dir("s3://bucket/checkpoints", make=True)
    assert not (tmp_path / "s3:").exists()


# --- two ranks: one verdict ----------------------------------------------------------------------


def _two_rank_world(rank: int, world_size: int, base_dir: str) -> dict[str, Any]:
    """Two ranks as torchrun starts them (Lightning joins the harness's process group): the
    job's own run, then her pickle planted newest (by rank 0, between the runs)."""
    import torch.distributed as dist

    n = str(world_size)  # torchrun's variables: Lightning takes the group as torchrun's
    os.environ.update(LOCAL_RANK=str(rank), GROUP_RANK="0", LOCAL_WORLD_SIZE=n, WORLD_SIZE=n)
    base = Path(base_dir)
    out: dict[str, Any] = {"own": _fit(base, "job", max_steps=4, devices=2)}
    if rank == 0:
        planted = base / "job" / "checkpoints" / "last-v9.ckpt"
        shutil.copy(_planted_pickle(base), planted)
        os.chown(planted, OTHER, OTHER)
        os.utime(planted, (FUTURE, FUTURE))
    dist.barrier()
    out["planted"] = _fit(base, "job", max_steps=6, devices=2)
    return out


def test_two_ranks_refuse_the_same_planted_file_together(tmp_path: Path) -> None:
    """Rank 0 decides and every rank raises its words: no rank goes on into the resume's
    collectives to wait there for one that stopped."""
    ranks = run_world(_two_rank_world, 2, str(tmp_path))
    own, planted = [r["own"] for r in ranks], [r["planted"] for r in ranks]
    assert all(r["error"] is None and r["steps_run"] == 4 for r in own), own
    messages = {_refused(r, "last-v9.ckpt", "uid 4242") for r in planted}
    assert len(messages) == 1, messages
    assert committed_steps(tmp_path / "job" / "dckpt") == [2, 4]


def test_each_hop_of_a_link_chain_is_in_a_directory_of_the_jobs_own(
    layout: tuple[Path, Path],
) -> None:
    """``save_last="link"`` makes a chain (last.ckpt -> a top-k link -> the step): every
    link on the way must sit in a proven directory, not only the first; a second hop in a
    directory anyone may write would let anyone pick what it leads to."""
    from dckpt.integrations.lightning import _own_target

    root, links = layout
    theirs = root.parent / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    (theirs / "epoch=0-step=4.ckpt").symlink_to(f"../dckpt/{step_dir_name(4)}")
    (links / "last.ckpt").symlink_to("../theirs/epoch=0-step=4.ckpt")
    with pytest.raises(NotOwnedError, match=str(theirs)):
        _own_target(links / "last.ckpt", root)
