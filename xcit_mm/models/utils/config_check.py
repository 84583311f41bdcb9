"""Config mistakes found before the Runner is built, so they end in one clear line.

mmengine's ``Runner`` logs the environment and the whole config (hundreds of lines) before it
builds the model; a wrong ``arch`` or ``patch_size`` would otherwise end under that dump. (A
checkpoint of another task is named by the backbone's load hook, on the load path of every door.)
"""
import torch
from mmengine.registry import MODELS, DefaultScope, init_default_scope


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
