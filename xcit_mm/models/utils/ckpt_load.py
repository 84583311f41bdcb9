"""Loading converted weights into a backbone or a whole model, strictly.

mmengine's loaders are non-strict by default and only warn: a checkpoint whose keys do not match
leaves modules at their random initialisation without stopping anything. Here every mismatch is a
:class:`~xcit_mm.utils.checkpoint_io.CheckpointError` that names the keys and the likely cause.
"""
from collections import OrderedDict
from typing import Dict, Optional

import torch
from mmengine.logging import print_log

from xcit_mm.utils.checkpoint_io import (CheckpointError, extract_state_dict,
                                         load_checkpoint_file)
from .ckpt_convert import (ADAPTER_KEY, LayoutError, convert_backbone_state_dict,
                           convert_model_state_dict, describe_backbone)

_TASK_HEADS = {
    'detector': ('rpn_head.', 'roi_head.', 'bbox_head.', 'mask_head.'),
    'segmentor': ('decode_head.', 'auxiliary_head.'),
}


def _compare_keys(own: Dict[str, torch.Tensor], state_dict: Dict[str, torch.Tensor],
                  may_be_absent=lambda key: False):
    """``(mismatched, unexpected, missing)`` keys of ``state_dict`` against a model's ``own``.

    BN ``num_batches_tracked`` counters, and the keys ``may_be_absent`` accepts, may be missing.
    """
    mismatched = [f'{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}'
                  for k, v in state_dict.items() if k in own and own[k].shape != v.shape]
    unexpected = [k for k in state_dict if k not in own]
    missing = [k for k in own if k not in state_dict and not may_be_absent(k)
               and not k.endswith('num_batches_tracked')]
    return mismatched, unexpected, missing


def _backbone_mismatch_hint(model, state_dict) -> str:
    model_desc = (f'embed_dims={model.embed_dims}, depth={model.num_layers}, '
                  f'patch_size={model.patch_size}')
    return (f'the checkpoint looks like {describe_backbone(state_dict)} while the backbone has '
            f'{model_desc}: pick the arch/patch_size that match the checkpoint')


def load_backbone_state_dict(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor],
                             source: str = 'checkpoint') -> dict:
    """Load converted weights into an ``XCiTBackbone``; every trunk tensor must be set.

    The stride adapter (``fpn1..fpn4``) may be absent (ImageNet weights): it keeps its fresh
    init. BN ``num_batches_tracked`` counters may be absent too. Anything else missing, any
    unexpected key and any shape mismatch is a :class:`CheckpointError` naming the keys.
    """
    own = model.state_dict()
    hint = _backbone_mismatch_hint(model, state_dict)
    mismatched, unexpected, missing = _compare_keys(
        own, state_dict, may_be_absent=lambda k: bool(ADAPTER_KEY.match(k)))
    if mismatched:
        raise CheckpointError(f'{source}: {len(mismatched)} tensors have the wrong shape, e.g. '
                              f'{mismatched[:5]}; {hint}')
    if unexpected:
        raise CheckpointError(f'{source}: {len(unexpected)} keys do not exist in XCiTBackbone, '
                              f'e.g. {unexpected[:5]}; {hint}')
    if missing:
        raise CheckpointError(f'{source}: {len(missing)} trunk weights are not in the checkpoint, '
                              f'e.g. {missing[:5]}; {hint}')
    model.load_state_dict(state_dict, strict=False)
    fresh = sorted({k.split('.')[0] for k in own if k not in state_dict and ADAPTER_KEY.match(k)})
    return dict(loaded=len(state_dict), adapter_fresh=fresh)


