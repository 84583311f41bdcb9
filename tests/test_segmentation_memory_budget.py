"""LeanEncoderDecoder's lean sliding windows and ``test_cfg.mode='auto'`` (a memory budget).

Expected labels and logits come from upstream mmseg: stock ``EncoderDecoder.predict`` with
``mode='slide'`` (or 'whole') on the same weights, built by ``tests/test_lean_segmentation.py``'s
``_pair`` (small XCiTs, a tied class pair). The choice of plan is tested with a given
``memory_model`` (deterministic); the memory bound is measured in fresh processes (malloc
returning freed memory at once, as the benchmarks measure, and glibc's defaults), each plan at
the tightest budget that picks it (its own estimate), so the estimate must bound the peak.
"""
import copy
import json
import logging
import math
import os
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
import torch
from mmengine.config import ConfigDict
from test_lean_segmentation import (SEM_FPN, UPERNET, _assert_same, _meta, _pair, _predict,
                                    _samples)

from xcit_mm.models.segmentors.lean_encoder_decoder import MIN_STREAM_BAND_MB, STREAM_BAND_MB
from xcit_mm.models.utils.memory_budget import MemoryBudgetError

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
NUM_CLASSES = 44  # chunks of 8 (24 channels-last) and a narrower last chunk
SLIDE = dict(mode='slide', crop_size=(64, 64), stride=(40, 40))  # strides no multiple of 8


def _slide_pair(heads, channels_last=False, **test_cfg):
    stock, lean = _pair(heads, channels_last=channels_last, num_classes=NUM_CLASSES,
                        lean_chunk_mb=0.01, keep_seg_logits=True)
    lean.test_cfg = copy.deepcopy(lean.test_cfg)  # the built models share the config's
    stock.test_cfg.update(SLIDE)
    lean.test_cfg.update(SLIDE, **test_cfg)
    return stock, lean


# (network input H, W; original H, W per image): odd sizes and both aspect ratios, a test resize
# (original larger), an image narrower than the window, one smaller than the window both ways,
# and a padded batch of two, flipped each way
CASES = {
    'odd': [((97, 131), [(97, 131)])],
    'resize_narrow': [((160, 48), [(517, 151)])],
    'smaller_than_crop': [((50, 40), [(50, 40)])],
    'batch2_pad_flip': [((112, 144), [(301, 397), (90, 150)])],
}


def _case_metas(img_hw, ori_hws):
    if len(ori_hws) == 1:
        return [_meta(img_hw, ori_hws[0])]
    return [_meta(img_hw, ori_hws[0], pad=(0, 9, 0, 13), flip='horizontal'),
            _meta(img_hw, ori_hws[1], pad=(0, 0, 0, 5), flip='vertical')]


@pytest.mark.parametrize('heads', [SEM_FPN, UPERNET], ids=['sem_fpn', 'upernet'])
@pytest.mark.parametrize('case', list(CASES))
def test_slide_labels_and_logits_equal_stock(heads, case):
    stock, lean = _slide_pair(heads)
    (img_hw, ori_hws), = CASES[case]
    torch.manual_seed(1)
    inputs = torch.randn(len(ori_hws), 3, *img_hw)
    metas = _case_metas(img_hw, ori_hws)
    _assert_same(_predict(stock, inputs, metas), _predict(lean, inputs, metas))


def test_slide_channels_last_and_without_data_samples():
    stock, lean = _slide_pair(SEM_FPN, channels_last=True)
    torch.manual_seed(2)
    inputs = torch.randn(1, 3, 90, 121)
    _assert_same(_predict(stock, inputs, [_meta((90, 121), (180, 240))]),
                 _predict(lean, inputs, [_meta((90, 121), (180, 240))]))
    _assert_same(_predict(stock, inputs, None), _predict(lean, inputs, None))


def test_slide_binary_head():
    stock, lean = _pair(SEM_FPN, num_classes=1, keep_seg_logits=True)
    for model in (stock, lean):
        model.test_cfg.update(SLIDE)
    torch.manual_seed(3)
    inputs = torch.randn(1, 3, 77, 101)
    metas = [_meta((77, 101), (150, 200))]
    _assert_same(_predict(stock, inputs, metas), _predict(lean, inputs, metas))


