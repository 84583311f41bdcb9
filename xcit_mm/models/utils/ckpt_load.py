"""Loading XCiT weights through any loader, exactly or not at all.

:class:`~xcit_mm.models.backbones.XCiTBackbone` registers :func:`backbone_load_pre_hook` and
:func:`backbone_load_post_hook` on itself (PyTorch's state-dict load hooks, as timm and
mmpretrain use to migrate old layouts). Whoever loads a state dict into the backbone or into a
model holding it -- ``model.load_state_dict``, mmengine's ``load_checkpoint`` / ``load_from`` /
resume, ``mmdet.apis.init_detector``, ``DetInferencer``, ``mmseg.apis.init_model``,
``MMSegInferencer`` -- gets the published layouts (official, timm, mmpretrain, released COCO /
ADE20k, older xcit_mm files) converted to the backbone's names on the fly, and a file that does
not fit is a :class:`CheckpointError` naming the likely cause, even under mmengine's non-strict
loading, which would otherwise only warn and leave the backbone at its random initialisation.
"""
import re
from collections import OrderedDict
from typing import Dict, List, Optional

import torch
from mmengine.logging import print_log

from .checkpoint_io import CheckpointError, extract_state_dict, load_checkpoint_file
from .ckpt_convert import (ADAPTER_KEY, LayoutError, convert_backbone_state_dict,
                           describe_backbone, kind_of_backbone, strip_ddp_prefix, strip_prefix)

# Heads that identify the kind of dense model a file was saved from (mmdet / mmseg names).
TASK_HEADS = {
    'detector': ('rpn_head.', 'roi_head.', 'bbox_head.', 'mask_head.'),
    'segmentor': ('decode_head.', 'auxiliary_head.'),
}

_CLASSIFIER_ROOT = re.compile(r'^(blocks\.|cls_token|cls_attn_blocks\.|pos_embeder\.|head\.)')


def _is_counter(key: str) -> bool:
    return key.endswith('num_batches_tracked')


def _arch_hint(module, state_dict: Dict[str, torch.Tensor]) -> str:
    return (f'the weights look like {describe_backbone(state_dict)} while the backbone has '
            f'embed_dims={module.embed_dims}, depth={module.num_layers}, '
            f'patch_size={module.patch_size}: pick the arch / patch_size of the checkpoint '
            f'(e.g. p8 vs p16, or another XCiT size)')


def _check_fit(module, converted: Dict[str, torch.Tensor], where: str) -> List[str]:
    """Raise unless ``converted`` sets every trunk tensor of ``module`` with the right shape.

    The stride adapter (``fpn1``..``fpn4``) is all there (dense-prediction files) or all absent
    (ImageNet weights: it keeps its fresh initialisation); partly present is an error.

    Returns:
        list[str]: The adapter branches left at their initialisation.
    """
    own = module.state_dict()
    mismatched = [f'{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}'
                  for k, v in converted.items() if k in own and own[k].shape != v.shape]
    unexpected = [k for k in converted if k not in own]
    missing = [k for k in own if k not in converted and not _is_counter(k)]
    missing_trunk = [k for k in missing if not ADAPTER_KEY.match(k)]
    adapter_own = [k for k in own if ADAPTER_KEY.match(k) and not _is_counter(k)]
    adapter_missing = [k for k in missing if ADAPTER_KEY.match(k)]
    problems = []
    if mismatched:
        problems.append(f'{len(mismatched)} tensors have the wrong shape, e.g. {mismatched[:3]}')
    if unexpected:
        problems.append(f'{len(unexpected)} keys do not exist in XCiTBackbone, e.g. '
                        f'{unexpected[:3]}')
    if missing_trunk:
        problems.append(f'{len(missing_trunk)} trunk weights are missing, e.g. '
                        f'{missing_trunk[:3]}')
    if problems:
        raise CheckpointError(f'The weights given to XCiTBackbone{where} do not fit it: '
                              f'{"; ".join(problems)}. Likely cause: '
                              f'{_arch_hint(module, converted)}.')
    if adapter_missing and len(adapter_missing) < len(adapter_own):
        raise CheckpointError(
            f'The weights given to XCiTBackbone{where} hold only part of the stride adapter: '
            f'{adapter_missing[:4]} are missing. A file holds the whole adapter (a COCO / '
            f'ADE20k model) or none of it (ImageNet weights); this one is incomplete or was '
            f'edited: re-export it.')
    return sorted({k.split('.')[0] for k in adapter_missing})


def _check_same_task(unexpected_keys: List[str]) -> None:
    """Raise if the model left heads of a detector / segmentor file unexpected: another task."""
    for task, heads in TASK_HEADS.items():
        foreign = [k for k in unexpected_keys if k.startswith(heads)]
        if foreign:
            raise CheckpointError(
                f'The checkpoint is a {task} checkpoint ({foreign[0]}, ...) whose heads the '
                f'model holding this XCiTBackbone does not have: use the config of the model '
                f'the file was saved from (the {task} config it was trained with).')


