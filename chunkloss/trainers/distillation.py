"""``ChunkedDistillationTrainer``: TRL's ``DistillationTrainer`` with the divergence computed by chunkloss's
``FusedLinearJSDLoss`` instead of TRL's ``ChunkedDivergenceFunction``.

Same constructor, same config (``ChunkedDistillationConfig`` adds the chunkloss fields), same generation of
the student's completions (transformers or vLLM), same tool-calling loop and the same logged metrics: only
``_compute_loss`` changes. The loss equals TRL's ``_chunked_divergence_loss``: the generalized JSD with
``args.beta`` between the student's and the teacher's next-token distributions at ``args.temperature``
(the DistillationTrainer passes its temperature to the divergence, unlike GKD), each head's ``logit_scale``
and final softcapping applied first, summed over the completion tokens of ``completion_mask · tool_mask``
and divided by their number, or by ``num_items_in_batch`` (counted over the generated completions) in
training. The logged ``entropy`` is the student's mean per-token entropy at that temperature over the
same tokens.

Like TRL's path, the student's backbone and the loss run inside the student wrapper's forward
(``_forward_redirection``), and the teacher's backbone inside the teacher's; the loss runs as the forward of
the student's head and, within it, of the teacher's (``in_head_forward``), so that FSDP2 and ZeRO-3 gather
both heads with their own hooks. The chunked loss projects only labelled rows, chunk by chunk, on every
device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import DistillationConfig, DistillationTrainer

from chunkloss._compat import trl as trl_compat
from chunkloss.losses.jsd import FusedLinearJSDLoss

from ._arguments import ChunkedArguments
from ._checkpointing import CheckpointingDefault
from ._common import jsd_loss_for, refuse
from ._head import in_head_forward
from ._setup import ChunkedTrainerSetup, teacher_head

__all__ = ["ChunkedDistillationConfig", "ChunkedDistillationTrainer"]


@dataclass
class ChunkedDistillationConfig(CheckpointingDefault, DistillationConfig, ChunkedArguments):
    """``trl.DistillationConfig`` with the chunkloss fields of :class:`ChunkedArguments`;
    TRL's activation checkpointing default (on) under transformers' name (:class:`CheckpointingDefault`)."""


class ChunkedDistillationTrainer(ChunkedTrainerSetup, DistillationTrainer):
    """``trl.DistillationTrainer`` whose divergence runs on chunkloss's engine.

    Refused at construction (no silent fallback): ``teacher_model=None`` (a teacher served remotely, as in
    ``ServerDistillationTrainer``, returns no hidden states to project) and LM heads that are not an
    ``nn.Linear``. ``use_vllm`` (student generation) is passed through untouched: it changes no loss math.
    Adapters on the student's ``lm_head`` are refused by TRL itself.
    """

    _tag_names = ["trl", "distillation", "chunkloss"]

    # TRL refuses adapters on the student's lm_head, and the loss reads the heads itself (no patched forward).
    _trains_lm_head_lora = False
    _patch_forward = False

    def _refuse_early(self, call: dict) -> None:
        if call.get("teacher_model") is None:
            refuse(
                type(self).__name__,
                "teacher_model=None",
                "the chunked divergence projects a local teacher's hidden states through its lm_head; "
                "pass the teacher model (or its path)",
            )

    def _setup_loss(self) -> None:
        teacher_head(self, patch=False)
        self._chunk_loss_kwargs = dict(
            beta=self.beta, temperature=self.temperature, reduction="batchmean", **self.chunk_opts
        )
        self._chunk_losses: dict = {}

    def _loss_module(self, student_head, teacher_head) -> FusedLinearJSDLoss:
        return jsd_loss_for(self._chunk_losses, student_head, teacher_head, **self._chunk_loss_kwargs)

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        # As TRL's `_compute_loss` up to the hidden states (runs inside the student wrapper's forward).
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        completion_mask = inputs["completion_mask"]
        loss_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        logits_to_keep = inputs["completion_ids"].size(1)
        multimodal_keys = (
            "pixel_values",
            "image_grid_thw",
            "pixel_attention_mask",
            "spatial_shapes",
            "image_sizes",
            "token_type_ids",
            "mm_token_type_ids",
            "image_position_ids",
        )
        multimodal_inputs = {k: inputs[k] for k in multimodal_keys if k in inputs}
        student_hidden = trl_compat.last_hidden_state(
            self, unwrapped_student, input_ids, attention_mask, logits_to_keep, **multimodal_inputs
        )
        self.teacher_model.eval()
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            teacher_hidden = trl_compat.redirected_last_hidden_state(
                self,
                self.teacher_model,
                unwrapped_teacher,
                input_ids,
                attention_mask,
                logits_to_keep,
                **multimodal_inputs,
            )

        device = unwrapped_student.get_output_embeddings().weight.device
        teacher_device = unwrapped_teacher.get_output_embeddings().weight.device
        if teacher_device != device:
            raise ValueError(
                f"The student `lm_head` is on {device} but the teacher `lm_head` is on "
                f"{teacher_device}. Place both on the same device in their `device_map`."
            )
        # The completion tokens the hidden states predict; rows outside the loss mask take no part.
        labels = inputs["completion_ids"].to(device).masked_fill(loss_mask.to(device) == 0, -100)
        grad_enabled = torch.is_grad_enabled()
        used = {}

        def student_fn(hidden_s, head_s):
            def teacher_fn(hidden_t, head_t):
                with torch.set_grad_enabled(grad_enabled):
                    used["loss_mod"] = loss_mod = self._loss_module(head_s, head_t)
                    return loss_mod(
                        head_s.features(hidden_s),
                        head_s.weight,
                        head_t.features(hidden_t),
                        head_t.weight,
                        labels,
                        bias=head_s.bias,
                        teacher_bias=head_t.bias,
                        num_items_in_batch=num_items_in_batch,
                    )

            # The teacher's head runs without gradient, as its backbone did: its hooks keep nothing for the
            # backward.
            with torch.no_grad():
                return in_head_forward(unwrapped_teacher, teacher_fn, teacher_hidden)

        loss = in_head_forward(unwrapped_student, student_fn, student_hidden)
        loss_mod = used["loss_mod"]
        n_valid = (labels != -100).sum()
        # TRL returns the raw entropy sum for compute_loss to gather over ranks and log.
        entropy_sum = (loss_mod.metrics["entropy"] * n_valid).detach()
        return loss, entropy_sum, n_valid
