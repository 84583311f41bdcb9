"""Stop training at the first NaN / infinite loss, on every rank at once.

Registered in mmengine's root ``HOOKS`` registry, which mmdet's and mmseg's registries fall back
to, so one config line serves both tasks (``tools/train.py`` adds it when a config lacks it)::

    custom_imports = dict(imports=['xcit_mm'], allow_failed_imports=False)
    custom_hooks = [dict(type='CheckFiniteLossHook')]

mmdet's ``CheckInvalidLossHook`` does the same check but only in the mmdet scope, every 50
iterations by default, with an ``assert`` whose message is ``None`` (``python -O`` removes the
check altogether), and in a distributed run only the rank that saw the NaN stops while the others
wait in the next all-reduce until the collective timeout.
"""
from typing import Dict

import numpy as np
import torch
from mmengine.dist import all_gather_object, all_reduce, get_world_size
from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from mmengine.runner import IterBasedTrainLoop
from mmengine.runner.checkpoint import find_latest_checkpoint


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