def refuse_headless_load(model, incompatible_keys) -> None:
    """Load post-hook of a whole detector / segmentor: a file that leaves one of its heads with no
    weight at all is not a checkpoint of this model (a backbone-only or classifier file, say), and
    loading it would give a model whose heads stay random."""
    missing = set(incompatible_keys.missing_keys)
    if not missing:
        return
    heads = {prefix.rstrip('.') for prefixes in TASK_HEADS.values() for prefix in prefixes}
    for name, head in model.named_children():
        if name not in heads:
            continue
        own = [f'{name}.{key}' for key in head.state_dict()  # BN counters may be absent
               if not key.endswith('num_batches_tracked')]
        if own and missing.issuperset(own):
            raise CheckpointError(
                f'The checkpoint has no weights for {name} ({own[0]}, ...): it is not a checkpoint '
                f'of this model, whose {name} would stay randomly initialised. Load a whole '
                f'model trained with this config; backbone-only or ImageNet weights go to '
                f'model.backbone.init_cfg.')


def backbone_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                           unexpected_keys, error_msgs) -> None:
    """Convert the backbone's part of ``state_dict`` (keys under ``prefix``) in place.

    At the root of a load (``prefix == ''``, e.g. ``backbone.load_state_dict(...)`` or the
    ``Pretrained`` init_cfg) a DDP ``module.`` prefix is stripped and, in a whole-model file,
    only the ``backbone.`` weights are taken; classification-only keys are dropped there too.
    """
    # The model holding the backbone is loaded first: heads it lacks are already unexpected.
    # Another task's file names that cause, not the backbone it happens to hold (e.g. p16 in p8).
    _check_same_task(unexpected_keys)
    keys = [k for k in state_dict if k.startswith(prefix)]
    where = f' (keys under {prefix!r})' if prefix else ''
    module.last_load_report = None
    if not keys:
        return  # backbone_load_post_hook names the problem, knowing the whole load
    local = OrderedDict((k[len(prefix):], state_dict.pop(k)) for k in keys)
    try:
        converted, info = convert_backbone_state_dict(local, prefix=None if not prefix else '')
    except LayoutError:
        other = kind_of_backbone(local)
        cause = (f'these are the weights of {other} backbone, not XCiT' if other else
                 f'none of the published XCiT layouts matches; first keys {list(local)[:5]}')
        raise CheckpointError(f'The weights given to XCiTBackbone{where} are not XCiT weights: '
                              f'{cause}. Use a checkpoint of an XCiT model, or a config with '
                              f'the backbone this file was trained with.') from None
    fresh = _check_fit(module, converted, where)
    state_dict.update((prefix + k, v) for k, v in converted.items())
    module.last_load_report = dict(info, prefix=prefix, loaded=len(converted),
                                   adapter_fresh=fresh)
    if info['layout'] != 'xcit_mm' or fresh or info['classifier'] or info['outside']:
        print_log(
            f'XCiTBackbone{where}: loaded {len(converted)} tensors ({info["layout"]} layout, '
            f'converted in memory); dropped {len(info["classifier"])} classification-only keys '
            f'and {len(info["outside"])} keys outside the backbone; adapter left at its '
            f'initialisation: {fresh or "none"}', logger='current')


def _no_weights_cause(unexpected: List[str]) -> str:
    if any(k.startswith('module.') for k in unexpected):
        return ('the keys start with the DDP prefix "module.": strip it (mmengine\'s '
                'load_checkpoint does; plain load_state_dict does not)')
    if any(_CLASSIFIER_ROOT.match(k) for k in unexpected):
        return ('this is an ImageNet classifier file (blocks.*, cls_token...): load it into the '
                'backbone with model.backbone.init_cfg=dict(type="Pretrained", checkpoint=FILE)')
    other = kind_of_backbone(unexpected)
    if other:
        return f'the file holds {other} model without the "backbone." prefix'
    return 'the file holds no weights for the backbone at all'


def backbone_load_post_hook(module, incompatible_keys) -> None:
    """After the load: fail if the backbone received no weights, or if the file is a model of
    another task (a segmentor file loaded into a detector, or the reverse).

    BN counters and an adapter left at its initialisation on purpose (ImageNet weights, logged
    by the pre-hook) are taken off the missing keys, so that a strict load accepts them.
    """
    report = getattr(module, 'last_load_report', None)
    unexpected = list(incompatible_keys.unexpected_keys)
    if report is None:
        raise CheckpointError(
            f'The state dict loaded into the model has no weights for its XCiTBackbone, which '
            f'would stay randomly initialised. Likely cause: {_no_weights_cause(unexpected)}. '
            f'First unexpected keys: {unexpected[:4]}')
    _check_same_task(unexpected)
    fresh = tuple(report['prefix'] + name + '.' for name in report['adapter_fresh'])
    missing = incompatible_keys.missing_keys
    ours = report['prefix']
    missing[:] = [k for k in missing
                  if not (k.startswith(ours) and (_is_counter(k) or k.startswith(fresh)))]


