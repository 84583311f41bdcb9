"""Tests of tools/benchmark.py: FLOP-counter exactness, model names and a tiny end-to-end run.

No timing assertions: the machine is shared and timings are noise here.
"""
import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, 'tools', 'benchmark.py')


@pytest.fixture(scope='module')
def bench():
    """tools/benchmark.py loaded as a module (tools/ is not a package)."""
    name = 'xcit_mm_tools_benchmark'
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses need the module registered while executing
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_flop_counter_linear_is_exact(bench):
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    assert bench.count_flops(lambda: linear(x)) == 2 * 4 * 16 * 8


def test_flop_counter_depthwise_conv_and_channel_attention_are_exact(bench):
    conv = torch.nn.Conv2d(6, 6, 3, padding=1, groups=6)
    x = torch.randn(1, 6, 10, 10)
    assert bench.count_flops(lambda: conv(x)) == 2 * 6 * 10 * 10 * 9
    # the XCA products: (B, h, d, N) @ (B, h, N, d) -> (B, h, d, d), then (B, h, d, d) @ (B, h, d, N)
    q, k, v = (torch.randn(2, 3, 5, 30) for _ in range(3))
    assert bench.count_flops(lambda: (q @ k.transpose(-2, -1)).softmax(-1) @ v) == \
        2 * (2 * 3 * 5 * 5 * 30) * 2


def test_backbone_trunk_flops_match_the_formula(bench):
    """The counter sees every MAC of XCiTBackbone.forward_trunk, XCA products included."""
    for arch, patch, res in (('n12', 16, 64), ('t12', 8, 96)):
        info = bench.point_flops(bench.parse_model(f'xcit_{arch}_p{patch}_trunk'), res,
                                 'inference')
        expected = bench.analytic_trunk_macs(arch, patch, res, res) / 1e9
        assert info['gmacs'] == pytest.approx(expected, rel=5e-3)
        assert info['params_m'] > 0


def test_parse_model_names_and_errors(bench):
    spec = bench.parse_model('xcit_s12_p8_trunk')
    assert (spec.family, spec.arch, spec.patch, spec.with_cp) == ('xcit_trunk', 's12', 8, False)
    assert bench.parse_model('swin_t+cp').with_cp
    for bad in ('xcit_x12_p16', 'xcit_s12_p4', 'mmpretrain_xcit_s12_p8+cp',
                'mmpretrain_xcit_s12_p8_trunk', 'resnet18'):
        with pytest.raises(ValueError):
            bench.parse_model(bad)


def test_tiny_run_writes_sane_csv_json_png(tmp_path):
    out_dir = tmp_path / 'bench'
    cmd = [sys.executable, TOOL, '--models', 'xcit_n12_p16', 'mmpretrain_xcit_n12_p16',
           '--resolutions', '64', '--repeats', '1', '--warmup', '0', '--device', 'cpu',
           '--threads', '1', '--out-dir', str(out_dir), '--name', 'tiny', '--quiet']
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    with open(out_dir / 'tiny.csv') as f:
        rows = list(csv.DictReader(f))
    assert [r['model'] for r in rows] == ['xcit_n12_p16', 'mmpretrain_xcit_n12_p16']
    for r in rows:
        assert r['status'] == 'ok', r
        assert r['resolution'] == '64' and r['batch'] == '1' and r['device'] == 'cpu'
        for key in ('ms_per_img', 'imgs_per_s', 'peak_mem_mb', 'gmacs', 'gflop_exec',
                    'params_m', 'achieved_gflop_s', 'matmul_gflop_s', 'matmul_frac'):
            value = float(r[key])
            assert 0 < value < 1e7, (key, value)
        # images/s is the inverse of the median time per image
        assert float(r['imgs_per_s']) == pytest.approx(1e3 / float(r['ms_per_img']), rel=1e-3)
    # the adapter adds MACs on top of the same trunk
    assert float(rows[0]['gmacs']) > float(rows[1]['gmacs'])

    with open(out_dir / 'tiny.json') as f:
        data = json.load(f)
    assert len(data['records']) == 2
    assert data['meta']['torch'] == torch.__version__
    assert all(len(r['times_s']) == 1 for r in data['records'])

    png = (out_dir / 'tiny.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 10_000
