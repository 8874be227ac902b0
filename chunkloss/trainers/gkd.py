"""``ChunkedGKDTrainer``: TRL's experimental ``GKDTrainer`` with the generalized JSD computed by chunkloss's
``FusedLinearJSDLoss``, so neither the student's nor the teacher's ``[tokens, vocab]`` logits exist.

Same constructor, same config (``ChunkedGKDConfig`` adds the chunkloss fields), same on-policy generation
(``lmbda``), sequence-level KD (``seq_kd``) and training step: only ``compute_loss`` changes. The loss
equals ``GKDTrainer.compute_loss``:
``generalized_jsd_loss(student[:, :-1], teacher[:, :-1], labels[:, 1:], beta)`` with the function's default
temperature 1 (``args.temperature`` is GKD's *sampling* temperature and never reaches the loss),
``reduction="batchmean"`` over labelled tokens, or ``/ num_items_in_batch`` under gradient accumulation.
Each head's ``logit_scale`` and final softcapping are applied as the models' own forwards apply them. The loss
fields GKDConfig inherits from SFTConfig (``loss_type``, ``label_smoothing_factor``, ``router_aux_loss_coef``)
reach neither ``GKDTrainer.compute_loss`` nor this one.

The student's backbone runs inside the student's forward (FSDP / ZeRO-3 hooks fire, the head is gathered), the
teacher's backbone runs without grad inside the teacher's forward, and the loss runs inside both, with the
student's and the teacher's heads gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast
from trl.experimental.gkd import GKDConfig, GKDTrainer

from chunkloss.losses.jsd import FusedLinearJSDLoss

from ._arguments import ChunkedArguments
from ._checkpointing import CheckpointingDefault
from ._common import jsd_loss_for, refuse
from ._setup import P_TUNING, PROMPT_TUNING, ChunkedTrainerSetup, teacher_head

__all__ = ["ChunkedGKDConfig", "ChunkedGKDTrainer"]


@dataclass
class ChunkedGKDConfig(CheckpointingDefault, GKDConfig, ChunkedArguments):
    """``trl.experimental.gkd.GKDConfig`` with the chunkloss fields of :class:`ChunkedArguments`;
    TRL's activation checkpointing default (on) under transformers' name (:class:`CheckpointingDefault`)."""


class ChunkedGKDTrainer(ChunkedTrainerSetup, GKDTrainer):
    """``trl.experimental.gkd.GKDTrainer`` whose loss never materialises the student's or teacher's logits.

    Refused at construction (no silent fallback): ``compute_metrics`` and ``preprocess_logits_for_metrics``
    (both take the full logits, which this trainer never builds), and adapters on either ``lm_head`` other
    than plain LoRA. A LoRA adapter on the student's ``lm_head`` is trained (TRL refuses it).
    """

    _tag_names = ["trl", "gkd", "chunkloss"]

    _prompt_learning_refused = (
        (PROMPT_TUNING, P_TUNING),
        "the student's logits carry the virtual tokens, the teacher's do not",
    )

    def _refuse_early(self, call: dict) -> None:
        for arg in ("compute_metrics", "preprocess_logits_for_metrics"):
            if call.get(arg) is not None:
                refuse(
                    type(self).__name__, arg, "it needs the full logits, which the chunked loss never builds"
                )

    def _setup_loss(self) -> None:
        teacher_head(self, patch=True)
        # GKD's loss call passes no temperature: generalized_jsd_loss's default 1.0 (args.temperature only
        # samples).
        self._chunk_loss_kwargs = dict(
            beta=self.beta, temperature=1.0, reduction="batchmean", **self.chunk_opts
        )
        self._chunk_losses: dict = {}

    def _loss_module(self, student_head, teacher_head) -> FusedLinearJSDLoss:
        return jsd_loss_for(self._chunk_losses, student_head, teacher_head, **self._chunk_loss_kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        labels = inputs["labels"][:, 1:]  # logits at position i predict token i + 1
        self.teacher_model.eval()
        teacher_model = self.teacher_model

        def student_fn(hidden_s, head_s):
            grad_enabled = torch.is_grad_enabled()

            def teacher_fn(hidden_t, head_t):
                # The teacher's backbone ran without grad; the loss needs the student's graph.
                with torch.set_grad_enabled(grad_enabled):
                    loss_mod = self._loss_module(head_s, head_t)
                    target = labels.to(hidden_s.device)
                    return loss_mod(
                        head_s.features(hidden_s[:, :-1]),
                        head_s.weight,
                        head_t.features(hidden_t[:, :-1].to(hidden_s.device)),
                        head_t.weight.to(hidden_s.device),
                        target,
                        bias=head_s.bias,
                        teacher_bias=None if head_t.bias is None else head_t.bias.to(hidden_s.device),
                        num_items_in_batch=num_items_in_batch,
                    )

            with torch.no_grad():
                out = teacher_model(
                    input_ids=input_ids, attention_mask=attention_mask, chunked_head=teacher_fn
                )
            return out.result

        loss = model(input_ids=input_ids, attention_mask=attention_mask, chunked_head=student_fn).result
        # GKDTrainer returns the student's outputs; here they hold the loss and no logits (compute_metrics is
        # refused, so evaluation only reads the loss).
        return (loss, CausalLMOutputWithPast(loss=loss)) if return_outputs else loss
