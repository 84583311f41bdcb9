"""Config mistakes found before the Runner is built (and logs hundreds of lines of config), so
that a wrong ``arch`` or ``patch_size`` ends in one clear line."""
import torch
from mmengine.registry import MODELS, DefaultScope, init_default_scope


class ConfigError(ValueError):
    """A config that cannot build the model it describes; the message names the key to fix."""


def check_backbone_config(cfg) -> None:
    """Build ``cfg.model.backbone`` alone (its arguments are checked at construction)."""
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
