"""``ChunkedKTOTrainer``: TRL's ``KTOTrainer`` with the loss computed by ``FusedLinearKTOLoss``.

The policy's hidden states of the batch's completions go to the chunked KTO loss with the LM head's weight.
The log-probs scored without grad come from TRL itself: the policy's and the reference's of the KL batch
(``KTOTrainer._compute_kl_logps``) and the reference's of the completions (precomputed in the dataset, or
``KTOTrainer.compute_ref_log_probs`` on the reference model / the adapter-free PEFT model), through TRL's
fused head; where the scored model has LoRA on ``lm_head``, which TRL's head would leave out, through the
chunked head (:func:`~chunkloss.trainers._head.fused_head_call`). Both loss types of TRL 1.16, ``beta`` and
the desirable / undesirable weights are covered, with the model's final logit softcapping (Gemma-2) and logit
scale (Cohere); the KL term is TRL's (gathered across processes, clamped at 0). TRL's ``entropy`` and
``logits/*`` metrics come from the same chunked pass as the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import KTOConfig, KTOTrainer

from chunkloss._compat import trl as trl_compat
from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss
from chunkloss.losses.kto import KTO_LOSS_TYPES, FusedLinearKTOLoss

from ._arguments import ChunkedArguments
from ._checkpointing import CheckpointingDefault
from ._common import refuse
from ._head import fused_head_call, has_lm_head_lora, refuse_precomputed_head_lora_reference
from ._metrics import DeferredMetrics
from ._setup import ChunkedTrainerSetup

__all__ = ["ChunkedKTOConfig", "ChunkedKTOTrainer"]

_MODEL_KEYS = ("input_ids", "attention_mask")
_BATCH_KEYS = {
    *_MODEL_KEYS,
    "completion_mask",
    "label",
    "ref_logps",
    "ref_KL_logps",
    "KL_input_ids",
    "KL_attention_mask",
    "KL_completion_mask",
}


@dataclass
class ChunkedKTOConfig(CheckpointingDefault, KTOConfig, ChunkedArguments):
    """``trl.KTOConfig`` with the chunkloss fields of :class:`ChunkedArguments`;
    TRL's activation checkpointing default (on) under transformers' name (:class:`CheckpointingDefault`)."""


class ChunkedKTOTrainer(ChunkedTrainerSetup, DeferredMetrics, KTOTrainer):
    """``trl.KTOTrainer`` whose loss never materialises the logits.

    Refused at construction: a ``loss_type`` TRL 1.16 does not define (its own trainer fails on it in the
    first step), vision datasets (the chunked head covers text models), adapters on ``lm_head`` other than
    plain LoRA, and ``precompute_ref_log_probs`` for a ``PeftModel`` with LoRA on ``lm_head`` given without
    ``ref_model`` (TRL precomputes in its constructor, without the adapter's ``lm_head``). Other inputs than
    text are refused when they arrive.
    """

    _tag_names = ["trl", "kto", "chunkloss"]

    def _refuse_early(self, call: dict) -> None:
        name, args = type(self).__name__, call.get("args")
        if args is not None and args.loss_type not in KTO_LOSS_TYPES:
            why = f"TRL 1.16's KTOTrainer defines {', '.join(KTO_LOSS_TYPES)} (and fails on others)"
            refuse(name, f"loss_type={args.loss_type!r}", why)
        refuse_precomputed_head_lora_reference(name, call)

    def _refuse_built(self) -> None:
        if trl_compat.is_vision_dataset(self):
            refuse(type(self).__name__, "vision datasets", "the chunked head covers text models only")

    def _setup_loss(self) -> None:
        self._kto_loss = FusedLinearKTOLoss(
            beta=float(self.beta),
            loss_type=self.loss_type,
            desirable_weight=float(self.desirable_weight),
            undesirable_weight=float(self.undesirable_weight),
            return_token_metrics=True,
            **self.head_transforms,
            **self.chunk_opts,
        )
        # Per-token log-probs through a LoRA adapter on lm_head (``_scored``).
        self._logp_loss = FusedLinearCrossEntropyLoss(
            reduction="none", **self.head_transforms, **self.chunk_opts
        )

    def _scored(self, model):
        """``model`` as TRL's no-grad scoring calls it; where it is the policy with LoRA on ``lm_head``, whose
        adapter TRL's fused head would leave out, the chunked head in that head's place. Before the chunked
        head exists (TRL's constructor precomputes), TRL's own."""
        if not hasattr(self, "_logp_loss"):
            return model
        unwrapped = self.accelerator.unwrap_model(model)
        if unwrapped is not self.accelerator.unwrap_model(self.model) or not has_lm_head_lora(unwrapped):
            return model
        return fused_head_call(model, self._logp_loss)

    def compute_ref_log_probs(self, model, inputs):
        """TRL's (the reference's sequence log-probs of the completions and of the KL batch, under the adapter
        TRL selects), scored through :meth:`_scored`."""
        return super().compute_ref_log_probs(self._scored(model), inputs)

    def _compute_kl_logps(self, model, batch):
        """TRL's (the KL batch's sequence log-probs, without grad), scored through :meth:`_scored`."""
        return super()._compute_kl_logps(self._scored(model), batch)

    def _reference(self, model, batch) -> tuple[torch.Tensor, dict]:
        """The reference's sequence log-probs of the completions, and the KL batch's log-probs (policy and
        reference) as the loss's keywords; computed as TRL's ``_compute_loss`` computes them."""
        kl_logps = self._compute_kl_logps(model, batch)
        if self.precompute_ref_logps:
            ref_logps = batch["ref_logps"]
            ref_kl_logps = batch["ref_KL_logps"] if self.calculate_KL else None
        else:
            ref_model = self.ref_model if self.ref_model is not None else self.model
            ref_logps, ref_kl_logps = self.compute_ref_log_probs(ref_model, batch)
        kl = dict(kl_logps=kl_logps, ref_kl_logps=ref_kl_logps) if self.calculate_KL else {}
        return ref_logps.detach().float(), kl

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        batch = {
            k: (v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v)
            for k, v in inputs.items()
        }
        other = set(batch) - _BATCH_KEYS
        if other:
            refuse(type(self).__name__, f"inputs {sorted(other)}", "the chunked head covers text models only")
        local, counts = self._counts(batch)
        ref_logps, kl = self._reference(model, batch)
        desirable = batch["label"].bool()
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)[:, 1:]

        def head_fn(hidden, head):
            # The hidden states just before each real token but the first, counted from the end: prompt tuning
            # and p-tuning put their virtual tokens first (TRL keeps the last positions of its log-probs too).
            x = head.features(hidden[:, -labels.shape[1] - 1 : -1])
            gather = self.accelerator.gather_for_metrics
            loss = self._kto_loss(
                x, head.weight, labels, desirable, bias=head.bias, ref_logps=ref_logps, **kl, kl_gather=gather
            )
            return loss, dict(self._kto_loss.metrics)

        model_kwargs = {k: batch[k] for k in _MODEL_KEYS}
        if self.aux_loss_enabled:
            model_kwargs["output_router_logits"] = True
        out = model(**model_kwargs, chunked_head=head_fn)
        loss, metrics = out.result
        self._store_metrics(mode, batch, metrics, local, counts)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * out.aux_loss
            self.record_aux_loss(mode, out.aux_loss)
        if return_outputs:
            # Asked for by compute_metrics: the user wants the logits.
            with torch.no_grad():
                return loss, model(**{k: batch[k] for k in _MODEL_KEYS})
        return loss

    def _counts(self, batch) -> tuple[torch.Tensor, list[int]]:
        """This process's (desirable, undesirable, desirable tokens, undesirable tokens) (4,) on the device,
        and every process's on the host, gathered one by one as TRL gathers them: one host sync, before the
        loss. TRL logs a side's metrics only at a step where that side has completions (or tokens)."""
        d = batch["label"].bool()
        n_tok = batch["completion_mask"][:, 1:].sum(1)
        local = torch.stack([d.sum(), (~d).sum(), (n_tok * d).sum(), (n_tok * ~d).sum()])
        gather = self.accelerator.gather_for_metrics
        return local, torch.stack([gather(c).sum() for c in local]).tolist()

    def _store_metrics(self, mode, batch, m, local, counts) -> None:
        """TRL's metrics of the step, in its order, kept on the device until the trainer logs
        (``DeferredMetrics``). The loss reports this process's means; TRL's are over every process: local
        means times local counts, gathered and summed, over the gathered counts (in float64, as TRL divides
        Python numbers)."""
        gather, store = self.accelerator.gather_for_metrics, trl_compat.metrics(self, mode)
        n_c, n_r, tok_c, tok_r = counts
        store["kl"].append(m["kl"])
        n_tok = local[2] + local[3]
        entropy = gather(m["entropy"] * n_tok).sum().double()
        store["entropy"].append(entropy / (tok_c + tok_r) if tok_c + tok_r > 0 else 0.0)
        self.record_tokens(mode, gather(batch["attention_mask"].sum()).sum() if mode == "train" else None)

        def mean(name: str, i: int, total: int) -> torch.Tensor:
            return gather(m[name] * local[i]).sum().double() / total

        for side, i, tok in (("chosen", 2, tok_c), ("rejected", 3, tok_r)):
            if tok > 0:
                store[f"logits/{side}"].append(mean(f"logits/{side}", i, tok))
        for side, i, n in (("chosen", 0, n_c), ("rejected", 1, n_r)):
            if n > 0:
                store[f"rewards/{side}"].append(mean(f"rewards/{side}", i, n))
                store[f"logps/{side}"].append(mean(f"logps/{side}", i, n))
        if n_c > 0 and n_r > 0:
            store["rewards/margins"].append(store["rewards/chosen"][-1] - store["rewards/rejected"][-1])
