"""mmengine's FLOP counter counts XCiT exactly (xcit_mm.models.utils.flop_count).

mmdet's and mmseg's ``tools/analysis_tools/get_flops.py`` count with mmengine's ``FlopAnalyzer``
(``get_model_complexity_info``), which has no handle for ``aten::baddbmm``, the op of XCA's fused
output projection; ``import xcit_mm`` adds one.  The expected values never come from that
handle: they are the architecture's multiply-adds written out by hand (:func:`_xcit_p16_flops`)
and torch's own ``FlopCounterMode`` (through the benchmark library's ``count_flops``, 2 FLOPs
per multiply-add), which knows ``baddbmm`` by itself.
"""
import os
import runpy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from mmengine.analysis import ActivationAnalyzer, FlopAnalyzer, get_model_complexity_info
from mmengine.analysis import complexity_analysis, print_helper
from xcit_benchmark.flops import count_flops

from xcit_mm.models import XCiTBackbone
from xcit_mm.models.utils import flop_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NORM_OPS = ('layer_norm', 'batch_norm')
T12 = dict(dims=192, depth=12, heads=4)


def _xcit_p16_flops(dims, depth, heads, h, w, batch=1):
    """``(multiply-adds, norm FLOPs)`` of ``XCiTBackbone(patch_size=16).forward`` in eval on a
    ``(batch, 3, h, w)`` batch (h, w multiples of 16), the norms counted as mmengine does
    (LayerNorm 5 and eval BatchNorm 2 FLOPs per element); no biases, activations or softmax.
    The position embedding is computed once per batch, everything else once per image."""
    d = dims // heads
    macs = norms = 0
    chans = [3, dims // 8, dims // 4, dims // 2, dims]
    for cin, cout in zip(chans[:-1], chans[1:]):  # stem: 3x3 stride-2 conv + BN
        h, w = h // 2, w // 2
        macs += h * w * cout * cin * 9
        norms += 2 * h * w * cout
    n = h * w
    pos = n * 64 * dims  # Fourier position code (64) -> dims, shared by the batch
    macs += depth * (n * 3 * dims * dims  # qkv
                     + n * dims * d  # q^T k: per head (d x N) @ (N x d)
                     + dims * dims * d  # attn^T @ W_proj^T per head: the (D x D) mixing matrix
                     + n * dims * dims  # v @ mixing + bias (the baddbmm): attn @ v and proj
                     + 2 * 9 * n * dims  # LPI: two depthwise 3x3 convs
                     + 8 * n * dims * dims)  # FFN
    norms += depth * (3 * 5 * n * dims + 2 * n * dims)  # 3 LayerNorms, the LPI's BN
    # adapter (p16): ConvT 2x2/2 -> BN -> GELU -> ConvT; ConvT; identity; max-pool
    macs += 4 * dims * dims * n + 4 * dims * dims * 4 * n + 4 * dims * dims * n
    norms += 2 * 4 * n * dims
    return batch * macs + pos, batch * norms


def _backbone(arch, **kwargs):
    torch.manual_seed(0)
    return XCiTBackbone(arch=arch, patch_size=16, **kwargs).eval()


def _quiet(analyzer):
    return analyzer.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


def test_import_installs_the_baddbmm_handle():
    """A baddbmm counts as its bmm (b n m p multiply-adds), the added tensor not at all, as
    mmengine's addmm handle ignores the bias; activations are the output's elements."""
    assert complexity_analysis._DEFAULT_SUPPORTED_FLOP_OPS['aten::baddbmm'] is \
        flop_count.baddbmm_flop_jit
    assert complexity_analysis._DEFAULT_SUPPORTED_ACT_OPS['aten::baddbmm'] is \
        flop_count.baddbmm_activation_jit

    class Fused(nn.Module):
        def forward(self, bias, a, b):
            return torch.baddbmm(bias, a, b)

    inputs = (torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    flops = _quiet(FlopAnalyzer(Fused(), inputs))
    assert flops.by_operator() == {'baddbmm': 2 * 3 * 4 * 5}  # traces
    assert not flops.unsupported_ops()
    assert _quiet(ActivationAnalyzer(Fused(), inputs)).total() == 2 * 3 * 5
    flop_count.install_flop_handles()  # idempotent
    assert complexity_analysis._DEFAULT_SUPPORTED_FLOP_OPS['aten::baddbmm'] is \
        flop_count.baddbmm_flop_jit


def test_s12_backbone_at_512_is_counted_exactly():
    """What the upstream get_flops.py scripts call: XCiT-S12/16 at 512x512 is 28.01 G (26.20 G
    with XCA's projection left out), every multiply-add of the hand count."""
    model = _backbone('s12')
    out = get_model_complexity_info(model, inputs=(torch.randn(1, 3, 512, 512), ),
                                    show_table=False, show_arch=False)
    macs, norms = _xcit_p16_flops(384, 12, 8, 512, 512)
    assert out['flops'] == macs + norms == 28_007_202_816
    assert out['flops_str'] == '28.007G'


def test_no_baddbmm_is_unsupported_and_mmengine_equals_torch_counter():
    """T12/16, two non-square images: baddbmm is not unsupported, each layer's projection is
    counted in its XCA module, and mmengine's count is the hand count, whose multiply-adds are
    torch's FlopCounterMode / 2 (the benchmark library's counter)."""
    model, x = _backbone('t12'), torch.randn(2, 3, 96, 160)
    flops = _quiet(FlopAnalyzer(model, (x, )))
    flops.total()  # traces
    assert 'aten::baddbmm' not in flops.unsupported_ops()
    dims, n = T12['dims'], (96 // 16) * (160 // 16)
    assert flops.by_operator()['baddbmm'] == T12['depth'] * 2 * n * dims * dims
    assert flops.by_operator('layers.3.attn')['baddbmm'] == 2 * n * dims * dims
    macs, norms = _xcit_p16_flops(**T12, h=96, w=160, batch=2)
    assert flops.total() == macs + norms
    with torch.no_grad():
        torch_macs = count_flops(lambda: model(x)) // 2
    by_op = flops.by_operator()
    assert sum(v for k, v in by_op.items() if k not in NORM_OPS) == torch_macs == macs


def test_config_custom_imports_install_the_handle_in_a_fresh_process():
    """A fresh process, as mmdet's / mmseg's get_flops.py: mmengine alone lacks the handle,
    loading an XCiT config (its ``custom_imports``) adds it."""
    code = ('import sys; from mmengine.analysis import complexity_analysis as ca; '
            'from mmengine.config import Config; ops = ca._DEFAULT_SUPPORTED_FLOP_OPS; '
            'before = "aten::baddbmm" in ops; Config.fromfile(sys.argv[1]); '
            'print(before, ops["aten::baddbmm"].__module__)')
    cfg = os.path.join(ROOT, 'configs', 'mask_rcnn_xcit_t12_p16_3x_coco.py')
    out = subprocess.run([sys.executable, '-c', code, cfg], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ['False', 'xcit_mm.models.utils.flop_count']


def _tiny_coco(root, size):
    """One random ``size`` x ``size`` image in COCO layout (no objects)."""
    import json

    import mmcv
    import numpy as np
    mmcv.imwrite(np.random.RandomState(0).randint(0, 256, (size, size, 3), dtype=np.uint8),
                 str(root / 'img.jpg'))
    (root / 'ann.json').write_text(json.dumps(dict(
        images=[dict(id=1, file_name='img.jpg', height=size, width=size)], annotations=[],
        categories=[dict(id=1, name='person')])))


def test_mmdet_get_flops_script_counts_xca(tmp_path, monkeypatch, capsys):
    """mmdet's own tools/analysis_tools/get_flops.py (shipped in the wheel under .mim), run as a
    user runs it on an XCiT Mask R-CNN config (one 128x128 image, few proposals): the backbone
    it counts is the hand count, XCA's projection included, and it prints that total."""
    import mmdet
    script = os.path.join(os.path.dirname(mmdet.__file__), '.mim', 'tools', 'analysis_tools',
                          'get_flops.py')
    if not os.path.exists(script):
        pytest.skip('this mmdet install ships no tools/analysis_tools/get_flops.py')
    size = 128
    _tiny_coco(tmp_path, size)
    base = os.path.join(ROOT, 'configs', 'mask_rcnn_xcit_t12_p16_3x_coco.py')
    cfg = tmp_path / 'cfg.py'
    cfg.write_text(f"""_base_ = [{base!r}]
custom_imports = dict(imports=['xcit_mm'], allow_failed_imports=False)
model = dict(test_cfg=dict(rpn=dict(nms_pre=50, max_per_img=10), rcnn=dict(max_per_img=5)))
val_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    dataset=dict(data_root={str(tmp_path) + '/'!r}, ann_file='ann.json', data_prefix=dict(img=''),
                 pipeline=[dict(type='LoadImageFromFile'),
                           dict(type='Resize', scale=({size}, {size}), keep_ratio=True),
                           dict(type='PackDetInputs')]))
""")
    analyzers = []

    class Recording(FlopAnalyzer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            analyzers.append(self)

    monkeypatch.setattr(print_helper, 'FlopAnalyzer', Recording)
    monkeypatch.setattr(sys, 'argv', [script, str(cfg), '--num-images', '1'])
    torch.manual_seed(0)
    runpy.run_path(script, run_name='__main__')
    printed = capsys.readouterr().out
    [flops] = analyzers
    assert 'aten::baddbmm' not in flops.unsupported_ops()
    macs, norms = _xcit_p16_flops(**T12, h=size, w=size)
    assert flops.total('backbone') == macs + norms
    n = (size // 16) ** 2
    assert flops.by_operator('backbone')['baddbmm'] == T12['depth'] * n * T12['dims'] ** 2
    assert f'Input shape: ({size}, {size})' in printed
    assert f'Flops: {print_helper._format_size(flops.total())}\n' in printed
