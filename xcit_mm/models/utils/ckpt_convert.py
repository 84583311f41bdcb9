"""Pure key conversion of the published XCiT layouts (docs/weights.md) to
:class:`XCiTBackbone`'s names: dicts of tensors in, dicts out, no file read."""
import re
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple

import torch

LAYOUTS = ('official', 'timm', 'mmpretrain', 'xcit_mm')

# Keys only the ImageNet classifier has: the dense backbone drops them (and says so).
CLASSIFIER_KEY = re.compile(r'^(cls_token|cls_attn_blocks\.|ca_layers\.|norm\.|head\.|fc_norm\.)')
ADAPTER_KEY = re.compile(r'^fpn[1-4]\.')

# (pattern, replacement) applied in order to each key, per source layout.
_RENAMES = {
    'official': [
        (r'^patch_embed\.proj\.(\d+)\.0\.', lambda m: f'patch_embed.proj.{int(m[1]) // 2}.conv.'),
        (r'^patch_embed\.proj\.(\d+)\.1\.', lambda m: f'patch_embed.proj.{int(m[1]) // 2}.bn.'),
        (r'^pos_embed(er)?\.token_projection\.', 'pos_embed.proj.'),
        (r'^blocks\.(\d+)\.', r'layers.\1.'),
        (r'^(layers\.\d+)\.local_mp\.', r'\1.lpi.'),
        (r'^(layers\.\d+)\.mlp\.', r'\1.ffn.'),
    ],
    'mmpretrain': [
        (r'^pos_embed\.token_projection\.conv\.', 'pos_embed.proj.'),
        (r'^xca_layers\.(\d+)\.', r'layers.\1.'),
        (r'^(layers\.\d+)\.local_mp\.conv1\.conv\.', r'\1.lpi.conv1.'),
        (r'^(layers\.\d+)\.local_mp\.conv1\.bn\.', r'\1.lpi.bn.'),
        (r'^(layers\.\d+)\.local_mp\.conv2\.conv\.', r'\1.lpi.conv2.'),
        (r'^(layers\.\d+)\.ffn\.layers\.0\.0\.', r'\1.ffn.fc1.'),
        (r'^(layers\.\d+)\.ffn\.layers\.1\.', r'\1.ffn.fc2.'),
    ],
    # xcit_mm 0.1 stored the adapter's transposed conv outside an nn.Sequential
    'xcit_mm': [(r'^(fpn[1-4])\.(weight|bias)$', r'\1.0.\2')],
}
_RENAMES['timm'] = _RENAMES['official']


class LayoutError(ValueError):
    """A state dict that is not in any known XCiT layout."""


def _detect_layout(keys: List[str]) -> str:
    """Which of :data:`LAYOUTS` a (prefix-free) backbone state dict's ``keys`` use."""
    if any(k.startswith('xca_layers.') for k in keys):
        return 'mmpretrain'
    # blocks.* alone is any timm / DeiT ViT: XCiT blocks also have their LPI (local_mp)
    if any(k.startswith('blocks.') for k in keys) and any('.local_mp.' in k for k in keys):
        return 'official' if any(k.startswith('pos_embeder.') for k in keys) else 'timm'
    if any(k.startswith('layers.') for k in keys) and any('.lpi.' in k for k in keys):
        return 'xcit_mm'
    raise LayoutError(f'Unrecognised checkpoint layout: none of {LAYOUTS} matches. Is this an '
                      f'XCiT checkpoint? First keys: {keys[:8]}')


def strip_prefix(state_dict, prefix) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    return (OrderedDict((k[len(prefix):], v) for k, v in state_dict.items()
                        if k.startswith(prefix)),
            [k for k in state_dict if not k.startswith(prefix)])


def strip_ddp_prefix(state_dict):
    """``state_dict`` without DDP's ``module.`` prefix, when every key has it."""
    if state_dict and all(k.startswith('module.') for k in state_dict):
        return strip_prefix(state_dict, 'module.')[0]
    return state_dict


def convert_backbone_state_dict(state_dict: Dict[str, torch.Tensor],
                                prefix: Optional[str] = None
                                ) -> Tuple['OrderedDict[str, torch.Tensor]', dict]:
    """``(converted, info)``: the keys under ``prefix`` (by default, without DDP's ``module.``,
    the ``backbone.`` keys if any) renamed; ``info`` holds the ``layout`` and the dropped
    ``classifier`` and ``outside`` keys."""
    outside: List[str] = []
    if prefix is None:
        state_dict = strip_ddp_prefix(state_dict)
        if any(k.startswith('backbone.') for k in state_dict):
            prefix = 'backbone.'
    if prefix:
        state_dict, outside = strip_prefix(state_dict, prefix)
        if not state_dict:
            raise LayoutError(f'No key starts with prefix {prefix!r}; first keys: {outside[:8]}')
    layout = _detect_layout(list(state_dict))
    converted: 'OrderedDict[str, torch.Tensor]' = OrderedDict()
    classifier: List[str] = []
    for key, value in state_dict.items():
        if CLASSIFIER_KEY.match(key):
            classifier.append(key)
            continue
        for pattern, repl in _RENAMES[layout]:
            key = re.sub(pattern, repl, key)
        converted[key] = value
    return converted, dict(layout=layout, classifier=classifier, outside=outside)


def convert_model_state_dict(state_dict: Dict[str, torch.Tensor]
                             ) -> Tuple['OrderedDict[str, torch.Tensor]', dict]:
    """Convert a whole detector / segmentor: the backbone's keys renamed, the neck and heads kept
    (mmdet 3 / mmseg 1 use the released names); without an XCiT backbone, ``layout=None``."""
    state_dict = strip_ddp_prefix(state_dict)
    try:
        backbone, info = convert_backbone_state_dict(state_dict, prefix='backbone.')
    except LayoutError:
        return OrderedDict(state_dict), dict(layout=None, classifier=[], outside=[])
    converted = OrderedDict(('backbone.' + k, v) for k, v in backbone.items())
    converted.update((k, v) for k, v in state_dict.items() if not k.startswith('backbone.'))
    return converted, dict(info, outside=[])


def describe_backbone(state_dict: Dict[str, torch.Tensor]) -> str:
    """Guess the arch of a converted backbone state dict, to explain a mismatch."""
    proj = state_dict.get('pos_embed.proj.weight')
    depth = len({k.split('.')[1] for k in state_dict if k.startswith('layers.')})
    convs = len({k.split('.')[2] for k in state_dict if k.startswith('patch_embed.proj.')})
    parts = [f'embed_dims={proj.shape[0]}' if proj is not None else '',
             f'depth={depth}' if depth else '', f'patch_size={2**convs}' if convs else '']
    return ', '.join(part for part in parts if part) or 'unknown'


# Key patterns of other backbones, to name them when their file meets an XCiT model.
_FOREIGN_BACKBONES = [
    (re.compile(r'(^|\.)stages\.\d+\.blocks\.\d+\.attn\.w_msa\.'), 'a Swin Transformer'),
    (re.compile(r'(^|\.)layer[1-4]\.\d+\.conv1\.'), 'a ResNet'),
    (re.compile(r'(^|\.)(layers|blocks)\.\d+\.attn\.qkv\.'), 'a ViT / DeiT'),
]


def kind_of_backbone(keys: Iterable[str]) -> Optional[str]:
    """The name of the other backbone whose ``keys`` these are, else None."""
    for pattern, name in _FOREIGN_BACKBONES:
        if any(pattern.search(k) for k in keys):
            return name
    return None
