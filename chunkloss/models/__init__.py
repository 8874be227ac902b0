"""transformers / PEFT integration: what puts chunkloss's kernels and losses into a causal LM.

Sits above :mod:`chunkloss.kernels` and the losses: it imports both, neither imports it.

Example::

    from chunkloss.models import patch
    model = patch(AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-0.6B", dtype=torch.bfloat16))
    loss = model(input_ids=ids, labels=ids).loss   # output.logits is None: the loss never builds them
"""

from .fp8 import float8_training, quantize_base_fp8
from .patch import SUPPORTED_MODEL_TYPES, patch

__all__ = ["SUPPORTED_MODEL_TYPES", "float8_training", "patch", "quantize_base_fp8"]
