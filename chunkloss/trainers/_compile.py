"""``torch_compile=True`` on a chunked trainer: regional compilation, each decoder layer compiled in place.

The decoder layers of a model are one class with one forward, so with parameters traced as inputs (Dynamo's
default) one graph serves them all: the first layer compiles, the others reuse it, and a model of any depth
compiles in the time of one layer (torchtune and Unsloth compile so; PyTorch's "regional compilation"
recipe). The embedding, the final norm and the chunked head stay eager: they run once a step, and the
chunked head has its own loop, whose per-chunk step ``chunk_compile`` compiles. accelerate's compile of the
model whole is then turned off for this trainer (its dynamo backend set to ``no``). ``chunk_compile_layers=
False`` leaves the model to accelerate (compiled whole; the chunked head not traced either way).
"""

from __future__ import annotations

import logging

from ._arguments import ChunkedArguments
from ._common import decoder_layers

__all__ = ["compile_layers"]


def compile_layers(trainer) -> None:
    """Compile each decoder layer of the trainer's model in place (``nn.Module.compile``) with the config's
    ``torch_compile_backend`` and ``torch_compile_mode``, when ``torch_compile`` and
    ``chunk_compile_layers`` are on and the model has a list of decoder layers."""
    from accelerate.utils import DynamoBackend

    args = trainer.args
    if not args.torch_compile or not ChunkedArguments.of(args).chunk_compile_layers:
        return
    layers = decoder_layers(trainer)
    if not layers:
        logging.getLogger("chunkloss.trainers").warning(
            "%s: torch_compile compiles the model whole: it has no list of decoder layers",
            type(trainer).__name__,
        )
        return
    options = {"backend": args.torch_compile_backend or "inductor"}
    if args.torch_compile_mode:
        options["mode"] = args.torch_compile_mode
    for layer in layers:
        layer.compile(**options)
    trainer.accelerator.state.dynamo_plugin.backend = DynamoBackend.NO
