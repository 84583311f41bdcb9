"""The benchmark's model names (``--list-models``) and factory: untrained, all parameters
trainable, drop-path 0, BatchNorm; ``+compile`` models built eager (the runner compiles them)."""
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch.nn as nn

from xcit_mm.models import arch_zoo

# arch -> (embed dims D, depth, heads): XCiTBackbone's table (= the paper's).
XCIT_ARCHS: Dict[str, Tuple[int, int, int]] = {
    k: (v['embed_dims'], v['depth'], v['num_heads']) for k, v in arch_zoo.items()}
XCIT_PATCHES = (8, 16)

BASELINES = {  # name: (description, registry scope, backbone config; ``with_cp`` set at build)
    'resnet50': ('mmdet ResNet-50 (4 stages, strides 4-32)', 'mmdet', dict(
        type='ResNet', depth=50, num_stages=4, out_indices=(0, 1, 2, 3), frozen_stages=-1,
        norm_cfg=dict(type='BN', requires_grad=True), norm_eval=False, style='pytorch')),
    'swin_t': ('mmdet SwinTransformer Swin-T (embed 96, depths 2,2,6,2, window 7)', 'mmdet', dict(
        type='SwinTransformer', embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24),
        window_size=7, mlp_ratio=4, qkv_bias=True, drop_path_rate=0.0, patch_norm=True,
        out_indices=(0, 1, 2, 3), convert_weights=False)),
    'vit_s16': ('mmseg VisionTransformer ViT-S/16 = DeiT-S (embed 384, depth 12, 6 heads)',
                'mmseg', dict(type='VisionTransformer', img_size=224, patch_size=16,
                              embed_dims=384, num_layers=12, num_heads=6, mlp_ratio=4,
                              out_indices=(2, 5, 8, 11), qkv_bias=True, with_cls_token=True,
                              final_norm=False, interpolate_mode='bicubic', drop_path_rate=0.0))}
