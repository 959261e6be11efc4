"""dckpt with the Hugging Face ``Trainer``: a callback, through public hooks only.

Role: ``DckptCallback`` saves through dckpt at the Trainer's own cadence (``save_strategy``
``"steps"`` / ``"epoch"``, ``save_steps``; and on SIGTERM or SIGUSR1, at one agreed step) and
resumes verified before ``trainer.train()``, so that training goes on exactly where it stopped.
The Trainer's own saving is turned off by the callback: it clears ``control.should_save`` in the
hook where it saved, so no ``checkpoint-*`` folder is written (and the Trainer's SIGTERM
checkpoint, which rewrites a complete checkpoint in place, is refused).

How a script uses it::

    ckpt = DckptCallback("runs/exp1")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ckpt])
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer))
    ckpt.close()

How the resume is driven (public API only). The Trainer builds its optimizer, scheduler and
data loader inside ``train()``, and the position it trains from (the epoch its loop starts at,
the batches it skips) lives in locals computed from a ``trainer_state.json`` it reads from the
folder given to ``train(resume_from_checkpoint=...)``; no hook can change them later. So
``resume(trainer)`` runs before ``train()``:

1. the optimizer is made by ``trainer.create_optimizer()`` (public; ``train()`` then keeps it);
2. ``CheckpointManager.resume()`` verifies and restores, with fallback: the model (in place),
   the optimizer (DCP, sharded), every rank's RNG, and, in ``extra["hf_trainer"]``, the
   ``TrainerState`` and the LR scheduler's state, as JSON text;
3. a folder is written with that ``trainer_state.json`` (the Trainer's own format, verified
   bytes) and a weight index whose one shard is empty, so that the Trainer's model load reads
   no weight at all (the weights are dckpt's), and finds no optimizer, scheduler, scaler or RNG
   file, so it loads none; the Trainer then restores its state and skips the data it trained;
4. in ``on_train_begin`` the scheduler the Trainer made gets its verified state, the
   optimizer's groups get back the LR (and any other field) the restore gave them, which the
   new scheduler's constructor had reset to its start, and the step the Trainer resumed at is
   checked against dckpt's;
5. the RNG is set back to what dckpt restored where the Trainer's own resume sets it: at the
   start of the first epoch and, mid-epoch, after the first batch is fetched (opening the data
   loader's iterator draws from the global RNG, and did so in the run that stopped at the
   start of the epoch, not here).

Where a save is made: after everything that draws from the RNG for that step, as the README's
"Where save() goes" asks. The Trainer logs, then evaluates, after ``on_step_end``; a save is
made in ``on_evaluate`` when the step evaluates, else in ``on_log`` when it logs, else in
``on_step_end``. Losses go to ``manager.observe(loss, step=global_step)`` from ``on_log`` (the
replay check and the loss watch stay on); a logged loss that averages steps from before and
after a resume is not observed (it differs from the run that stopped by construction).

Invariants: everything in the checkpoint is the same on every rank (the TrainerState is rank
0's, broadcast inside ``save()``, as the Trainer writes rank 0's; dckpt's replica check fails a
save whose copies differ); RNG is saved per rank by the manager. The Trainer reads no byte of
model, optimizer, scheduler or RNG from a file of its own. This module imports transformers
itself, so ``import dckpt`` and ``import dckpt.integrations`` never do.

Supported: single process and DDP (``torchrun``). Not supported (refused at ``resume``):
``save_strategy="best"`` and ``load_best_model_at_end`` (they need the Trainer's folders),
DeepSpeed and FSDP (the optimizer is made after wrapping), ``enable_jit_checkpoint``, a
``model_init`` (``train()`` would build a new model after the resume). Not saved: the
Trainer's fp16 GradScaler (CPU and bf16 runs have none).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from ..config import CheckpointConfig
from ..errors import CheckpointError
from ..manager import CheckpointManager
from ..preemption import CHECK_EVERY_S
from ..train import rng
from ..train.state import TrainState

try:
    from transformers import (
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "dckpt.integrations.hf_trainer needs transformers: pip install dckpt[hf]"
    ) from exc

__all__ = ["DckptCallback"]

# The Trainer's file names (transformers.trainer / utils constants), spelled out: the module
# paths of those constants moved between releases; the names did not.
_TRAINER_STATE = "trainer_state.json"
_SAFE_INDEX = "model.safetensors.index.json"
_EMPTY_SHARD = "dckpt-no-weights.safetensors"
# TrainerState fields that differ per rank; every other one is the same on every rank (the
# losses and flos it records are all-reduced), as a replicated value must be.
_PER_RANK_FIELDS = ("is_local_process_zero", "is_world_process_zero")


class _TrainerParts:
    """``extra["hf_trainer"]``: the TrainerState and the LR scheduler's state, as JSON text.

    Text, not nested dicts: the resume runs before the Trainer builds its scheduler, and DCP
    fills only the keys a state dict names; a string leaf is filled whatever it holds. Taken
    when a save asks for it (inside ``save()``, as every category is), from the Trainer's live
    objects once ``attach`` gave them; before that (the resume) the values a load left."""

    def __init__(self) -> None:
        self.trainer_state = ""
        self.scheduler = ""
        self._live: tuple[TrainerState, TrainerControl, list[Any], Any] | None = None

    def attach(
        self, state: TrainerState, control: TrainerControl, callbacks: list[Any], scheduler: Any
    ) -> None:
        self._live = (state, control, callbacks, scheduler)

    def state_dict(self) -> dict[str, Any]:
        if self._live is not None:
            state, control, callbacks, scheduler = self._live
            # As the Trainer's own save does: the exportable callbacks' state, then the whole
            # TrainerState (global step, epoch, log history, best metric...).
            exported = cast(dict[str, Any], state.stateful_callbacks)  # a dict once built
            for cb in [*callbacks, control]:
                if isinstance(cb, ExportableState):
                    name = type(cb).__name__
                    if not isinstance(exported.get(name), list):
                        exported[name] = cb.state()
            saved = dataclasses.asdict(state)
            for per_rank in _PER_RANK_FIELDS:  # the Trainer sets them again at train()
                saved.pop(per_rank, None)
            self.trainer_state = _rank0s(json.dumps(saved, sort_keys=True))
            if scheduler is not None:
                try:
                    self.scheduler = json.dumps(scheduler.state_dict())
                except TypeError as exc:
                    raise CheckpointError(
                        f"the LR scheduler's state is not JSON ({exc}): DckptCallback saves it "
                        "as text; use a scheduler whose state_dict holds plain values"
                    ) from exc
        return {"trainer_state": self.trainer_state, "scheduler": self.scheduler}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer_state = str(state["trainer_state"])
        self.scheduler = str(state["scheduler"])


class DckptCallback(TrainerCallback):
    """Checkpoints of a ``Trainer`` run through dckpt; see the module docstring.

    Args:
        config: a ``CheckpointConfig``, or the checkpoint root (a directory or ``s3://`` URL).
        run_config: the run's configuration, stored in every manifest and compared on resume;
            default: the ``TrainingArguments`` that shape the run (see ``_run_config``).
        preemption: make SIGTERM and SIGUSR1 end the run at one agreed step, saved
            (``manager.watch_preemption``); ``deadline_s`` and ``check_every_s`` as there.
        manager_kwargs: passed to ``CheckpointManager`` (``run_id``, ``allow_config_changes``...).
    """

    def __init__(
        self,
        config: CheckpointConfig | str | os.PathLike[str],
        *,
        run_config: dict[str, Any] | None = None,
        preemption: bool = True,
        deadline_s: float = 120.0,
        check_every_s: float = CHECK_EVERY_S,
        **manager_kwargs: Any,
    ) -> None:
        self._config = config
        self._run_config = run_config
        self._preemption = preemption
        self._deadline_s = deadline_s
        self._check_every_s = check_every_s
        self._manager_kwargs = manager_kwargs
        self._parts = _TrainerParts()
        self._manager: CheckpointManager | None = None
        self._callbacks: list[Any] = []
        self._resumed_step: int | None = None
        self._rng: dict[str, Any] | None = None  # what the resume restored, set again later
        self._rng_at_step = False  # mid-epoch resume: set again after the first fetch
        self._groups: list[dict[str, Any]] = []  # the optimizer's groups as restored
        self._skip_first_loss = False  # the first logged loss straddles the resume
        self._last_logged = 0  # the step of the last logged loss (the Trainer's own rule)
        self._step_end: tuple[int, bool] | None = None  # (step, save?) awaiting its last hook
        self._done_step = -1  # the step whose end (save, preemption check) is done
        self._saved_step = -1  # the last step saved by this run
        self._folder: Path | None = None  # what train() reads its TrainerState from

    # --- public ------------------------------------------------------------------------------

    @property
    def manager(self) -> CheckpointManager:
        """The ``CheckpointManager`` (after ``resume``)."""
        if self._manager is None:
            raise CheckpointError(
                "DckptCallback: call trainer.train(resume_from_checkpoint=callback.resume("
                "trainer)): the resume runs before train()"
            )
        return self._manager

    def resume(self, trainer: Trainer) -> str | None:
        """Resume verified from the newest good checkpoint, before ``trainer.train()``.

        Returns what to pass as ``trainer.train(resume_from_checkpoint=...)``: a folder that
        holds the verified ``TrainerState`` and no weights (None on a fresh start). Call it on
        every rank, once, after the Trainer is built."""
        if self._manager is not None:
            raise CheckpointError("DckptCallback.resume() is called once per run")
        args = trainer.args
        _refuse_unsupported(trainer, args)
        self._callbacks = list(trainer.callback_handler.callbacks)
        # The Trainer keeps an optimizer it already has (create_optimizer returns it), so the
        # one restored here is the one it steps. Made before train() wraps the model (DDP):
        # the parameters are the same tensors.
        optimizer = trainer.create_optimizer()
        model = trainer.model
        assert isinstance(model, torch.nn.Module)  # _refuse_unsupported: there is one
        state = TrainState(model, optimizer, extra={"hf_trainer": self._parts}, seed=int(args.seed))
        run_config = self._run_config if self._run_config is not None else _run_config(args)
        self._manager = CheckpointManager(
            self._config, state, run_config=run_config, **self._manager_kwargs
        )
        report = self._manager.resume()
        if self._preemption:
            self._manager.watch_preemption(
                deadline_s=self._deadline_s, check_every_s=self._check_every_s
            )
        if not report.resumed or report.step is None:
            return None
        self._resumed_step = self._last_logged = report.step
        # The scheduler the Trainer builds in train() sets the groups' LR (and a cyclic one
        # the momentum) to its start: the restored values are put back after it is built.
        self._groups = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
        self._rng = rng.capture()  # as the manager restored it: this rank's own
        saved = json.loads(self._parts.trainer_state)
        # A logged loss averages the steps since the last log: the first one after the resume
        # equals the run that stopped's only when that run logged at the step saved.
        self._skip_first_loss = not any(
            e.get("step") == report.step and "loss" in e for e in saved.get("log_history", [])
        )
        self._folder = _resume_folder(model, self._parts.trainer_state)
        return str(self._folder)

    def close(self) -> None:
        """Drain the save in flight and release dckpt's groups (done at ``on_train_end`` too);
        raises if any save failed."""
        self._drop_folder()
        if self._manager is not None:
            self._manager.close()

    def _drop_folder(self) -> None:
        """The folder ``resume`` wrote for ``train()`` goes once read, or at ``close``: a
        run that never began training (its start refused) does not leave it in /tmp."""
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    # --- hooks -------------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.manager  # noqa: B018 - raises when resume() was not called
        scheduler = kwargs.get("lr_scheduler")
        self._drop_folder()  # read by now: train() looks only for RNG files later
        if state.global_step != (self._resumed_step or 0):
            raise CheckpointError(
                f"the Trainer starts at step {state.global_step}, dckpt resumed "
                + (f"step {self._resumed_step}" if self._resumed_step else "nothing")
                + ": pass resume_from_checkpoint=callback.resume(trainer) to trainer.train(), "
                "and nothing else"
            )
        if self._resumed_step is not None:
            if self._parts.scheduler and scheduler is not None:
                scheduler.load_state_dict(json.loads(self._parts.scheduler))
            optimizer = self.manager.state.optimizer
            assert optimizer is not None
            for group, saved in zip(optimizer.param_groups, self._groups, strict=True):
                group.update(saved)
            steps = _update_steps_per_epoch(
                kwargs.get("train_dataloader"), args.gradient_accumulation_steps
            )
            # Mid-epoch the Trainer skips batches and opens the epoch's iterator (which draws
            # from the global RNG) now, where the run that stopped opened it at the epoch's
            # start: the RNG is set again after the first fetch, as the Trainer's resume does.
            self._rng_at_step = steps is not None and state.global_step % steps != 0
        self._parts.attach(state, control, self._callbacks, scheduler)

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._rng is not None:  # the first epoch after a resume, before its iterator opens
            rng.restore(self._rng)
            if not self._rng_at_step:
                self._rng = None

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._rng is not None:  # mid-epoch: after the first fetch
            rng.restore(self._rng)
            self._rng = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        return self._after_flow(state, control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        return self._after_flow(state, control)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> TrainerControl:
        loss = (logs or {}).get("loss")
        if loss is None:  # an eval's metrics, the run's summary
            return control
        self._last_logged = state.global_step
        if self._skip_first_loss:
            self._skip_first_loss = False
        else:
            self.manager.observe(float(loss), step=state.global_step)
        if not control.should_evaluate:
            self._end_of_step(state, control)
        return control

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self._end_of_step(state, control)
        return control

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_of_step(state, control)  # a hook it waited for never came
        self.close()

    # --- internals ---------------------------------------------------------------------------

    def _after_flow(self, state: TrainerState, control: TrainerControl) -> TrainerControl:
        """After the Trainer's DefaultFlowCallback decided this step's log, eval and save (it
        runs before any user callback): take the save from the Trainer, and make it once what
        draws from the RNG for this step is done. The Trainer logs, then evaluates, after this
        hook: the step ends in ``on_evaluate`` when it evaluates, else in ``on_log`` when it
        logs (the Trainer's own rule: a step after the last logged one), else here."""
        step = state.global_step
        wanted = bool(control.should_save)
        control.should_save = False  # the Trainer's own checkpoint is never written
        if self._step_end is not None and self._step_end[0] != step:
            self._end_of_step(state, control)  # cannot happen with the Trainer's order
        if step == self._done_step and not wanted:
            return control  # on_epoch_end after its last step ended: nothing new
        if self._step_end is not None:
            wanted = wanted or self._step_end[1]
        self._step_end = (step, wanted)
        logs = bool(control.should_log) and step > self._last_logged
        if not (logs or control.should_evaluate):
            self._end_of_step(state, control)
        return control

    def _end_of_step(self, state: TrainerState, control: TrainerControl) -> None:
        """Save the step if it was due, then ask whether a signal ends the run here (every
        rank, once per step: ``preempted`` agrees with the other ranks now and then)."""
        if self._step_end is None:
            return
        step, wanted = self._step_end
        self._step_end = None
        manager = self.manager
        if wanted and step != self._saved_step:  # (an epoch's end after a preemption's save)
            manager.save(step, epoch=int(state.epoch or 0))
            self._saved_step = step
        if self._preemption and step != self._done_step and manager.preempted(step):
            control.should_training_stop = True
            self._saved_step = step  # committed: preempted() saved it if nothing had
        self._done_step = step


def _rank0s(text: str) -> str:
    """Rank 0's ``text`` on every rank: the TrainerState the Trainer itself writes is rank
    0's, and its log history holds per-rank values (an eval's runtime and samples per second)
    that a replicated value must not. One broadcast on the training group, made inside
    ``save()``, which every rank calls at the same point (the only caller once attached)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return text
    box: list[Any] = [text]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _refuse_unsupported(trainer: Trainer, args: TrainingArguments) -> None:
    why = []
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "best" or args.load_best_model_at_end:
        why.append("save_strategy='best' and load_best_model_at_end need the Trainer's folders")
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(
        trainer, "is_fsdp_enabled", False
    ):
        why.append("DeepSpeed and FSDP make the optimizer after wrapping the model")
    if getattr(args, "enable_jit_checkpoint", False):
        why.append(
            "enable_jit_checkpoint: the Trainer's SIGTERM checkpoint would race dckpt's "
            "(DckptCallback saves on SIGTERM itself)"
        )
    model: object = trainer.model  # None when the Trainer was given only a model_init
    model_init: object = getattr(trainer, "model_init", None)
    if model_init is not None or not isinstance(model, torch.nn.Module):
        why.append("model_init: train() would build a new model after the resume")
    if trainer.optimizer is None and trainer.lr_scheduler is not None:
        why.append("a scheduler given without its optimizer")
    if why:
        raise CheckpointError("DckptCallback cannot run this Trainer: " + "; ".join(why))


def _run_config(args: TrainingArguments) -> dict[str, Any]:
    """The TrainingArguments that shape the run, under the names dckpt's config check knows
    (a change of learning rate, batch, schedule or seed is refused on resume)."""
    return {
        "learning_rate": args.learning_rate,
        "weight_decay": args.weight_decay,
        "betas": [args.adam_beta1, args.adam_beta2],
        "eps": args.adam_epsilon,
        "grad_clip": args.max_grad_norm,
        "optim": str(getattr(args.optim, "value", args.optim)),
        "lr_schedule": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "warmup_steps": args.warmup_steps,
        "batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "seed": args.seed,
        "data_seed": args.data_seed,
        "max_steps": args.max_steps,
        "num_train_epochs": args.num_train_epochs,
        "save_steps": args.save_steps,
        "logging_steps": args.logging_steps,
        "output_dir": args.output_dir,
    }


def _update_steps_per_epoch(loader: Any, accumulation: int) -> int | None:
    """Optimizer steps per epoch, as the Trainer counts them (None: a loader of no length)."""
    try:
        batches = len(loader)
    except TypeError:
        return None
    return max(math.ceil(batches / accumulation), 1)


def _resume_folder(model: torch.nn.Module, trainer_state: str) -> Path:
    """A folder for ``train(resume_from_checkpoint=...)``: the verified TrainerState, and a
    weight index naming every key of the model with one empty shard, so that the Trainer's
    model load loads nothing and warns of no missing key. No optimizer, scheduler, scaler or
    RNG file: the Trainer loads those only when it finds them. Private to this rank."""
    from safetensors.torch import save_file

    folder = Path(tempfile.mkdtemp(prefix="dckpt-hf-resume-"))
    (folder / _TRAINER_STATE).write_text(trainer_state, encoding="utf-8")
    save_file({}, str(folder / _EMPTY_SHARD))
    index = {"metadata": {"dckpt": "weights restored by dckpt"}, "weight_map": {}}
    index["weight_map"] = {key: _EMPTY_SHARD for key in model.state_dict()}
    (folder / _SAFE_INDEX).write_text(json.dumps(index), encoding="utf-8")
    return folder
