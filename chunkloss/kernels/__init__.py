"""Triton kernels (RMSNorm, LayerNorm, RoPE, SwiGLU, GeGLU, the gated MLP, the attention input), with LoRA
and QLoRA (a frozen base weight materialised for each GEMM: ``FrozenWeight``) or an FP8 base
(``Float8Weight``: e4m3 with a scale per output row, its GEMMs in fp8).

Every kernel has a pure-PyTorch ``*_ref`` beside it that matches the corresponding ``transformers`` module.
This package imports nothing from the rest of chunkloss; :func:`chunkloss.models.patch` puts the kernels into
a transformers model.
"""

from .attention_input import attention_input, attention_input_ref
from .fp8 import Float8Linear, Float8Weight, fp8_linear, fp8_linear_ref
from .frozen import FrozenWeight
from .glu import GeGLU, SwiGLU, geglu, geglu_ref, swiglu, swiglu_ref
from .layer_norm import LayerNorm, layer_norm, layer_norm_ref
from .lora import LoraAdapter, lora_linear, lora_linear_ref
from .mlp import FusedGatedMLP, gated_mlp, gated_mlp_ref
from .rms_norm import RMSNorm, rms_norm, rms_norm_ref
from .rope import ApplyRotaryPosEmb, apply_rotary_pos_emb, apply_rotary_pos_emb_ref

__all__ = [
    "RMSNorm",
    "rms_norm",
    "rms_norm_ref",
    "LayerNorm",
    "layer_norm",
    "layer_norm_ref",
    "ApplyRotaryPosEmb",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_ref",
    "SwiGLU",
    "GeGLU",
    "swiglu",
    "swiglu_ref",
    "geglu",
    "geglu_ref",
    "FusedGatedMLP",
    "gated_mlp",
    "gated_mlp_ref",
    "attention_input",
    "attention_input_ref",
    "LoraAdapter",
    "FrozenWeight",
    "Float8Weight",
    "Float8Linear",
    "fp8_linear",
    "fp8_linear_ref",
    "lora_linear",
    "lora_linear_ref",
]
