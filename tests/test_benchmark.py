"""Tests of the benchmark library (xcit_benchmark) and its CLIs
(tools/analysis_tools/benchmark.py, get_flops.py): FLOP-counter exactness, model names, the spec,
the docs tables, and a tiny end-to-end run.

No timing assertions: the machine is shared and timings are noise here.

mmpretrain's port is never loaded through the tools' loader in this process (its placeholder
packages for ``mmpretrain.models`` would stay in ``sys.modules``): in-process tests get the port
from conftest's ``mmpretrain_xcit`` fixture (``port_module``), and the loader itself runs in a
subprocess (``test_loader_in_a_fresh_process``).  ``no_placeholder_leak`` checks it after every
test.
"""
import csv
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

import xcit_benchmark as lib
from xcit_benchmark import goals as lib_goals
from xcit_benchmark import models as lib_models
from xcit_benchmark import whole_model as lib_whole
from xcit_benchmark.spec import SpecError, validate_spec
from xcit_benchmark.timing import time_interleaved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, 'tools', 'analysis_tools', 'benchmark.py')
ARTIFACTS = os.path.join(ROOT, 'docs', 'benchmark')


def _placeholders():
    return sorted(name for name, mod in list(sys.modules.items())
                  if name.startswith('mmpretrain')
                  and vars(mod).get('__xcit_benchmark_placeholder__', False))


@pytest.fixture(autouse=True)
def no_placeholder_leak():
    yield
    assert _placeholders() == [], 'the mmpretrain loader ran inside the pytest process'


@pytest.fixture
def port_module(mmpretrain_xcit, monkeypatch):
    """mmpretrain's ``xcit`` module (conftest's scoped import), served to the library instead of
    its process-wide loader."""
    module = sys.modules[mmpretrain_xcit.__module__]
    monkeypatch.setattr(lib_models, 'load_mmpretrain_xcit', lambda: module)
    return module


def _artifact(name):
    with open(os.path.join(ARTIFACTS, name)) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------
def test_flop_counter_linear_is_exact():
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    assert lib.count_flops(lambda: linear(x)) == 2 * 4 * 16 * 8


def test_flop_counter_depthwise_conv_and_channel_attention_are_exact():
    conv = torch.nn.Conv2d(6, 6, 3, padding=1, groups=6)
    x = torch.randn(1, 6, 10, 10)
    assert lib.count_flops(lambda: conv(x)) == 2 * 6 * 10 * 10 * 9
    # the XCA products: (B, h, d, N) @ (B, h, N, d) -> (B, h, d, d), then @ (B, h, d, N)
    q, k, v = (torch.randn(2, 3, 5, 30) for _ in range(3))
    assert lib.count_flops(lambda: (q @ k.transpose(-2, -1)).softmax(-1) @ v) == \
        2 * (2 * 3 * 5 * 5 * 30) * 2


def test_trunk_flops_match_the_formula(port_module):
    """The counter sees every MAC of the XCiT trunk, the XCA products included.

    mmpretrain's port computes XCA exactly as the paper, so its count equals the formula.
    XCiTBackbone may rewrite XCA algebraically (e.g. fold ``attn @ v`` into the projection),
    which moves its count by a few percent at 224 px, not more.
    """
    for arch, patch, res in (('n12', 16, 64), ('t12', 8, 96)):
        port = lib.point_flops(lib.parse_model(f'mmpretrain_xcit_{arch}_p{patch}'), res,
                               'inference')
        assert port['gmacs'] * 1e9 == pytest.approx(
            lib.analytic_trunk_macs(arch, patch, res, res), rel=1e-9)
    ours = lib.point_flops(lib.parse_model('xcit_n12_p16_trunk'), 224, 'inference')
    assert ours['gmacs'] * 1e9 == pytest.approx(
        lib.analytic_trunk_macs('n12', 16, 224, 224), rel=0.05)
    assert ours['params_m'] > 0


