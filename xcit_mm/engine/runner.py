"""The Runner the XCiT configs use, and what the tools add to a config before building it."""
from typing import Callable, Union

from mmengine.model import is_model_wrapper
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

from xcit_mm.models.utils.ckpt_load import is_released_layout, load_model_state_dict
from xcit_mm.utils.checkpoint_io import extract_state_dict, load_checkpoint_file

RELIABILITY_HOOKS = ('CheckFiniteLossHook', 'RandomStateHook')


@RUNNERS.register_module()
class XCiTRunner(Runner):
    """mmengine's ``Runner`` whose ``load_from`` / ``--resume`` loading is safe and strict.

    mmengine 0.10 loads whole-model checkpoints non-strictly (a key mismatch is a warning, the
    affected modules stay random), unpickles downloaded URLs without ``weights_only``, and cannot
    read its own checkpoints under torch >= 2.6's ``weights_only`` default. This runner reads
    every file through :func:`xcit_mm.utils.checkpoint_io.load_checkpoint_file`, converts the
    released XCiT COCO / ADE20k layouts in memory (no separate conversion step), and loads the
    whole model strictly. The XCiT configs select it with ``runner_type = 'XCiTRunner'``, so
    upstream ``mmdet`` / ``mmseg`` ``tools/train.py`` and ``tools/test.py`` use it too.
    """

    def load_checkpoint(self,
                        filename: str,
                        map_location: Union[str, Callable] = 'cpu',
                        strict: bool = True,
                        revise_keys: list = [(r'^module.', '')]):
        """Load ``filename`` into the model, strictly; return the checkpoint dict.

        ``strict`` and ``revise_keys`` are accepted for mmengine's signature: loading is always
        strict (a mismatch is a :class:`~xcit_mm.utils.checkpoint_io.CheckpointError`) and a DDP
        ``module.`` prefix is always removed.
        """
        checkpoint = load_checkpoint_file(filename, 'checkpoint', map_location=map_location)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        model = self.model.module if is_model_wrapper(self.model) else self.model
        report = load_model_state_dict(model, extract_state_dict(checkpoint, str(filename)),
                                       source=str(filename))
        self._has_loaded = True
        layout = (f' (released {report["layout"]} layout, converted in memory)'
                  if is_released_layout(report['layout']) else '')
        self.logger.info(f'Load checkpoint from {filename}{layout}: {report["loaded"]} tensors, '
                         f'strict')
        return checkpoint


def ensure_reliability_hooks(cfg) -> list:
    """Add :data:`RELIABILITY_HOOKS` to ``cfg.custom_hooks`` unless the config has them.

    Args:
        cfg (mmengine.Config): The full config; modified in place.

    Returns:
        list[str]: The hook types that were added.
    """
    hooks = list(cfg.get('custom_hooks', None) or [])
    present = {getattr(h.get('type'), '__name__', h.get('type')) for h in hooks
               if isinstance(h, dict)}
    added = [name for name in RELIABILITY_HOOKS if name not in present]
    cfg.custom_hooks = hooks + [dict(type=name) for name in added]
    return added


def build_runner(cfg):
    """The Runner a config asks for: :class:`XCiTRunner` unless it sets ``runner_type``.

    Args:
        cfg (mmengine.Config): The full config.

    Returns:
        mmengine.runner.Runner: The built runner.
    """
    if 'runner_type' not in cfg:
        return XCiTRunner.from_cfg(cfg)
    return RUNNERS.build(cfg)