# ---------------------------------------------------------------- mode='auto'
@pytest.fixture
def log_lines():
    """Messages of mmengine's current logger (where the plan choice and ``calibrate`` log)."""
    from mmengine.logging import MMLogger
    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = MMLogger.get_current_instance()
    handler = Collect()
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


# a steep line: the network dominates, so the whole image costs far more than one window
STEEP = dict(base_mb=10.0, mb_per_mpix=20000.0)


def test_auto_picks_whole_or_slide_by_budget_and_logs(log_lines):
    stock, lean = _slide_pair(SEM_FPN)
    lean.test_cfg.update(mode='auto', memory_model=STEEP, max_memory=10**6)  # set per plan below
    torch.manual_seed(4)
    inputs = torch.randn(1, 3, 150, 170)
    metas = [_meta((150, 170), (150, 170))]
    whole, slide = lean.memory_plans(inputs, _samples(metas))
    assert (whole.name, slide.name) == ('whole', 'slide')
    assert slide.estimate_mb < whole.estimate_mb
    # the tightest budget of each plan picks it
    for plan, budget in (('whole', whole.estimate_mb), ('slide', slide.estimate_mb)):
        lean.test_cfg.max_memory = budget
        stock.test_cfg.mode = plan
        _assert_same(_predict(stock, inputs, metas), _predict(lean, inputs, metas))
        assert lean.last_memory_plan.name == plan
        assert lean.last_memory_plan.estimate_mb == pytest.approx(
            {'whole': whole, 'slide': slide}[plan].estimate_mb)
        if plan == 'whole':  # the line dominates: whole's bound is its estimate, no listing
            line = log_lines[-1]
            assert (f'whole, its peak at most {whole.estimate_mb:.0f} MB (the network\'s line '
                    'and the post-processing counted from its shapes), within max_memory=') in line
            continue
        line = [m for m in log_lines if f'{plan} within max_memory' in m][-1]
        assert f'whole (150x170 px): {whole.estimate_mb:.0f} MB' in line
        assert f'slide (16 windows 64x64, stride 40x40): {slide.estimate_mb:.0f} MB' in line
    assert lean.calibrated_memory_model is None  # the given line, no calibration


def test_auto_impossible_budget_names_the_smallest():
    _, lean = _slide_pair(SEM_FPN, mode='auto', memory_model=STEEP, max_memory=1)
    inputs = torch.randn(1, 3, 150, 170)
    smallest = min(p.estimate_mb for p in lean.memory_plans(inputs))
    with pytest.raises(MemoryBudgetError, match=f'at least {smallest:.0f}'):
        _predict(lean, inputs, None)
    assert lean.last_memory_plan is None


def test_post_processing_is_measured_at_the_batch_geometry_scaled_down(monkeypatch):
    """mode='auto' measures the post-processing on zeros at the batch's geometry scaled down (here
    by a half, then whole): each image's original shape and padding scaled alike, its flip kept."""
    _, lean = _slide_pair(SEM_FPN, mode='auto', memory_model=STEEP, max_memory=10**6)
    metas = [_meta((112, 144), (302, 398), pad=(0, 10, 0, 14), flip='horizontal'),
             _meta((112, 144), (90, 150), pad=(0, 0, 0, 6), flip='vertical')]
    seen, real = {}, lean._whole_post

    def spy(low_res, head_hw, samples, width=None):
        seen[tuple(head_hw)] = [(tuple(s.ori_shape), list(s.padding_size), s.flip_direction)
                                for s in samples]
        return real(low_res, head_hw, samples, width)

    monkeypatch.setattr(lean, '_whole_post', spy)
    lean.memory_plans(torch.zeros(2, 3, 112, 144), _samples(metas))
    assert seen == {
        (56, 72): [((151, 199), [0, 5, 0, 7], 'horizontal'), ((45, 75), [0, 0, 0, 3], 'vertical')],
        (112, 144): [((302, 398), [0, 10, 0, 14], 'horizontal'),
                     ((90, 150), [0, 0, 0, 6], 'vertical')]}


MISSPELT = r"unknown test_cfg key\(s\) \['max_memroy'\]; the keys are \[.*'max_memory'"