def test_train_step_flops_are_three_forwards(port_module):
    """Backward = 2x forward for every layer, depthwise convs included (torch's own formula
    overcounts grouped conv weight gradients; the library corrects it)."""
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
    x = torch.randn(1, 8, 10, 10, requires_grad=True)
    assert lib.count_flops(lambda: conv(x).sum().backward()) == 3 * 2 * 8 * 100 * 9
    info = lib.point_flops(lib.parse_model('mmpretrain_xcit_n12_p16'), 64, 'train')
    # the first conv has no input gradient: a little less than 3 forwards
    assert 2.9 < info['gflop_exec'] / (2 * info['gmacs']) <= 3.0


def test_flops_report_reproduces_the_committed_rows(port_module):
    """docs/benchmark/flops.json is what the current code counts (N12 re-counted)."""
    spec = lib.load_spec()['flops_report']
    rows = lib.flops_report(spec['paper_table1'], spec['tolerance'], archs=['n12'],
                            xcit_module=port_module)
    committed = [r for r in _artifact('flops.json')['rows'] if r['arch'] == 'n12']
    assert [r['setting'] for r in rows] == [r['setting'] for r in committed] == \
        ['224/p16', '384/p8']
    for new, old in zip(rows, committed):
        for key, value in old.items():
            if isinstance(value, float):
                assert new[key] == pytest.approx(value, rel=1e-6), (new['setting'], key)
            else:
                assert new[key] == value, (new['setting'], key)
    assert all(r['ok'] for r in rows)


def test_get_flops_counts_models(flops_tool, tmp_path, capsys):
    out_dir = tmp_path / 'flops'
    assert flops_tool.main(['--models', 'xcit_n12_p16_trunk', 'resnet50', '--resolutions', '224',
                            '--out-dir', str(out_dir)]) == 0
    text = capsys.readouterr().out
    assert 'xcit_n12_p16_trunk' in text and 'wrote ' in text
    with open(out_dir / 'model_flops.csv') as f:
        rows = {r['model']: r for r in csv.DictReader(f)}
    assert float(rows['xcit_n12_p16_trunk']['gmacs']) * 1e9 == pytest.approx(
        lib.analytic_trunk_macs('n12', 16, 224, 224), rel=0.05)
    assert float(rows['resnet50']['params_m']) == pytest.approx(23.5, rel=0.01)
    with pytest.raises(SystemExit) as exc:
        flops_tool.main(['--models', 'xcit_s13_p16'])
    assert exc.value.code == 2


# ---------------------------------------------------------------------------------------------
# names and command lines
# ---------------------------------------------------------------------------------------------
def test_parse_model_names_and_errors():
    spec = lib.parse_model('xcit_s12_p8_trunk')
    assert (spec.family, spec.arch, spec.patch, spec.with_cp) == ('xcit_trunk', 's12', 8, False)
    assert lib.parse_model('swin_t+cp').with_cp
    assert lib.parse_model('mmpretrain_xcit_t24_p16').family == 'mmpretrain_xcit'
    for bad in ('xcit_x12_p16', 'xcit_s12_p4', 'mmpretrain_xcit_s12_p8+cp',
                'mmpretrain_xcit_s12_p8_trunk', 'resnet18'):
        with pytest.raises(ValueError):
            lib.parse_model(bad)
    # the archs are XCiTBackbone's
    assert set(lib.XCIT_ARCHS) == {'n12', 't12', 't24', 's12', 's24', 'm24', 'l24'}


