"""The construction every chunked trainer shares, written once: :class:`ChunkedTrainerSetup`; and what they
share in training: checkpoints that resume exactly and are used only once complete, and running out of
memory (a retry at a smaller batch with ``auto_find_batch_size``, or one clear error without it)."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import warnings

import torch

from chunkloss._compat import transformers as transformers_compat
from chunkloss._compat import trl as trl_compat

from . import _long_context as long_context
from ._common import apply_chunk_kernels, check_max_steps, chunk_options, peft_base, refuse
from ._head import add_chunked_head, allow_lm_head_adapter, check_head_supported, head_transforms
from ._nonfinite import NonFiniteLossWatch

__all__ = ["STATE_FILE", "ChunkedTrainerSetup", "is_complete_checkpoint", "last_complete_checkpoint",
           "prompt_learning_types", "teacher_head"]  # fmt: skip

#: Written last into each checkpoint of a chunked trainer (renamed into place): the state the trainer keeps
#: beyond transformers' (see ``ChunkedTrainerSetup._save_checkpoint``); its presence marks the checkpoint
#: complete.
STATE_FILE = "chunkloss_state.pt"


def last_complete_checkpoint(folder: str) -> str | None:
    """The ``checkpoint-N`` folder of ``folder`` with the highest N that holds :data:`STATE_FILE` (a save
    that was interrupted leaves a folder without it), or ``None``."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    steps = []
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        head, _, step = name.rpartition("-")
        complete = os.path.isfile(os.path.join(folder, name, STATE_FILE))
        if head == PREFIX_CHECKPOINT_DIR and step.isdigit() and complete:
            steps.append(int(step))
    return os.path.join(folder, f"{PREFIX_CHECKPOINT_DIR}-{max(steps)}") if steps else None


def _find_oom(exc: BaseException | None) -> torch.OutOfMemoryError | None:
    """The ``torch.OutOfMemoryError`` that ``exc`` is or was raised from (torch.compile and Triton launches
    wrap it), or ``None``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


# PEFT's prompt-learning adapters: prompt tuning and p-tuning prepend virtual tokens to the hidden states;
# prefix tuning hands the attention layers virtual keys and values (the hidden states keep their length).
PROMPT_TUNING, P_TUNING, PREFIX_TUNING = "PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING"


def prompt_learning_types(model) -> set[str]:
    """The PEFT types (``"PROMPT_TUNING"``, ``"P_TUNING"``, ``"PREFIX_TUNING"``) of ``model``'s
    prompt-learning adapters; empty for a model that is not a ``PeftModel``."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return set()
    return {str(getattr(c.peft_type, "value", c.peft_type)) for c in configs.values() if c.is_prompt_learning}


