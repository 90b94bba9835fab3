"""A checkpoint written at the end of an epoch resumes at the start of the next one.

Lightning (2.6) restores its fit loop as *restarting* whenever training is bounded by ``max_steps``, even when the
saved epoch had finished (``FitLoop.restarting``: ``restarting and epoch_unfinished or
self._iteration_based_training()``). The training epoch loop then keeps the finished epoch's batch counters
(``batch_progress.current``, reset only by ``reset_on_run`` when an epoch starts normally), so the next epoch starts
at batch index ``num_training_batches`` instead of 0, and the data fetcher, which counts those batches as already
fetched, ends that epoch early: a resume after ``trainer.save_checkpoint`` at the end of ``fit`` or from a
``ModelCheckpoint`` saved in ``on_train_epoch_end`` skips the rest of the next epoch's data. Checkpoints saved
mid-epoch (the counters then really are the position in the epoch) and those saved in ``on_train_batch_end`` of
the last batch (Lightning resets the counters itself there) are not affected.

:func:`start_next_epoch` rewrites such a checkpoint's loop state to what an uninterrupted run holds when the next
epoch begins. It reads and writes Lightning's private loop-state layout; ``tests/test_resume.py`` checks it against
checkpoints that Lightning writes, so a change of that layout fails there.
"""

from __future__ import annotations

from typing import Any

__all__ = ["start_next_epoch"]


def start_next_epoch(checkpoint: dict[str, Any]) -> bool:
    """If ``checkpoint`` was saved after its epoch's last batch and the end of the epoch (``is_last_batch``, every
    batch complete, the epoch processed), count the epoch as completed and zero the in-epoch batch counters, as
    Lightning's own ``batch_progress.reset_on_run`` does when the next epoch starts. Returns whether it changed
    anything; checkpoints without loop state (weights only) are left alone."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if not fit:
        return False
    epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
    done = batches["total"]
    # is_last_batch alone also holds after the save in on_train_batch_end of the last batch (completed is one
    # behind there) and after validation at the epoch end, before the epoch was processed: both resume correctly
    batches_complete = done["ready"] == done["started"] == done["processed"] == done["completed"]
    epoch_processed = epochs["total"]["processed"] == epochs["total"]["started"]
    epoch_ended = batches["is_last_batch"] and batches_complete and epoch_processed
    if not epoch_ended:
        return False
    for counter in (epochs["total"], epochs["current"]):
        counter["completed"] = counter["processed"]
    batches["current"] = {k: 0 for k in batches["current"]}
    batches["is_last_batch"] = False
    return True
