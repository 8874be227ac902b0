"""Checkpoints of the chunked trainers that resume exactly and are used only once complete:
:class:`ResumableCheckpoints`, :data:`STATE_FILE` and finding the last complete checkpoint."""

from __future__ import annotations

import json
import os

import torch

from chunkloss._compat import transformers as transformers_compat
from chunkloss._compat import trl as trl_compat

__all__ = ["STATE_FILE", "ResumableCheckpoints", "is_complete_checkpoint", "last_complete_checkpoint"]

#: Written last into each checkpoint of a chunked trainer (renamed into place): the state the trainer keeps
#: beyond transformers' (see ``ResumableCheckpoints._save_checkpoint``); its presence marks the checkpoint
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


class ResumableCheckpoints:
    """Mixin placed before the TRL trainer: each checkpoint holds the state TRL's leave out
    (:data:`chunkloss._compat.trl.RESUMED_STATE`) and is marked complete by :data:`STATE_FILE`
    (``_save_checkpoint``); resuming loads that state (``_load_optimizer_and_scheduler``) and takes only a
    complete checkpoint (``train``)."""

    def _resumed_state(self) -> dict:
        """What a checkpoint holds beyond transformers' and TRL's own."""
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
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