def load_backbone_checkpoint(model: torch.nn.Module, checkpoint: str,
                             prefix: Optional[str] = None, weights_only: bool = True) -> dict:
    """Read ``checkpoint`` (any layout) safely and load it into an ``XCiTBackbone``.

    Args:
        prefix (str, optional): Take only the keys under this prefix (e.g. ``'backbone.'``);
            by default the backbone's load hook finds them.
        weights_only (bool): False unpickles arbitrary objects: only for files you trust.

    Returns:
        dict: ``layout``, ``loaded``, ``adapter_fresh``, ``classifier``, ``outside``.
    """
    source = str(checkpoint)
    state_dict = extract_state_dict(
        load_checkpoint_file(checkpoint, 'pretrained checkpoint', weights_only), source)
    if prefix:
        state_dict, outside = strip_prefix(state_dict, prefix)
        if not state_dict:
            raise CheckpointError(f'{source}: no key starts with prefix {prefix!r}; first keys: '
                                  f'{outside[:8]}')
    try:
        # strict: the hooks accept an absent adapter (ImageNet weights) and absent BN counters
        model.load_state_dict(state_dict)
    except CheckpointError as e:
        raise CheckpointError(f'{source}: {e}') from None
    return dict(model.last_load_report)


def _likely_cause(model: torch.nn.Module, own_keys, state_dict) -> str:
    """Explain a whole-model mismatch outside the backbone: another task, or another model."""
    for task, heads in TASK_HEADS.items():
        if any(k.startswith(heads) for k in state_dict) and \
                not any(k.startswith(heads) for k in own_keys):
            return f'the file is a {task} checkpoint, the config builds another kind of model'
    return 'the config does not build the model this file was saved from'


def load_model_state_dict(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor],
                          source: str = 'checkpoint') -> dict:
    """Strictly load a whole detector / segmentor (released XCiT layouts are converted by the
    backbone's load hook): every model tensor must come from the file (BN counters excepted)
    and every file tensor must fit the model.

    Returns:
        dict: ``layout`` of the backbone in the file (None without an XCiT backbone),
        ``loaded`` (tensors in the file).

    Raises:
        CheckpointError: naming the keys and the likely cause.
    """
    state_dict = OrderedDict(strip_ddp_prefix(state_dict))
    try:
        result = model.load_state_dict(state_dict, strict=False)
        error = None
    except RuntimeError as e:  # shape mismatches outside the backbone
        result, error = None, e
    if isinstance(error, CheckpointError):
        raise CheckpointError(f'{source}: {error}') from None
    parts = []
    if error is not None:
        sizes = re.findall(r'size mismatch for ([^:]+):', str(error))
        parts.append(f'{len(sizes)} tensors have the wrong shape, e.g. {sizes[:4]}')
    else:
        missing = [k for k in result.missing_keys if not _is_counter(k)]
        if missing:
            parts.append(f'{len(missing)} model weights are not in the file, e.g. {missing[:4]}')
        if result.unexpected_keys:
            parts.append(f'{len(result.unexpected_keys)} keys of the file do not exist in the '
                         f'model, e.g. {result.unexpected_keys[:4]}')
    if parts:
        raise CheckpointError(
            f'{source} does not fit the model: {"; ".join(parts)}. Likely cause: '
            f'{_likely_cause(model, model.state_dict(), state_dict)}. Loading stopped, so that '
            f'no part of the model is silently left at its random initialisation.')
    reports = [m.last_load_report for m in model.modules()
               if getattr(m, 'last_load_report', None)]
    return dict(layout=reports[0]['layout'] if reports else None, loaded=len(state_dict))


def load_model_checkpoint(model: torch.nn.Module, filename: str, map_location='cpu',
                          what: str = 'checkpoint'):
    """Read a whole-model checkpoint safely and load it strictly (released layouts converted).

    Returns:
        tuple: ``(checkpoint, report)``: the checkpoint dict as read, and
        :func:`load_model_state_dict`'s report.
    """
    checkpoint = load_checkpoint_file(filename, what, map_location=map_location)
    source = f'{what} {filename}'
    report = load_model_state_dict(model, extract_state_dict(checkpoint, source), source=source)
    return checkpoint, report


__all__ = [
    'TASK_HEADS', 'backbone_load_post_hook', 'backbone_load_pre_hook', 'load_backbone_checkpoint'
]
