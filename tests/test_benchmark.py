"""Tests of the benchmark library (xcit_benchmark) and its CLI (benchmarks/benchmark.py).

The measurements are checked against workloads whose cost is known without the code under test:

* FLOPs: formulas (a Linear, a depthwise conv, the XCA products, the XCiT trunk, the
  class-attention head of paper Table 1, a 1x1 conv) and growth with the input size;
* time: a virtual clock that only the measured steps advance, by known amounts (exact medians,
  quartiles, per-image times, rates), and a real sleep (a lower bound);
* memory: tensors of known size allocated inside the measured call or part;
* ratios and goal verdicts: hand-computed values of given timings and records;
* files: the CSV and JSON of a run agree with each other and with the records.

The committed results under docs/benchmark/ are made by this code, so they are never the expected
values here: they are only checked for being well-formed (their fields agree with each other,
docs/benchmark.md quotes them, the N12 FLOPs rows are what the current code counts).

Two fresh processes start with the module, once per session (whichever xdist worker is first),
and run meanwhile: one end-to-end command-line run (with its own memory process) and one that
measures known allocations with the memory method and counts mmpretrain's port (``fresh_run``);
their tests come last. The rest runs in this process, on one thread (plus two memory processes
the guard test kills at once).  Real timings are only bounded from below: the machine is shared.

mmpretrain's port is only loaded (by the tools' loader) in the fresh processes: its placeholder
packages for ``mmpretrain.models`` would stay in ``sys.modules``; ``no_placeholder_leak`` checks
it after every test.
"""
import csv
import gc
import glob
import json
import math
import os
import statistics
import sys
import time

import pytest
import torch
import torch.nn as nn

from background import background_once

from types import SimpleNamespace

from xcit_benchmark import flops as lib_flops
from xcit_benchmark import fresh_points as lib_fresh
from xcit_benchmark import models as lib_models
from xcit_benchmark import report as lib_report
from xcit_benchmark import runner as lib_runner
from xcit_benchmark import spec as lib_spec
from xcit_benchmark import timing as lib_timing
from xcit_benchmark import whole_model as lib_whole
from xcit_benchmark.spec import SpecError, validate_spec
from xcit_benchmark.timing import time_interleaved

# the library's public names in one namespace
lib = SimpleNamespace(**{name: getattr(module, name)
                         for module in (lib_flops, lib_fresh, lib_models,
                                        lib_report, lib_runner, lib_spec, lib_timing)
                         for name in dir(module) if not name.startswith('_')})

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, 'benchmarks', 'benchmark.py')
ARTIFACTS = os.path.join(ROOT, 'docs', 'benchmark')
MIB = 2 ** 20


def _placeholders():
    return sorted(name for name, mod in list(sys.modules.items())
                  if name.startswith('mmpretrain')
                  and vars(mod).get('__xcit_benchmark_placeholder__', False))


@pytest.fixture(autouse=True)
def no_placeholder_leak():
    yield
    assert _placeholders() == [], 'the mmpretrain loader ran inside the pytest process'


# one torch thread and a frozen heap for the timing code (fixtures of conftest.py)
pytestmark = pytest.mark.usefixtures('one_torch_thread', 'frozen_heap')


def _artifact(name):
    with open(os.path.join(ARTIFACTS, name)) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# known workloads
