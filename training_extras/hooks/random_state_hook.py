"""Save every rank's random states in checkpoints and restore them on resume.

mmengine 0.10 saves the model, optimizer, schedulers and message hub but re-seeds the generators
from ``randomness.seed`` when it resumes. :class:`RandomStateHook` saves the Python, NumPy and
torch random states in every checkpoint and restores them on ``--resume`` where the interrupted
run would have continued, so a resumed run draws the same drop-path masks, RoI samples and data
augmentations as an uninterrupted one. Registered in mmengine's root ``HOOKS`` registry
(``custom_hooks = [dict(type='RandomStateHook')]``; configs/_base_/training_extras.py adds it).
"""
import random
from typing import List, Optional

import numpy as np
import torch
from mmengine.dist import all_gather_object, get_rank, get_world_size
from mmengine.hooks import CheckpointHook, Hook
from mmengine.registry import HOOKS
from mmengine.runner import IterBasedTrainLoop

RNG_KEY = 'rng_state'


def _capture_rng() -> dict:
    """The random states of this process in types ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = dict(
        python=random.getstate(),
        numpy=(kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
        torch=torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def _apply_rng(state: dict) -> None:
    version, internal, gauss = state['python']
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state['numpy']
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state['torch'])
    if state.get('cuda') is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


class _RestoreAfterSkip:
    """Wraps a train loop's dataloader iterator to restore random states after the skip.

    On resume, ``IterBasedTrainLoop.run`` draws ``skip`` batches to move the sampler to where the
    interrupted run stopped; with ``num_workers=0`` this runs the data pipeline (random flips,
    crops...) in the main process. The saved states must be restored after that and before the
    first new batch, so that the new batch and the model see the same random numbers as in the
    uninterrupted run. Puts the original iterator back on the loop once done.
    """

    def __init__(self, loop, skip: int, state: dict):
        self._loop = loop
        self._inner = loop.dataloader_iterator
        self._skip = skip
        self._state = state

    def __iter__(self):
        return self

    def __next__(self):
        if self._skip > 0:
            self._skip -= 1
            return next(self._inner)
        _apply_rng(self._state)
        self._loop.dataloader_iterator = self._inner
        return next(self._inner)


@HOOKS.register_module()
class RandomStateHook(Hook):
    """Save the random states in checkpoints and restore them when training resumes.

    Without it, a resumed run re-seeds Python's, NumPy's and torch's generators with
    ``randomness.seed`` and continues with random numbers an uninterrupted run never drew
    (drop-path masks, RPN / RoI sampling, random flips and crops in the main process). With it,
    and deterministic settings (``randomness=dict(seed=..., deterministic=True)``), the losses
    after ``--resume`` equal those of an uninterrupted run.

    What it does:

    - ``before_save_checkpoint``: stores ``checkpoint['rng_state'] = dict(world_size=N,
      states=[per rank])`` (plain lists and tensors, so ``torch.load(weights_only=True)`` reads
      it). In a distributed run only rank 0 writes checkpoints; the states of all ranks are
      gathered just before a checkpoint is due (the configured ``CheckpointHook`` decides).
    - validation inside training leaves the random states as they were (``before_val`` /
      ``after_val``): creating the validation dataloader draws from torch's generator, so without
      this the training stream would depend on when validation runs, and a checkpoint written
      before validation would not describe the state training continues from.
    - on resume (``after_load_checkpoint`` with ``runner.iter > 0`` or ``runner.epoch > 0`` once
      training starts), each rank restores its own state: for ``IterBasedTrainLoop`` right after
      mmengine has re-drawn the already trained batches, for epoch-based loops at the start of the
      first resumed epoch. Checkpoints without saved states, or written by a different number of
      processes, resume with the seeded generators and a warning.
    - ``load_from`` (fine-tuning, iteration 0) leaves the generators alone.
    """

    priority = 'LOW'  # after the loss check and the logger, before CheckpointHook (VERY_LOW)

    def __init__(self) -> None:
        self._pending: Optional[dict] = None
        self._gathered: Optional[List[dict]] = None  # all ranks' states for the next checkpoint
        self._val_state: Optional[dict] = None
        self._val_gathered: Optional[List[dict]] = None

    # ------------------------------------------------------------------ saving
    @staticmethod
    def _checkpoint_due(runner, stage: str) -> bool:
        for hook in runner.hooks:
            if not isinstance(hook, CheckpointHook):
                continue
            if stage == 'iter' and not hook.by_epoch:
                if hook.every_n_train_iters(runner, hook.interval, hook.save_begin) or (
                        hook.save_last and hook.is_last_train_iter(runner)):
                    return True
            if stage == 'epoch' and hook.by_epoch:
                if hook.every_n_epochs(runner, hook.interval, hook.save_begin) or (
                        hook.save_last and hook.is_last_train_epoch(runner)):
                    return True
        return False

    def _gather_if_due(self, runner, stage: str) -> None:
        if get_world_size() > 1 and self._checkpoint_due(runner, stage):
            self._gathered = all_gather_object(_capture_rng())

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        """Gather every rank's state when CheckpointHook is about to save (distributed only)."""
        self._gather_if_due(runner, 'iter')

    def after_train_epoch(self, runner) -> None:
        """As :meth:`after_train_iter`, for epoch-based checkpoints."""
        self._gather_if_due(runner, 'epoch')

    def before_val(self, runner) -> None:
        """Remember the training random state (all ranks') before validation consumes any."""
        self._val_state = _capture_rng()
        if get_world_size() > 1:
            self._val_gathered = all_gather_object(self._val_state)

    def after_val(self, runner) -> None:
        """Put the training random state back after validation."""
        if self._val_state is not None:
            _apply_rng(self._val_state)
        self._val_state = self._val_gathered = None

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        """Store the random states of all ranks in the checkpoint (rank 0)."""
        world_size = get_world_size()
        if self._val_state is not None:  # a best-checkpoint saved during validation
            states = self._val_gathered if world_size > 1 else [self._val_state]
        elif world_size > 1:
            states, self._gathered = self._gathered, None
        else:
            states = [_capture_rng()]
        if states is None or len(states) != world_size:
            runner.logger.warning(
                'RandomStateHook: the random states of the other ranks were not gathered for this '
                'checkpoint (it was not written by the configured CheckpointHook); it stores none, '
                'and resuming from it re-seeds the generators.')
            return
        checkpoint[RNG_KEY] = dict(world_size=world_size, states=states)

    # ------------------------------------------------------------------ resuming
    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        """Keep this rank's saved state until training continues (see the class docs)."""
        saved = checkpoint.get(RNG_KEY)
        world_size = get_world_size()
        if not saved:
            self._pending = dict(missing='the checkpoint has no saved random states (written '
                                 'without RandomStateHook)')
        elif saved.get('world_size') != world_size:
            self._pending = dict(missing=f'the checkpoint was written by {saved.get("world_size")} '
                                 f'processes and this run has {world_size}')
        else:
            self._pending = dict(state=saved['states'][get_rank()])

    def before_train_epoch(self, runner) -> None:
        """Restore the saved state at the point where the interrupted run continued."""
        pending, self._pending = self._pending, None
        if pending is None or (runner.iter == 0 and runner.epoch == 0):
            return  # fresh run, or load_from (fine-tuning)
        if 'missing' in pending:
            runner.logger.warning(
                f'RandomStateHook: {pending["missing"]}; the random generators restart from the '
                f'seed, so the resumed run will not repeat the random draws of an uninterrupted '
                f'one exactly.')
            return
        loop = runner.train_loop
        if isinstance(loop, IterBasedTrainLoop) and loop.iter > 0:
            loop.dataloader_iterator = _RestoreAfterSkip(loop, loop.iter, pending['state'])
        else:
            _apply_rng(pending['state'])