def test_a_misspelt_test_cfg_key_in_the_config_fails_the_build():
    """A config's misspelt ``max_memory`` would otherwise run the whole image with no budget
    (changed after the build, the next predict refuses it: test_bad_settings_are_clear_errors)."""
    with pytest.raises(ValueError, match=MISSPELT):
        _pair(SEM_FPN, max_memroy=4000)


@pytest.mark.parametrize('settings,error,match', [
    (dict(mode='fast'), ValueError, r"one of \['whole', 'slide', 'auto', 'stream'\]"),
    (dict(mode='auto', max_memory=-5), MemoryBudgetError, 'positive number'),
    (dict(mode='auto', max_memory='3000'), MemoryBudgetError, 'positive number'),
    (dict(mode='auto', max_memory=3000, memory_model=dict(base_mb=1)), MemoryBudgetError,
     'memory_model must be'),
    (dict(mode='auto', max_memory=3000, memory_model=dict(base_mb=1, mb_per_mpix=-2)),
     MemoryBudgetError, 'non-negative'),
    (dict(mode='whole', max_memory=3000), ValueError,
     r"\['max_memory'\] only apply to mode='auto' or mode='stream'"),
    (dict(mode='slide', memory_model=STEEP), ValueError, r"\['memory_model'\] only apply"),
    (dict(mode='slide', crop_size=None), ValueError, 'needs crop_size'),
    (dict(mode='auto', max_memory=3000, memory_model=STEEP, stride=(80, 80)), ValueError,
     'leave gaps'),
    (dict(mode='auto', max_memory=3000, lean=False), ValueError, 'needs the lean predict'),
    (dict(mode='auto', max_memroy=3000), ValueError, MISSPELT),
], ids=['unknown_mode', 'negative_budget', 'str_budget', 'memory_model_keys',
        'memory_model_negative', 'budget_without_auto', 'memory_model_without_auto',
        'slide_without_crop', 'stride_over_crop', 'auto_not_lean', 'misspelt_key'])
def test_bad_settings_are_clear_errors(settings, error, match):
    _, lean = _slide_pair(SEM_FPN)
    lean.test_cfg.update(settings)
    with pytest.raises(error, match=match):
        _predict(lean, torch.randn(1, 3, 70, 70), None)
    assert lean.calibrated_memory_model is None  # checked before any measuring


def test_calibrates_once_per_model_with_a_positive_line(monkeypatch, log_lines):
    from xcit_mm.models.segmentors import lean_encoder_decoder as module
    calls, calibrate = [], module.calibrate
    monkeypatch.setattr(module, 'calibrate',
                        lambda *args, **kwargs: calls.append(args[1]) or calibrate(*args, **kwargs))
    _, lean = _slide_pair(SEM_FPN, mode='auto', max_memory=100000)
    bn = next(m for m in lean.modules() if isinstance(m, torch.nn.BatchNorm2d))
    stats = bn.running_mean.clone()
    lean.train()  # calibrating a model in training mode leaves its batch-norm statistics alone
    line = lean.network_memory_model(torch.zeros(1, 3, 8, 8))
    assert lean.training and torch.equal(bn.running_mean, stats)
    lean.eval()
    for _ in range(2):
        _predict(lean, torch.randn(1, 3, 80, 90), None)
    assert calls == [module.CALIBRATION_SIZES]
    assert lean.calibrated_memory_model is line
    assert line.mb_per_mpix > 0 and line.base_mb >= 0
    assert any('memory calibrated' in m for m in log_lines)


# ---------------------------------------------------------------- no mode: the configs' default
@pytest.fixture
def available_mb(tmp_path, monkeypatch):
    """Sets the memory the process may use (MB): MemAvailable of a /proc/meminfo of the test's
    own, no cgroup."""
    from xcit_mm.models.utils import memory_budget
    meminfo = tmp_path / 'meminfo'
    monkeypatch.setattr(memory_budget, 'PROC_MEMINFO', str(meminfo))
    monkeypatch.setattr(memory_budget, 'PROC_SELF_CGROUP', str(tmp_path / 'no_cgroup'))
    return lambda mb: meminfo.write_text(f'MemAvailable:   {math.ceil(mb * 1024)} kB\n')


def _without_mode(lean, **test_cfg):
    """``lean`` (its weights) with a ``test_cfg`` that names no mode, as the configs give it."""
    lean = copy.deepcopy(lean)
    lean.test_cfg = ConfigDict(test_cfg)
    return lean