# ---------------------------------------------------------------------------------------------
class FakeClock:
    """Stands in for the ``time`` module of the timing code: ``perf_counter`` moves only when a
    step calls ``advance``, so every measured time is known exactly."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


KNOWN_CHANNELS = 16


class KnownConv(nn.Module):
    """A 1x1 conv 3 -> KNOWN_CHANNELS: ``3 * KNOWN_CHANNELS * H * W`` MACs per image.

    Each real call (not the FLOP counter's fake-tensor call) advances ``clock`` by
    ``factor * batch * H * W`` microseconds, ``factor`` cycling through ``factors``.
    """

    def __init__(self, clock=None, factors=(1.,)):
        super().__init__()
        self.conv = nn.Conv2d(3, KNOWN_CHANNELS, 1)
        self.clock, self.factors, self.calls = clock, factors, 0

    def forward(self, img):
        from torch._subclasses.fake_tensor import FakeTensor
        if self.clock is not None and not isinstance(img, FakeTensor):
            b, _, h, w = img.shape
            self.clock.advance(self.factors[self.calls % len(self.factors)] * b * h * w * 1e-6)
            self.calls += 1
        return [self.conv(img)]


def _known_macs(res):
    return 3 * KNOWN_CHANNELS * res * res


def _mm_gflops(step_seconds):
    """Rate of the reference step: 4 products of two 1024x1024 matrices, 2 * 1024^3 FLOPs each."""
    return 4 * 2 * 1024 ** 3 / step_seconds / 1e9


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


def test_point_flops_of_a_known_module_grow_with_the_input(monkeypatch):
    """point_flops (fake tensors) of a 1x1 conv: the formula at every size, 4x per doubled side;
    a train step adds the weight gradient only (the image needs no gradient): 2x the forward."""
    model = KnownConv()
    monkeypatch.setattr(lib_flops, 'build_model', lambda spec, device='cpu': (model, model))
    spec = lib.ModelSpec(name='known_conv', family='resnet50')
    for res in (32, 64, 96):
        info = lib.point_flops(spec, res, 'inference')
        assert info['gmacs'] * 1e9 == _known_macs(res)
        assert info['gflop_exec'] * 1e9 == 2 * _known_macs(res)
        assert info['params_m'] * 1e6 == 3 * KNOWN_CHANNELS + KNOWN_CHANNELS
        train = lib.point_flops(spec, res, 'train')
        assert train['gmacs'] == info['gmacs'] and train['gflop_exec'] * 1e9 == \
            2 * 2 * _known_macs(res)
    assert model.calls == 0  # counted on fake tensors: nothing computed


FLOPS_CACHE = {}  # models built once for all FLOPs tests of this file


def _cls_part_macs(dims, tokens):
    """MACs of what the ImageNet classifier adds to the trunk (paper Table 1): 2 class-attention
    blocks on the N + 1 tokens -- q of the class token (D^2), k and v of all tokens (2 T D^2),
    q k^T and attn v (2 D T), projection (D^2), FFN of the class token (8 D^2) -- and the
    Linear(D, 1000) head."""
    block = 10 * dims * dims + 2 * tokens * dims * dims + 2 * dims * tokens
    return 2 * block + 1000 * dims


def _check_flops_row(row, paper_table, tolerance):
    """A FLOPs report row against the formulas and its own arithmetic."""
    dims, _, _ = lib.XCIT_ARCHS[row['arch']]
    res, patch = (int(v) for v in row['setting'].split('/p'))
    tokens = math.ceil(res / patch) ** 2 + 1
    analytic = lib.analytic_trunk_macs(row['arch'], patch, res, res) / 1e9
    cls = _cls_part_macs(dims, tokens) / 1e9
    assert row['analytic_trunk_gmacs'] == pytest.approx(analytic, rel=1e-12)
    assert row['cls_part_gmacs'] == pytest.approx(cls, rel=1e-12)
    # mmpretrain's full classifier, counted in one go, is the formula (trunk + class attention)
    assert row['port_classifier_gmacs'] == pytest.approx(analytic + cls, rel=1e-12)
    assert row['trunk_gmacs'] == pytest.approx(analytic, rel=0.05)
    assert row['classifier_gmacs'] == pytest.approx(row['trunk_gmacs'] + cls, rel=1e-12)
    paper = paper_table[row['arch']]
    assert row['paper_gmacs'] == paper[f'gmacs_{res}_p{patch}']
    assert row['paper_params_m'] == paper['params_m']
    assert row['rel_diff'] == pytest.approx(row['classifier_gmacs'] / row['paper_gmacs'] - 1,
                                            rel=1e-9, abs=1e-12)
    assert row['ok'] is (abs(row['rel_diff']) <= tolerance)
    # the port's classifier has the paper's parameter count
    assert row['classifier_params_m'] == pytest.approx(paper['params_m'], rel=0.005)
    assert 0 < row['backbone_params_m'] < row['classifier_params_m']


def test_flops_of_models_alone(bench, tmp_path, capsys, monkeypatch):
    """``--no-time --no-mem``: FLOPs and parameters of any models at any sizes, nothing run."""
    monkeypatch.setattr(lib_timing, 'MATMUL_SIZE', 64)  # the reference rate: not checked here
    assert bench.main(['--models', 'xcit_n12_p16_trunk', 'resnet50', '--resolutions', '224',
                       '--no-time', '--no-mem', '--quiet', '--out-dir', str(tmp_path),
                       '--name', 'flops', '--no-plot']) == 0
    assert 'wrote ' in capsys.readouterr().out
    with open(tmp_path / 'flops.csv') as f:
        rows = {r['model']: r for r in csv.DictReader(f)}
    assert float(rows['xcit_n12_p16_trunk']['gmacs']) * 1e9 == pytest.approx(
        lib.analytic_trunk_macs('n12', 16, 224, 224), rel=0.05)
    # ResNet-50: 4.09 GMACs at 224 px with its classifier (published); this is the backbone
    assert float(rows['resnet50']['gmacs']) == pytest.approx(4.09, rel=0.02)
    assert float(rows['resnet50']['params_m']) == pytest.approx(23.5, rel=0.01)


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
    out = lib.variants(specs, 'both', pairs, '+cp')
    assert [s.name for s in out] == ['xcit_s12_p16', 'xcit_s12_p16+cp', 'mmpretrain_xcit_s12_p8']
    assert pairs == [('xcit_s12_p16+cp', 'xcit_s12_p16')]
    specs, pairs = lib.compare_pairs([lib.parse_model('xcit_s12_p8'), lib.parse_model('swin_t')])
    assert [s.name for s in specs] == ['xcit_s12_p8_trunk', 'mmpretrain_xcit_s12_p8']
    assert pairs == [('xcit_s12_p8_trunk', 'mmpretrain_xcit_s12_p8')]


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def test_time_interleaved_rotates_the_order():
    calls = []
    steps = {name: (lambda n=name: calls.append(n)) for name in 'abc'}
    times = time_interleaved(steps, warmup=1, repeats=3, device='cpu')
    assert calls == list('abc') + list('abc') + list('bca') + list('cab')
    assert {k: len(v) for k, v in times.items()} == {'a': 3, 'b': 3, 'c': 3}


def test_time_interleaved_times_each_step_exactly(monkeypatch):
    """With a virtual clock that only the steps advance, every time is the step's own duration,
    in round order, whatever the rotation; the warm-up calls are not timed; the garbage
    collector is off while timing and on again after."""
    clock = FakeClock()
    monkeypatch.setattr(lib_timing, 'time', clock)
    calls = {'a': 0, 'b': 0}
    gc_states = []

    def step(name, base):
        def run():
            calls[name] += 1
            gc_states.append(gc.isenabled())
            clock.advance(base * calls[name])  # the k-th call lasts k * base
        return run

    times = time_interleaved({'a': step('a', 0.001), 'b': step('b', 0.1)}, warmup=2, repeats=3,
                             device='cpu')
    assert times['a'] == pytest.approx([0.003, 0.004, 0.005], rel=1e-9)
    assert times['b'] == pytest.approx([0.3, 0.4, 0.5], rel=1e-9)
    assert gc_states[4:] == [False] * 6 and gc.isenabled()


def test_matmul_rate_counts_every_product_it_times(monkeypatch):
    """The reference rate: each timed 1024x1024 product (here 10 ms of a virtual clock) counts
    2 * 1024^3 FLOPs, no more and no fewer than the step runs."""
    clock = FakeClock()
    monkeypatch.setattr(lib_timing, 'time', clock)

    def mm(a, b):
        assert a.shape == b.shape == (1024, 1024)
        clock.advance(0.01)
        return a

    monkeypatch.setattr(torch, 'mm', mm)
    assert lib.measure_matmul_gflops('cpu', repeats=3) == pytest.approx(
        2 * 1024 ** 3 / 0.01 / 1e9, rel=1e-9)


def test_time_interleaved_measures_the_wall_time_of_a_known_sleep():
    """Real clock: a step that sleeps 30 ms is never timed shorter, and not absurdly longer."""
    times = time_interleaved({'sleep': lambda: time.sleep(0.03), 'noop': lambda: None},
                             warmup=0, repeats=3, device='cpu')
    assert len(times['sleep']) == len(times['noop']) == 3
    assert all(0.03 <= t < 2.0 for t in times['sleep']), times
    assert all(t >= 0 for t in times['noop']), times


@pytest.fixture(scope='module')
def known_run():
    """run_points on KnownConv with the virtual clock, batch 2: inference at 32 and 64 px, then
    a train step at 32 px.  Per resolution 1 warm-up + 4 timed calls lasting 9, 1, 3, 2, 5 us
    per pixel of the batch; the reference matmul steps of each run last 0.2 s (before the
    run), 0.1 s (in the rounds of each resolution) and 0.4 s (after)."""
    clock = FakeClock()
    model = KnownConv(clock, factors=(9., 1., 3., 2., 5.))
    mm_seconds, made = [], []

    def make_matmul_step(device):
        seconds = mm_seconds[len(made)]
        made.append(seconds)
        return lambda: clock.advance(seconds)

    spec = lib.ModelSpec(name='known_conv', family='resnet50')
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lib_timing, 'time', clock)
        for module in (lib_flops, lib_runner):
            mp.setattr(module, 'build_model', lambda spec, device='cpu': (model, model))
        mp.setattr(lib_timing, 'make_matmul_step', make_matmul_step)
        for mode, resolutions in (('inference', (32, 64)), ('train', (32,))):
            mm_seconds += [0.2] + [0.1] * len(resolutions) + [0.4]
            opts = lib.RunOptions(batch=2, mode=mode, warmup=1, repeats=4, do_mem=False)
            runs[mode] = lib.run_points([(spec, r) for r in resolutions], opts,
                                        log=lambda msg: None)
    assert made == mm_seconds
    return runs


def test_compiled_point_times_its_first_call_apart(monkeypatch):
    """A ``+compile`` point: the first call at its size (the compilation) is its ``compile_s``,
    not one of its timed calls (virtual clock: 7, then 1 us per pixel)."""
    clock = FakeClock()
    model = KnownConv(clock, factors=(7., 1., 1.))
    monkeypatch.setattr(lib_timing, 'time', clock)
    monkeypatch.setattr(lib_timing, 'make_matmul_step', lambda device: lambda: clock.advance(0.1))
    for module in (lib_flops, lib_runner):
        monkeypatch.setattr(module, 'build_model', lambda spec, device='cpu': (model, model))
    compiled = []
    monkeypatch.setattr(torch, 'compile', lambda fn, dynamic: compiled.append(dynamic) or fn)
    spec = lib.ModelSpec(name='known_conv+compile', family='resnet50', compiled=True)
    opts = lib.RunOptions(warmup=0, repeats=2, do_mem=False)
    (rec,), _ = lib.run_points([(spec, 32)], opts, log=lambda msg: None)
    assert compiled == [False]  # one static graph
    assert rec['compile_s'] == pytest.approx(7 * 32 * 32 * 1e-6, rel=1e-9)
    assert rec['times_s'] == pytest.approx([32 * 32 * 1e-6] * 2, rel=1e-9)


def test_run_points_figures_of_a_known_workload(known_run, tmp_path):
    """Every figure of a record from known step times and FLOPs (batch 2): the per-image median
    and quartiles of the timed calls (warm-up left out), images/s, the FLOPs of the formula,
    the achieved rate and the reference matmul rates before, during and after the run."""
    records, meta = known_run['inference']
    train, _ = known_run['train']
    assert [(r['model'], r['resolution'], r['mode'], r['status']) for r in records + train] == \
        [('known_conv', 32, 'inference', 'ok'), ('known_conv', 64, 'inference', 'ok'),
         ('known_conv', 32, 'train', 'ok')]
    for r in records + train:
        px = r['resolution'] ** 2
        flop_per_mac = 2 if r['mode'] == 'inference' else 4  # train: + the weight gradient
        assert r['times_s'] == pytest.approx([f * 2 * px * 1e-6 for f in (1, 3, 2, 5)],
                                             rel=1e-9)
        # per image: 1, 3, 2, 5 us per pixel -> median 2.5, quartiles 1.25 and 4.5
        assert r['ms_per_img'] == pytest.approx(2.5e-3 * px, rel=1e-9)
        assert (r['ms_p25'], r['ms_p75']) == pytest.approx((1.25e-3 * px, 4.5e-3 * px),
                                                           rel=1e-9)
        assert r['imgs_per_s'] == pytest.approx(1e3 / (2.5e-3 * px), rel=1e-9)
        assert r['gmacs'] * 1e9 == _known_macs(r['resolution'])
        assert r['gflop_exec'] * 1e9 == flop_per_mac * _known_macs(r['resolution'])
        # 2 (4) * 3 * 16 FLOPs per pixel in 2.5 us per pixel, whatever the size
        assert r['achieved_gflop_s'] == pytest.approx(
            flop_per_mac * 3 * KNOWN_CHANNELS / 2.5e-6 / 1e9, rel=1e-9)
        assert r['matmul_gflop_s'] == pytest.approx(_mm_gflops(0.1), rel=1e-9)
        assert (r['batch'], r['repeats'], r['warmup']) == (2, 4, 1)
        assert r['threads'] == torch.get_num_threads()
        assert 'peak_mem_mb' not in r  # do_mem=False
    # bigger input, proportionally more FLOPs and time
    small, big = records
    assert big['gmacs'] == 4 * small['gmacs']
    assert big['ms_per_img'] == pytest.approx(4 * small['ms_per_img'], rel=1e-9)
    assert meta['matmul_gflop_s_before'] == pytest.approx(_mm_gflops(0.2), rel=1e-9)
    assert meta['matmul_gflop_s_after'] == pytest.approx(_mm_gflops(0.4), rel=1e-9)
    assert meta['options']['repeats'] == 4 and meta['torch'] == torch.__version__

    # the files of the run: the CSV row holds the record's fields, the JSON the records
    paths = lib.write_outputs(records, meta, str(tmp_path), 'known', plot=False)
    assert [os.path.basename(p) for p in paths] == ['known.csv', 'known.json']
    with open(tmp_path / 'known.csv') as f:
        rows = list(csv.DictReader(f))
    with open(tmp_path / 'known.json') as f:
        data = json.load(f)
    assert data['records'] == json.loads(json.dumps(records))
    _check_csv_matches_records(rows, data['records'])
    assert data['meta']['matmul_gflop_s_before'] == meta['matmul_gflop_s_before']


def test_matmul_frac_is_relative_to_the_in_round_matmul_rate(known_run):
    """``matmul_frac`` = achieved rate / the rate of the matmul step timed in the same rounds
    (``matmul_gflop_s`` of the same record): for the known inference 0.0384 / 85.9 GFLOP/s."""
    for r in known_run['inference'][0] + known_run['train'][0]:
        assert r['matmul_frac'] == pytest.approx(r['achieved_gflop_s'] / _mm_gflops(0.1),
                                                 rel=1e-9)


def _check_csv_matches_records(rows, records, committed=False):
    """The CSV of a backbone run: the CSV_FIELDS columns (a committed file may predate the last
    ones), a row per record, every value the record's (floats rounded to 4 decimals)."""
    assert len(rows) == len(records)
    for row, rec in zip(rows, records):
        if committed:
            assert list(row) == lib.CSV_FIELDS[:len(row)]
        else:
            assert list(row) == lib.CSV_FIELDS
        for key in row:
            value = rec.get(key)
            if value is None:
                assert row[key] == '', key
            elif isinstance(value, float):
                assert float(row[key]) == pytest.approx(round(value, 4), rel=1e-12,
                                                        abs=1e-12), key
            else:
                assert row[key] == str(value), key


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------
FRESH_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from xcit_benchmark import fresh_points, runner


class KnownAllocation(torch.nn.Module):
    # allocates (and writes) a float32 (B, 256, H, W) tensor: 256 * H * W * 4 bytes per image
    def forward(self, img):
        b, _, h, w = img.shape
        return [torch.ones(b, 256, h, w)]


def build(spec, device='cpu'):
    torch.ones(96 * 2 ** 20 // 4).sum()  # a transient peak before the measurement
    model = KnownAllocation()
    return model, model


real_build, runner.build_model = runner.build_model, build
worker = [runner.memory_worker(dict(
    model='resnet50', resolution=res, batch=1, mode='inference', precision='fp32',
    device='cpu', threads=1, mem_iters=2)) for res in (128, 256)]
runner.build_model = real_build  # check_same_trunk builds the real port
clock = fresh_points.PartMeter()
clock.start()
clock.mark('trunk')
x = torch.ones(48 * 2 ** 20 // 4)
del x
clock.mark('neck')
y = torch.ones(16 * 2 ** 20 // 4)
clock.mark('heads')
del y
parts = clock.sequence(('trunk', 'adapter', 'neck', 'heads'))
from xcit_benchmark import flops, models, spec
table = spec.load_spec()['flops_report']
# a train count counts the forward first: N12/16's forward MACs come with it
train = flops.point_flops(models.parse_model('mmpretrain_xcit_n12_p16'), 64, 'train')
port = dict(n12_p16=train['gmacs'], t12_p8=flops.point_flops(
    models.parse_model('mmpretrain_xcit_t12_p8'), 96, 'inference')['gmacs'])
print(json.dumps(dict(
    worker=worker, part_clock={k: p for k, (_, p) in parts.items()}, port=port,
    train_over_forward=train['gflop_exec'] / (2 * train['gmacs']),
    n12_rows=flops.flops_report(table['paper_table1'], table['tolerance'], archs=['n12']),
    same_trunk=runner.check_same_trunk('n12', 16))))
"""


@pytest.fixture(scope='module', autouse=True)
def _fresh_run(tmp_path_factory):
    """``FRESH_SCRIPT`` in a fresh single-threaded process with the memory process's malloc
    setting (as ``run_memory_worker`` starts it), started with the module. Fresh: in a long-lived
    pytest process the RSS also depends on what earlier tests freed (peaks of 0 were seen), and
    mmpretrain's port is loaded by the tools' loader, whose placeholder packages must not enter
    this process."""
    return background_once(
        tmp_path_factory, 'benchmark_fresh',
        lambda folder: [sys.executable, '-c', FRESH_SCRIPT, os.path.join(ROOT, 'benchmarks')],
        timeout=300, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536', OMP_NUM_THREADS='1'))


@pytest.fixture(scope='module')
def fresh_run(_fresh_run):
    """What ``FRESH_SCRIPT`` printed."""
    status, folder = _fresh_run()
    assert status == 0, (folder / 'stderr.txt').read_text()[-2000:]
    return json.loads((folder / 'stdout.txt').read_text().strip().splitlines()[-1])


def test_memory_worker_guard_kills_over_the_limit_and_after_the_timeout():
    """The parent kills a worker above the RSS limit (reported as 'oom', never reaching the
    kernel's OOM killer) or past its time limit ('timeout')."""
    cfg = dict(model='xcit_n12_p16', resolution=64, batch=1, mode='inference', precision='fp32',
               device='cpu', threads=1, mem_iters=1)
    out = lib.run_memory_worker(cfg, limit_bytes=1, timeout_s=600)
    assert out['status'] == 'oom' and '--mem-limit-gb' in out['note'], out
    out = lib.run_memory_worker(cfg, limit_bytes=2 ** 40, timeout_s=0)
    assert out['status'] == 'timeout' and '--mem-limit-gb' not in out['note'], out


# ---------------------------------------------------------------------------------------------
# ratios and goals (given records, hand-computed values)
# ---------------------------------------------------------------------------------------------
def _rec(model, res, ms=None, times=None, peak=None, mode='inference'):
    rec = dict(model=model, resolution=res, mode=mode)
    if ms is not None:
        rec['ms_per_img'] = ms
    if times is not None:
        rec['times_s'] = times
    if peak is not None:
        rec['peak_mem_mb'] = peak
    return rec


def test_ratio_rows_are_ratios_of_medians_and_medians_of_paired_ratios():
    # per round: 1/2, 4/3, 9/18 -> paired median 0.5; medians 4 s / 3 s -> 1.33
    records = [_rec('a', 224, ms=4000., times=[1., 4., 9.], peak=10.),
               _rec('b', 224, ms=3000., times=[2., 3., 18.], peak=40.),
               _rec('a', 384, ms=10., times=[0.01, 0.01]),
               _rec('b', 384, ms=20., times=[0.02, 0.02, 0.02]),
               _rec('a', 512, ms=1., peak=1.)]
    rows = lib.ratio_rows(records, [('a', 'b')])
    assert [r['resolution'] for r in rows] == [224, 384]  # no b at 512
    row = rows[0]
    assert row['time_ratio'] == pytest.approx(4 / 3)
    assert row['paired_time_ratio'] == pytest.approx(0.5)
    assert row['mem_ratio'] == pytest.approx(0.25)
    assert (row['a_ms'], row['b_ms'], row['a_mb'], row['b_mb']) == (4000., 3000., 10., 40.)
    # rounds of different lengths cannot be paired; no memory figures, no memory ratio
    assert rows[1]['time_ratio'] == 0.5 and rows[1]['paired_time_ratio'] is None
    assert 'mem_ratio' not in rows[1]
    text = lib.format_ratios(rows).splitlines()
    assert text[2].split()[-7:] == ['4000.0', '3000.0', '1.333', '0.500', '10.0', '40.0', '0.250']


def test_goal_values_and_verdicts_from_given_records():
    """ratio = a / b, saving = 1 - a / b; the verdict compares with the threshold; a point that
    was not measured gives no value and no verdict; the time goal quotes the paired ratio."""
    records = [_rec('m', 512, peak=30.), _rec('m', 1024, peak=90.),
               _rec('t', 384, ms=80., times=[0.08, 0.09, 0.07]),
               _rec('p', 384, ms=100., times=[0.1, 0.1, 0.1]),
               _rec('cp', 1024, peak=60., mode='train'), _rec('m', 1024, peak=100., mode='train')]

    def check(metric, mode, value, a, b, op, threshold, **kw):
        return dict(goal=f'{a}/{b}', metric=metric, mode=mode, value=value, a=list(a),
                    b=list(b), op=op, threshold=threshold, **kw)

    checks = [check('peak_mem_mb', 'inference', 'ratio', ('m', 1024), ('m', 512), '<=', 3.5),
              check('peak_mem_mb', 'inference', 'ratio', ('m', 1024), ('m', 512), '<=', 2.5),
              check('ms_per_img', 'inference', 'ratio', ('t', 384), ('p', 384), '<=', 0.9),
              check('peak_mem_mb', 'train', 'saving', ('cp', 1024), ('m', 1024), '>=', 0.45,
                    detail='{a} MB with_cp vs {b} MB without'),
              check('peak_mem_mb', 'inference', 'ratio', ('m', 2048), ('m', 512), '<=', 9.),
              # a value equal to its threshold meets it, either way
              check('peak_mem_mb', 'inference', 'ratio', ('m', 1024), ('m', 512), '<=', 3.),
              check('peak_mem_mb', 'train', 'saving', ('cp', 1024), ('m', 1024), '>=', 0.4)]
    goals = lib.evaluate_goals(records, checks, repeats=3)
    assert [g['value'] for g in goals] == pytest.approx([3.0, 3.0, 0.8, 0.4, None, 3.0, 0.4])
    assert [g['ok'] for g in goals] == [True, False, True, False, None, True, True]
    assert [g['target'] for g in goals] == ['<= 3.5', '<= 2.5', '<= 0.9', '>= 45%', '<= 9.0',
                                            '<= 3.0', '>= 40%']
    assert goals[0]['detail'] == '90.0 MB / 30.0 MB'
    # per round 0.8, 0.9, 0.7: paired median 0.8
    assert goals[2]['detail'] == \
        '80.0 ms / 100.0 ms, paired median ratio 0.800, 3 interleaved repeats'
    assert goals[3]['detail'] == '60.0 MB with_cp vs 100.0 MB without'
    assert goals[4]['detail'] == '- MB / 30.0 MB'


def test_run_goals_measures_the_spec_runs(monkeypatch):
    """--goals runs the spec's runs in order, with its batch / precision / mode and timing only
    where asked, and evaluates every check on the records measured (given figures here)."""
    spec = lib.load_spec()['goals']
    calls = []

    def figures(name, res, mode):  # a known, distinct figure per point
        return (len(name) + res / 64 + (mode == 'train')), (res / 100 + len(name) / 10)

    def fake_run_points(points, opts, log=None):
        calls.append(([(s.name, r) for s, r in points], opts))
        records = []
        for s, r in points:
            peak, ms = figures(s.name, r, opts.mode)
            rec = _rec(s.name, r, peak=peak, mode=opts.mode)
            if opts.do_time:
                rec.update(ms_per_img=ms, times_s=[ms / 1e3] * opts.repeats)
            records.append(rec)
        return records, dict(run=len(calls))

    monkeypatch.setattr(lib_spec, 'run_points', fake_run_points)
    logs = []
    opts = lib.RunOptions(batch=4, precision='amp', mode='train', warmup=2, repeats=10)
    goals, records, meta = lib.run_goals(opts, spec, log=logs.append)
    assert logs == [run['label'] for run in spec['runs']]
    assert [points for points, _ in calls] == \
        [[tuple(p) for p in run['points']] for run in spec['runs']]
    for (_, o), run in zip(calls, spec['runs']):
        assert (o.batch, o.precision, o.mode, o.do_time, o.warmup, o.repeats) == \
            (1, 'fp32', run['mode'], run['time'], 2, 10)
    assert meta == dict(run=1)
    assert len(records) == sum(len(run['points']) for run in spec['runs'])
    assert len(goals) == len(spec['checks'])
    for goal, check in zip(goals, spec['checks']):
        index = 0 if check['metric'] == 'peak_mem_mb' else 1
        a = figures(*check['a'], check['mode'])[index]
        b = figures(*check['b'], check['mode'])[index]
        want = a / b if check['value'] == 'ratio' else 1 - a / b
        assert goal['value'] == pytest.approx(want), goal
        assert goal['ok'] is (want <= check['threshold'] if check['op'] == '<='
                              else want >= check['threshold'])


# ---------------------------------------------------------------------------------------------
# the spec
# ---------------------------------------------------------------------------------------------
def test_spec_drives_the_defaults(bench):
    spec = lib.load_spec()
    args = bench.parse_args([])
    assert args.models == spec['default_models'] and args.resolutions == \
        spec['default_resolutions']


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
    with pytest.raises(SpecError, match='x.json: the top level must be an object'):
        validate_spec(['default_models'], 'x.json')


# ---------------------------------------------------------------------------------------------
# the committed results: well-formed (never the expected values of a measurement)
# ---------------------------------------------------------------------------------------------
def _check_backbone_records(records):
    """The figures of timed records follow from their own per-round times."""
    for r in records:
        if 'times_s' not in r:
            continue
        per_img = [t / r['batch'] for t in r['times_s']]
        assert len(per_img) == r['repeats']
        assert r['ms_per_img'] == pytest.approx(statistics.median(per_img) * 1e3, rel=1e-9)
        q = statistics.quantiles(per_img, n=4) if len(per_img) > 1 else per_img * 3
        assert (r['ms_p25'], r['ms_p75']) == pytest.approx((q[0] * 1e3, q[2] * 1e3), rel=1e-9)
        assert r['ms_p25'] <= r['ms_per_img'] <= r['ms_p75']
        assert r['imgs_per_s'] == pytest.approx(1e3 / r['ms_per_img'], rel=1e-9)
        if 'gflop_exec' in r:
            assert r['achieved_gflop_s'] == pytest.approx(
                r['gflop_exec'] / (r['ms_per_img'] / 1e3), rel=1e-9)


def _check_backbone_ratios(rows, records):
    index = {(r['model'], r['resolution']): r for r in records}
    for row in rows:
        a, b = index[(row['a'], row['resolution'])], index[(row['b'], row['resolution'])]
        assert row['time_ratio'] == pytest.approx(a['ms_per_img'] / b['ms_per_img'], rel=1e-9)
        assert row['paired_time_ratio'] == pytest.approx(statistics.median(
            x / y for x, y in zip(a['times_s'], b['times_s'])), rel=1e-9)
        if a.get('peak_mem_mb') and b.get('peak_mem_mb'):
            assert row['mem_ratio'] == pytest.approx(a['peak_mem_mb'] / b['peak_mem_mb'])


def _check_whole_model(data, rows):
    """Headline figures = medians over the ok rounds; ratios = median / min / max of the
    per-round ratios over the rounds both configs have; the CSV row per record."""
    med = statistics.median
    for r in data['records']:
        ok = [p for p in r['per_round'] if p['status'] == 'ok']
        assert r['rounds_ok'] == len(ok) and r['round_times_ms'] == [p['time_ms'] for p in ok]
        assert r['round_peaks_mb'] == [p['peak_mem_mb'] for p in ok]
        assert r['time_ms'] == pytest.approx(med(r['round_times_ms']), rel=1e-9)
        assert r['peak_mem_mb'] == pytest.approx(med(r['round_peaks_mb']), rel=1e-9)
        for part, fig in r['parts'].items():
            assert fig['time_ms'] == pytest.approx(med(p['parts'][part]['time_ms'] for p in ok),
                                                   rel=1e-9, abs=1e-12)
        # the parts of a step add up to the step (medians of medians: approximately)
        total = sum(fig['time_ms'] for fig in r['parts'].values())
        assert total == pytest.approx(r['time_ms'], rel=0.1)
    subject, *baselines = data['records']
    assert len(data['meta']['ratios']) == len(baselines)
    for row, base in zip(data['meta']['ratios'], baselines):
        a = {p['round']: p for p in subject['per_round'] if p['status'] == 'ok'}
        b = {p['round']: p for p in base['per_round'] if p['status'] == 'ok'}
        common = sorted(set(a) & set(b))
        assert (row['subject'], row['baseline'], row['rounds']) == \
            (subject['model'], base['model'], len(common))
        for key, fig in (('time', 'time_ms'), ('peak', 'peak_mem_mb')):
            ratios = [a[k][fig] / b[k][fig] for k in common]
            assert row[f'{key}_ratios'] == pytest.approx(ratios, rel=1e-9)
            assert (row[f'{key}_ratio'], row[f'{key}_ratio_min'], row[f'{key}_ratio_max']) == \
                pytest.approx((med(ratios), min(ratios), max(ratios)), rel=1e-9)
    assert [row['model'] for row in rows] == [r['model'] for r in data['records']]
    for row, r in zip(rows, data['records']):
        assert float(row['time_ms']) == pytest.approx(r['time_ms'], rel=1e-9)
        assert float(row['time_ms_min']) == pytest.approx(min(r['round_times_ms']), rel=1e-9)
        assert float(row['time_ms_max']) == pytest.approx(max(r['round_times_ms']), rel=1e-9)
        for part, fig in r['parts'].items():
            assert float(row[f'{part}_ms']) == pytest.approx(fig['time_ms'], rel=1e-9,
                                                             abs=1e-12)


RESULT_FILES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ARTIFACTS, '*.json'))
                      if os.path.basename(p) not in ('goals_spec.json', 'flops.json',
                                                     'roi_align_cpu.json'))


@pytest.mark.parametrize('name', RESULT_FILES)
def test_committed_results_are_self_consistent(name):
    """Every committed benchmark result: its figures follow from its own rounds (medians,
    quartiles, rates, ratios), its CSV holds its JSON records, a goals file's verdicts are those
    of its records under the current spec."""
    data = _artifact(name)
    with open(os.path.join(ARTIFACTS, name[:-5] + '.csv')) as f:
        rows = list(csv.DictReader(f))
    if 'whole_model' in data['meta']:
        _check_whole_model(data, rows)
        return
    _check_backbone_records(data['records'])
    _check_backbone_ratios(data['meta'].get('ratios') or [], data['records'])
    _check_csv_matches_records(rows, data['records'], committed=True)
    if 'goals' in data['meta']:
        spec = lib.load_spec()['goals']
        assert lib.evaluate_goals(data['records'], spec['checks'],
                                  data['meta']['options']['repeats']) == data['meta']['goals']
        points = [(n, r, run['mode']) for run in spec['runs'] for n, r in run['points']]
        assert sorted(points) == sorted((r['model'], r['resolution'], r['mode'])
                                        for r in data['records'])


def test_result_files_are_all_checked():
    assert {'goals.json', 'cpu_inference_fp32.json', 'wholemodel_semfpn_train.json'} <= \
        set(RESULT_FILES)


@pytest.mark.parametrize('name', [
    'goals.json', 'cpu_inference_fp32.json', 'flops.json', 'wholemodel_maskrcnn_train.json',
    'wholemodel_maskrcnn_inference.json', 'wholemodel_semfpn_train.json',
    'wholemodel_maskrcnn_train_before_lean.json', 'wholemodel_shapes_maskrcnn_train.json',
    'wholemodel_shapes_semfpn_train.json'])
def test_docs_tables_quote_the_committed_artifacts(bench, capsys, name):
    """Every table row the docs page of a result shows is rendered from its JSON."""
    assert bench.main(['--markdown', os.path.join(ARTIFACTS, name)]) == 0
    rendered = capsys.readouterr().out.strip()
    page = ('flops.md' if name == 'flops.json' else
            'benchmark_shapes.md' if name.startswith('wholemodel_shapes_') else
            'benchmark_whole_model.md' if name.startswith('wholemodel_') else 'benchmark.md')
    with open(os.path.join(ROOT, 'docs', page)) as f:
        doc = f.read()
    missing = [line for line in rendered.splitlines() if line and line not in doc]
    assert not missing, f'docs/{page} does not quote {name}: {missing}'


def test_markdown_tables_of_given_records():
    records = [dict(model='a', resolution=224, ms_per_img=12.4, peak_mem_mb=99.6, gmacs=4.56,
                    achieved_gflop_s=50.2, matmul_frac=0.424),
               dict(model='a', resolution=384, peak_mem_mb=300.),
               dict(model='b', resolution=384, ms_per_img=7.)]
    text = lib.markdown_result(dict(meta={}, records=records))
    assert text.split('\n\n') == [
        '| ms / image | 224² | 384² |\n|---|---:|---:|\n| `a` | 12 | - |\n| `b` | - | 7 |',
        '| peak MB | 224² | 384² |\n|---|---:|---:|\n| `a` | 100 | 300 |\n| `b` | - | - |',
        '| GMACs | 224² | 384² |\n|---|---:|---:|\n| `a` | 4.6 | - |\n| `b` | - | - |',
        '| GFLOP/s (% of mm) | 224² | 384² |\n|---|---:|---:|\n| `a` | 50 (42%) | - |\n'
        '| `b` | - | - |']


# ---------------------------------------------------------------------------------------------
# the one end-to-end run (fresh processes)
# ---------------------------------------------------------------------------------------------
E2E_SCRIPT = r'''
import importlib.util, json, os, runpy, sys
tool, argv = sys.argv[1], sys.argv[2:]
import xcit_mm
report = dict(bench_modules=sorted(m for m in sys.modules if m.startswith('xcit_benchmark')))
sys.path.insert(0, os.path.dirname(tool))  # what `python tool ...` puts first
import xcit_benchmark.timing
# the reference matmul step of 4 products of 256x256 matrices instead of 1024x1024 (its rate,
# only checked to be positive here, then takes 1/64 of the ~3 s of CPU of the 22 steps)
xcit_benchmark.timing.MATMUL_SIZE = 256
sys.argv = [tool] + argv
try:
    runpy.run_path(tool, run_name='__main__')
except SystemExit as e:
    report['exit'] = e.code
models = sys.modules.get('mmpretrain.models')
report.update(
    placeholder=getattr(models, '__xcit_benchmark_placeholder__', False),
    torchvision_installed=importlib.util.find_spec('torchvision') is not None,
    torchvision_imported='torchvision' in sys.modules)
print('@@' + json.dumps(report))
'''


@pytest.fixture(scope='module', autouse=True)
def end_to_end_run(tmp_path_factory):
    """The end-to-end process, started with the module (once per session); its test (the last
    one) waits for it and reads its files."""
    argv = ['--models', 'mmpretrain_xcit_n12_p16', '--resolutions', '64', '--repeats', '3',
            '--warmup', '0', '--device', 'cpu', '--threads', '1', '--name', 'tiny', '--quiet']
    return background_once(
        tmp_path_factory, 'benchmark_e2e',
        lambda folder: [sys.executable, '-c', E2E_SCRIPT, TOOL, *argv, '--out-dir', str(folder)],
        timeout=600, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS='1'))


# ---------------------------------------------------------------------------------------------
# --whole-model: the part clock, one tiny config in this process, the rounds with fake workers
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def mmap_every_tensor():
    """The whole-model worker's memory-pass malloc setting (every block of 64 KiB or more mapped
    and unmapped) in this pytest process for one test: with glibc's dynamic threshold a tensor
    can reuse resident pages that earlier tests freed, and the RSS does not grow."""
    assert lib_fresh.mallopt_mmap_threshold(65536)
    yield
    lib_fresh.mallopt_mmap_threshold(32 * MIB)  # the ceiling of glibc's dynamic threshold


TINY_WHOLE_CFG = """\
_base_ = [{base!r}]
model = dict(
    backbone=dict(_delete_=True, type='XCiTBackbone',
                  arch=dict(embed_dims=32, depth=2, num_heads=2), patch_size=16,
                  out_indices=(0, 1, 1, 1)),
    neck=dict(in_channels=[32] * 4, out_channels=32),
    decode_head=dict(in_channels=[32] * 4, channels=32, num_classes=5))
"""


def test_fresh_child_prints_the_targets_rows_and_an_exception_as_a_last_row(capsys):
    """A fresh process's protocol: a target's dict is one row, an iterable a row each; an
    exception is an 'error' row naming it, exit status 1."""
    def rows():
        return [json.loads(x[len(lib_fresh.ROW):]) for x in capsys.readouterr().out.splitlines()]

    assert lib_fresh.child_main(['builtins:dict', '{"status": "ok"}']) == 0
    assert rows() == [{'status': 'ok'}]
    assert lib_fresh.child_main(['builtins:list', '[{"a": 1}, {"b": 2}]']) == 0
    assert rows() == [{'a': 1}, {'b': 2}]
    assert lib_fresh.child_main(['json:loads', '"{"']) == 1
    ((row,),) = [rows()]
    assert row['status'] == 'error' and row['note'].startswith('JSONDecodeError'), row


def test_fresh_process_environment(monkeypatch):
    """run_fresh's child: benchmarks/ importable; 'live' malloc (64 KiB mmap threshold) or
    glibc's defaults even where the parent has the setting; the thread count in OpenMP's."""
    seen = []
    monkeypatch.setattr(lib_fresh, 'run_process', lambda cmd, *a, env, **k: seen.append(env))
    monkeypatch.setenv('MALLOC_MMAP_THRESHOLD_', '1')
    lib_fresh.run_fresh('builtins:dict', {}, 1, 1, live=True, threads=3)
    lib_fresh.run_fresh('builtins:dict', {}, 1, 1, live=False)
    assert seen[0]['MALLOC_MMAP_THRESHOLD_'] == '65536' and seen[0]['OMP_NUM_THREADS'] == '3'
    assert 'MALLOC_MMAP_THRESHOLD_' not in seen[1]
    assert os.path.join(ROOT, 'benchmarks') in seen[1]['PYTHONPATH'].split(os.pathsep)


@pytest.mark.usefixtures('mmap_every_tensor')
def test_whole_model_worker_parts(tmp_path, capsys):
    """issue 14.1: one --whole-model measurement of a tiny XCiT Sem-FPN train step at 64x64, by
    the whole-model worker entry point (here in this process, its memory pass under the worker's
    'live' malloc setting, which the fixture undoes afterwards): every part has a positive time,
    the parts add up to the step, the step's peak is the highest part peak."""
    cfg = tmp_path / 'tiny_sem_fpn.py'
    cfg.write_text(TINY_WHOLE_CFG.format(
        base=os.path.join(ROOT, 'configs', 'sem_fpn_xcit_t12_p16_80k_ade20k.py')))
    capsys.readouterr()
    assert lib_fresh.child_main(['xcit_benchmark.whole_model:worker_main', json.dumps(dict(
        kind='whole_model', config=str(cfg), mode='train', height=64, width=64, batch=1,
        repeats=1, threads=None, mem_pass='live', work=None))]) == 0  # what run_fresh runs
    (line,) = [x for x in capsys.readouterr().out.splitlines()
               if x.startswith(lib_fresh.ROW)]
    rec = json.loads(line[len(lib_fresh.ROW):])
    assert rec['status'] == 'ok' and rec['is_xcit'] and rec['task'] == 'seg', rec
    assert rec['backbone'] == 'XCiTBackbone'
    parts = rec['parts']
    assert list(parts) == ['trunk', 'adapter', 'neck', 'heads', 'backward', 'optimizer']
    assert all(p['time_ms'] > 0 for p in parts.values()), parts
    total = sum(p['time_ms'] for p in parts.values())
    assert rec['time_ms'] > 0 and abs(total - rec['time_ms']) <= 0.05 * rec['time_ms']
    assert rec['times_ms'] == pytest.approx([rec['time_ms']])
    assert rec['peak_mem_mb'] >= max(p['peak_mb'] for p in parts.values()) - 1e-6
    assert rec['peak_mem_mb'] > 0
    # one step, started at the RSS of the memory pass's base: its peak is its highest part's
    assert rec['peak_mem_mb'] == pytest.approx(max(p['peak_mb'] for p in parts.values()), abs=2)
    assert rec['mem_base_mb'] > 100  # the process's RSS, torch and the model in it


def test_whole_model_bad_config_is_a_usage_error(bench, tmp_path, capsys, monkeypatch):
    """issue 14.1: a missing config is a clear argparse error (exit 2), before any worker; a
    repository config is found from any working directory."""
    monkeypatch.chdir(tmp_path)
    relative = 'configs/sem_fpn_xcit_s12_p16_80k_ade20k.py'
    assert bench.parse_args(['--whole-model', relative, '--shape', '64', '64']).whole_model
    assert lib_whole.check_config_path(relative) == os.path.join(ROOT, relative)
    missing = str(tmp_path / 'nope.py')
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(['--whole-model', missing, '--shape', '64', '64'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert 'config not found' in err and 'nope.py' in err
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(['--whole-model', missing])
    assert exc.value.code == 2
    assert '--whole-model needs --shape' in capsys.readouterr().err


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
    text = lib.markdown_whole_model(dict(
        meta=dict(whole_model=dict(mode='train', shape=[64, 64], batch=1), ratios=[row]),
        records=records))
    assert '| `base` | oom |' in text and '| `subj` / `base` | 0.50x (0.50-0.50)' in text


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
    assert '| `subj` / `base` | 0.50x (0.50-1.33) | 0.50x (0.40-3.00) | 3 |' in text
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


def test_the_user_entry_in_tools_runs_the_harness(bench, capsys, monkeypatch):
    """tools/analysis_tools/benchmark.py is the harness (benchmarks/benchmark.py) with the same
    command line: same output, same exit status (run here as ``python`` would run it)."""
    import runpy
    tool = os.path.join(ROOT, 'tools', 'analysis_tools', 'benchmark.py')

    def run(*argv):
        monkeypatch.setattr(sys, 'argv', [tool, *argv])
        monkeypatch.setattr(sys, 'path', list(sys.path))
        with pytest.raises(SystemExit) as exc:
            runpy.run_path(tool, run_name='__main__')
        return exc.value.code, capsys.readouterr()

    code, out = run('--list-models')
    assert code == 0 and out.out == lib.list_models() + '\n' and 'xcit_' in out.out
    code, out = run('--models', 'no_such_model')
    assert code == 2 and 'no_such_model' in out.err


# ---------------------------------------------------------------------------------------------
# what the fresh process measured (last: it runs meanwhile)
# ---------------------------------------------------------------------------------------------
def test_trunk_flops_match_the_formula(fresh_run):
    """The counter sees every MAC of the XCiT trunk, the XCA products included.

    mmpretrain's port computes XCA exactly as the paper, so its count equals the formula (which
    is linear in the number of tokens: 4x per doubled side).  XCiTBackbone may rewrite XCA
    algebraically (e.g. fold ``attn @ v`` into the projection), which moves its count by a few
    percent, not more, and keeps it linear in the tokens.
    """
    assert lib.analytic_trunk_macs('n12', 16, 448, 448) == \
        4 * lib.analytic_trunk_macs('n12', 16, 224, 224)
    # XCiTBackbone.forward_trunk at 128 and 256 (at 64 px what the formula leaves out is 12%)
    gmacs = {res: lib.point_flops(lib.parse_model('xcit_n12_p16_trunk'), res, 'inference',
                                  FLOPS_CACHE)['gmacs'] for res in (128, 256)}
    for res, value in gmacs.items():
        assert value * 1e9 == pytest.approx(lib.analytic_trunk_macs('n12', 16, res, res),
                                            rel=0.05)
    assert 3.8 < gmacs[256] / gmacs[128] < 4.2
    for arch, patch, res in (('n12', 16, 64), ('t12', 8, 96)):
        assert fresh_run['port'][f'{arch}_p{patch}'] * 1e9 == pytest.approx(
            lib.analytic_trunk_macs(arch, patch, res, res), rel=1e-9)


def test_train_step_flops_are_three_forwards(fresh_run):
    """Backward = 2x forward for every layer, depthwise convs included (torch's own formula
    overcounts grouped conv weight gradients; the library corrects it)."""
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
    x = torch.randn(1, 8, 10, 10, requires_grad=True)
    assert lib.count_flops(lambda: conv(x).sum().backward()) == 3 * 2 * 8 * 100 * 9
    # mmpretrain's N12/16 trunk: the first conv has no input gradient, a little less than 3
    assert 2.9 < fresh_run['train_over_forward'] <= 3.0


def test_flops_report_rows_follow_the_formulas(fresh_run):
    """--flops-report (N12, counted in the end-to-end process): the class-attention part and
    the port's classifier equal the formulas, the classifier is trunk + class attention, and
    the verdict is the paper comparison within the spec's tolerance."""
    spec = lib.load_spec()['flops_report']
    assert [r['setting'] for r in fresh_run['n12_rows']] == ['224/p16', '384/p8']
    for row in fresh_run['n12_rows']:
        _check_flops_row(row, spec['paper_table1'], spec['tolerance'])
        assert row['ok']


def test_committed_flops_report_is_well_formed(fresh_run):
    """docs/benchmark/flops.json (and .csv): every arch's rows satisfy the same formulas and
    arithmetic, the CSV holds the JSON rows, and its N12 rows are what the current code counts."""
    spec = lib.load_spec()['flops_report']
    data = _artifact('flops.json')
    assert [r['arch'] for r in data['rows']] == [a for a in spec['paper_table1'] for _ in '12']
    for row in data['rows']:
        _check_flops_row(row, spec['paper_table1'], spec['tolerance'])
    with open(os.path.join(ARTIFACTS, 'flops.csv')) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(data['rows'])
    for row, rec in zip(rows, data['rows']):
        assert list(row) == list(rec)
        for key, value in rec.items():
            assert row[key] == str(value), key
    committed = [r for r in data['rows'] if r['arch'] == 'n12']
    for new, old in zip(fresh_run['n12_rows'], committed):
        assert new.keys() == old.keys()
        for key, value in old.items():
            assert new[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float)
                                else value), (new['setting'], key)


def test_compare_times_the_same_trunk(fresh_run):
    """--compare's premise: with the port's weights, XCiTBackbone's trunk gives the same maps."""
    verdict = fresh_run['same_trunk']
    assert 'max |diff|' in verdict, verdict
    diff = float(verdict.split('= ')[1].split(' ')[0])
    assert diff < 1e-4, verdict


def test_memory_worker_measures_a_known_allocation(fresh_run):
    """The memory method (a fresh process, its malloc setting: peak RSS growth over the RSS
    after the build, warm-up, input and malloc_trim) sees a tensor allocated by the call:
    16 MiB at 128 px, 64 MiB at 256 px; not the 96 MiB the build allocated and freed before."""
    peaks = {}
    for res, out in zip((128, 256), fresh_run['worker']):
        assert out['status'] == 'ok' and out['mem_base_mb'] > 0
        assert 'MALLOC_MMAP_THRESHOLD_=65536' in out['mem_method']
        want = 256 * res * res * 4 / MIB
        assert want - 1 <= out['peak_mem_mb'] <= want + 4, (res, out)
        peaks[res] = out['peak_mem_mb']
    assert 3.5 < peaks[256] / peaks[128] < 4.5


def test_part_clock_times_and_peaks_of_known_parts(monkeypatch, fresh_run):
    """Virtual clock, then (in a fresh process, as the worker is, with its malloc setting) a
    48 MiB tensor allocated and freed in the neck, a 16 MiB one in the heads: each part gets its
    own time and its own peak (the counter is reset at each mark), the trunk none; a part
    without a mark is 0."""
    clock = FakeClock()
    monkeypatch.setattr(lib_fresh, 'time', clock)
    part_clock = lib_fresh.PartMeter()
    part_clock.start()
    clock.advance(0.002)
    part_clock.mark('trunk')
    clock.advance(0.005)
    part_clock.mark('neck')
    clock.advance(0.001)
    part_clock.mark('heads')
    parts = part_clock.sequence(('trunk', 'adapter', 'neck', 'heads'))
    assert {k: t for k, (t, _) in parts.items()} == pytest.approx(
        dict(trunk=0.002, adapter=0., neck=0.005, heads=0.001), rel=1e-9, abs=1e-12)

    peaks = fresh_run['part_clock']
    assert peaks['trunk'] < 4 and peaks['adapter'] == 0, peaks
    # the neck's 48 MiB, freed before its end, is not the heads' peak: 16 MiB
    assert 47 <= peaks['neck'] <= 52 and 15 <= peaks['heads'] <= 20, peaks


def test_cli_end_to_end_in_a_fresh_process(end_to_end_run):
    """benchmark.py on mmpretrain's N12/16 trunk at 64 px, 3 rounds: the FLOPs are the paper
    formula exactly, every figure follows from the run's own times, the memory comes from a
    fresh worker process, CSV / JSON / PNG are written and agree.

    The same process shows that ``import xcit_mm`` does not import the benchmark and that the
    loader builds mmpretrain's trunk without torchvision (placeholder packages only where
    torchvision is missing, no torchvision stub left behind).  The one change to the command:
    the reference matmul step is 64x smaller (``E2E_SCRIPT``).
    """
    returncode, out_dir = end_to_end_run()
    stdout = (out_dir / 'stdout.txt').read_text()
    output = stdout + (out_dir / 'stderr.txt').read_text()
    assert returncode == 0, output
    report = json.loads(stdout.split('@@')[-1])
    assert report['exit'] == 0, output
    assert report['bench_modules'] == []
    assert report['placeholder'] is not report['torchvision_installed']
    assert report['torchvision_imported'] is report['torchvision_installed']

    with open(out_dir / 'tiny.json') as f:
        data = json.load(f)
    with open(out_dir / 'tiny.csv') as f:
        rows = list(csv.DictReader(f))
    (r,) = data['records']
    assert (r['model'], r['status'], r['resolution'], r['batch'], r['device'], r['mode'],
            r['threads']) == ('mmpretrain_xcit_n12_p16', 'ok', 64, 1, 'cpu', 'inference', 1)
    assert r['gmacs'] * 1e9 == pytest.approx(lib.analytic_trunk_macs('n12', 16, 64, 64),
                                             rel=1e-9)
    assert r['gflop_exec'] == pytest.approx(2 * r['gmacs'], rel=1e-9)  # inference: 2 per MAC
    assert len(r['times_s']) == 3 and all(t > 0 for t in r['times_s'])
    _check_backbone_records(data['records'])
    _check_csv_matches_records(rows, data['records'])
    assert 0 < r['peak_mem_mb'] < 1024 and r['mem_base_mb'] > 0
    assert 'MALLOC_MMAP_THRESHOLD_=65536' in r['mem_method']
    assert r['matmul_gflop_s'] > 0
    assert data['meta']['torch'] == torch.__version__
    assert data['meta']['matmul_gflop_s_before'] > 0 and data['meta']['matmul_gflop_s_after'] > 0
    assert data['meta']['options']['repeats'] == 3
    png = (out_dir / 'tiny.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 10_000


def _large_image_tool():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        'large_image_tool', os.path.join(ROOT, 'benchmarks', 'large_image_tool.py'))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_large_image_tool_update_keeps_the_other_points_rows(tmp_path, monkeypatch):
    """``benchmarks/large_image_tool.py --update`` replaces the rows of the points it runs (config,
    input, options, budget) and keeps the others with the revision that measured them, and the
    earlier runs' commands; a row's memory is its peak above its own run's floor."""
    tool = _large_image_tool()
    (tmp_path / 'sem_fpn_xcit_s12_p16_80k_ade20k_random.pth').write_bytes(b'')  # made already
    runs = iter(range(1, 10))  # each run's peak RSS, the floor's first: the tool is faked
    monkeypatch.setattr(tool, 'measure', lambda args, image, ckpt, budget, name: dict(
        returncode=0, wall_s=1.0, peak_rss_mb=10 * next(runs)))
    monkeypatch.setattr(tool, 'tool_flags', lambda: '')
    monkeypatch.setattr(tool, 'revision', lambda: 'first')
    out = str(tmp_path / 'artifact.json')
    common = ['--size', '64', '--work-dir', str(tmp_path), '--out', out]
    tool.main(common + ['--budgets', 'none', '3000'])
    monkeypatch.setattr(tool, 'revision', lambda: 'second')
    tool.main(common + ['--budgets', '3000', '--update'])
    tool.main(common + ['--budgets', '3000', '--mosaic', '2', '--update'])
    with open(out) as f:
        artifact = json.load(f)
    got = {(row['mosaic'], row['max_memory']): (row['revision'], row['peak_rss_mb'],
           row['memory_mb']) for row in artifact['rows']}
    assert got == {(None, None): ('first', 20, 10), (None, 3000.0): ('second', 50, 10),
                   (2, 3000.0): ('second', 70, 10)}
    assert len(artifact['meta']['earlier_commands']) == 2


def test_large_image_tool_mosaic_is_the_bigtiff_as_gdal_reads_them(tmp_path):
    """The benchmark's VRT of N x N GeoTIFFs and its BigTIFF of the same size are, as GDAL reads
    them, one scene: the same pixels, CRS and transform."""
    import rasterio
    tool = _large_image_tool()
    with rasterio.open(tool.make_input(str(tmp_path), 64, 96, None)) as tiff, \
            rasterio.open(tool.make_input(str(tmp_path), 64, 96, 2)) as vrt:
        assert len(vrt.files) == 5 and vrt.driver == 'VRT'  # the VRT and its 2 x 2 pieces
        assert (vrt.shape, vrt.crs, vrt.transform) == (tiff.shape, tiff.crs, tiff.transform)
        assert tiff.crs.to_epsg() == tool.EPSG
        assert (vrt.read() == tiff.read()).all()