class ChunkedTrainerSetup(NonFiniteLossWatch, long_context.LongContextStep):
    """Mixin placed before the TRL trainer in a chunked trainer's bases: its constructor.

    The constructor takes exactly the TRL trainer's arguments (``inspect.signature`` of the chunked trainer is
    the TRL trainer's) and runs, in this order:

    1. :meth:`_refuse_early` with the arguments given (a dict by parameter name): refusals that need nothing
       built, before TRL loads models or tokenises data; the config's chunk options are validated too, and
       ``max_steps=0`` (which transformers runs as one step) is refused.
    2. TRL's constructor, which sees a LoRA adapter on ``lm_head`` as the plain ``nn.Linear`` under it when
       ``_trains_lm_head_lora`` (the chunked head trains it; TRL's fused head would not).
    3. :meth:`_refuse_built`: refusals that read the built trainer; then the prompt-learning adapters this
       trainer cannot train as TRL does (``_prompt_learning_refused``, and prefix tuning under gradient
       checkpointing, which drops the prefix's keys and values).
    4. ``chunk_kernels`` (:func:`apply_chunk_kernels`), the LM head's check and, when ``_patch_forward``, the
       chunked head on the trained model (:func:`add_chunked_head`). ``self.chunk_opts`` (the engine options)
       and ``self.head_transforms`` (``softcap``, ``logit_scale`` of the trained model) are set.
    5. :meth:`_setup_loss`: the trainer's own loss modules.

    In training it adds: checkpoints holding the state TRL's leave out
    (:data:`chunkloss._compat.trl.RESUMED_STATE`), marked complete by :data:`STATE_FILE`
    (``_save_checkpoint``, ``train``); and, per attempt of the training loop, a fresh start and the
    out-of-memory error as accelerate's retry needs it or as one that says what to do
    (``_inner_training_loop``); the first non-finite loss reported in one line (:class:`NonFiniteLossWatch`);
    and, while training or evaluating, none of the FutureWarnings of TRL's calls of transformers' deprecated
    checkpointing names (:func:`chunkloss._compat.trl.quiet_checkpointing_calls`).
    """

    _trains_lm_head_lora = True
    _patch_forward = True
    #: PEFT types refused, with what goes wrong with them in TRL's trainer, which fails on them mid-training
    #: (no objective to match).
    _prompt_learning_refused: tuple[tuple[str, ...], str] = ((), "")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        trl_cls = next(c for c in cls.__mro__ if c.__module__.startswith("trl."))
        cls._trl_trainer = trl_cls
        # A subclass without a constructor of its own takes TRL's arguments, unless it inherits a chunked
        # trainer's hand-written one (ChunkedMedusaTrainer's), which must keep running.
        inherited = cls.__init__
        generated = getattr(inherited, "_takes_trl_arguments", False)
        if "__init__" not in cls.__dict__ and (generated or inherited.__module__.startswith("trl.")):
            cls.__init__ = _init_with_signature_of(trl_cls)

    def _build(self, call: dict) -> None:
        self._refuse_early(call)
        if call.get("args") is not None:
            chunk_options(call["args"])
            check_max_steps(call["args"])
            long_context.enable(call["args"])
        model = call.get("model")
        adapter = allow_lm_head_adapter(model) if self._trains_lm_head_lora else contextlib.nullcontext()
        with adapter, warnings.catch_warnings():
            # The chunked loss takes the label smoothing itself (trl_compat.SFT_LABEL_SMOOTHING_WARNING).
            smoothing = trl_compat.SFT_LABEL_SMOOTHING_WARNING
            warnings.filterwarnings("ignore", message=smoothing, category=FutureWarning)
            super().__init__(**call)
        self._refuse_built()
        self._refuse_prompt_learning()
        apply_chunk_kernels(self)
        self._chunk_offload = long_context.offload_context(self)
        base = peft_base(self.accelerator.unwrap_model(self.model))
        check_head_supported(base)
        if self._patch_forward:
            add_chunked_head(base)
        self.chunk_opts = chunk_options(self.args)
        softcap, logit_scale = head_transforms(base.config)
        self.head_transforms = {"softcap": softcap, "logit_scale": logit_scale}
        self._setup_loss()

    # --- checkpoints -------------------------------------------------------------------------------------

    def _resumed_state(self) -> dict:
        """What a checkpoint holds beyond transformers' and TRL's own (:data:`trl_compat.RESUMED_STATE`)."""
        fetch = getattr(self, "fetch_deferred_metrics", None)
        if fetch is not None:
            fetch()  # the token counts still on the device join TRL's running total
        return trl_compat.resumed_state(self)

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' checkpoint, then :data:`STATE_FILE` (written to a temporary name and renamed, so it
        is whole or absent), then the deletion of old checkpoints beyond ``save_total_limit``, which
        transformers would otherwise run before this checkpoint is complete."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir = transformers_compat.output_dir(self, trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        state = self._resumed_state()
        self.accelerator.wait_for_everyone()  # every rank's shards are written
        if self.args.should_save:
            tmp = os.path.join(folder, STATE_FILE + ".tmp")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(folder, STATE_FILE))
            best = self.state.best_model_checkpoint
            rotate_checkpoints(run_dir, save_total_limit=limit, best_model_checkpoint=best, use_mtime=True)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        path = None if checkpoint is None else os.path.join(checkpoint, STATE_FILE)
        if path is not None and os.path.isfile(path):
            trl_compat.restore_state(self, torch.load(path, weights_only=False))

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """transformers' ``train``. ``resume_from_checkpoint=True`` resumes from the last *complete*
        checkpoint of ``output_dir`` (:func:`last_complete_checkpoint`): a save interrupted by a crash or a
        kill leaves a folder that transformers would pick and fail on. A path to such a folder is refused
        with the last complete one named."""
        if resume_from_checkpoint is True:
            found = last_complete_checkpoint(self.args.output_dir)
            if found is None:
                raise ValueError(
                    f"resume_from_checkpoint=True: no complete checkpoint in {self.args.output_dir} (a "
                    f"complete one holds {STATE_FILE})"
                )
            resume_from_checkpoint = found
        elif isinstance(resume_from_checkpoint, str) and not is_complete_checkpoint(resume_from_checkpoint):
            parent = os.path.dirname(os.path.normpath(resume_from_checkpoint))
            last = last_complete_checkpoint(parent)
            raise ValueError(
                f"resume_from_checkpoint: {resume_from_checkpoint} is incomplete (its save was interrupted: "
                f"no trainer_state.json or {STATE_FILE}); the last complete one is {last}"
            )
        self.__dict__.pop("_attempt_start", None)
        try:
            with trl_compat.quiet_checkpointing_calls():
                return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        finally:
            self.__dict__.pop("_attempt_start", None)

    def evaluate(self, *args, **kwargs):
        """transformers' ``evaluate``, without the FutureWarnings of TRL's checkpointing calls
        (:func:`chunkloss._compat.trl.quiet_checkpointing_calls`)."""
        with trl_compat.quiet_checkpointing_calls():
            return super().evaluate(*args, **kwargs)

    # --- running out of memory ----------------------------------------------------------------------------

    def _prepare_inputs(self, inputs):
        prepared = super()._prepare_inputs(inputs)
        if isinstance(prepared, dict):  # the shapes an out-of-memory error names
            self._batch_shapes = {
                k: tuple(v.shape)
                for k, v in prepared.items()
                if k.endswith("_ids") and isinstance(v, torch.Tensor) and v.ndim == 2
            }
        return prepared

    def _inner_training_loop(self, batch_size=None, *args, **kwargs):
        """transformers' loop; what one attempt leaves behind is reset before the next (with
        ``auto_find_batch_size``, the loop runs again at a smaller batch after running out of memory), and
        an out-of-memory error is re-raised as itself (not wrapped by torch.compile), or, without
        ``auto_find_batch_size``, as one that names the batch and what to do."""
        trl_compat.restore_state(self, self.__dict__.setdefault("_attempt_start", self._resumed_state()))
        trl_compat.clear_metrics(self)
        self.__dict__.pop("_pending_tokens", None)
        try:
            return super()._inner_training_loop(batch_size, *args, **kwargs)
        except Exception as exc:
            oom = _find_oom(exc)
            if oom is None:
                raise
            if self.args.auto_find_batch_size:
                if oom is exc:
                    raise
                raise oom from None  # accelerate retries only on the error itself
            raise torch.OutOfMemoryError(self._oom_message(batch_size, oom)) from exc

    def _oom_message(self, batch_size, oom) -> str:
        shapes = getattr(self, "_batch_shapes", {})
        batch = ", ".join(f"{k} {v}" for k, v in shapes.items()) or "before its first batch"
        last = last_complete_checkpoint(self.args.output_dir)
        resume = f"resume from {last}" if last else "no checkpoint was written"
        first = str(oom).split("\n")[0]
        size = batch_size or self.args.per_device_train_batch_size
        return (
            f"out of memory at per_device_train_batch_size={size} (the batch: {batch}): set "
            "auto_find_batch_size=True to retry at smaller batches, or lower per_device_train_batch_size "
            "(raising gradient_accumulation_steps keeps the effective batch) or the sequence length, or set "
            f"chunk_kernels=True and its recompute options; {resume}. ({first})"
        )

    def _refuse_early(self, call: dict) -> None:
        """Raise for arguments this trainer refuses (``call``: the constructor's arguments given, by name)."""

    def _refuse_built(self) -> None:
        """Raise for what this trainer refuses once TRL's constructor has built it."""

    def _setup_loss(self) -> None:
        """Build the trainer's chunked loss modules."""

    def _refuse_prompt_learning(self) -> None:
        kinds = prompt_learning_types(self.accelerator.unwrap_model(self.model))
        refused, what = self._prompt_learning_refused
        why = (
            f"TRL's {self._trl_trainer.__name__} fails on it mid-training ({what}), so there is no objective "
            "to match; prefix tuning and LoRA are supported"
        )
        for kind in sorted(kinds & set(refused)):
            refuse(type(self).__name__, f"PEFT {kind.lower()}", why)
        if PREFIX_TUNING in kinds and self.args.gradient_checkpointing:
            refuse(
                type(self).__name__,
                "PEFT prefix tuning with gradient_checkpointing=True",
                "transformers drops the prefix's past key values under gradient checkpointing (TRL's own "
                "trainer fails mid-training); set gradient_checkpointing=False",
            )