def test_default_runs_whole_bit_identical_measuring_nothing_per_size(available_mb, log_lines,
                                                                     monkeypatch):
    """Where whole plainly fits, the default is stock's whole (labels and logits bit for bit, a
    padded flipped batch of two and a test resize) and measures nothing per image size: the
    network's line given (calibrating is test_calibrates_once_per_model_with_a_positive_line's),
    the choice logged once for both sizes; mode='whole' plans nothing."""
    from xcit_mm.models.segmentors import lean_encoder_decoder as module
    measured, measure_line = [], module.measure_line
    monkeypatch.setattr(module, 'measure_line',
                        lambda *a, **k: measured.append(a[1]) or measure_line(*a, **k))
    available_mb(10**5)
    stock, whole = _pair(SEM_FPN, keep_seg_logits=True)
    default = _without_mode(whole, keep_seg_logits=True, memory_model=STEEP)
    (img_hw, ori_hws), = CASES['batch2_pad_flip']
    cases = [(img_hw, _case_metas(img_hw, ori_hws)), ((160, 48), [_meta((160, 48), (517, 151))])]
    torch.manual_seed(6)
    for hw, metas in cases:
        inputs = torch.randn(len(metas), 3, *hw)
        expected = _predict(stock, inputs, metas)
        _assert_same(expected, _predict(default, inputs, metas))
        assert default.last_memory_plan.name == 'whole'
        _assert_same(expected, _predict(whole, inputs, metas))
    assert measured == []
    assert whole.calibrated_memory_model is None and whole.last_memory_plan is None
    chosen = [m for m in log_lines if 'LeanEncoderDecoder on' in m]
    assert len(chosen) == 1, chosen
    assert 'whole, its peak at most' in chosen[0] and 'the memory this process may use' in chosen[0]
    assert 'MemAvailable in ' in chosen[0] and f'within {10**5} MB' in chosen[0], chosen[0]


def test_default_runs_small_images_whole_without_calibrating(available_mb, log_lines,
                                                             monkeypatch):
    """The default (no max_memory, no memory_model) runs a batch of no more pixels than the
    calibration's largest forward whole without calibrating (stock's labels, nothing measured,
    logged as not calibrated), unless the post-processing counted from its shapes passes the
    memory available; a larger batch calibrates, once."""
    from xcit_mm.models.segmentors import lean_encoder_decoder as module
    calls, calibrate = [], module.calibrate
    monkeypatch.setattr(module, 'calibrate',
                        lambda *args, **kwargs: calls.append(args[1]) or calibrate(*args, **kwargs))
    monkeypatch.setattr(module, 'CALIBRATION_SIZES', ((32, 32), (48, 48), (64, 64)))
    monkeypatch.setattr(module, 'CALIBRATION_PIXELS', 64 * 64)
    available_mb(10**5)
    stock, lean = _pair(SEM_FPN, keep_seg_logits=True)
    default = _without_mode(lean, keep_seg_logits=True)
    torch.manual_seed(8)
    small = torch.randn(1, 3, 48, 80)  # 3840 px
    metas = [_meta((48, 80), (96, 160))]
    _assert_same(_predict(stock, small, metas), _predict(default, small, metas))
    assert default.last_memory_plan.name == 'whole' and calls == []
    assert default.calibrated_memory_model is None
    assert any('whole, not calibrated' in m for m in log_lines), log_lines
    needed = default._whole_bound_mb(small, _samples(metas), with_network=False)
    assert default._whole_without_calibrating(small, _samples(metas), needed)
    assert not default._whole_without_calibrating(small, _samples(metas), needed - 0.01)
    larger = torch.randn(1, 3, 64, 80)  # 5120 px
    for _ in range(2):
        _predict(default, larger, [_meta((64, 80), (64, 80))])
    assert calls == [module.CALIBRATION_SIZES]
    assert not default._whole_without_calibrating(small, _samples(metas), 10**5)  # line known