def test_unknown_model_is_an_argparse_error(bench, capsys):
    """issue 16.6: no ValueError traceback, but usage + the valid names, exit status 2."""
    with pytest.raises(SystemExit) as exc:
        bench.main(['--models', 'xcit_s13_p16'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert 'usage:' in err and "invalid choice: 'xcit_s13_p16'" in err
    assert 'xcit_<n12|t12|t24|s12|s24|m24|l24>_p<8|16>' in err and 'swin_t' in err
    assert 'Traceback' not in err
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(['--compare', '--models', 'resnet50'])
    assert exc.value.code == 2


def test_with_cp_variants_and_compare_pairs():
    specs = [lib.parse_model(n) for n in ('xcit_s12_p16', 'mmpretrain_xcit_s12_p8')]
    pairs = []
    out = lib.with_cp_variants(specs, 'both', pairs)
    assert [s.name for s in out] == ['xcit_s12_p16', 'xcit_s12_p16+cp', 'mmpretrain_xcit_s12_p8']
    assert pairs == [('xcit_s12_p16+cp', 'xcit_s12_p16')]
    specs, pairs = lib.compare_pairs([lib.parse_model('xcit_s12_p8'), lib.parse_model('swin_t')])
    assert [s.name for s in specs] == ['xcit_s12_p8_trunk', 'mmpretrain_xcit_s12_p8']
    assert pairs == [('xcit_s12_p8_trunk', 'mmpretrain_xcit_s12_p8')]


def test_time_interleaved_rotates_the_order():
    calls = []
    steps = {name: (lambda n=name: calls.append(n)) for name in 'abc'}
    times = time_interleaved(steps, warmup=1, repeats=3, device='cpu')
    assert calls == list('abc') + list('abc') + list('bca') + list('cab')
    assert {k: len(v) for k, v in times.items()} == {'a': 3, 'b': 3, 'c': 3}


def test_compare_times_the_same_trunk(port_module):
    """--compare's premise: with the port's weights, XCiTBackbone's trunk gives the same maps."""
    verdict = lib.check_same_trunk('n12', 16)
    assert 'max |diff|' in verdict, verdict
    diff = float(verdict.split('= ')[1].split(' ')[0])
    assert diff < 1e-4, verdict


# ---------------------------------------------------------------------------------------------
# the spec and the docs
# ---------------------------------------------------------------------------------------------
def test_spec_drives_the_defaults_and_reproduces_the_committed_goals(bench):
    spec = lib.load_spec()
    args = bench.parse_args([])
    assert args.models == spec['default_models'] and args.resolutions == \
        spec['default_resolutions']
    committed = _artifact('goals.json')
    goals = lib.evaluate_goals(committed['records'], spec['goals']['checks'],
                               committed['meta']['options']['repeats'])
    assert goals == committed['meta']['goals']
    # the measured points are the spec's runs, in order
    points = [(n, r, run['mode']) for run in spec['goals']['runs'] for n, r in run['points']]
    assert sorted(points) == sorted((r['model'], r['resolution'], r['mode'])
                                    for r in committed['records'])


def test_run_goals_measures_the_spec_runs(monkeypatch):
    """--goals runs the spec's runs in order, with its batch / precision / mode and timing only
    where asked; the verdicts come from the records (here: the committed ones)."""
    spec = lib.load_spec()['goals']
    committed = _artifact('goals.json')
    calls = []

    def fake_run_points(points, opts, progress_factory=None, log=None):
        calls.append(([(s.name, r) for s, r in points], opts))
        wanted = {(s.name, r, opts.mode) for s, r in points}
        return [r for r in committed['records']
                if (r['model'], r['resolution'], r['mode']) in wanted], dict(run=len(calls))

    monkeypatch.setattr(lib_goals, 'run_points', fake_run_points)
    logs = []
    opts = lib.RunOptions(batch=4, precision='amp', mode='train', warmup=2, repeats=10)
    goals, records, meta = lib.run_goals(opts, spec, log=logs.append)
    assert logs == [run['label'] for run in spec['runs']]
    assert [points for points, _ in calls] == \
        [[tuple(p) for p in run['points']] for run in spec['runs']]
    for (_, o), run in zip(calls, spec['runs']):
        assert (o.batch, o.precision, o.mode, o.do_time, o.warmup, o.repeats) == \
            (1, 'fp32', run['mode'], run['time'], 2, 10)
    assert meta == dict(run=1) and len(records) == len(committed['records'])
    assert goals == committed['meta']['goals']


def test_spec_errors_name_the_entry():
    spec = lib.load_spec()
    bad = json.loads(json.dumps(spec))
    bad['goals']['checks'][0]['a'] = ['xcit_s12_p16', 2048]
    with pytest.raises(SpecError, match=r'goals.checks\[0\].a: xcit_s12_p16@2048'):
        validate_spec(bad, 'x.json')
    bad = json.loads(json.dumps(spec))
    bad['default_models'].append('xcit_s13_p16')
    with pytest.raises(SpecError, match="default_models: unknown XCiT arch 's13'"):
        validate_spec(bad, 'x.json')
    with pytest.raises(SpecError, match='not found'):
        lib.load_spec(os.path.join(ARTIFACTS, 'no_such_spec.json'))


@pytest.mark.parametrize('name', [
    'goals.json', 'cpu_inference_fp32.json', 'flops.json', 'wholemodel_maskrcnn_train.json',
    'wholemodel_maskrcnn_inference.json', 'wholemodel_semfpn_train.json',
    'wholemodel_maskrcnn_train_before_lean.json', 'wholemodel_shapes_maskrcnn_train.json',
    'wholemodel_shapes_semfpn_train.json'])
def test_docs_tables_quote_the_committed_artifacts(bench, capsys, name):
    """Every table row docs/benchmark.md shows for a result is rendered from its JSON."""
    assert bench.main(['--markdown', os.path.join(ARTIFACTS, name)]) == 0
    rendered = capsys.readouterr().out.strip()
    with open(os.path.join(ROOT, 'docs', 'benchmark.md')) as f:
        doc = f.read()
    missing = [line for line in rendered.splitlines() if line and line not in doc]
    assert not missing, f'docs/benchmark.md does not quote {name}: {missing}'


# ---------------------------------------------------------------------------------------------
# fresh processes
# ---------------------------------------------------------------------------------------------
LOADER_SCRIPT = r'''
import importlib.util, json, sys
import torch
import xcit_mm
report = dict(bench_modules=sorted(m for m in sys.modules
                                   if m.startswith('xcit_benchmark')))
sys.path.insert(0, 'tools/analysis_tools')  # the library lives beside the tools that use it
from xcit_benchmark import build_model, parse_model
model, forward = build_model(parse_model('mmpretrain_xcit_n12_p16'))
model.eval()
with torch.no_grad():
    outs = forward(torch.randn(1, 3, 64, 64))
report.update(
    shapes=[list(o.shape) for o in outs],
    placeholder=getattr(sys.modules['mmpretrain.models'], '__xcit_benchmark_placeholder__', False),
    torchvision_installed=importlib.util.find_spec('torchvision') is not None,
    torchvision_imported='torchvision' in sys.modules)
print('@@' + json.dumps(report))
'''


def test_loader_in_a_fresh_process():
    """``import xcit_mm`` does not import the benchmark; the loader builds mmpretrain's trunk
    without torchvision (placeholder packages only where torchvision is missing)."""
    proc = subprocess.run([sys.executable, '-c', LOADER_SCRIPT], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS='1'), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.split('@@')[-1])
    assert report['bench_modules'] == []
    assert report['shapes'] == [[1, 128, 4, 4]] * 4
    assert report['placeholder'] is not report['torchvision_installed']
    assert report['torchvision_imported'] is report['torchvision_installed']


def test_tiny_run_writes_sane_csv_json_png(tmp_path):
    analytic_n12_64 = lib.analytic_trunk_macs('n12', 16, 64, 64)
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
    assert list(r) == lib.CSV_FIELDS
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
    assert 'MALLOC_MMAP_THRESHOLD_=65536' in r['mem_method']

    with open(out_dir / 'tiny.json') as f:
        data = json.load(f)
    assert len(data['records']) == 1 and len(data['records'][0]['times_s']) == 1
    assert data['meta']['torch'] == torch.__version__
    assert data['meta']['matmul_gflop_s_before'] > 0
    assert data['meta']['options']['repeats'] == 1

    png = (out_dir / 'tiny.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 10_000


TINY_WHOLE_CFG = """\
_base_ = [{base!r}]
model = dict(
    backbone=dict(_delete_=True, type='XCiTBackbone',
                  arch=dict(embed_dims=32, depth=2, num_heads=2), patch_size=16,
                  out_indices=(0, 1, 1, 1)),
    neck=dict(in_channels=[32] * 4, out_channels=32),
    decode_head=dict(in_channels=[32] * 4, channels=32, num_classes=5))
"""


def test_whole_model_mode_parts(tmp_path):
    """issue 14.1: --whole-model on a tiny XCiT Sem-FPN, train step at 64x64, one repeat: the
    JSON has every part, positive times summing to the step time, and the CSV a row."""
    cfg = tmp_path / 'tiny_sem_fpn.py'
    cfg.write_text(TINY_WHOLE_CFG.format(
        base=os.path.join(ROOT, 'configs', 'sem_fpn_xcit_t12_p16_80k_ade20k.py')))
    out = tmp_path / 'out'
    proc = subprocess.run(
        [sys.executable, TOOL, '--whole-model', str(cfg), '--mode', 'train', '--shape', '64',
         '64', '--repeats', '1', '--rounds', '2', '--threads', '1', '--out-dir', str(out),
         '--name', 'wm', '--quiet'], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'backward' in proc.stdout
    with open(out / 'wm.json') as f:
        data = json.load(f)
    (rec,) = data['records']
    assert rec['status'] == 'ok' and rec['is_xcit'] and rec['task'] == 'seg'
    parts = rec['parts']
    assert list(parts) == ['trunk', 'adapter', 'neck', 'heads', 'backward', 'optimizer']
    assert all(p['time_ms'] > 0 for p in parts.values())
    total = sum(p['time_ms'] for p in parts.values())
    assert rec['time_ms'] > 0 and abs(total - rec['time_ms']) <= 0.05 * rec['time_ms']
    assert rec['peak_mem_mb'] >= max(p['peak_mb'] for p in parts.values()) - 1e-6
    # two rounds, each a fresh process; the headline figures are their medians
    assert [p['round'] for p in rec['per_round']] == [0, 1] and rec['rounds_ok'] == 2
    assert rec['time_ms'] == pytest.approx(statistics.median(
        p['time_ms'] for p in rec['per_round']))
    assert rec['parts']['backward']['time_ms'] == pytest.approx(statistics.median(
        p['parts']['backward']['time_ms'] for p in rec['per_round']))
    assert data['meta']['whole_model']['rounds'] == 2 and data['meta']['ratios'] == []
    with open(out / 'wm.csv') as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and float(rows[0]['trunk_ms']) > 0
    assert float(rows[0]['time_ms_min']) <= float(rows[0]['time_ms']) <= \
        float(rows[0]['time_ms_max'])


def test_whole_model_bad_config_is_a_usage_error(tmp_path):
    """issue 14.1: a missing config is a clear argparse error (exit 2), before any worker."""
    missing = str(tmp_path / 'nope.py')
    proc = subprocess.run([sys.executable, TOOL, '--whole-model', missing, '--shape', '64', '64'],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert 'config not found' in proc.stderr and 'nope.py' in proc.stderr


# ---------------------------------------------------------------------------------------------
# --whole-model rounds (fake workers: no model is run)
# ---------------------------------------------------------------------------------------------
def test_whole_model_round_order_is_the_interleaved_timing_order():
    """Round r of --whole-model visits the configs in the order the backbone benchmark's
    interleaved timing uses in its round r."""
    calls = []
    steps = {name: (lambda n=name: calls.append(n)) for name in 'abc'}
    time_interleaved(steps, warmup=0, repeats=5, device='cpu')
    assert calls == [x for r in range(5) for x in lib_whole.round_order('abc', r)]
    assert lib_whole.round_order(['a', 'b'], 3) == ['b', 'a']
    assert lib_whole.round_order([], 2) == []


# (step time ms, peak MB) of every round, per config; built so that the median of the per-round
# ratios (0.5) differs from the ratio of the medians (400 / 300 = 1.33)
FAKE_ROUNDS = {'subj.py': [(100., 10.), (400., 40.), (900., 90.)],
               'base.py': [(200., 20.), (300., 100.), (1800., 30.)],
               'other.py': [(50., 5.), (50., 5.), (50., 5.)]}


def _fake_worker(calls, fail=None):
    """A stand-in for run_memory_worker: the figures of FAKE_ROUNDS, by config and call count;
    ``fail = (config, call index)`` makes that call an OOM."""
    def worker(cfg, limit_bytes, timeout_s):
        name = os.path.basename(cfg['config'])
        k = sum(c == name for c in calls)
        calls.append(name)
        if fail == (name, k):
            return dict(status='oom', note='killed at RSS 9.9 GiB')
        t, peak = FAKE_ROUNDS[name][k]
        parts = {'trunk': dict(time_ms=t / 2, peak_mb=peak), 'neck': dict(time_ms=t / 2,
                                                                          peak_mb=peak / 2)}
        return dict(status='ok', task='det', backbone='Fake', is_xcit=name == 'subj.py',
                    params_m=1.0, time_ms=t, times_ms=[t - 1, t, t + 1], peak_mem_mb=peak,
                    mem_base_mb=k + 1., parts=parts, malloc_mmap_threshold='65536', note='')
    return worker


def _run_fake(monkeypatch, configs, rounds, fail=None, log=None):
    calls = []
    monkeypatch.setattr(lib_whole, 'run_memory_worker', _fake_worker(calls, fail))
    records = lib_whole.run_whole_models(configs, 'train', 64, 64, repeats=3, rounds=rounds,
                                         log=log)
    return records, calls


def test_whole_model_rounds_rotate_and_report_medians(monkeypatch):
    logs = []
    records, calls = _run_fake(monkeypatch, ['x/subj.py', 'x/base.py', 'x/other.py'], 3,
                               log=logs.append)
    # round r = every config once, in the order rotated by r
    assert calls == ['subj.py', 'base.py', 'other.py', 'base.py', 'other.py', 'subj.py',
                     'other.py', 'subj.py', 'base.py']
    assert len(logs) == 2 * 9 and logs[1].startswith('round 1/3, 1/3: subj: 100 ms/step')
    subj, base, _ = records
    assert [p['round'] for p in subj['per_round']] == [0, 1, 2]
    assert [p['position'] for p in subj['per_round']] == [0, 2, 1]
    assert [p['position'] for p in base['per_round']] == [1, 0, 2]
    # headline = medians over the rounds (not the first run, not a mean), per part too
    assert (subj['status'], subj['rounds_ok'], subj['rounds']) == ('ok', 3, 3)
    assert (subj['time_ms'], subj['peak_mem_mb'], subj['mem_base_mb']) == (400., 40., 2.)
    assert (base['time_ms'], base['peak_mem_mb']) == (300., 30.)
    assert subj['round_times_ms'] == [100., 400., 900.]
    assert base['round_peaks_mb'] == [20., 100., 30.]
    assert subj['parts'] == {'trunk': dict(time_ms=200., peak_mb=40.),
                             'neck': dict(time_ms=200., peak_mb=20.)}
    assert subj['times_ms'] == [99., 100., 101., 399., 400., 401., 899., 900., 901.]
    assert (subj['is_xcit'], subj['backbone'], subj['params_m']) == (True, 'Fake', 1.0)
    assert subj['per_round'][1]['time_ms'] == 400. and 'params_m' not in subj['per_round'][1]


def test_whole_model_ratios_are_medians_of_per_round_ratios(monkeypatch):
    records, _ = _run_fake(monkeypatch, ['x/subj.py', 'x/base.py', 'x/other.py'], 3)
    rows = lib_whole.whole_model_ratios(records)
    assert [(r['subject'], r['baseline']) for r in rows] == [('subj', 'base'),
                                                             ('subj', 'other')]
    row = rows[0]
    # per round: time 100/200, 400/300, 900/1800; peak 10/20, 40/100, 90/30
    assert row['time_ratios'] == pytest.approx([0.5, 4 / 3, 0.5])
    assert (row['time_ratio'], row['time_ratio_min']) == (0.5, 0.5)
    assert row['time_ratio_max'] == pytest.approx(4 / 3)
    assert row['peak_ratios'] == pytest.approx([0.5, 0.4, 3.0])
    assert (row['peak_ratio'], row['peak_ratio_min'], row['peak_ratio_max']) == \
        pytest.approx((0.5, 0.4, 3.0))
    assert row['rounds'] == 3 and (row['subject_time_ms'], row['baseline_time_ms']) == (400., 300.)
    assert row['part_time_ratios'] == pytest.approx({'trunk': 4 / 3, 'neck': 4 / 3})
    assert lib_whole.format_whole_ratios(rows).splitlines()[0] == \
        'subj / base: time 0.50x (0.50-1.33), peak memory 0.50x (0.40-3.00), 3 rounds'
    assert lib_whole.whole_model_ratios(records[:1]) == []


def test_whole_model_failed_round_is_reported_and_left_out(monkeypatch):
    """A config that fails in a round is not measured again, its record names the round, and the
    ratios use only the rounds where both configs were measured."""
    records, calls = _run_fake(monkeypatch, ['x/subj.py', 'x/base.py'], 3, fail=('base.py', 1))
    assert calls == ['subj.py', 'base.py', 'base.py', 'subj.py', 'subj.py']
    subj, base = records
    assert subj['status'] == 'ok' and subj['rounds_ok'] == 3
    assert base['status'] == 'oom' and base['note'].startswith('round 2: oom')
    assert base['rounds_ok'] == 1 and base['time_ms'] == 200.
    (row,) = lib_whole.whole_model_ratios(records)
    assert row['rounds'] == 1 and row['time_ratios'] == [0.5]
    assert 'round 2: oom' in lib_whole.format_whole_table(records)


def test_whole_model_cli_rounds_and_ratios(bench, monkeypatch, tmp_path, capsys):
    """The CLI wiring: --rounds reaches the library, the ratios are printed and stored in
    meta['ratios'], the CSV has one row per config; --rounds is only for --whole-model."""
    configs = []
    for name in ('subj.py', 'base.py'):
        (tmp_path / name).write_text('')
        configs.append(str(tmp_path / name))
    calls = []
    monkeypatch.setattr(lib_whole, 'run_memory_worker', _fake_worker(calls))
    out = tmp_path / 'out'
    assert bench.main(['--whole-model', *configs, '--shape', '64', '64', '--rounds', '3',
                       '--out-dir', str(out), '--name', 'wm', '--quiet']) == 0
    assert len(calls) == 6
    text = capsys.readouterr().out
    assert 'subj / base: time 0.50x (0.50-1.33), peak memory 0.50x (0.40-3.00), 3 rounds' in text
    with open(out / 'wm.json') as f:
        data = json.load(f)
    assert data['meta']['whole_model']['rounds'] == 3
    assert [r['time_ratio'] for r in data['meta']['ratios']] == [0.5]
    assert [len(r['per_round']) for r in data['records']] == [3, 3]
    with open(out / 'wm.csv') as f:
        rows = list(csv.DictReader(f))
    assert [(r['model'], float(r['time_ms']), float(r['time_ms_min']), float(r['time_ms_max']))
            for r in rows] == [('subj', 400., 100., 900.), ('base', 300., 200., 1800.)]
    assert 'per_round' not in rows[0]
    for argv in (['--rounds', '2'], ['--whole-model', configs[0], '--shape', '64', '64',
                                     '--rounds', '0']):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2
