"""The load hooks of :class:`XCiTBackbone`: every published layout loads through any loader,
exactly, and a file that does not fit is a :class:`CheckpointError` naming the cause, even under
mmengine's non-strict loading (docs/weights.md)."""
import re
from collections import OrderedDict
from typing import Dict, List, Optional

import torch
from mmengine.logging import print_log

from .checkpoint_io import CheckpointError, extract_state_dict, load_checkpoint_file
from .ckpt_convert import (ADAPTER_KEY, LayoutError, convert_backbone_state_dict,
                           describe_backbone, kind_of_backbone, strip_prefix)

# Heads that identify the kind of dense model a file was saved from (mmdet / mmseg names).
TASK_HEADS = {
    'detector': ('rpn_head.', 'roi_head.', 'bbox_head.', 'mask_head.'),
    'segmentor': ('decode_head.', 'auxiliary_head.'),
}

_CLASSIFIER_ROOT = re.compile(r'^(blocks\.|cls_token|cls_attn_blocks\.|pos_embeder\.|head\.)')


def _is_counter(key: str) -> bool:
    return key.endswith('num_batches_tracked')


def _check_fit(module, converted: Dict[str, torch.Tensor], where: str) -> List[str]:
    """Raise unless ``converted`` sets every trunk tensor of ``module``, and the adapter whole or
    not at all (ImageNet weights); return the adapter branches left at their initialisation."""
    own = module.state_dict()
    mismatched = [f'{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}'
                  for k, v in converted.items() if k in own and own[k].shape != v.shape]
    unexpected = [k for k in converted if k not in own]
    missing = [k for k in own if k not in converted and not _is_counter(k)]
    missing_trunk = [k for k in missing if not ADAPTER_KEY.match(k)]
    adapter_missing = [k for k in missing if ADAPTER_KEY.match(k)]
    problems = [f'{len(keys)} {what}, e.g. {keys[:3]}' for keys, what in (
        (mismatched, 'tensors have the wrong shape'),
        (unexpected, 'keys do not exist in XCiTBackbone'),
        (missing_trunk, 'trunk weights are missing')) if keys]
    if problems:
        raise CheckpointError(f'The weights given to XCiTBackbone{where} do not fit it: '
                              f'{"; ".join(problems)}. Likely cause: the weights look like '
                              f'{describe_backbone(converted)} while the backbone has '
                              f'embed_dims={module.embed_dims}, depth={module.num_layers}, '
                              f'patch_size={module.patch_size}: pick the arch / patch_size of '
                              f'the checkpoint (e.g. p8 vs p16, or another XCiT size).')
    if adapter_missing and any(ADAPTER_KEY.match(k) and not _is_counter(k) for k in converted):
        raise CheckpointError(
            f'The weights given to XCiTBackbone{where} hold only part of the stride adapter: '
            f'{adapter_missing[:4]} are missing. A file holds the whole adapter (a COCO / '
            f'ADE20k model) or none of it (ImageNet weights); this one is incomplete or was '
            f'edited: re-export it.')
    return sorted({k.split('.')[0] for k in adapter_missing})


def _check_same_task(unexpected_keys: List[str]) -> None:
    """Raise if the model left a detector's / segmentor's heads unexpected: another task."""
    for task, heads in TASK_HEADS.items():
        foreign = [k for k in unexpected_keys if k.startswith(heads)]
        if foreign:
            raise CheckpointError(
                f'The checkpoint is a {task} checkpoint ({foreign[0]}, ...) whose heads the '
                f'model holding this XCiTBackbone does not have: use the config of the model '
                f'the file was saved from (the {task} config it was trained with).')


def refuse_headless_load(model, incompatible_keys) -> None:
    """Load post-hook of a whole detector / segmentor: refuse a file that leaves a head random."""
    missing = set(incompatible_keys.missing_keys)
    heads = {prefix.rstrip('.') for prefixes in TASK_HEADS.values() for prefix in prefixes}
    for name, head in model.named_children():
        if name not in heads:
            continue
        own = [f'{name}.{key}' for key in head.state_dict() if not _is_counter(key)]
        if own and missing.issuperset(own):
            raise CheckpointError(
                f'The checkpoint has no weights for {name} ({own[0]}, ...): it is not a checkpoint '
                f'of this model, whose {name} would stay randomly initialised. Load a whole '
                f'model trained with this config; backbone-only or ImageNet weights go to '
                f'model.backbone.init_cfg.')


def backbone_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                           unexpected_keys, error_msgs) -> None:
    """Convert the backbone's keys (under ``prefix``; at the root of a load, a whole-model or DDP
    file's ``backbone.`` keys) in ``state_dict``, in place."""
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
    """Fail if the backbone received no weights or the file is of another task; take BN counters
    and an adapter left fresh on purpose off the missing keys (a strict load passes)."""
    report = getattr(module, 'last_load_report', None)
    unexpected = list(incompatible_keys.unexpected_keys)
    if report is None:
        raise CheckpointError(
            f'The state dict loaded into the model has no weights for its XCiTBackbone, which '
            f'would stay randomly initialised. Likely cause: {_no_weights_cause(unexpected)}. '
            f'First unexpected keys: {unexpected[:4]}')
    _check_same_task(unexpected)
    ours = report['prefix']
    fresh = tuple(ours + name + '.' for name in report['adapter_fresh'])
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing
                  if not (k.startswith(ours) and (_is_counter(k) or k.startswith(fresh)))]


def load_backbone_checkpoint(model: torch.nn.Module, checkpoint: str,
                             prefix: Optional[str] = None, weights_only: bool = True) -> dict:
    """Load ``checkpoint`` (any layout; the keys under ``prefix`` if given) into an
    ``XCiTBackbone``; return its ``last_load_report``."""
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
