"""ONNX export and ONNX Runtime (issue 13, part 3): tools/deployment/export_onnx.py and
xcit_mm.deployment.

The small shapes configs (XCiT D=128: Sem-FPN p16, Mask R-CNN p8) are exported with dynamic axes
and run by ONNX Runtime at the export size and at a second, padded size; the relative difference
to PyTorch must stay under 1e-4 (it is ~1e-6). Skipped where onnx / onnxruntime are not installed
(tools/install.sh installs them).
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, 'tools', 'deployment', 'export_onnx.py')
SEG_CFG = os.path.join(ROOT, 'configs', 'shapes', 'sem_fpn_xcit_shapes_ade.py')
DET_CFG = os.path.join(ROOT, 'configs', 'shapes', 'mask_rcnn_xcit_shapes_coco.py')

onnx = pytest.importorskip('onnx')
ort = pytest.importorskip('onnxruntime')


def test_sem_fpn_exports_and_verifies_at_two_sizes(onnx_tool, tmp_path, capsys):
    """image -> per-class logits at the input size; ORT equals PyTorch at 160x160 (export) and
    192x144 (dynamic axes); a too strict tolerance makes --verify fail with exit status 1."""
    out = tmp_path / 'sem_fpn.onnx'
    assert onnx_tool.main([SEG_CFG, '--out', str(out), '--shape', '160', '160', '--dynamic',
                           '--verify']) == 0
    text = capsys.readouterr().out
    assert 'verify 160x160: OK' in text and 'verify 192x144: OK' in text, text
    assert 'logits   1x4x192x144' in text
    model = onnx.load(str(out))
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta['xcit_mm.task'] == 'seg' and meta['xcit_mm.dynamic'] == 'True'
    assert meta['xcit_mm.classes'] == 'background,circle,square,triangle'
    assert [i.name for i in model.graph.input] == ['image']
    assert [o.name for o in model.graph.output] == ['logits']

    assert onnx_tool.main([SEG_CFG, '--out', str(tmp_path / 'static.onnx'), '--shape', '96',
                           '128', '--verify', '--tolerance', '1e-12']) == 1
    captured = capsys.readouterr()
    assert 'verify 96x128: MISMATCH' in captured.out
    assert 'error: ONNX Runtime differs from PyTorch' in captured.err


def test_segmentor_logits_are_the_segmentors_inference():
    """The exported module computes what EncoderDecoder.encode_decode does (whole inference)."""
    from xcit_mm.deployment import build_export_model
    wrapper = build_export_model(SEG_CFG)
    image = torch.randn(1, 3, 96, 128)
    with torch.no_grad():
        want = wrapper.model.encode_decode(image, [dict(img_shape=(96, 128))])
        got = wrapper(image)
    torch.testing.assert_close(got, want)


def test_mask_rcnn_backbone_and_neck(tmp_path):
    """A Mask R-CNN config exports backbone + FPN: 5 maps at strides 4..64, equal in ORT at the
    export size and a padded second size."""
    from xcit_mm.deployment import build_export_model, export_onnx, verify_onnx
    model = build_export_model(DET_CFG)
    assert model.task == 'det' and model.output_names == [f'feat{i}' for i in range(5)]
    path = export_onnx(model, str(tmp_path / 'mask_rcnn.onnx'), (128, 160), dynamic=True)
    results = verify_onnx(model, path, [(128, 160), (150, 200)])
    for r in results:
        assert r['ok'], r
        assert r['max_rel'] < 1e-4
    assert [o['shape'][-2:] for o in results[1]['outputs']] == \
        [[38, 50], [19, 25], [10, 13], [5, 7], [3, 4]]


def test_adaptive_avg_pool_replacement_is_exact():
    """UperNet's pyramid pooling is exported through averaging matrices (dynamic sizes); they
    equal nn.AdaptiveAvgPool2d for every output size and uneven bins."""
    from xcit_mm.deployment.onnx import _adaptive_avg_pool_traceable
    for size in (1, 2, 3, 6, (2, 5)):
        pool = nn.AdaptiveAvgPool2d(size)
        for hw in ((16, 16), (13, 9), (7, 20)):
            x = torch.randn(2, 4, *hw, dtype=torch.float64)
            torch.testing.assert_close(_adaptive_avg_pool_traceable(pool, x), pool(x))


def test_bad_inputs_are_one_error_line(onnx_tool, tmp_path, capsys):
    """Exit status 2 and one 'error:' line, before anything is exported."""
    other = tmp_path / 'classifier.py'
    other.write_text("default_scope = 'mmpretrain'\nmodel = dict(type='ImageClassifier')\n")
    cascade = tmp_path / 'cascade.py'
    cascade.write_text(f"_base_ = ['{SEG_CFG}']\nmodel = dict(type='CascadeEncoderDecoder')\n")
    cases = [
        ([SEG_CFG, str(tmp_path / 'missing.pth')], 'checkpoint not found'),
        ([str(tmp_path / 'missing.py')], 'config not found'),
        ([str(other)], "default_scope is 'mmpretrain'"),
        ([str(cascade)], "segmentor type 'CascadeEncoderDecoder' is not supported"),
        ([TOOL], 'cannot read config'),
    ]
    for argv, message in cases:
        out = tmp_path / 'x.onnx'
        assert onnx_tool.main(argv + ['--out', str(out), '--shape', '64', '64']) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith('error: ') and message in err and '\n' not in err, (argv, err)
        assert not out.exists()
    assert onnx_tool.main([SEG_CFG, '--out', str(tmp_path / 'x.onnx'), '--shape', '16', '64']) == 2
    assert 'error: image sides must be >= 32 px' in capsys.readouterr().err


BLOCK_ONNX = r'''
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('onnx', 'onnxruntime'):
            raise ImportError(f'blocked {name}')
sys.meta_path.insert(0, Block())
import xcit_mm, xcit_mm.apis, xcit_mm.deployment
from xcit_mm.deployment import check_onnx_runtime
try:
    check_onnx_runtime()
except ImportError as e:
    print('@@', e)
'''


def test_package_imports_without_onnx():
    proc = subprocess.run([sys.executable, '-c', BLOCK_ONNX], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "@@ ONNX export needs the onnx package: pip install 'xcit_mm[onnx]'" in proc.stdout


def test_benchmark_onnx_option(tmp_path):
    """benchmark.py --onnx CONFIG: PyTorch eager and ONNX Runtime records, timed in the same
    rounds, the file checked against PyTorch first (note), the ratio ONNX Runtime / eager."""
    import json
    bench = os.path.join(ROOT, 'tools', 'analysis_tools', 'benchmark.py')
    proc = subprocess.run(
        [sys.executable, bench, '--onnx', SEG_CFG, '--resolutions', '64', '--repeats', '2',
         '--warmup', '0', '--threads', '1', '--out-dir', str(tmp_path), '--quiet'],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / 'onnx.json') as f:
        data = json.load(f)
    names = [r['model'] for r in data['records']]
    assert names == ['sem_fpn_xcit_shapes_ade', 'sem_fpn_xcit_shapes_ade+onnxruntime']
    for r in data['records']:
        assert r['status'] == 'ok' and len(r['times_s']) == 2 and r['ms_per_img'] > 0
        assert 'max rel diff' in r['note']
    assert data['meta']['ratios'][0]['a'] == 'sem_fpn_xcit_shapes_ade+onnxruntime'
    assert data['meta']['onnxruntime'] == ort.__version__
