"""Write the learning rate of each layer depth to the message hub (layer-wise lr decay).

mmengine's ``RuntimeInfoHook`` logs one ``lr``: that of the first param group, which
:class:`~xcit_mm.engine.optimizers.XCiTLayerDecayOptimizerConstructor` makes a head group. This
hook adds, before every training iteration (when ``RuntimeInfoHook`` records ``lr``), one scalar
per depth ``d``: ``train/depth_{d}_lr`` (0 = patch embedding, ``L + 1`` = after the trunk). The
names end in ``lr`` so that mmengine's ``LogProcessor`` prints them like ``lr`` (``1.2345e-06``,
the current value, never a window mean) instead of rounding them to ``0.0000``; they reach the
text log, ``scalars.json`` and the visualizer backends like ``lr``. Use::

    custom_hooks = [..., dict(type='LayerDecayLrHook')]
"""
import logging
from typing import Optional

from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.optim import OptimWrapperDict
from mmengine.registry import HOOKS

from ..optimizers.layer_decay_optim_wrapper_constructor import layer_depth_lrs

SCALAR_NAME = 'train/{prefix}depth_{depth}_lr'


def _wrappers(optim_wrapper):
    if isinstance(optim_wrapper, OptimWrapperDict):
        return [(f'{name}.', wrapper) for name, wrapper in optim_wrapper.items()]
    return [('', optim_wrapper)]


@HOOKS.register_module()
class LayerDecayLrHook(Hook):
    """Record ``train/depth_{d}_lr`` for each depth of a layer-decayed optimizer."""

    priority = 'VERY_HIGH'  # with RuntimeInfoHook, which records `lr` at the same point

    def before_train(self, runner) -> None:
        if not any(layer_depth_lrs(w.optimizer.param_groups)
                   for _, w in _wrappers(runner.optim_wrapper)):
            print_log('LayerDecayLrHook: no param group has a layer depth (build the optimizer '
                      "with constructor='XCiTLayerDecayOptimizerConstructor'); nothing to record",
                      logger='current', level=logging.WARNING)

    def before_train_iter(self, runner, batch_idx: int, data_batch: Optional[dict] = None) -> None:
        for prefix, wrapper in _wrappers(runner.optim_wrapper):
            for depth, lr in layer_depth_lrs(wrapper.optimizer.param_groups).items():
                runner.message_hub.update_scalar(
                    SCALAR_NAME.format(prefix=prefix, depth=depth), lr)