def load_backbone_checkpoint(model: torch.nn.Module, checkpoint: str,
                             prefix: Optional[str] = None, weights_only: bool = True) -> dict:
    """Read ``checkpoint`` (any layout), convert it and load it into ``model``; log a summary."""
    source = str(checkpoint)
    state_dict = extract_state_dict(
        load_checkpoint_file(checkpoint, 'pretrained checkpoint', weights_only), source)
    try:
        converted, info = convert_backbone_state_dict(state_dict, prefix)
    except LayoutError as e:
        raise CheckpointError(f'{source}: {e}') from e
    report = load_backbone_state_dict(model, converted, source=source)
    report.update(info)
    print_log(
        f'XCiTBackbone: loaded {report["loaded"]} tensors from {checkpoint} ({info["layout"]} '
        f'layout); dropped {len(info["classifier"])} classification-only keys and '
        f'{len(info["outside"])} keys outside the backbone; adapter initialised fresh: '
        f'{report["adapter_fresh"] or "none"}', logger='current')
    return report


def _likely_cause(model: torch.nn.Module, own_keys, state_dict) -> str:
    """Explain a whole-model mismatch: another task, another backbone size or patch size."""
    for task, heads in _TASK_HEADS.items():
        file_has = any(k.startswith(heads) for k in state_dict)
        model_has = any(k.startswith(heads) for k in own_keys)
        if file_has and not model_has:
            return f'the file is a {task} checkpoint, the config builds another kind of model'
    backbone = getattr(model, 'backbone', None)
    if backbone is not None and hasattr(backbone, 'patch_size'):
        sub = OrderedDict((k[len('backbone.'):], v) for k, v in state_dict.items()
                          if k.startswith('backbone.'))
        if sub:
            return (f'{_backbone_mismatch_hint(backbone, sub)} (e.g. p8 vs p16, or another '
                    f'XCiT size)')
    return 'the config does not build the model this file was saved from'


def load_model_state_dict(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor],
                          source: str = 'checkpoint') -> dict:
    """Strictly load a whole detector / segmentor, converting released XCiT layouts first.

    Every model tensor must come from the file (BN ``num_batches_tracked`` counters excepted),
    every file tensor must exist in the model with the same shape.

    Returns:
        dict: ``layout`` of the backbone in the file (None for other backbones), ``loaded``.

    Raises:
        CheckpointError: naming the keys and the likely cause.
    """
    converted, info = convert_model_state_dict(state_dict)
    own = model.state_dict()
    mismatched, unexpected, missing = _compare_keys(own, converted)
    if mismatched or unexpected or missing:
        parts = []
        if mismatched:
            parts.append(f'{len(mismatched)} tensors have the wrong shape, e.g. {mismatched[:4]}')
        if missing:
            parts.append(f'{len(missing)} model weights are not in the file, e.g. {missing[:4]}')
        if unexpected:
            parts.append(f'{len(unexpected)} keys of the file do not exist in the model, e.g. '
                         f'{unexpected[:4]}')
        raise CheckpointError(
            f'{source} does not fit the model: {"; ".join(parts)}. Likely cause: '
            f'{_likely_cause(model, own, converted)}. Loading stopped, so that '
            f'no part of the model is silently left at its random initialisation.')
    model.load_state_dict(converted, strict=False)  # counters may be absent: checked above
    return dict(layout=info['layout'], loaded=len(converted))


def load_model_checkpoint(model: torch.nn.Module, filename: str, map_location='cpu',
                          what: str = 'checkpoint'):
    """Read a whole-model checkpoint safely and load it strictly (released layouts converted).

    Args:
        what (str): How messages name the file.

    Returns:
        tuple: ``(checkpoint, report)``: the checkpoint dict as read, and
        :func:`load_model_state_dict`'s report.
    """
    checkpoint = load_checkpoint_file(filename, what, map_location=map_location)
    source = f'{what} {filename}'
    report = load_model_state_dict(model, extract_state_dict(checkpoint, source), source=source)
    return checkpoint, report


def is_released_layout(layout: Optional[str]) -> bool:
    """True when a whole-model file needed key conversion (official / timm / mmpretrain)."""
    return layout is not None and layout != 'xcit_mm'


__all__ = [
    'load_backbone_checkpoint', 'load_backbone_state_dict', 'load_model_checkpoint',
    'load_model_state_dict',
    'is_released_layout'
]
