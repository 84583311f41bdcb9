"""``--compare``: XCiTBackbone's trunk vs mmpretrain's port of the same trunk, and ratios A/B of
any two models' records."""
import os
import statistics
import tempfile
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .models import ModelSpec, build_model, parse_model


def median_paired_ratio(a: dict, b: dict) -> Optional[float]:
    """Median of the per-round time ratios of two records timed in the same interleaved rounds."""
    ta, tb = a.get('times_s'), b.get('times_s')
    if not ta or not tb or len(ta) != len(tb):
        return None
    return statistics.median(x / y for x, y in zip(ta, tb))


def ratio_rows(records: Sequence[dict], pairs: Sequence[Tuple[str, str]]) -> List[dict]:
    """Time and memory ratios A/B per resolution for the given (A, B) model-name pairs."""
    index = {(r['model'], r['resolution']): r for r in records}
    rows = []
    for a_name, b_name in pairs:
        for res in sorted({r['resolution'] for r in records}):
            a, b = index.get((a_name, res)), index.get((b_name, res))
            if a is None or b is None:
                continue
            row = dict(a=a_name, b=b_name, resolution=res)
            if a.get('ms_per_img') and b.get('ms_per_img'):
                row['time_ratio'] = a['ms_per_img'] / b['ms_per_img']
                row['paired_time_ratio'] = median_paired_ratio(a, b)
            if a.get('peak_mem_mb') and b.get('peak_mem_mb'):
                row['mem_ratio'] = a['peak_mem_mb'] / b['peak_mem_mb']
            row.update(a_ms=a.get('ms_per_img'), b_ms=b.get('ms_per_img'),
                       a_mb=a.get('peak_mem_mb'), b_mb=b.get('peak_mem_mb'))
            rows.append(row)
    return rows


def compare_pairs(specs: Sequence[ModelSpec]) -> Tuple[List[ModelSpec], List[Tuple[str, str]]]:
    """``--compare``: for every XCiT model, XCiTBackbone.forward_trunk vs mmpretrain's trunk."""
    out, pairs = [], []
    for spec in specs:
        if spec.family in ('xcit', 'xcit_trunk'):
            ours = parse_model(f'xcit_{spec.arch}_p{spec.patch}_trunk')
            port = parse_model(f'mmpretrain_xcit_{spec.arch}_p{spec.patch}')
            out += [s for s in (ours, port) if s not in out]
            pairs.append((ours.name, port.name))
    if not pairs:
        raise ValueError('--compare needs at least one xcit_* model in --models')
    return out, pairs


def variants(specs: Sequence[ModelSpec], mode: str, pairs: List[Tuple[str, str]],
             suffix: str = '+cp') -> List[ModelSpec]:
    """``--with-cp`` (suffix ``+cp``) / ``--compile`` (``+compile``) ``on``: every model's
    variant where it has one; ``both``: the variant next to the model, the pair (variant, model)
    added to ``pairs`` for the ratios. Each model once."""
    if mode == 'off':
        return list(dict.fromkeys(specs))
    out = []
    for s in specs:
        done = s.with_cp if suffix == '+cp' else s.compiled
        try:
            variant = s if done else parse_model(s.name + suffix)
        except ValueError:  # mmpretrain's port has no with_cp
            variant = s
        if mode == 'both' and s != variant:
            out.append(s)
            pairs.append((variant.name, s.name))
        out.append(variant)
    return list(dict.fromkeys(out))


def compile_variants(specs, mode: str, pairs) -> List[ModelSpec]:
    return variants(specs, mode, pairs, '+compile')


def check_same_trunk(arch: str, patch: int, resolution: int = 64) -> str:
    """A one-line verdict that ``--compare`` times the same computation: the port's weights,
    loaded into XCiTBackbone through its ``Pretrained`` loader, give the same trunk maps."""
    name = f'same trunk check XCiT-{arch.upper()}/{patch}'
    try:
        torch.manual_seed(0)
        port, _ = build_model(parse_model(f'mmpretrain_xcit_{arch}_p{patch}'))
        with torch.no_grad():  # non-trivial BatchNorm statistics
            for m in port.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.1, 0.1)
                    m.running_var.uniform_(0.5, 1.5)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, 'port.pth')
            torch.save({'state_dict': {'backbone.' + k: v for k, v in
                                       port.state_dict().items()}}, path)
            from mmengine.registry import MODELS
            ours = MODELS.build(dict(type='XCiTBackbone', arch=arch, patch_size=patch,
                                     norm_cfg=dict(type='BN'),
                                     init_cfg=dict(type='Pretrained', checkpoint=path)))
            ours.init_weights()
        port.eval()  # (mmpretrain's train() returns None)
        img = torch.randn(1, 3, resolution, resolution)
        with torch.no_grad():
            a, b = ours.eval().forward_trunk(img), port(img)
        diff = max((x - y).abs().max().item() for x, y in zip(a, b))
        scale = max(y.abs().max().item() for y in b)
        return (f'{name}: port weights loaded into XCiTBackbone, max |diff| of the {len(a)} '
                f'trunk maps = {diff:.2e} (max |value| {scale:.2e})')
    except Exception as e:  # report, do not abort the benchmark
        return f'{name} not possible: {type(e).__name__}: {e}'
