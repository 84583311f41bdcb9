"""FLOPs: the exact counter (torch's ``FlopCounterMode``: fake tensors and backward, which
mmengine's jit tracing cannot do), the XCiT trunk formula, per-point FLOPs, the Table 1 report;
``gmacs``: forward multiply-accumulates per image, ``gflop_exec``: 2 per MAC of all that runs."""
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .models import (XCIT_ARCHS, ModelSpec, build_model, count_params, load_mmpretrain_xcit,
                     parse_model)
from .timing import make_step


def _conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation,
                        transposed, _output_padding, _groups, output_mask, out_shape=None,
                        **kwargs) -> int:
    """FLOPs of ``aten.convolution_backward``, each gradient its forward's: torch's formula counts
    a depthwise conv's weight gradient as dense."""
    from torch.utils.flop_counter import conv_flop_count
    forward = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs executed by ``fn()``, 2 per multiply-accumulate, its backward included."""
    from torch.utils.flop_counter import FlopCounterMode
    mapping = {torch.ops.aten.convolution_backward: _conv_backward_flop}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return int(counter.get_total_flops())


def analytic_trunk_macs(arch: str, patch: int, height: int, width: int) -> int:
    """MACs of an XCiT trunk by formula (the counter's cross-check): patch embedding, position
    projection, per layer ``N (12 D^2 + 2 D d_h + 18 D)`` (qkv, XCA, proj, LPI, FFN)."""
    dims, depth, heads = XCIT_ARCHS[arch]
    chans = [3, dims // 8, dims // 4, dims // 2, dims] if patch == 16 else \
        [3, dims // 4, dims // 2, dims]
    h, w, macs = height, width, 0
    for cin, cout in zip(chans[:-1], chans[1:]):
        h, w = math.ceil(h / 2), math.ceil(w / 2)
        macs += h * w * cout * cin * 9
    tokens = h * w
    macs += tokens * 64 * dims
    macs += depth * tokens * (12 * dims * dims + 2 * dims * (dims // heads) + 18 * dims)
    return macs


def point_flops(spec: ModelSpec, resolution: int, mode: str,
                cache: Optional[Dict[str, Tuple[nn.Module, Callable]]] = None) -> dict:
    """Forward MACs and executed FLOPs of one image (the steps the timing runs), counted on a fake
    input (any size is cheap), else (data-dependent control flow) on a real one."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cache = {} if cache is None else cache
    if spec.name not in cache:
        torch.manual_seed(0)
        cache[spec.name] = build_model(spec, 'cpu')
    model, forward = cache[spec.name]

    def count() -> list:  # the forward's FLOPs, then (train) the train step's
        img = torch.randn(1, 3, resolution, resolution)
        return [count_flops(make_step(model, forward, img, step_mode, 'cpu', 'fp32'))
                for step_mode in dict.fromkeys(('inference', mode))]

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            counts, counter = count(), 'torch FlopCounterMode, fake tensors'
    except Exception:  # data-dependent control flow: count a real image instead
        counts, counter = count(), 'torch FlopCounterMode, real CPU pass'
    return dict(gmacs=counts[0] / 2e9, gflop_exec=counts[-1] / 1e9,
                params_m=count_params(model) / 1e6, flops_counter=counter)


def flops_report(paper_table: Dict[str, Dict[str, float]], tolerance: float = 0.05,
                 archs: Optional[Sequence[str]] = None) -> List[dict]:
    """GMACs of every XCiT arch at 224/p16 and 384/p8 against paper Table 1: the trunk plus the
    classifier's class attention and head, checked by mmpretrain's classifier and the formula."""
    xcit_mod = load_mmpretrain_xcit()
    rows = []
    for arch in (archs if archs is not None else list(paper_table)):
        dims, depth, heads = XCIT_ARCHS[arch]
        eta = 1.0 if depth == 12 else 1e-5
        for res, patch, key in ((224, 16, 'gmacs_224_p16'), (384, 8, 'gmacs_384_p8')):
            trunk_info = point_flops(parse_model(f'xcit_{arch}_p{patch}_trunk'), res, 'inference')
            tokens = math.ceil(res / patch) ** 2
            with torch.device('meta'):  # shapes only
                port = xcit_mod.XCiT(img_size=res, patch_size=patch, embed_dims=dims, depth=depth,
                                     num_heads=heads, cls_attn_layers=2, out_type='cls_token',
                                     layer_scale_init_value=eta, init_cfg=None)
                head = nn.Linear(dims, 1000)
                tok, img = torch.randn(1, tokens + 1, dims), torch.randn(1, 3, res, res)
            port.eval()  # (mmpretrain's train() returns None)
            cls_blocks = nn.Sequential(*port.ca_layers, port.norm)  # the port's class attention
            with torch.no_grad():
                cls_macs = count_flops(lambda: head(cls_blocks(tok)[:, 0])) / 2
                port_macs = count_flops(lambda: head(port(img)[-1])) / 2
            classifier = trunk_info['gmacs'] + cls_macs / 1e9
            paper = paper_table[arch][key]
            rows.append(dict(
                arch=arch, setting=f'{res}/p{patch}', trunk_gmacs=trunk_info['gmacs'],
                analytic_trunk_gmacs=analytic_trunk_macs(arch, patch, res, res) / 1e9,
                cls_part_gmacs=cls_macs / 1e9, classifier_gmacs=classifier,
                port_classifier_gmacs=port_macs / 1e9, paper_gmacs=paper,
                rel_diff=classifier / paper - 1, ok=abs(classifier / paper - 1) <= tolerance,
                classifier_params_m=(count_params(port) + count_params(head)) / 1e6,
                paper_params_m=paper_table[arch]['params_m'],
                backbone_params_m=trunk_info['params_m']))
    return rows
