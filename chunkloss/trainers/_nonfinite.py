"""The first non-finite training loss, reported once: one warning line with the step and what was non-finite
first, at no host sync of its own in the training step.

transformers' ``logging_nan_inf_filter`` (on by default) leaves a step whose loss is NaN or inf out of the
logged loss, so a run whose weights have turned NaN can go on logging finite losses, or 0. Here each training
step keeps on the device, without waiting for it, whether its loss is finite; the chunked head keeps whether
the hidden states and the head's weight it received were (:func:`record_head_inputs`, called by
``in_head_forward``). The first step with a non-finite loss and those two flags of it are fetched when the
trainer logs, which waits for the device anyway, or when an error ends training, and reported then, once
(logger ``chunkloss.trainers``).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import Tensor, nn

from ._common import peft_base

__all__ = ["NonFiniteLossWatch", "record_head_inputs"]

# The model attribute where the chunked head leaves its inputs' flags for the step: (hidden finite, weight
# finite), a (2,) bool tensor on the device.
_HEAD_FLAGS = "_chunkloss_head_inputs_finite"


def _finite(x: Tensor) -> Tensor:
    """0-d bool on ``x``'s device: every element is finite. ``aminmax`` carries a NaN or an inf to its min or
    max and reads ``x`` once, with no copy of it."""
    x = x.detach()
    if x.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=x.device)
    low, high = torch.aminmax(x)
    return torch.isfinite(low) & torch.isfinite(high)


def record_head_inputs(model: nn.Module, hidden: Tensor, weight: Tensor) -> None:
    """Keep on ``model`` whether ``hidden`` and ``weight``, the inputs of a training forward's chunked head,
    are finite (and-ed over the calls of one step)."""
    flags = torch.stack([_finite(hidden), _finite(weight)])
    previous = model.__dict__.get(_HEAD_FLAGS)
    model.__dict__[_HEAD_FLAGS] = flags if previous is None else previous & flags


class NonFiniteLossWatch:
    """Mixin of the chunked trainers: the first training step whose loss is NaN or inf is reported in one
    warning line when the trainer next logs (or an error ends training), naming the step and the first
    non-finite input: the LM head's weight, the hidden states reaching it, or, both finite, the loss itself.
    Later ones are not reported."""

    def training_step(self, *args, **kwargs):
        if self.__dict__.get("_nonfinite_reported"):
            return super().training_step(*args, **kwargs)
        # The chunked head records on the model it is given: the base model (its patched forward) or, where a
        # trainer calls it itself (distillation), the unwrapped one, which may be a PEFT wrapper.
        unwrapped = self.accelerator.unwrap_model(self.model)
        models = [unwrapped] + [m for m in (peft_base(unwrapped),) if m is not unwrapped]
        for m in models:
            m.__dict__.pop(_HEAD_FLAGS, None)
        loss = super().training_step(*args, **kwargs)
        found = [f for f in (m.__dict__.pop(_HEAD_FLAGS, None) for m in models) if f is not None]
        self._record_loss(loss, functools.reduce(torch.logical_and, found) if found else None)
        return loss

    def _record_loss(self, loss: Tensor, head_flags: Tensor | None) -> None:
        """Keep on the device ``[step, loss, hidden finite, weight finite]`` (flags 1 or 0; -1: not known) of
        the first step whose loss is not finite (step -1 while there is none); no host sync."""
        loss = loss.detach().reshape(1).float()
        dev = loss.device
        if head_flags is None:  # no chunked head ran in a training forward of this step
            flags = torch.full((2,), -1.0, device=dev)
        else:
            flags = head_flags.to(dev).float()
        first = self.__dict__.get("_nonfinite_first")
        if first is None:
            first = self._nonfinite_first = torch.full((4,), -1.0, device=dev)
        step = torch.full((1,), float(self.state.global_step + 1), device=dev)
        now = torch.cat([step, loss, flags])
        take = (first[0] < 0) & ~torch.isfinite(loss[0])
        self._nonfinite_first = torch.where(take, now, first)

    def log(self, logs, *args, **kwargs):
        self._report_nonfinite()
        return super().log(logs, *args, **kwargs)

    def train(self, *args, **kwargs):
        """transformers' ``train``; a non-finite loss not yet reported is reported before an error leaves it
        (generation fails on a policy whose weights a NaN loss has turned NaN, before the next log)."""
        try:
            return super().train(*args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # the device itself may be what failed
                self._report_nonfinite()
            raise

    def _report_nonfinite(self) -> None:
        first = self.__dict__.get("_nonfinite_first")
        if first is None or self.__dict__.get("_nonfinite_reported"):
            return
        step, loss, hidden_ok, weight_ok = first.tolist()  # the log's own wait for the device
        if step < 0:
            return
        self._nonfinite_reported = True
        if weight_ok == 0:
            first_bad = "the LM head's weight was already non-finite (an earlier update made it so)"
        elif hidden_ok == 0:
            first_bad = "the hidden states reaching the LM head were non-finite (its weight was finite)"
        elif hidden_ok == 1:
            first_bad = "the LM head's weight and input were finite: the loss's own math or inputs were not"
        else:
            first_bad = "the LM head's inputs were not checked in this step"
        logging.getLogger("chunkloss.trainers").warning(
            "%s: the training loss is %s at step %d: %s. Reported once; the logged loss leaves such steps "
            "out while logging_nan_inf_filter is on",
            type(self).__name__,
            loss,
            int(step),
            first_bad,
        )
