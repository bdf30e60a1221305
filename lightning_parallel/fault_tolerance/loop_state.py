"""Where a replica group's Lightning loop stands, and a healing group put at the same place: committed steps,
epoch, batch of the epoch, batches trained in all, the logger's step and the training loader's position.

Note:
    A group that restarts heals at start-up, before Lightning's fit loop runs. Setting the committed step and the
    epoch alone (as before) left every other counter at 0: the group counted its batches from where it rejoined, so
    it validated -- and wrote ``last.ckpt`` -- at other steps than the healthy groups (seen: an 800-step run ended
    with ``last.ckpt`` at steps 800 and 799, parameters one AdamW step apart), logged its steps from 0, never
    flagged its first epoch's last batch as the last, and a group healing from it later skipped too few batches.
    So the healthy group sends its fit-loop state as a checkpoint written at the end of the batch before the one
    the healing group trains first would hold it (``on_train_batch_end``: the shape Lightning resumes mid-epoch
    from), and the healing group loads it as ``trainer.fit(ckpt_path=...)`` loads a checkpoint's loops
    (``fit_loop.load_state_dict``). The loader's position comes from the end of the sender's last step, before the
    next batch was drawn; a loader that keeps no position is moved by :mod:`.data_position` instead.

    The keys below are Lightning 2.6's fit-loop checkpoint layout (the one ``checkpoints/`` and
    ``callbacks/exact_resume.py`` read); ``_batches_that_stepped`` is its private name for the logger's step.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from lightning_parallel._compat import drop_loader_position

BATCHES = "epoch_loop.batch_progress"
EPOCHS = "epoch_progress"
EPOCH_LOOP = "epoch_loop.state_dict"
LOGGED_STEPS = "_batches_that_stepped"
LOADERS = "state_dict"  # the fit loop's own entry: {"combined_loader": [one state per stateful loader]}
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def set_global_step(trainer: Any, step: int, counting: bool = False) -> None:
    """Set Lightning's optimizer-step count (what ``trainer.global_step`` reads and ``max_steps`` checks).

    Args:
        trainer: the Trainer.
        step: committed optimizer steps.
        counting: inside an optimizer step that Lightning counts when it returns (it has marked the step ready and
            adds one completed step): the counters are left as Lightning's own would be then.
    """
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    step = max(step, 0)
    progress.ready, progress.completed = (step + 1, step) if counting else (step, step)


def loader_position(trainer: Any) -> dict[str, Any]:
    """The training loaders' positions now, between two batches, and which batch of which epoch comes next.

    Taken at the end of every optimizer step: the next quorum happens after Lightning has drawn the next batch.
    """
    loop = trainer.fit_loop
    return {"epoch": int(trainer.current_epoch), "batch": int(loop.epoch_loop.batch_progress.current.ready),
            "loaders": loop.on_save_checkpoint()}  # the fit loop's own checkpoint entry: the loaders' states


def resume_state(trainer: Any, batch_done: bool, loaders: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """This group's fit-loop state as a checkpoint at the end of the batch before the next one would hold it.

    Args:
        trainer: the Trainer (called while Lightning is inside a batch).
        batch_done: whether that batch has been trained (``local_sgd``'s meeting, at its step's end) or is about
            to be (``ddp``'s quorum, before its forward).
        loaders: :func:`loader_position` from the end of the last step (used when it is where the next batch is).

    Returns:
        The state, or ``None`` before the first batch (nothing to resume).
    """
    state = trainer.fit_loop.state_dict()
    batches, epochs, done = state[BATCHES], state[EPOCHS], int(batch_done)
    total = batches["total"]["completed"] + done  # batches trained before the next one, over all epochs
    if total == 0:
        return None
    in_epoch = batches["current"]["completed"] + done
    epoch = epochs["current"]["processed"]  # the epoch Lightning is in (it counts it processed at its end)
    if done and batches["is_last_batch"]:
        epoch, in_epoch = epoch + 1, 0
    steps = state[EPOCH_LOOP][LOGGED_STEPS] + done  # Lightning counts a batch's step after its end hooks
    batches["is_last_batch"] = False
    if in_epoch == 0:  # an epoch's start: the epoch before is complete, nothing of this one is to resume
        for counter in (epochs["current"], epochs["total"]):
            counter.update(ready=epoch, started=epoch, processed=epoch, completed=epoch)
        for counter, value in ((batches["current"], 0), (batches["total"], total)):
            counter.update(ready=value, started=value, processed=value, completed=value)
        state[EPOCH_LOOP][LOGGED_STEPS] = steps
        drop_loader_position(state)
        return state
    for counter, value in ((batches["current"], in_epoch), (batches["total"], total)):
        counter.update(ready=value, started=value, processed=value, completed=value - 1)
    state[EPOCH_LOOP][LOGGED_STEPS] = steps - 1  # resuming from on_train_batch_end, Lightning adds that step back
    if loaders is not None and (loaders["epoch"], loaders["batch"]) == (epoch, in_epoch):
        state[LOADERS] = loaders["loaders"]
    else:
        drop_loader_position(state)
    return state


def next_batch(state: dict[str, Any]) -> tuple[int, int]:
    """``(epoch, batch of the epoch)`` a :func:`resume_state` continues at."""
    epochs = state[EPOCHS]["current"]
    batches = state[BATCHES]["current"]
    started = epochs["started"] > epochs["processed"]
    return (epochs["processed"], batches["ready"]) if started else (epochs["completed"], 0)


def restore(trainer: Any, state: dict[str, Any]) -> bool:
    """Load a :func:`resume_state` into this trainer's fit loop, before the loop runs.

    Returns:
        Whether it holds the training loaders' positions (Lightning restores them as it prepares the loader);
        otherwise the caller moves the loader to the batch of :func:`next_batch`.
    """
    trainer.fit_loop.load_state_dict(state)
    if state[BATCHES]["current"]["ready"] == 0:
        # At an epoch's start there is nothing to resume inside the epoch: it starts as in a fresh run, with the
        # run's counters. Restarting, Lightning would take it for a resume after the previous batch's validation
        # and, where one was due, give that turn to no batch but count a logged step for it.
        trainer.fit_loop.epoch_loop.restarting = False
    positioned = bool(state.get(LOADERS, {}).get("combined_loader"))
    if not positioned:
        # The loader that keeps no position is moved to its batch by data_position; Lightning's warning that it
        # would restart the epoch does not hold for this fit.
        warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
    return positioned