def is_complete_checkpoint(checkpoint: str) -> bool:
    """A checkpoint folder whose save finished: it holds :data:`STATE_FILE`, or (written by another trainer)
    a ``trainer_state.json`` that parses."""
    if os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
        return True
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            json.load(f)
    except (OSError, ValueError):
        return False
    return True


def teacher_head(trainer, patch: bool) -> None:
    """Check the LM head of ``trainer.teacher_model`` (errors name ``teacher_model``) and, with ``patch``,
    give the teacher the chunked head too (:func:`add_chunked_head`)."""
    teacher = peft_base(trainer.accelerator.unwrap_model(trainer.teacher_model))
    try:
        check_head_supported(teacher)
    except ValueError as e:
        raise ValueError(f"teacher_model: {e}") from None
    if patch:
        add_chunked_head(teacher)


def _init_with_signature_of(trl_cls):
    """A constructor taking ``trl_cls``'s arguments (its signature shown by ``inspect`` and ``help``) that
    binds them as ``trl_cls`` does (a wrong argument raises TRL's ``TypeError``) and runs
    :meth:`ChunkedTrainerSetup._build`."""
    signature = inspect.signature(trl_cls.__init__)

    def __init__(self, *args, **kwargs):
        call = dict(signature.bind(self, *args, **kwargs).arguments)
        del call["self"]
        ChunkedTrainerSetup._build(self, call)

    __init__.__signature__ = signature
    __init__._takes_trl_arguments = True
    __init__.__doc__ = f"``{trl_cls.__name__}``'s arguments; the class docstring says what is refused."
    return __init__
