"""Helpers for the command-line tools (tools/train.py, tools/test.py) and for reliable training.

Not imported by ``xcit_mm/__init__.py``: the backbone must stay importable without them. The
tools import what they need explicitly; configs that use the hooks or the CPU AMP wrapper list
``'xcit_mm.utils'`` in ``custom_imports`` (the XCiT base configs do), which registers them in
mmengine's root registries, visible from the mmdet and mmseg scopes.

- :mod:`.data_check`: fail early, with download instructions, when a config's dataset is missing
  or a COCO annotation file is not one; generate the built-in shapes dataset when asked.
- :mod:`.ckpt_check`: check every checkpoint a run reads before any work, never unpickling code.
- :mod:`.hooks`: ``CheckFiniteLossHook`` (stop at the first NaN/inf loss, naming the iteration)
  and ``RandomStateHook`` (resume with the random states of the interrupted run).
- :mod:`.amp`: ``CPUAmpOptimWrapper``, bfloat16 autocast for ``--amp`` without a GPU.
- :mod:`.cpu_dist`: make ``tools/dist_train.sh CONFIG N`` work on machines without a GPU (gloo).
"""
from .amp import CPUAmpOptimWrapper, amp_optim_wrapper_type
from .ckpt_check import (CheckpointFileError, check_checkpoint, check_pretrained,
                         find_pretrained, resolve_auto_resume)
from .cpu_dist import (CPUDistributedDataParallel, distributed_session, init_cpu_dist,
                       init_distributed, prepare_cpu_distributed_cfg)
from .data_check import (AnnotationFormatError, DatasetNotFoundError, check_annotation_formats,
                         check_data, coco_annotation_problem, ensure_shapes_world,
                         find_missing_data)
from .hooks import CheckFiniteLossHook, NonFiniteLossError, RandomStateHook

RELIABILITY_HOOKS = ('CheckFiniteLossHook', 'RandomStateHook')


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
    """The Runner a config asks for: mmengine's ``Runner`` unless it sets ``runner_type``.

    Args:
        cfg (mmengine.Config): The full config.

    Returns:
        mmengine.runner.Runner: The built runner.
    """
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    if 'runner_type' not in cfg:
        return Runner.from_cfg(cfg)
    return RUNNERS.build(cfg)


__all__ = [
    'AnnotationFormatError', 'CPUAmpOptimWrapper', 'CPUDistributedDataParallel',
    'CheckFiniteLossHook', 'CheckpointFileError', 'DatasetNotFoundError', 'NonFiniteLossError',
    'RELIABILITY_HOOKS', 'RandomStateHook', 'amp_optim_wrapper_type', 'build_runner',
    'check_annotation_formats',
    'check_checkpoint', 'check_data', 'check_pretrained', 'coco_annotation_problem',
    'distributed_session', 'ensure_reliability_hooks', 'ensure_shapes_world',
    'find_missing_data', 'find_pretrained', 'init_cpu_dist', 'init_distributed',
    'prepare_cpu_distributed_cfg', 'resolve_auto_resume'
]