def test_default_streams_when_little_memory_is_available(available_mb, log_lines):
    """The default where whole does not fit the memory available: the stream (labels as stock's
    whole up to float rounding), logged once with the estimates and where the budget came from."""
    stock, lean = _pair(SEM_FPN)
    default = _without_mode(lean, memory_model=STEEP)
    torch.manual_seed(7)
    inputs = torch.randn(1, 3, 150, 170)
    metas = [_meta((150, 170), (150, 170))]
    whole, stream = default.memory_plans(inputs, _samples(metas))[:2]
    assert stream.name == 'stream' and stream.estimate_mb < whole.estimate_mb
    expected = _predict(stock, inputs, metas)[0].pred_sem_seg.data
    for extra_mb in (0.5, 1.5):  # the memory available moves a little: one decision, one line
        available_mb(stream.estimate_mb + extra_mb)
        got = _predict(default, inputs, metas)[0].pred_sem_seg.data
        assert default.last_memory_plan.name == 'stream'
        assert int((got != expected).sum()) <= 1e-4 * got.numel()
    chosen = [m for m in log_lines if 'LeanEncoderDecoder on' in m]
    assert len(chosen) == 1, chosen
    assert (f'stream within {stream.estimate_mb + 0.5:.0f} MB, the memory this process may use '
            '(MemAvailable in ') in chosen[0], chosen[0]
    assert f'whole (150x170 px): {whole.estimate_mb:.0f} MB' in chosen[0]


def test_whole_bound_is_at_least_the_measured_estimate():
    """The default's whole without measuring (the post-processing counted from its shapes) is
    never below whole's estimate with the post-processing measured: whole admitted by the count is
    whole that the measured plans choose. A padded, flipped batch of two resized up, outputs
    large enough that the count is far above its fixed slack (measured scaled down:
    quick); no network line (the post-processing alone decides); one slide window."""
    img_hw = (1024, 1280)
    metas = [_meta(img_hw, (2000, 2600), pad=(0, 9, 0, 13), flip='horizontal'),
             _meta(img_hw, (1500, 2400), pad=(0, 0, 0, 5), flip='vertical')]
    _, lean = _pair(SEM_FPN, num_classes=8)  # one chunk: quick
    lean = _without_mode(lean, memory_model=dict(base_mb=0, mb_per_mpix=0), crop_size=img_hw,
                         stride=img_hw)
    inputs = torch.zeros(len(metas), 3, *img_hw)
    with torch.no_grad():
        whole = lean.memory_plans(inputs, _samples(metas))[0]
        bound = lean._whole_bound_mb(inputs, _samples(metas))
    print(f'bound {bound:.0f} MB, measured estimate {whole.estimate_mb:.0f} MB')
    assert whole.name == 'whole' and whole.estimate_mb > 250
    assert bound >= whole.estimate_mb, (bound, whole)


# ---------------------------------------------------------------- the memory bound
BOUND_IMAGE = 1280  # large enough that the two plans differ by far at 48 classes
BOUND_CROP = (640, 640)  # four windows: the slide run stays quick


def _bound_child() -> dict:
    """In a fresh process: calibrate (measured), then at whole's own estimate (the tightest budget
    that picks it) and at two smaller budgets, measure the peak growth of predict."""
    from mmseg.structures import SegDataSample

    from xcit_mm.models.utils.memory_budget import measure_peak_growth_mb
    lean = _pair(SEM_FPN, num_classes=48)[1]
    lean.test_cfg.update(mode='auto', max_memory=1e9, crop_size=BOUND_CROP, stride=BOUND_CROP)
    S = BOUND_IMAGE
    inputs = torch.randn(1, 3, S, S)
    samples = [SegDataSample(metainfo=_meta((S, S), (S, S)))]
    runs = []
    with torch.no_grad():
        calibration_mb = measure_peak_growth_mb(lambda: lean.memory_plans(inputs, samples))
        whole_mb = lean.memory_plans(inputs, samples)[0].estimate_mb
        for budget_mb in (whole_mb, whole_mb - 1, 300):
            lean.test_cfg.max_memory = budget_mb
            peak_mb = measure_peak_growth_mb(lambda: lean.predict(inputs, samples))
            runs.append(dict(chosen=lean.last_memory_plan.name, budget_mb=budget_mb,
                             peak_mb=peak_mb, estimate_mb=lean.last_memory_plan.estimate_mb,
                             band_mb=lean.last_memory_plan.band_mb))
    return dict(runs=runs, calibration_mb=calibration_mb, line=list(lean.calibrated_memory_model))


