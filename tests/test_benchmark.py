"""Tests of tools/benchmark.py: FLOP-counter exactness, model names and a tiny end-to-end run.

No timing assertions: the machine is shared and timings are noise here.
"""
import csv
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, 'tools', 'analysis_tools', 'benchmark.py')


def test_flop_counter_linear_is_exact(bench):
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    assert bench.count_flops(lambda: linear(x)) == 2 * 4 * 16 * 8


def test_flop_counter_depthwise_conv_and_channel_attention_are_exact(bench):
    conv = torch.nn.Conv2d(6, 6, 3, padding=1, groups=6)
    x = torch.randn(1, 6, 10, 10)
    assert bench.count_flops(lambda: conv(x)) == 2 * 6 * 10 * 10 * 9
    # the XCA products: (B, h, d, N) @ (B, h, N, d) -> (B, h, d, d), then @ (B, h, d, N)
    q, k, v = (torch.randn(2, 3, 5, 30) for _ in range(3))
    assert bench.count_flops(lambda: (q @ k.transpose(-2, -1)).softmax(-1) @ v) == \
        2 * (2 * 3 * 5 * 5 * 30) * 2


def test_trunk_flops_match_the_formula(bench):
    """The counter sees every MAC of the XCiT trunk, the XCA products included.

    mmpretrain's port computes XCA exactly as the paper, so its count equals the formula.
    XCiTBackbone may rewrite XCA algebraically (e.g. fold ``attn @ v`` into the projection),
    which moves its count by a few percent at 224 px, not more.
    """
    for arch, patch, res in (('n12', 16, 64), ('t12', 8, 96)):
        port = bench.point_flops(bench.parse_model(f'mmpretrain_xcit_{arch}_p{patch}'), res,
                                 'inference')
        assert port['gmacs'] * 1e9 == pytest.approx(
            bench.analytic_trunk_macs(arch, patch, res, res), rel=1e-9)
    ours = bench.point_flops(bench.parse_model('xcit_n12_p16_trunk'), 224, 'inference')
    assert ours['gmacs'] * 1e9 == pytest.approx(
        bench.analytic_trunk_macs('n12', 16, 224, 224), rel=0.05)
    assert ours['params_m'] > 0


def test_train_step_flops_are_three_forwards(bench):
    """Backward = 2x forward for every layer, depthwise convs included (torch's own formula
    overcounts grouped conv weight gradients; the tool corrects it)."""
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
    x = torch.randn(1, 8, 10, 10, requires_grad=True)
    assert bench.count_flops(lambda: conv(x).sum().backward()) == 3 * 2 * 8 * 100 * 9
    info = bench.point_flops(bench.parse_model('mmpretrain_xcit_n12_p16'), 64, 'train')
    # the first conv has no input gradient: a little less than 3 forwards
    assert 2.9 < info['gflop_exec'] / (2 * info['gmacs']) <= 3.0


def test_parse_model_names_and_errors(bench):
    spec = bench.parse_model('xcit_s12_p8_trunk')
    assert (spec.family, spec.arch, spec.patch, spec.with_cp) == ('xcit_trunk', 's12', 8, False)
    assert bench.parse_model('swin_t+cp').with_cp
    for bad in ('xcit_x12_p16', 'xcit_s12_p4', 'mmpretrain_xcit_s12_p8+cp',
                'mmpretrain_xcit_s12_p8_trunk', 'resnet18'):
        with pytest.raises(ValueError):
            bench.parse_model(bad)


def test_compare_times_the_same_trunk(bench):
    """--compare's premise: with the port's weights, XCiTBackbone's trunk gives the same maps."""
    verdict = bench.check_same_trunk('n12', 16)
    assert 'max |diff|' in verdict, verdict
    diff = float(verdict.split('= ')[1].split(' ')[0])
    assert diff < 1e-4, verdict


def test_tiny_run_writes_sane_csv_json_png(bench, tmp_path):
    analytic_n12_64 = bench.analytic_trunk_macs('n12', 16, 64, 64)
    out_dir = tmp_path / 'bench'
    cmd = [sys.executable, TOOL, '--models', 'xcit_n12_p16', '--resolutions', '64',
           '--repeats', '1', '--warmup', '0', '--device', 'cpu', '--threads', '1',
           '--out-dir', str(out_dir), '--name', 'tiny', '--quiet']
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    with open(out_dir / 'tiny.csv') as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1
    r = rows[0]
    assert (r['model'], r['status'], r['resolution'], r['batch'], r['device'], r['mode']) == \
        ('xcit_n12_p16', 'ok', '64', '1', 'cpu', 'inference')
    for key in ('ms_per_img', 'imgs_per_s', 'peak_mem_mb', 'gmacs', 'gflop_exec', 'params_m',
                'achieved_gflop_s', 'matmul_gflop_s', 'matmul_frac'):
        value = float(r[key])
        assert 0 < value < 1e7, (key, value)
    # images/s is the inverse of the median time per image
    assert float(r['imgs_per_s']) == pytest.approx(1e3 / float(r['ms_per_img']), rel=1e-3)
    # trunk + adapter costs more than the trunk formula alone
    assert float(r['gmacs']) * 1e9 > analytic_n12_64

    with open(out_dir / 'tiny.json') as f:
        data = json.load(f)
    assert len(data['records']) == 1 and len(data['records'][0]['times_s']) == 1
    assert data['meta']['torch'] == torch.__version__
    assert data['meta']['matmul_gflop_s_before'] > 0

    png = (out_dir / 'tiny.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 10_000
