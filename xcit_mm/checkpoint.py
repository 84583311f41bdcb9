"""Reading published XCiT checkpoints safely, whatever their layout.

Four layouts exist in the wild (see the README):

* ``official``  - facebookresearch/xcit ImageNet and DINO files, ``{'model': state_dict}``,
  keys ``blocks.{i}.local_mp.*``, ``pos_embeder.*``, ``patch_embed.proj.{0,2,4,6}.{0,1}.*``;
  the official COCO/ADE detectors use the same names under ``backbone.``.
* ``timm``      - the official names with ``pos_embed.`` for ``pos_embeder.``.
* ``mmpretrain``- ``{'state_dict': ...}`` with ``backbone.xca_layers.{i}.*`` and mmcv brick names.
* ``xcit_mm``   - this package's names (see :mod:`xcit_mm.models.xcit`), possibly inside an
  mmengine checkpoint under ``backbone.``.

:func:`convert_state_dict` is the pure conversion used both by the backbone's
``init_cfg=dict(type='Pretrained', ...)`` and by ``tools/convert_checkpoint.py``.
Every file is read with ``torch.load(weights_only=True)``: nothing is unpickled unless the caller
opts in with ``weights_only=False`` for a file they trust.
"""
import os
import pickle
import re
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from mmengine.logging import print_log

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
    'xcit_mm': [],
}
_RENAMES['timm'] = _RENAMES['official']


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the backbone."""


# ---------------------------------------------------------------------------- reading files
def read_checkpoint(path: str, weights_only: bool = True) -> dict:
    """Load a checkpoint file or URL on the CPU, refusing pickled code unless opted in.

    Args:
        path: Local path, or an http(s) URL (downloaded once into torch's hub cache).
        weights_only: Keep ``True`` for downloaded or shared files. ``False`` unpickles arbitrary
            objects and so can run code: only for files you trust (e.g. your own mmengine run).
    """
    try:
        if re.match(r'^https?://', str(path)):
            return torch.hub.load_state_dict_from_url(
                path, map_location='cpu', weights_only=weights_only)
        if not os.path.isfile(path):
            raise CheckpointError(f'Checkpoint file not found: {path!r}. Check the path in '
                                  f"init_cfg=dict(type='Pretrained', checkpoint=...) / the CLI.")
        return torch.load(path, map_location='cpu', weights_only=weights_only)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f'Refusing to unpickle {path!r}: it holds Python objects beyond tensors, which '
            f'torch.load(weights_only=True) will not execute ({first_line[:300]}). Full '
            f'mmengine training checkpoints (optimizer, message hub) are like this. If you trust '
            f'the file, opt in with weights_only=False (init_cfg=dict(type=\'Pretrained\', '
            f'checkpoint=..., weights_only=False)), or convert it once: python '
            f'tools/convert_checkpoint.py {path} OUT.pth --trust') from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f'Cannot read checkpoint {path!r}: the file is truncated, corrupt '
                              f'or not a PyTorch checkpoint ({type(e).__name__}: '
                              f'{str(e)[:300]})') from e


def extract_state_dict(obj) -> Dict[str, torch.Tensor]:
    """The tensor dict inside a checkpoint (``state_dict``, ``model``, ``module`` or itself)."""
    if not isinstance(obj, dict):
        raise CheckpointError(f'A checkpoint must be a dict, got {type(obj).__name__}')
    for key in ('state_dict', 'model', 'module'):
        if key in obj and isinstance(obj[key], dict):
            return extract_state_dict(obj[key])
    tensors = OrderedDict((k, v) for k, v in obj.items() if isinstance(v, torch.Tensor))
    if not tensors:
        raise CheckpointError(f'No tensors found in the checkpoint (top-level keys: '
                              f'{list(obj)[:10]})')
    return tensors


# ---------------------------------------------------------------------------- pure conversion
def detect_layout(state_dict: Dict[str, torch.Tensor]) -> str:
    """Which of :data:`LAYOUTS` a (prefix-free) backbone state dict uses."""
    keys = list(state_dict)
    if any(k.startswith('xca_layers.') for k in keys):
        return 'mmpretrain'
    if any(k.startswith('blocks.') for k in keys):
        return 'official' if any(k.startswith('pos_embeder.') for k in keys) else 'timm'
    if any(k.startswith('layers.') for k in keys) and any('.lpi.' in k for k in keys):
        return 'xcit_mm'
    raise CheckpointError(f'Unrecognised checkpoint layout: none of {LAYOUTS} matches. Is this an '
                          f'XCiT checkpoint? First keys: {keys[:8]}')


def _strip_prefix(state_dict, prefix) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    kept = OrderedDict((k[len(prefix):], v) for k, v in state_dict.items()
                       if k.startswith(prefix))
    dropped = [k for k in state_dict if not k.startswith(prefix)]
    return kept, dropped


def convert_state_dict(state_dict: Dict[str, torch.Tensor], prefix: Optional[str] = None
                       ) -> Tuple['OrderedDict[str, torch.Tensor]', dict]:
    """Convert any published XCiT state dict to xcit_mm's backbone keys.

    Args:
        state_dict: Tensors as found in the file (after :func:`extract_state_dict`).
        prefix: Sub-module to take, e.g. ``'backbone.'``. By default ``module.`` (DDP) is stripped
            and, when ``backbone.`` keys exist (mmpretrain, mmdet/mmseg models), only those are
            taken.

    Returns:
        ``(converted, info)`` where ``info`` has ``layout``, ``classifier`` (classification-only
        keys dropped) and ``outside`` (keys outside the backbone prefix, dropped).
    """
    outside: List[str] = []
    if prefix is None:
        if state_dict and all(k.startswith('module.') for k in state_dict):
            state_dict, _ = _strip_prefix(state_dict, 'module.')
        if any(k.startswith('backbone.') for k in state_dict):
            prefix = 'backbone.'
    if prefix:
        state_dict, outside = _strip_prefix(state_dict, prefix)
        if not state_dict:
            raise CheckpointError(f'No key starts with prefix {prefix!r}; first keys: '
                                  f'{outside[:8]}')
    layout = detect_layout(state_dict)
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
    """Convert a whole detector / segmentor (``backbone.*`` plus neck and heads).

    The official COCO / ADE20k models were trained with mmdet 2.11 / mmseg 0.11, whose neck and
    head names are unchanged in mmdet 3 / mmseg 1; only the backbone keys need renaming. Use the
    result with ``tools/test.py`` (``load_from``) to evaluate the released weights.
    """
    if state_dict and all(k.startswith('module.') for k in state_dict):
        state_dict, _ = _strip_prefix(state_dict, 'module.')
    backbone, info = convert_state_dict(state_dict, prefix='backbone.')
    converted = OrderedDict(('backbone.' + k, v) for k, v in backbone.items())
    converted.update((k, v) for k, v in state_dict.items() if not k.startswith('backbone.'))
    info = dict(info, outside=[])
    return converted, info


# ---------------------------------------------------------------------------- loading
def _describe(state_dict: Dict[str, torch.Tensor]) -> str:
    """Guess the arch of a converted state dict, to explain a mismatch."""
    parts = []
    proj = state_dict.get('pos_embed.proj.weight')
    if proj is not None:
        parts.append(f'embed_dims={proj.shape[0]}')
    depth = len({k.split('.')[1] for k in state_dict if k.startswith('layers.')})
    if depth:
        parts.append(f'depth={depth}')
    convs = len({k.split('.')[2] for k in state_dict if k.startswith('patch_embed.proj.')})
    if convs:
        parts.append(f'patch_size={2**convs}')
    return ', '.join(parts) or 'unknown'


def load_converted(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor],
                   source: str = 'checkpoint') -> dict:
    """Load converted weights into an ``XCiTBackbone``; every trunk tensor must be set.

    The stride adapter (``fpn1..fpn4``) may be absent (ImageNet weights): it keeps its fresh
    init. BN ``num_batches_tracked`` counters may be absent too. Anything else missing, any
    unexpected key and any shape mismatch is a :class:`CheckpointError` naming the keys.
    """
    own = model.state_dict()
    model_desc = (f'embed_dims={model.embed_dims}, depth={model.num_layers}, '
                  f'patch_size={model.patch_size}')
    hint = (f'the checkpoint looks like {_describe(state_dict)} while the backbone has '
            f'{model_desc}: pick the arch/patch_size that match the checkpoint')

    unexpected = [k for k in state_dict if k not in own]
    mismatched = [f'{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}'
                  for k, v in state_dict.items() if k in own and own[k].shape != v.shape]
    missing = [k for k in own if k not in state_dict and not ADAPTER_KEY.match(k)
               and not k.endswith('num_batches_tracked')]
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


def load_pretrained(model: torch.nn.Module, checkpoint: str, prefix: Optional[str] = None,
                    weights_only: bool = True) -> dict:
    """Read ``checkpoint`` (any layout), convert it and load it into ``model``; log a summary."""
    converted, info = convert_state_dict(
        extract_state_dict(read_checkpoint(checkpoint, weights_only)), prefix)
    report = load_converted(model, converted, source=str(checkpoint))
    report.update(info)
    print_log(
        f'XCiTBackbone: loaded {report["loaded"]} tensors from {checkpoint} ({info["layout"]} '
        f'layout); dropped {len(info["classifier"])} classification-only keys and '
        f'{len(info["outside"])} keys outside the backbone; adapter initialised fresh: '
        f'{report["adapter_fresh"] or "none"}', logger='current')
    return report


# ---------------------------------------------------------------------------- runner files
def _history_buffer_getattr(obj, name):
    """Stands in for ``getattr`` while unpickling: only HistoryBuffer's statistics methods.

    mmengine pickles the statistics registry of its ``HistoryBuffer`` as
    ``getattr(HistoryBuffer, 'mean')``. Allow-listing the builtin ``getattr`` would let a file
    reach any attribute of any object; this serves exactly the lookups mmengine writes.
    """
    from mmengine.logging.history_buffer import HistoryBuffer
    if obj is HistoryBuffer and name in ('min', 'max', 'current', 'mean'):
        return getattr(HistoryBuffer, name)
    raise pickle.UnpicklingError(f'checkpoint asks for getattr({obj!r}, {name!r}), which is not '
                                 f'part of an mmengine checkpoint: refused')


def allow_runner_checkpoints():
    """Let ``torch.load(weights_only=True)`` read mmengine's own training checkpoints.

    torch >= 2.6 loads with ``weights_only=True`` by default, and mmengine 0.10.7 checkpoints hold
    a pickled message hub (``HistoryBuffer`` with numpy arrays and scalars); official XCiT files
    may carry their ``argparse.Namespace`` of training arguments. Rather than turning the safe
    loader off, this allow-lists exactly those classes (and a ``getattr`` restricted to what
    mmengine writes), none of which can run code: resuming and evaluating mmengine checkpoints
    works while arbitrary pickled code is still refused. Applied on ``import xcit_mm``;
    process-wide.
    """
    import argparse

    import numpy as np
    from mmengine.logging.history_buffer import HistoryBuffer

    # argparse.Namespace: the training arguments that DeiT-style (official XCiT) files carry.
    safe = [HistoryBuffer, np.dtype, np.ndarray, np.core.multiarray._reconstruct,
            np.core.multiarray.scalar, (_history_buffer_getattr, 'builtins.getattr'),
            argparse.Namespace]
    safe += [type(np.dtype(t)) for t in ('float64', 'float32', 'int64', 'int32', 'bool')]
    torch.serialization.add_safe_globals(safe)