def test_measured_peak_within_budget_at_three_budgets():
    """Whole at a budget equal to its estimate, the stream at smaller ones, in a fresh process
    with glibc's default malloc, as a user runs it (the benchmarks measure with malloc returning
    freed memory at once, ``MALLOC_MMAP_THRESHOLD_``, which lowers peaks)."""
    result = _child_report('bound')
    runs = result['runs']
    report = '; '.join(f"{r['chosen']}: peak {r['peak_mb']:.0f} MB <= budget {r['budget_mb']:.0f}"
                       f" MB (estimate error {r['budget_mb'] - r['peak_mb']:+.0f} MB)"
                       for r in runs) + f"; calibration peak {result['calibration_mb']:.0f} MB"
    print(report)
    # whole at its own estimate; just below it the stream at its default bands, then its bands
    # shrunk to fit the budget (below slide's estimate here: slide never runs)
    assert [r['chosen'] for r in runs] == ['whole', 'stream', 'stream'], report
    assert runs[1]['band_mb'] == STREAM_BAND_MB['cpu'] > runs[2]['band_mb'], report
    for r in runs:
        assert r['peak_mb'] <= r['budget_mb'], report
        assert result['calibration_mb'] <= r['budget_mb'], report
        assert r['estimate_mb'] <= r['budget_mb'], report


