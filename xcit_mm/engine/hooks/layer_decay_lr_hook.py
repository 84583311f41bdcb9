"""Record the learning rate of each layer depth (layer-wise lr decay) in the message hub.

mmengine logs one ``lr``, the head's; this hook adds ``train/depth_{d}_lr`` per depth before each
training iteration (named ``..._lr`` so that ``LogProcessor`` prints them like ``lr``). Use::

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
