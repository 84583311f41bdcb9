"""Config mistakes found before the Runner is built, so they end in one clear line.

mmengine's ``Runner`` logs the environment and the whole config (hundreds of lines) before it
builds the model; a wrong ``arch`` or ``patch_size``, or a ``load_from`` file of another kind of
model, would otherwise end under that dump, or much later.
"""
import torch
from mmengine.registry import MODELS, DefaultScope, init_default_scope

from .checkpoint_io import CheckpointError, extract_state_dict, load_checkpoint_file
from .ckpt_load import TASK_HEADS


class ConfigError(ValueError):
    """A config that cannot build the model it describes; the message names the key to fix."""


def check_backbone_config(cfg) -> None:
    """Build ``cfg.model.backbone`` alone (its arguments are checked at construction).

    Raises:
        ConfigError: naming ``model.backbone`` and the problem.
    """
    backbone = (cfg.get('model') or {}).get('backbone')
    if not isinstance(backbone, dict) or backbone.get('type') != 'XCiTBackbone':
        return
    scope = cfg.get('default_scope')
    if scope and DefaultScope.get_current_instance() is None:
        init_default_scope(scope)
    backbone = dict(backbone, init_cfg=None)  # the weights are checked separately
    try:
        with torch.device('meta'):  # no memory, no initialisation: only the arguments matter
            MODELS.build(backbone)
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(f'model.backbone: {error}') from error


def model_task(model_cfg) -> str:
    """'detector', 'segmentor' or '' from the heads a model config has."""
    model_cfg = model_cfg or {}
    for task, heads in TASK_HEADS.items():
        if any(model_cfg.get(head.rstrip('.')) for head in heads):
            return task
    return ''


def check_checkpoint_task(path: str, cfg, what: str = 'checkpoint') -> None:
    """A whole-model checkpoint of another task than ``cfg.model``'s is an error.

    Raises:
        CheckpointError: naming the file's task and the config's.
    """
    wanted = model_task(cfg.get('model'))
    if not wanted:
        return
    keys = extract_state_dict(load_checkpoint_file(path, what, mmap=True), path).keys()
    for task, heads in TASK_HEADS.items():
        found = [k for k in keys if k.startswith(heads)]
        if task != wanted and found:
            raise CheckpointError(
                f'{what} {path} is a {task} checkpoint ({found[0]}, ...) but the config builds a '
                f'{wanted}: use the {task} config it was trained with, or a {wanted} checkpoint.')