def _child_report(name: str) -> dict:
    """Run this file as a fresh process (``name``: the child to run) with glibc's default malloc,
    as a user runs it (the benchmarks measure with malloc returning freed memory at once,
    ``MALLOC_MMAP_THRESHOLD_``, which lowers peaks); its JSON report."""
    env = {k: v for k, v in os.environ.items() if k != 'MALLOC_MMAP_THRESHOLD_'}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, osp.join(ROOT, 'tests')]))
    proc = subprocess.run([sys.executable, __file__, name], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# a wide strip: one row of the 150 classes at full resolution is more than the smallest band;
# a head of 256 channels (the paper's has 512): its rows of every level, not the bands, then set
# the peak of the label stage
UPER_BOUND_HW = (32, 16384)
UPER_BOUND_CHANNELS = 256


def _uper_bound_child() -> dict:
    """In a fresh process: UperNet streamed at the tightest budget that picks the stream with its
    token maps in memory and its smallest bands; the peak growth of predict."""
    from xcit_mm.models.utils.memory_budget import measure_peak_growth_mb
    heads = copy.deepcopy(UPERNET)
    heads['decode_head']['channels'] = UPER_BOUND_CHANNELS
    lean = _pair(heads)[1]
    lean.test_cfg = ConfigDict(mode='stream', max_memory=1)
    inputs = torch.randn(1, 3, *UPER_BOUND_HW)
    plan = lean.memory_plans(inputs, stream_only=True)[0]
    lean.test_cfg.max_memory = plan.estimate_mb
    with torch.no_grad():
        peak_mb = measure_peak_growth_mb(lambda: lean.predict(inputs))
    chosen = lean.last_memory_plan
    return dict(chosen=chosen.name, band_mb=chosen.band_mb, budget_mb=plan.estimate_mb,
                peak_mb=peak_mb)


def test_upernet_stream_peak_within_budget():
    """UperNet's stream (its pyramid pooling by rows, the last resize and argmax by class chunks)
    within the budget its plan gives, on a strip where a row of all 150 classes at full
    resolution is more than a band (taken at once, they pass the budget), and where the rows
    of every level that even a one-row band makes (the label stage's floor) weigh more than
    the bands."""
    run = _child_report('upernet')
    print(run)
    assert run['chosen'] == 'stream' and run['band_mb'] == MIN_STREAM_BAND_MB, run
    assert run['peak_mb'] <= run['budget_mb'], run


# an image of two full trunk bands of the default size for a model as wide as S12/8 (two layers)
TRUNK_BOUND_HW = (2640, 1024)


def _trunk_bound_child() -> dict:
    """In a fresh process: the trunk stage alone (``stream_trunk``, token maps in memory) of a
    384-dims XCiT at the stream's default bands; its peak growth and what the plan counts for
    it: the maps, ``STREAM_WORK_MB`` and ``TRUNK_WORK_BANDS`` of its bands."""
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    from test_lean_segmentation import BACKBONE
    from xcit_mm.models.inference.row_stream import TokenMaps
    from xcit_mm.models.segmentors import lean_encoder_decoder as module
    from xcit_mm.models.utils.memory_budget import measure_peak_growth_mb
    init_default_scope('mmseg')
    backbone = MODELS.build(dict(BACKBONE, patch_size=8,
                                 arch=dict(embed_dims=384, depth=2, num_heads=8))).eval()
    band_mb = STREAM_BAND_MB['cpu']
    image = torch.randn(1, 3, *TRUNK_BOUND_HW, generator=torch.Generator().manual_seed(0))

    def trunk(pixels):
        with TokenMaps('cpu') as maps, torch.no_grad():
            backbone.stream_trunk(lambda a, b: pixels[:, :, a:b], tuple(pixels.shape[2:]), maps,
                                  band_mb)

    trunk(image[:, :, :256, :256])  # one-time allocations are not the trunk's
    peak_mb = measure_peak_growth_mb(lambda: trunk(image))
    counted = (backbone.token_maps_mb(TRUNK_BOUND_HW)[1] + module.STREAM_WORK_MB
               + module.TRUNK_WORK_BANDS * backbone.trunk_band_mb(TRUNK_BOUND_HW, band_mb))
    return dict(peak_mb=peak_mb, counted_mb=counted,
                trunk_band_mb=backbone.trunk_band_mb(TRUNK_BOUND_HW, band_mb))


def test_the_plan_counts_the_trunks_work_in_bands():
    """The trunk stage's peak at the default bands within what the stream's plan counts for it:
    a band's FFN hidden layer is the band, and its tokens, the attention's pieces and the
    activation's copy come on top of it."""
    run = _child_report('trunk')
    print(run)
    assert run['trunk_band_mb'] > 0.9 * STREAM_BAND_MB['cpu'], run  # full bands
    assert run['peak_mb'] <= run['counted_mb'], run


# ---------------------------------------------------------------- through mmseg's doors
def test_inference_model_door_auto():
    """mmseg.apis.inference_model on the shapes config at full resolution: mode='auto' gives
    the stream's labels under a small budget and stock's whole labels under a large one (the
    stream's estimate is below slide's at this size: slide never runs)."""
    from mmengine.config import Config
    from mmseg.apis import inference_model, init_model
    cfg = Config.fromfile('configs/shapes/sem_fpn_xcit_shapes_ade.py')
    cfg.test_pipeline = [t for t in cfg.test_pipeline if t.type != 'Resize']
    cfg.model.test_cfg = dict(mode='auto', max_memory=1, memory_model=STEEP,
                              crop_size=(160, 160), stride=(106, 106))
    lean = init_model(cfg, device='cpu')
    stock_cfg = copy.deepcopy(cfg)
    stock_cfg.model.type = 'EncoderDecoder'
    stock_cfg.model.test_cfg = dict(mode='slide', crop_size=(160, 160), stride=(106, 106))
    stock = init_model(stock_cfg, device='cpu')
    torch.manual_seed(5)
    with torch.no_grad():  # random weights with varied labels: spread the classifier
        lean.decode_head.conv_seg.weight.normal_(0, 0.01)
    stock.load_state_dict(lean.state_dict())
    img = np.random.RandomState(0).randint(0, 255, (333, 517, 3), dtype=np.uint8)
    with pytest.raises(MemoryBudgetError, match='raise test_cfg.max_memory'):
        inference_model(lean, img)
    stock.test_cfg.mode = 'whole'
    for plan, budget in (('stream', 2000), ('whole', 10**6)):
        lean.test_cfg.max_memory = budget
        expected, got = inference_model(stock, img), inference_model(lean, img)
        assert lean.last_memory_plan.name == plan
        assert got.pred_sem_seg.shape == (333, 517)
        differ = int((expected.pred_sem_seg.data != got.pred_sem_seg.data).sum())
        assert differ == 0 if plan == 'whole' else differ <= 1e-4 * 333 * 517, differ
        assert len(torch.unique(got.pred_sem_seg.data)) > 1


if __name__ == '__main__':  # the children of the memory-bound tests (_child_report)
    print(json.dumps(dict(bound=_bound_child, upernet=_uper_bound_child,
                          trunk=_trunk_bound_child)[sys.argv[1]]()))
