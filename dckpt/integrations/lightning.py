"""dckpt under Lightning: ``Trainer(strategy=DckptStrategy(root))`` saves and resumes through dckpt.

Role: a Lightning strategy (DDP: ``DckptStrategy``; FSDP2 through ``ModelParallelStrategy``:
``DckptModelParallelStrategy``) whose ``save_checkpoint`` / ``load_checkpoint`` go to one
``CheckpointManager`` instead of ``torch.save``. A strategy is the seam, not a
``CheckpointIO``: Lightning calls a CheckpointIO on rank 0 only, and a dckpt save is collective.

What goes where in the checkpoint (dckpt.train.state's categories):

- the model and the optimizer: ``model`` / ``optimizer``, sharded through DCP and verified;
- the LR schedulers (``lr_scheduler_configs``): ``scheduler``; a GradScaler of the precision
  plugin: ``scaler``;
- everything else Lightning's ``dump_checkpoint`` holds (loops, with the data position;
  callbacks, ``ModelCheckpoint`` included; the precision plugin; hyper-parameters; epoch and
  global step): ``extra["lightning"]``, as one ``torch.save`` blob. Rank 0's blob, broadcast
  to every rank before the save, as Lightning's own checkpoint is rank 0's dump: every
  category but ``rng`` holds the same value on every rank (DCP keeps one copy);
- every rank's RNG: ``rng``, by the manager.

Invariants:

- ``ModelCheckpoint`` keeps its cadence (``every_n_train_steps``, ``every_n_epochs``,
  ``save_last``, top-k); the files it names are symbolic links, never pickles: ``last*.ckpt``
  to the dckpt root (``ckpt_path="last"`` then resumes the newest verified checkpoint, and
  falls back past a damaged one), any other name to its ``step-N`` directory. Retention is
  dckpt's (``CheckpointConfig(keep_last=...)``); removing a top-k file removes the link only.
- Lightning never loads a file through these strategies. Whatever path Lightning hands to
  ``load_checkpoint`` (the newest ``last*`` of ``ckpt_path="last"`` by modification time, a
  top-k file, ``"best"``, an explicit path) must be the strategy's own link: a symbolic link
  the job's user owns, in a directory proven the job's own (``_prove_links_dir``), leading
  (through such links only) to the dckpt root or one of its ``step-N`` directories; or that
  root or step directory itself. Anything else (a pickle, a link elsewhere or another
  user's) is refused in words on every rank before anything is read (rank 0 decides). The
  path is never read again: the verdict is "resume the root" or "load step N", which the
  manager does from its own root.
- The directories ModelCheckpoint names its files in (``dirpath``) are proven as the root
  is, at setup and at each save: owned by the job's user (or root), writable by nobody else,
  not a link, each parent owned by the job's user or root and writable by others only when
  sticky; one missing is made private. Another user's directory, or one every user can write,
  is refused in words.
- A save requested at step N (after step N's optimizer step) is taken at the start of step
  N+1 (or when training ends), before anything of step N+1 runs: the RNG then is what step
  N+1 draws from, whatever ran in between (the end of an epoch, validation, a new DataLoader
  iterator, which draws a seed from the global generator). A resume puts that RNG back at the
  same point, the first training batch after the restart, so the replayed steps are bit-exact.
- The data position: Lightning's loops hold the batch count of the epoch; the train
  DataLoader is wrapped so that it is resumable (``state_dict``/``load_state_dict``, the
  seam Lightning's loops use) and, after a resume, skips the batches the epoch already
  trained on (through the sampler without loading them where the loader has no workers).
- Every step's loss (the mean over ranks) goes to ``manager.observe``: dckpt's replay check
  and loss watch stay on.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import pickle
import secrets
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

try:
    import lightning.pytorch as pl
    from lightning import __version__ as lightning_version
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
    from lightning.pytorch.utilities.types import STEP_OUTPUT
except ImportError as exc:  # tests/test_integration_lightning.py hides lightning to see it
    raise ImportError(
        "dckpt.integrations.lightning needs Lightning: pip install dckpt[lightning]"
    ) from exc

from ..config import CheckpointConfig
from ..errors import CheckpointError
from ..manager import CheckpointManager
from ..owned import NotOwnedError, check_ancestors, make_dir, owner_name
from ..root.layout import STEP_RE, step_dir_name
from ..train import rng
from ..train.state import TrainState

__all__ = ["DckptModelParallelStrategy", "DckptStrategy"]

log = logging.getLogger("dckpt")

_LAST = "last"  # ModelCheckpoint.CHECKPOINT_NAME_LAST: a file whose name starts so is "resume"
_MAX_HOPS = 8  # links followed from a checkpoint path: ours, then save_last="link"'s to ours


class _LightningState:
    """``extra["lightning"]``: rank 0's ``dump_checkpoint`` less the model, optimizer and
    scheduler states (saved in their own categories), as bytes that are the same on every rank.
    """

    def __init__(self) -> None:
        self.blob = b""

    def state_dict(self) -> dict[str, Any]:
        return {"blob": self.blob}  # a fresh dict: DCP fills it in place on load

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        self.blob = bytes(state_dict["blob"])

    def checkpoint(self, step: int, weights_only: bool | None) -> dict[str, Any]:
        """The dump, loaded as Lightning loads a local ``.ckpt``: ``weights_only`` is what
        ``trainer.fit(weights_only=...)`` passed, and None is torch's default (True): a
        pickle runs code, and these bytes, though they match the manifest's digest, are only
        as trustworthy as whoever can write the root."""
        try:
            loaded = torch.load(
                io.BytesIO(self.blob), weights_only=True if weights_only is None else weights_only
            )
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"step {step}'s Lightning state (hyper-parameters, callbacks' state) holds a "
                f"type that weights-only loading refuses: {str(exc).splitlines()[0]}. If this "
                "root is written only by your own jobs, pass trainer.fit(..., "
                "weights_only=False), or allow the type with torch.serialization."
                "add_safe_globals([...])."
            ) from exc
        assert isinstance(loaded, dict)
        return loaded


class _ResumableLoader:
    """The train DataLoader, made resumable for Lightning's loops: its state is the epoch and
    the batches of it trained on (read from the loops, which know them exactly; the loader's
    own count runs ahead by the batches Lightning prefetched). After ``load_state_dict`` the
    next iteration of that epoch skips them. Everything else is the wrapped loader's."""

    def __init__(self, loader: Any, strategy: _Driver) -> None:
        self._loader = loader
        self._driver = strategy
        self._skip: tuple[int, int] | None = None

    def __getattr__(self, name: str) -> Any:  # sampler, batch_sampler, dataset, num_workers
        if name == "_loader":  # not set yet (a copy, an unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def __len__(self) -> int:
        return len(self._loader)

    def state_dict(self) -> dict[str, Any]:
        fit = self._driver.trainer().fit_loop
        return {"epoch": _epoch(fit), "batches": _processed(fit.epoch_loop.batch_progress.current)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._skip = (int(state_dict["epoch"]), int(state_dict["batches"]))

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # A generator: nothing below runs before the first batch is asked for, after Lightning
        # set this epoch on the sampler (a DistributedSampler's order is a function of it).
        skip = 0
        if self._skip is not None:
            epoch, batches = self._skip
            self._skip = None
            if epoch == _epoch(self._driver.trainer().fit_loop):
                skip = batches
        it = iter(self._loader)
        by_index = not isinstance(getattr(self._loader, "dataset", None), IterableDataset)
        if skip and by_index and isinstance(it, _SingleProcessDataLoaderIter):
            # No workers, a map-style dataset: step the index sampler only (torch's private
            # iterator fields, stable since torch 1.x), without loading the batches.
            for _ in range(skip):
                next(it._sampler_iter)
            it._num_yielded += skip
        elif skip:  # workers already hold indices, or an iterable dataset: consume batches
            yield from itertools.islice(it, skip, None)
            return
        yield from it


class _Driver:
    """The dckpt side of a strategy, shared by the strategies below (each forwards to it)."""

    def __init__(
        self,
        strategy: pl.strategies.Strategy,
        root: str | os.PathLike[str] | CheckpointConfig,
        manager_kwargs: dict[str, Any],
    ) -> None:
        self.strategy = strategy
        self.config = (
            root if isinstance(root, CheckpointConfig) else CheckpointConfig(root=os.fspath(root))
        )
        self.manager_kwargs = manager_kwargs
        self.manager: CheckpointManager | None = None
        self.lightning = _LightningState()
        self.pending: tuple[int, int, dict[str, Any]] | None = None  # (step, epoch, dump)
        self.last_saved: int | None = None
        self.from_dckpt = False  # the checkpoint being restored was dckpt's: already loaded
        self.rng_at_resume: dict[str, Any] | None = None
        self.losses: list[torch.Tensor] = []
        self.observed_step: int | None = None
        self.failing = False

    # --- Lightning's objects --------------------------------------------------------------

    def trainer(self) -> pl.Trainer:
        module = self.strategy.lightning_module
        assert module is not None, "the strategy has no LightningModule attached"
        return module.trainer

    @property
    def root(self) -> Path:
        return Path(self.config.directory)

    @staticmethod
    def links_dirs(trainer: pl.Trainer) -> list[str]:
        """The directories the checkpoint callbacks name their files in (resolved by their own
        setup, which runs before the strategy's)."""
        dirs = {getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks}
        return sorted(os.fspath(d) for d in dirs if d is not None)

    def agree(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` on rank 0, its result or its error the same on every rank: a path's
        verdict cannot differ between ranks (one raising while the others go on into a
        collective would leave them waiting out the timeout). Rank 0 raises its own error,
        the others a ``NotOwnedError`` (a refusal) or ``CheckpointError`` in its words."""
        verdict: tuple[Any, str | None, bool] = (None, None, False)
        error: Exception | None = None
        if self.strategy.is_global_zero:
            try:
                verdict = (decide(), None, False)
            except Exception as exc:  # an OSError too: every rank must hear of it
                error = exc
                verdict = (None, str(exc), isinstance(exc, NotOwnedError))
        result, words, refused = self.strategy.broadcast(verdict, src=0)
        if error is not None:
            raise error
        if words is not None:
            raise NotOwnedError(words) if refused else CheckpointError(f"on rank 0: {words}")
        return result

    # --- lifetime ---------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        """After the strategy set up the model and optimizers: build the manager (fit only)."""
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self.agree(lambda: [_prove_links_dir(d, make=True) for d in self.links_dirs(trainer)])
        optimizers = [getattr(o, "_optimizer", o) for o in self.strategy.optimizers]
        if len(optimizers) > 1:
            raise ValueError(
                f"dckpt's Lightning strategy saves one optimizer; configure_optimizers returned "
                f"{len(optimizers)}"
            )
        scaler = getattr(self.strategy.precision_plugin, "scaler", None)
        module = self.strategy.lightning_module
        assert module is not None and self.strategy.model is not None
        kwargs = dict(self.manager_kwargs)
        run_config = kwargs.pop("run_config", None)
        if run_config is None:  # the hyper-parameters are what shapes the run
            run_config = dict(module.hparams)
        state = TrainState(
            self.strategy.model,
            optimizers[0] if optimizers else None,
            scheduler=[cfg.scheduler for cfg in self.strategy.lr_scheduler_configs],
            scaler=scaler,
            extra={"lightning": self.lightning},
            seed=int(os.environ.get("PL_GLOBAL_SEED", "0")),
        )
        self.failing = False
        self.manager = CheckpointManager(self.config, state, run_config=run_config, **kwargs)

    def on_exception(self) -> None:
        self.failing = True
        self.pending = None  # a save Lightning asked for before the error: not taken

    def close(self) -> None:
        """Drain the save in flight and let go; its error raises, unless training already
        failed (then it is logged: the error in flight is the one to see)."""
        if self.manager is None:
            return
        manager, self.manager = self.manager, None
        try:
            manager.close()
        except Exception as exc:
            if not self.failing:
                raise
            log.error("dckpt: while closing after an error in training: %r", exc)

    # --- saving -----------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH) -> None:
        """Lightning asks for a checkpoint (every rank): keep the dump, take the save at the
        next step's start (see the module docstring), and point ``filepath`` at it."""
        trainer = self.trainer()
        if self.manager is None:
            raise RuntimeError("dckpt saves only while fitting (the manager is built in setup)")
        step = trainer.global_step
        if self.last_saved != step:  # a second file of a saved step is one more link
            rest = {
                k: v
                for k, v in checkpoint.items()
                if k not in ("state_dict", "optimizer_states", "lr_schedulers")
            }
            self.pending = (step, trainer.current_epoch, rest)  # a later dump of it wins
        # The directory proven (made private if missing) before the link goes in, every save:
        # an explicit trainer.save_checkpoint(path) may name any directory.
        links = self.agree(lambda: _prove_links_dir(Path(filepath).parent, make=True))
        if self.strategy.is_global_zero:
            name = Path(filepath).name
            target = self.root if name.startswith(_LAST) else self.root / step_dir_name(step)
            _link(links / name, target)

    def flush(self) -> None:
        """Take the save Lightning asked for, if any (every rank, the same step)."""
        if self.pending is None or self.manager is None:
            return
        step, epoch, rest = self.pending
        self.pending = None
        buf = io.BytesIO()
        if self.strategy.is_global_zero:
            torch.save(rest, buf)
        # Rank 0's dump is the checkpoint's, as in Lightning: the same bytes on every rank.
        self.lightning.blob = self.strategy.broadcast(buf.getvalue(), src=0)
        self.manager.save(step, epoch=epoch)
        self.last_saved = step

    def remove_checkpoint(self, filepath: _PATH) -> bool:
        """Remove a link ModelCheckpoint drops (the checkpoint stays, for dckpt's retention);
        False for what is not ours."""
        path = Path(filepath)
        if not path.is_symlink():
            return False
        if self.strategy.is_global_zero:
            path.unlink(missing_ok=True)
        return True

    # --- loading ----------------------------------------------------------------------------

    def load_checkpoint(self, path: _PATH, weights_only: bool | None) -> dict[str, Any]:
        """Whatever Lightning picked (every rank, the same path) is first proven one of the
        strategy's own links or the root itself (``_own_target``, on rank 0, its verdict on
        every rank), else refused before anything of it is read: Lightning never loads a
        file here. A ``last*`` link or the root: ``resume()`` (the newest verified, falling
        back past a damaged one); a step's link: ``load(step)``. Returns the dict Lightning
        restores the rest from; the model, optimizer and schedulers hold the checkpoint's
        values already. ``weights_only``: how the Lightning part is unpickled
        (``_LightningState.checkpoint``)."""
        step: int | None = self.agree(lambda: _own_target(path, self.root))
        if self.manager is None:
            raise RuntimeError(
                "dckpt loads a checkpoint only to fit (validate/test: load it with fit first, "
                "or export it with `dckpt export`)"
            )
        self.from_dckpt = True
        if step is None or Path(path).name.startswith(_LAST):
            report = self.manager.resume()
            resumed, report_step = report.resumed, report.step or 0
        else:
            report_step = step
            self.manager.load(report_step)
            resumed = True
        module = self.strategy.lightning_module
        assert module is not None
        if resumed:
            # dckpt put every generator back last; Lightning draws from them before the first
            # batch (a new DataLoader iterator): put them back again at that batch.
            self.rng_at_resume = rng.capture()
            checkpoint = self.lightning.checkpoint(report_step, weights_only)
            self.last_saved = int(checkpoint["global_step"])
        else:  # a link but nothing committed yet: Lightning restores the fresh objects
            checkpoint = {"pytorch-lightning_version": lightning_version}
        checkpoint["state_dict"] = module.state_dict()
        checkpoint["optimizer_states"] = [o.state_dict() for o in self.strategy.optimizers]
        checkpoint["lr_schedulers"] = [
            c.scheduler.state_dict() for c in self.strategy.lr_scheduler_configs
        ]
        return checkpoint

    # --- every step -------------------------------------------------------------------------

    def on_train_batch_start(self) -> None:
        """Before the step: observe the last step's loss, take a requested save, and, on the
        first batch after a resume, put back the RNG the save took."""
        self.observe()
        self.flush()
        if self.rng_at_resume is not None:
            rng.restore(self.rng_at_resume)
            self.rng_at_resume = None

    def after_optimizer_step(self) -> None:
        """Automatic optimization: the step's losses are all recorded by now; observe them
        before anything else can happen to the step (a kill at its end, say: the replay
        journal then holds it)."""
        module = self.strategy.lightning_module
        if module is not None and module.automatic_optimization:
            self.observe(self.trainer().global_step + 1)  # counted once this returns

    def record(self, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if isinstance(loss, torch.Tensor):
            self.losses.append(loss.detach())

    def observe(self, step: int | None = None) -> None:
        """The losses since the last optimizer step, as one value for ``step`` (default:
        the steps done): their mean over the batches and the ranks (the replay check
        compares rank 0's with its journal; the loss watch wants the same value on every
        rank). Manual optimization: observed at the next batch's start."""
        if self.manager is None:
            return
        step = self.trainer().global_step if step is None else step
        if not self.losses or step == self.observed_step:
            return
        mean = torch.stack(self.losses).float().mean()
        self.losses = []
        reduced = self.strategy.reduce(mean, reduce_op="mean")
        assert isinstance(reduced, torch.Tensor)
        self.manager.observe(float(reduced), step=step)
        self.observed_step = step

    def on_train_end(self) -> None:
        self.observe()
        self.flush()

    def wrap_dataloader(self, dataloader: object) -> object:
        module = self.strategy.lightning_module
        if module is None or module.trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        return _ResumableLoader(dataloader, self)


def _processed(tracker: Any) -> int:
    """A progress tracker's ``processed`` count (typed as the base tracker, which lacks it)."""
    return int(tracker.processed)


def _epoch(fit: Any) -> int:
    """The epoch the fit loop is in, as Lightning passes it to ``sampler.set_epoch``."""
    return _processed(fit.epoch_progress.current)


def _link(path: Path, target: Path) -> None:
    """``path`` -> ``target``, relative, replacing what is there in one rename. The link is
    made under a name of its own (random: nothing there to remove first, which another user
    of a shared directory could have put there, and which would stop the save) and renamed
    over ``path``; neither step follows a link. ``path.parent`` exists, proven by the caller
    (``_prove_links_dir``)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.dckpt-link")
    tmp.symlink_to(os.path.relpath(target.resolve(), path.parent.resolve()))
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --- whose paths ---------------------------------------------------------------------------
# A shared host is hostile: another user can make a ModelCheckpoint directory first, or put a
# file in one she can write, and ckpt_path="last" picks the newest last*.ckpt by mtime, which
# she sets. Lightning would load it, and dckpt's next save would seal her weights as verified.


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _existing(path: Path) -> Path:
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def _prove_links_dir(path: str | os.PathLike[str], *, make: bool) -> Path:
    """The real path of ``path``, a directory the strategy writes its links in and Lightning
    picks checkpoints from (a ModelCheckpoint's ``dirpath``), proven the job's own as the root
    is: a real directory (not a link) owned by the job's user or root that nobody else may
    write (a sticky one neither: it is used, not only passed through), and every directory on
    the way owned by the job's user or root, writable by others only when sticky, a link on
    the way the job's user's or root's (``dckpt.owned.check_ancestors``). ``make``: a missing
    one is made with the private mode, after the existing part of the way is proven (nothing
    is made inside another user's directory). Nothing is changed on a directory that exists.
    ``NotOwnedError`` in words otherwise."""
    if "://" in os.fspath(path):  # ModelCheckpoint takes fsspec URLs; a link is local
        raise NotOwnedError(
            f"ModelCheckpoint's directory {os.fspath(path)} is not on a local file system: "
            "dckpt's strategy keeps its links there, and proves the directory its job's own; "
            "give ModelCheckpoint(dirpath=...) a local directory (the checkpoints go to "
            "dckpt's root, an s3:// one included)"
        )
    given = Path(os.path.abspath(path))
    me = os.geteuid()
    fix = (
        "give ModelCheckpoint(dirpath=...) a directory of your own (one under "
        f"{os.path.expanduser('~')}, say; dckpt makes a missing one private)"
    )
    try:
        if make and not os.path.lexists(given):
            check_ancestors(_existing(given))  # before anything is made on the way
            make_dir(given, parents=True)
        st = os.lstat(given)
        if stat.S_ISLNK(st.st_mode):
            raise NotOwnedError(
                f"it is a symbolic link (owned by {owner_name(st.st_uid)}) to "
                f"{os.path.realpath(given)}: dckpt reads and writes its links only in a real "
                "directory, where no one but its owner decides what is found"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise NotOwnedError(f"it is not a directory (owned by {owner_name(st.st_uid)})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = "every user" if st.st_mode & stat.S_IWOTH else "its group"
            if st.st_uid == me:
                fix = f"run `chmod go-w {given}` if it is yours alone, or {fix}"
            raise NotOwnedError(
                f"it is owned by {owner_name(st.st_uid)} and {who} may write it (mode "
                f"{_mode(st)}): anyone who can write it can put a last*.ckpt there for "
                "ckpt_path='last' to pick"
            )
        return check_ancestors(given)  # its owner, and the way to it
    except NotOwnedError as exc:
        raise NotOwnedError(
            f"ModelCheckpoint's directory {given} is not this job's user's ({owner_name(me)}): "
            f"{exc}. dckpt's strategy writes its links there and resumes from what it finds "
            f"there; {fix}"
        ) from None


def _own_target(path: str | os.PathLike[str], root: Path) -> int | None:
    """What the checkpoint path Lightning hands over stands for, proven: None for the dckpt
    root (resume the newest verified step), N for its ``step-N`` directory. ``path`` is the
    root or a step directory itself, or one of the strategy's links: a symbolic link the job's
    user owns, in a directory ``_prove_links_dir`` proves, leading through such links only
    (ModelCheckpoint's ``save_last="link"`` links ``last.ckpt`` to a top-k link) to one of
    them. ``NotOwnedError`` in words for anything else, before anything of it is read; the
    path is not looked at again (the manager reads its own root)."""
    given = Path(os.path.abspath(path))
    me = os.geteuid()
    real_root = Path(os.path.realpath(root))
    fix = (
        f"remove it if you did not put it there (`rm {given}`), or pass "
        f"trainer.fit(ckpt_path={os.fspath(root)!r}) to resume dckpt's newest verified "
        "checkpoint whatever that directory holds (ckpt_path=None starts from scratch)"
    )

    def refuse(what: str) -> NotOwnedError:
        return NotOwnedError(
            f"Lightning's checkpoint path {given} {what}. dckpt's strategy resumes only its own "
            f"links (a symbolic link owned by this job's user {owner_name(me)}, in a "
            f"directory of the job's own, to the dckpt root {root} or one of its step-N "
            f"directories) and never lets Lightning load a file: its weights would be sealed "
            f"as verified at the next save. Nothing was loaded; {fix}"
        )

    cur = given
    for _ in range(_MAX_HOPS):
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            raise refuse(f"leads to {cur}, which does not exist") from None
        if not stat.S_ISLNK(st.st_mode):
            break
        this = "is" if cur == given else f"leads to {cur}, which is"
        if st.st_uid != me:
            raise refuse(
                f"{this} a symbolic link owned by {owner_name(st.st_uid)}: another user "
                "decides where it leads"
            )
        try:  # the user's directory as named; a later hop's as the kernel reaches it
            parent = cur.parent if cur == given else os.path.realpath(cur.parent)
            where = _prove_links_dir(parent, make=False)
        except NotOwnedError as exc:
            raise NotOwnedError(
                f"Lightning's checkpoint path {given}: {exc}. Nothing was loaded."
            ) from None
        # The next hop, relative to the proven directory; a ".." in it stays for the kernel to
        # read after what comes before it (os.path.realpath below does the same).
        cur = where / os.readlink(cur)
    else:
        raise refuse(f"is a chain of more than {_MAX_HOPS} symbolic links")
    real = Path(os.path.realpath(cur))
    if stat.S_ISDIR(st.st_mode):
        if real == real_root:
            return None
        match = STEP_RE.fullmatch(real.name)
        if match and real.parent == real_root:
            return int(match.group(1))
    kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
    if cur == given:
        return_what = (
            f"is {kind} owned by {owner_name(st.st_uid)} (mode {_mode(st)}), not a link "
            "dckpt's strategy made"
        )
    else:
        return_what = (
            f"leads to {real}, {kind} owned by {owner_name(st.st_uid)}, which is neither the "
            "dckpt root nor one of its step directories"
        )
    raise refuse(return_what)


class _DckptHooks(pl.strategies.Strategy):
    """The Lightning methods both strategies below route to their ``_Driver``; listed before
    Lightning's strategy in their bases, so each ``super()`` here is that strategy's."""

    def __init__(
        self,
        root: str | os.PathLike[str] | CheckpointConfig,
        *,
        run_config: dict[str, Any] | None = None,
        manager_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)  # the Lightning strategy's, next in the bases
        self._dckpt = _Driver(self, root, {**(manager_kwargs or {}), "run_config": run_config})

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._dckpt.setup(trainer)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Lightning's copy would be thrown away (dckpt reads the model itself); under
        # ModelParallelStrategy it would gather every shard to the CPU, for nothing.
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        self._dckpt.save_checkpoint(checkpoint, filepath)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if not self._dckpt.remove_checkpoint(filepath):
            super().remove_checkpoint(filepath)

    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # Never Lightning's own load (torch.load of whatever file is there): see _own_target.
        return self._dckpt.load_checkpoint(checkpoint_path, weights_only)

    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        output = super().training_step(*args, **kwargs)
        self._dckpt.record(output)
        return output

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._dckpt.after_optimizer_step()
        return output

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._dckpt.on_train_batch_start()

    def on_train_end(self) -> None:
        super().on_train_end()
        self._dckpt.on_train_end()

    def process_dataloader(self, dataloader: object) -> object:
        return self._dckpt.wrap_dataloader(super().process_dataloader(dataloader))

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._dckpt.on_exception()

    def teardown(self) -> None:
        try:
            self._dckpt.close()
        finally:
            super().teardown()


class DckptStrategy(_DckptHooks, DDPStrategy):
    """DDP whose checkpoints are dckpt's; see the module docstring.

    Args:
        root: the dckpt root (a directory or an ``s3://`` URL), or a ``CheckpointConfig``.
        run_config: compared on resume; default: the LightningModule's ``hparams``.
        manager_kwargs: further ``CheckpointManager`` arguments (``precision``,
            ``allow_config_changes``, ``strict_keys``, ``run_id``).
        **kwargs: ``DDPStrategy``'s.
    """

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the manager needs the wrapped model and the optimizer

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._dckpt.from_dckpt:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._dckpt.from_dckpt:
            super().load_optimizer_state_dict(checkpoint)


class DckptModelParallelStrategy(_DckptHooks, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2, tensor parallel) whose checkpoints are dckpt's; the
    same arguments as ``DckptStrategy`` (``**kwargs``: ``ModelParallelStrategy``'s)."""
