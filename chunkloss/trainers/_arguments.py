"""The chunkloss fields of the chunked trainers' configs (:class:`ChunkedArguments`), and reading them: the
engine options (:func:`chunk_options`) and the checks of a config that need nothing built."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chunkloss.engine.options import check_chunk_size

__all__ = ["ACCUM_DTYPES", "ChunkedArguments", "check_max_steps", "chunk_options", "parse_accum_dtype"]

#: ``chunk_accum_dtype``'s accepted names, by canonical name first; None: the weight's own dtype.
ACCUM_DTYPES: dict[str, torch.dtype | None] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "weight": None,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "none": None,
}
#: The canonical name of each accumulator dtype (the first name of ``ACCUM_DTYPES`` that maps to it).
_ACCUM_NAMES = {dtype: name for name, dtype in reversed(ACCUM_DTYPES.items())}


def parse_accum_dtype(value: str | torch.dtype | None) -> str:
    """The canonical name (``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"weight"``) of a
    ``chunk_accum_dtype`` given as one of :data:`ACCUM_DTYPES`' names (YAML and the command line give
    strings), a ``torch.dtype`` among them, or None (the weight's dtype); ``ValueError`` otherwise."""
    if isinstance(value, str) and value in ACCUM_DTYPES:
        return _ACCUM_NAMES[ACCUM_DTYPES[value]]
    if (value is None or isinstance(value, torch.dtype)) and value in _ACCUM_NAMES:
        return _ACCUM_NAMES[value]
    raise ValueError(
        f"chunk_accum_dtype must be one of {list(ACCUM_DTYPES)} or torch.float32, torch.bfloat16, "
        f"torch.float16 or None, got {value!r}"
    )


@dataclass
class ChunkedArguments:
    """chunkloss fields added to TRL's config classes (the defaults need no tuning).

    Args:
        chunk_size: rows of logits per chunk; ``None`` sizes chunks to a 448 MiB logits budget.
        chunk_accum_dtype: dtype of the LM-head gradient accumulator across chunks: ``"float32"`` (default),
            ``"bfloat16"``, ``"float16"`` or ``"weight"`` (the weight's own dtype), their short names
            (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"none"``), or the ``torch.dtype`` (None for the weight's);
            kept as its canonical name, read as a ``torch.dtype`` from :attr:`accum_dtype`.
        chunk_compile: run the per-chunk math under ``torch.compile``.
        chunk_compile_layers: under ``torch_compile=True``, compile each decoder layer once, in place
            (regional compilation: one graph for every layer), rather than the model whole; the embedding,
            final norm and chunked head run eagerly (:mod:`chunkloss.trainers._compile`). On by default;
            ``False``: accelerate compiles the model whole (the chunked head is still not traced).
        chunk_kernels: run the model on chunkloss's Triton kernels (``chunkloss.models.patch(model,
            loss=False)``: RMSNorms, rotary embedding, each layer's input norm, q/k/v projections and rotary
            embedding as one fused call, the gated MLPs, and LoRA adapters inside those calls), and a
            reference or teacher model too. ``None`` (the default): on when the model is on CUDA, of a
            supported type and ``use_liger_kernel`` is off, else off with one log line saying why; ``True``:
            required (the trainer is refused when it cannot be); ``False``: off. See
            :func:`apply_chunk_kernels`.
        chunk_kernels_mlp_recompute: with ``chunk_kernels``, the fused MLP saves only its input and replays
            the gate/up GEMM in the backward (``patch(..., mlp_recompute=True)``): less activation memory, one
            more GEMM per MLP. Off by default (the gate and up pre-activations are saved).
        chunk_kernels_norm_recompute: with ``chunk_kernels``, the decoder layers keep no output of the norms
            before attention and MLP for the backward, which runs those norms again
            (``patch(..., norm_recompute=True)``): 2·H fewer elements per token and layer. Off by default.
        chunk_kernels_mlp_tile: with ``chunk_kernels``, tokens per tile of the fused MLP
            (``patch(..., mlp_tile=...)``): its (tokens, intermediate) tensors exist for one tile at a time.
            None: one call over all tokens, or 8192-token tiles under ``chunk_long_context``.
        chunk_long_context: train long sequences: checkpointing on, what it keeps (each layer's input)
            offloaded to pinned host memory on a side stream by TRL's activation offloading, and with the
            kernels the MLP recomputed and tiled and the attention's norm recomputed
            (:mod:`chunkloss.trainers._long_context`). Off by default.
        chunk_fp8: ``"base"``: a PEFT LoRA model's frozen q/k/v, o, gate, up and down base weights stored in
            float8 e4m3 with one scale per output row (:func:`chunkloss.models.quantize_base_fp8`) and their
            GEMMs run in fp8 inside the fused kernels; the adapters, norms and LM head keep the model's dtype.
            Needs the kernels and a device with fp8 GEMMs (CUDA compute capability 8.9 or newer). It halves
            the base weights' bytes; at the Llama-3.1-8B shape (4 × 2048 tokens, H100) its step takes 0.86×
            the bf16 LoRA step. Smaller shapes are not measured: there the fp8 GEMMs save less than the
            quantisation costs (docs/design.md, "An FP8 base for LoRA").
            ``"train"``: full fine-tuning in float8 through torchao's float8 training
            (:func:`chunkloss.models.float8_training`, its ``tensorwise`` recipe): every linear layer but the
            LM head runs its three GEMMs in float8; needs torchao (``pip install 'chunkloss[fp8]'``), a
            model that is not a PEFT model and a device with fp8 GEMMs; the kernels, when on, keep the norms,
            RoPE and the gating. ``None`` (the default): off.

    A config of TRL's own (what a trainer builds when given none) has none of these fields: :meth:`of`
    reads them from any config, the defaults where it has none. A chunked config checks them when it is
    built (``CheckpointingDefault.__post_init__`` calls :meth:`__post_init__`: TrainingArguments' does not
    call its bases').
    """

    chunk_size: int | None = field(
        default=None, metadata={"help": "Rows of logits per chunk (None: automatic)."}
    )
    chunk_accum_dtype: str = field(
        default="float32",
        metadata={
            "help": "LM-head gradient accumulator dtype: float32, bfloat16, float16 or weight (the weight's "
            "own dtype)."
        },
    )
    chunk_compile: bool = field(
        default=True, metadata={"help": "Compile the per-chunk loss with torch.compile."}
    )
    chunk_compile_layers: bool = field(
        default=True,
        metadata={
            "help": "With torch_compile: compile each decoder layer once, in place (regional compilation), "
            "rather than the model whole. False: accelerate compiles the model whole."
        },
    )
    chunk_kernels: bool | None = field(
        default=None,
        metadata={
            "help": "Run the model's RMSNorm, rotary embedding, attention input (norm + q/k/v + rotary as "
            "one call) and gated MLP on chunkloss's Triton kernels, LoRA adapters inside them "
            "(chunkloss.models.patch(model, loss=False); a reference/teacher model of a supported type too): "
            "less activation memory, faster steps. None (default): on when the model is on CUDA, of a "
            "supported type (llama, mistral, qwen2, qwen3, gemma, gemma2: "
            "chunkloss.models.SUPPORTED_MODEL_TYPES) and use_liger_kernel is off; otherwise off, with one "
            "log line saying why. True: required (refused when impossible). False: off; results then equal "
            "TRL's up to rounding."
        },
    )
    chunk_kernels_mlp_recompute: bool = field(
        default=False,
        metadata={
            "help": "With chunk_kernels: the fused MLP saves only its input and replays the gate/up GEMM in "
            "the backward (chunkloss.models.patch(model, mlp_recompute=True)): less activation memory, one "
            "more GEMM per MLP."
        },
    )
    chunk_kernels_norm_recompute: bool = field(
        default=False,
        metadata={
            "help": "With chunk_kernels: the decoder layers keep no output of the norms before attention and "
            "MLP for the backward, which runs those norms again (chunkloss.models.patch(model, "
            "norm_recompute=True)): 2*H fewer activation elements per token and layer."
        },
    )
    chunk_kernels_mlp_tile: int | None = field(
        default=None,
        metadata={
            "help": "With chunk_kernels: tokens per tile of the fused MLP (chunkloss.models.patch(model, "
            "mlp_tile=N)); its (tokens, intermediate) tensors exist for one tile at a time. None: no tiles, "
            "or 8192 under chunk_long_context."
        },
    )
    chunk_long_context: bool = field(
        default=False,
        metadata={
            "help": "Train long sequences: gradient checkpointing on, each checkpointed layer input "
            "offloaded to pinned CPU memory on a side stream (TRL's activation offloading), and with "
            "chunk_kernels the MLP recomputed and tiled and the attention's norm recomputed."
        },
    )
    chunk_fp8: str | None = field(
        default=None,
        metadata={
            "help": "'base': store a PEFT LoRA model's frozen projection weights in float8 e4m3 (one scale "
            "per output row) and run their GEMMs in fp8 inside chunkloss's kernels (needs chunk_kernels and "
            "CUDA compute capability 8.9+); it halves the base weights' bytes and takes 0.86x the bf16 LoRA "
            "step at Llama-3.1-8B (H100; smaller shapes not measured). 'train': full fine-tuning in float8 "
            "through torchao (every linear layer but the LM head; needs torchao). None (default): off."
        },
    )

    def __post_init__(self):
        self.chunk_accum_dtype = parse_accum_dtype(self.chunk_accum_dtype)
        check_chunk_size(self.chunk_size)

    @property
    def accum_dtype(self) -> torch.dtype | None:
        """``chunk_accum_dtype`` as the engine's ``accum_dtype``: a ``torch.dtype``, None for the weight's."""
        return ACCUM_DTYPES[self.chunk_accum_dtype]

    @classmethod
    def of(cls, args) -> ChunkedArguments:
        """The chunkloss fields of ``args``: ``args`` itself when it has them, else the defaults (TRL's own
        config)."""
        return args if isinstance(args, ChunkedArguments) else cls()


def chunk_options(args) -> dict:
    """The engine options (``chunk_size``, ``accum_dtype``, ``compile``) from a config, TRL's own or ours."""
    chunked = ChunkedArguments.of(args)
    check_chunk_size(chunked.chunk_size)  # a value set after the config was built
    return {
        "chunk_size": chunked.chunk_size,
        "accum_dtype": chunked.accum_dtype,
        "compile": bool(chunked.chunk_compile),
    }


def check_max_steps(args) -> None:
    """``max_steps`` is a step count (at least 1) or negative (transformers' "train ``num_train_epochs``");
    0, which transformers runs as one step, is refused."""
    if args.max_steps == 0:
        raise ValueError(
            "max_steps=0 would train one step (transformers runs at least one): set max_steps to the number "
            "of steps, or -1 (the default) to train num_train_epochs epochs"
        )
