"""The construction every chunked trainer shares, written once: :class:`ChunkedTrainerSetup`, with the
refusals each trainer adds; and the mixins it brings for training: checkpoints (:mod:`._resume`), running out
of memory (:mod:`._oom`), the first non-finite loss (:mod:`._nonfinite`) and long sequences
(:mod:`._long_context`)."""

from __future__ import annotations

import contextlib
import inspect
import warnings

from chunkloss._compat import trl as trl_compat

from . import _long_context as long_context
from ._arguments import check_max_steps, chunk_options
from ._common import peft_base, refuse
from ._compile import compile_layers
from ._head import add_chunked_head, allow_lm_head_adapter, check_head_supported, head_transforms
from ._kernel_policy import apply_chunk_kernels
from ._nonfinite import NonFiniteLossWatch
from ._oom import OutOfMemoryRetry
from ._resume import ResumableCheckpoints

__all__ = ["ChunkedTrainerSetup", "prompt_learning_types", "teacher_head"]

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


class ChunkedTrainerSetup(
    ResumableCheckpoints, OutOfMemoryRetry, NonFiniteLossWatch, long_context.LongContextStep
):
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
    4. ``chunk_kernels`` (:func:`apply_chunk_kernels`), under ``torch_compile`` the decoder layers compiled
       (:func:`compile_layers`), the LM head's check and, when ``_patch_forward``, the
       chunked head on the trained model (:func:`add_chunked_head`). ``self.chunk_opts`` (the engine options)
       and ``self.head_transforms`` (``softcap``, ``logit_scale`` of the trained model) are set.
    5. :meth:`_setup_loss`: the trainer's own loss modules.

    In training it adds, through its bases: checkpoints that hold the state TRL's leave out and are used only
    once complete (:class:`~chunkloss.trainers._resume.ResumableCheckpoints`); per attempt of the training
    loop, a fresh start and the out-of-memory error as accelerate's retry needs it or as one that says what to
    do (:class:`~chunkloss.trainers._oom.OutOfMemoryRetry`); the first non-finite loss reported in one line
    (:class:`NonFiniteLossWatch`); each step inside ``chunk_long_context``'s offloading
    (:class:`~chunkloss.trainers._long_context.LongContextStep`); and, while training or evaluating, none of
    the FutureWarnings of TRL's calls of transformers' deprecated checkpointing names
    (:func:`chunkloss._compat.trl.quiet_checkpointing_calls`).
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
        compile_layers(self)
        self._chunk_offload = long_context.offload_context(self)
        long_context.check_host_memory(self)
        base = peft_base(self.accelerator.unwrap_model(self.model))
        check_head_supported(base)
        if self._patch_forward:
            add_chunked_head(base)
        self.chunk_opts = chunk_options(self.args)
        softcap, logit_scale = head_transforms(base.config)
        self.head_transforms = {"softcap": softcap, "logit_scale": logit_scale}
        self._setup_loss()

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """transformers' ``train``, resuming only from a complete checkpoint
        (:meth:`ResumableCheckpoints.train <chunkloss.trainers._resume.ResumableCheckpoints.train>`), without
        the FutureWarnings of TRL's checkpointing calls."""
        with trl_compat.quiet_checkpointing_calls():
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def evaluate(self, *args, **kwargs):
        """transformers' ``evaluate``, without the FutureWarnings of TRL's checkpointing calls
        (:func:`chunkloss._compat.trl.quiet_checkpointing_calls`)."""
        with trl_compat.quiet_checkpointing_calls():
            return super().evaluate(*args, **kwargs)

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