COMPILE_SUFFIX = '+compile'
_XCIT_RE = re.compile(r'(?P<port>mmpretrain_)?xcit_(?P<arch>[a-z]\d\d)_p(?P<patch>\d+)'
                      r'(?P<trunk>_trunk)?')


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``--models`` entry; ``name`` canonical (``+cp`` before ``+compile``)."""

    name: str
    family: str
    arch: Optional[str] = None
    patch: Optional[int] = None
    with_cp: bool = False
    compiled: bool = False

    @property
    def description(self) -> str:
        cp = (' +with_cp' if self.with_cp else '') + (' +torch.compile' if self.compiled else '')
        if self.family in BASELINES:
            return BASELINES[self.family][0] + cp
        label = f'XCiT-{self.arch.upper()}/{self.patch}'
        if self.family == 'xcit':
            return f'xcit_mm XCiTBackbone {label} (trunk + adapter){cp}'
        if self.family == 'xcit_trunk':
            return f'xcit_mm XCiTBackbone.forward_trunk {label}{cp}'
        return f'mmpretrain XCiT port {label} (trunk, cls_attn_layers=0){cp}'


def parse_model(name: str) -> ModelSpec:
    """Parse a model name of ``--models``."""
    if name.endswith((COMPILE_SUFFIX, COMPILE_SUFFIX + '+cp')):
        spec = parse_model(name.replace(COMPILE_SUFFIX, '', 1))
        if spec.compiled:
            raise ValueError(f'unknown model {name!r}; see --list-models')
        return dataclasses.replace(spec, name=spec.name + COMPILE_SUFFIX, compiled=True)
    base, with_cp = (name[:-3], True) if name.endswith('+cp') else (name, False)
    if base in BASELINES:
        return ModelSpec(name=name, family=base, with_cp=with_cp)
    m = _XCIT_RE.fullmatch(base)
    if m is None:
        raise ValueError(f'unknown model {name!r}; see --list-models')
    arch, patch = m.group('arch'), int(m.group('patch'))
    if arch not in XCIT_ARCHS:
        raise ValueError(f'unknown XCiT arch {arch!r} in {name!r}; choose from '
                         f'{sorted(XCIT_ARCHS)}')
    if patch not in XCIT_PATCHES:
        raise ValueError(f'XCiT patch size must be 8 or 16, got {patch} in {name!r}')
    if m.group('port'):
        if m.group('trunk'):
            raise ValueError(f'{name!r}: mmpretrain_xcit_* already is the trunk only; drop _trunk')
        if with_cp:
            raise ValueError(f'{name!r}: mmpretrain\'s XCiT has no with_cp option')
        family = 'mmpretrain_xcit'
    else:
        family = 'xcit_trunk' if m.group('trunk') else 'xcit'
    return ModelSpec(name=name, family=family, arch=arch, patch=patch, with_cp=with_cp)


def list_models() -> str:
    archs = '|'.join(XCIT_ARCHS)
    lines = [f'xcit_<{archs}>_p<8|16>           XCiTBackbone (trunk + adapter)',
             f'xcit_<{archs}>_p<8|16>_trunk     XCiTBackbone.forward_trunk',
             f'mmpretrain_xcit_<{archs}>_p<8|16> mmpretrain XCiT port, trunk only']
    lines += [f'{k:<32}{v[0]}' for k, v in BASELINES.items()]
    lines.append('any name + "+cp": built with with_cp=True (not for mmpretrain_xcit_*)')
    lines.append('any name + "+compile": timed through torch.compile(forward, dynamic=False)')
    return '\n'.join(lines)


def load_mmpretrain_xcit():
    """Import ``mmpretrain.models.backbones.xcit`` (no torchvision needed) without
    ``mmpretrain.models``' ``__init__`` (needs it): without torchvision, placeholder packages stand
    for the parents for the life of the process, so call it only in a process of its own."""
    name = 'mmpretrain.models.backbones.xcit'
    if importlib.util.find_spec('mmpretrain') is None:
        raise ImportError('mmpretrain is not installed; it is needed for the mmpretrain_xcit_* '
                          'models and the class-attention part of the FLOPs report')
    if importlib.util.find_spec('torchvision') is not None:
        return importlib.import_module(name)
    # mmdet's optional import of mmpretrain.models.classifiers may have failed half-way
    import mmpretrain  # the top-level package does not import mmpretrain.models
    parent = mmpretrain
    for pkg in ('mmpretrain.models', 'mmpretrain.models.backbones'):
        if pkg not in sys.modules:
            spec = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
            spec.submodule_search_locations = [
                os.path.join(parent.__path__[0], pkg.rpartition('.')[2])]
            module = importlib.util.module_from_spec(spec)
            module.__xcit_benchmark_placeholder__ = True
            sys.modules[pkg] = module
            setattr(parent, pkg.rpartition('.')[2], module)
        parent = sys.modules[pkg]
    return importlib.import_module(name)


def build_model(spec: ModelSpec, device: str = 'cpu') -> Tuple[nn.Module, Callable]:
    """Build one benchmark model."""
    cp, forward = spec.with_cp, None
    if spec.family in ('xcit', 'xcit_trunk'):
        from mmengine.registry import MODELS  # XCiTBackbone is registered by `import xcit_mm`
        model = MODELS.build(dict(type='XCiTBackbone', arch=spec.arch, patch_size=spec.patch,
                                  norm_cfg=dict(type='BN'), drop_path_rate=0.0, with_cp=cp))
        forward = model.forward_trunk if spec.family == 'xcit_trunk' else None
    elif spec.family == 'mmpretrain_xcit':  # the trunk only, the paper's dense-prediction layers
        dims, depth, heads = XCIT_ARCHS[spec.arch]
        model = load_mmpretrain_xcit().XCiT(
            img_size=224, patch_size=spec.patch, embed_dims=dims, depth=depth, num_heads=heads,
            cls_attn_layers=0, out_type='featmap', final_norm=False,
            out_indices=(3, 5, 7, 11) if depth == 12 else (7, 11, 15, 23),
            layer_scale_init_value=1.0 if depth == 12 else 1e-5, bn_norm_cfg=dict(type='BN'),
            init_cfg=None)
    else:  # a baseline
        _, scope, cfg = BASELINES[spec.family]
        importlib.import_module(f'{scope}.models')  # fills the scope's MODELS registry
        model = importlib.import_module(f'{scope}.registry').MODELS.build(dict(cfg, with_cp=cp))
    model = model.to(device)
    return model, forward or model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
