"""Hooks that make long training runs fail loudly and resume exactly.

Both hooks are registered in mmengine's root ``HOOKS`` registry, which mmdet's and mmseg's
registries fall back to, so one config line serves both tasks::

    custom_imports = dict(imports=['xcit_mm', 'xcit_mm.utils'], allow_failed_imports=False)
    custom_hooks = [dict(type='CheckFiniteLossHook'), dict(type='RandomStateHook')]

(the XCiT base configs in ``configs/_base_/`` do this, and ``tools/train.py`` adds whichever of the
two a config lacks).

- :class:`CheckFiniteLossHook` stops training at the first iteration whose loss is NaN or infinite
  and says which iteration, which loss terms and on which rank, and where the last checkpoint is.
  mmdet's ``CheckInvalidLossHook`` does the same check but only in the mmdet scope, every 50
  iterations by default, with an ``assert`` whose message is ``None`` (``runner.logger.info``
  returns None; ``python -O`` removes the check altogether), and in a distributed run only the
  rank that saw the NaN stops while the others wait in the next all-reduce until the collective
  timeout.
- :class:`RandomStateHook` saves the Python, NumPy and torch random states in every checkpoint
  and restores them on ``--resume`` at the point where the interrupted run would have continued,
  so that a resumed run draws the same drop-path masks, RoI samples and data augmentations as an
  uninterrupted one. mmengine 0.10 saves the model, optimizer, schedulers and message hub but
  re-seeds the generators from ``randomness.seed`` when it resumes.
"""
import random
from typing import Dict, List, Optional

import numpy as np
import torch
from mmengine.dist import all_gather_object, all_reduce, get_rank, get_world_size
from mmengine.hooks import CheckpointHook, Hook
from mmengine.registry import HOOKS
from mmengine.runner import IterBasedTrainLoop
from mmengine.runner.checkpoint import find_latest_checkpoint

RNG_KEY = 'rng_state'


class NonFiniteLossError(FloatingPointError):
    """Raised by :class:`CheckFiniteLossHook` when a training loss becomes NaN or infinite.

    Attributes:
        iteration (int): 1-based training iteration whose loss was not finite.
        terms (dict[int, dict[str, float]]): Per rank, the non-finite loss terms.
    """

    def __init__(self, message: str, iteration: int, terms: Dict[int, Dict[str, float]]):
        super().__init__(message)
        self.iteration = iteration
        self.terms = terms


@HOOKS.register_module()
class CheckFiniteLossHook(Hook):
    """Stop training at the first iteration whose loss is NaN or infinite.

    The check runs after every ``interval``-th iteration, before the logger and checkpoint hooks
    (higher priority), so a diverged model is never written to a checkpoint. In a distributed run
    the verdict is all-reduced, so every rank stops at the same iteration (no rank is left waiting
    in a collective) and the message lists the bad terms of each rank.

    The error (:class:`NonFiniteLossError`) names the iteration (1-based, as in the log), the
    epoch, the non-finite loss terms with their values, the last checkpoint of the work dir and
    the ways out (resume from that checkpoint with a lower learning rate, gradient clipping, or
    without mixed precision).

    Args:
        interval (int): Check every ``interval`` iterations. Defaults to 1: the loss is already a
            scalar on the host for logging, so checking each iteration costs nothing measurable.
    """

    priority = 'ABOVE_NORMAL'

    def __init__(self, interval: int = 1) -> None:
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f'CheckFiniteLossHook: interval must be a positive int, got '
                             f'{interval!r}')
        self.interval = interval

    @staticmethod
    def _bad_terms(outputs) -> Dict[str, float]:
        bad = {}
        for name, value in (outputs or {}).items():
            if 'loss' not in name:  # accuracies etc. are logged but not optimised
                continue
            if isinstance(value, torch.Tensor):
                if not bool(torch.isfinite(value.detach()).all()):
                    bad[name] = float(value.detach().float().mean())
            elif isinstance(value, float) and not np.isfinite(value):
                bad[name] = value
        return bad

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        """Raise :class:`NonFiniteLossError` if this iteration's loss is not finite."""
        if not self.every_n_train_iters(runner, self.interval):
            return
        bad = self._bad_terms(outputs)
        world_size = get_world_size()
        if world_size > 1:
            flag = torch.tensor([1.0 if bad else 0.0])
            all_reduce(flag, op='sum')
            if float(flag) == 0:
                return
            per_rank = {rank: terms for rank, terms in enumerate(all_gather_object(bad)) if terms}
        else:
            if not bad:
                return
            per_rank = {0: bad}
        iteration = runner.iter + 1
        raise NonFiniteLossError(self._message(runner, iteration, per_rank, world_size),
                                 iteration, per_rank)

    @staticmethod
    def _message(runner, iteration: int, per_rank: Dict[int, Dict[str, float]],
                 world_size: int) -> str:
        terms = '; '.join(
            (f'rank {rank}: ' if world_size > 1 else '') +
            ', '.join(f'{name}={value}' for name, value in sorted(values.items()))
            for rank, values in sorted(per_rank.items()))
        where = f'iteration {iteration}'
        max_iters = getattr(runner, 'max_iters', None)
        if max_iters:
            where += f'/{max_iters}'
        if not isinstance(runner.train_loop, IterBasedTrainLoop) and \
                getattr(runner.train_loop, 'max_epochs', None):
            where += f' (epoch {runner.epoch + 1})'
        last = None
        try:
            last = find_latest_checkpoint(runner.work_dir)
        except OSError:
            pass
        if last:
            resume = (f'The last checkpoint is {last}. To continue, make training more stable '
                      f'(gradient clipping: optim_wrapper.clip_grad=dict(max_norm=1.0) in the '
                      f'config; or train without --amp) and resume: tools/train.py CONFIG '
                      f'--resume {last}. A resumed run takes its learning rate from the '
                      f'checkpoint; to lower it, start from the checkpoint\'s weights instead: '
                      f'--cfg-options load_from={last} optim_wrapper.optimizer.lr=...')
        else:
            resume = ('No checkpoint has been written yet. Make training more stable and start '
                      'again: a lower learning rate (optim_wrapper.optimizer.lr), gradient '
                      'clipping (optim_wrapper.clip_grad=dict(max_norm=1.0)), a longer warm-up, '
                      'or no --amp.')
        return (
            f'Training stopped: the loss became NaN or infinite at {where}. Non-finite loss '
            f'terms: {terms}. The optimizer has already applied this iteration\'s gradients, so '
            f'the weights in memory are unusable and no checkpoint was written for this '
            f'iteration. {resume}')


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
