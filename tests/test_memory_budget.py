"""The estimate and the choice behind ``mode='auto'`` (``xcit_mm/models/utils/memory_budget.py``).

The models' own plans are tested in ``test_segmentation_memory_budget.py`` and
``test_detection_memory_budget.py``; here the line, the measurement and the choice, and two
parts of LeanEncoderDecoder's plans: the post-processing's line kept per batch geometry, and
the slide plan's estimate against the measured peak of slide."""
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from xcit_mm.models.utils import memory_budget as mb
from xcit_mm.models.utils.memory_budget import (MemoryBudgetError, MemoryModel, MemoryPlanMixin,
                                                Plan, calibrate, measure_peak_growth_mb,
                                                read_budget_mb, read_memory_model)


@pytest.fixture
def logged(monkeypatch):
    lines = []
    monkeypatch.setattr(mb, 'print_log', lambda msg, **kw: lines.append(msg))
    return lines


def test_fit_is_least_squares_raised_so_no_measured_point_lies_above():
    points = [(1e6, 150.0), (2e6, 210.0), (4e6, 300.0)]
    model = MemoryModel.fit(points)
    x = np.array([p for p, _ in points]) / 1e6
    y = np.array([m for _, m in points])
    slope, _ = np.polyfit(x, y, 1)
    assert model.mb_per_mpix == pytest.approx(slope)
    assert model.base_mb == pytest.approx(max(y - slope * x))
    assert all(model.estimate_mb(p) >= m - 1e-9 for p, m in points)
    assert model.estimate_mb(8e6) == pytest.approx(model.base_mb + 8 * slope)


def test_fit_keeps_slope_and_base_non_negative_and_needs_two_sizes():
    assert MemoryModel.fit([(1e6, 300.0), (2e6, 100.0)]).mb_per_mpix == 0.0
    assert MemoryModel.fit([(1e6, 1.0), (2e6, 3.0)]).base_mb == 0.0
    with pytest.raises(MemoryBudgetError, match='two or more sizes'):
        MemoryModel.fit([(1e6, 1.0), (1e6, 2.0)])


def test_measured_peak_growth_is_the_memory_the_call_held():
    size_mb = 256
    growth = measure_peak_growth_mb(
        lambda: torch.ones(size_mb * 2**20 // 4).add_(1).sum())
    assert size_mb * 0.95 < growth < size_mb * 1.15


class _FakeCudaAllocator:
    """torch.cuda's counters for a test without a GPU: bytes held by tensors and their peak since
    the last reset, which a previous call left high."""

    def __init__(self, held: int, stale_peak: int):
        self.held, self.peak, self.events = held, stale_peak, []

    def hold(self, nbytes: int):
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, 'synchronize', lambda device=None: self.events.append('sync'))
        monkeypatch.setattr(cuda, 'reset_peak_memory_stats',
                            lambda device=None: setattr(self, 'peak', self.held))
        monkeypatch.setattr(cuda, 'memory_allocated', lambda device=None: self.held)
        monkeypatch.setattr(cuda, 'max_memory_allocated', lambda device=None: self.peak)


def test_on_a_cuda_device_the_growth_is_the_memory_tensors_held_there(monkeypatch):
    allocator = _FakeCudaAllocator(held=500 * 2**20, stale_peak=9000 * 2**20)
    allocator.install(monkeypatch)

    def call():  # 300 MB at its peak, 100 MB kept by its result
        allocator.hold(300 * 2**20)
        allocator.hold(-200 * 2**20)
        allocator.events.append('call')

    assert measure_peak_growth_mb(call, 'cuda:0') == pytest.approx(300)
    # the kernels queued before and by the call are finished before each reading
    assert allocator.events == ['sync', 'call', 'sync']


def test_calibration_on_cuda_measures_the_device_and_says_so(monkeypatch, logged):
    allocator = _FakeCudaAllocator(held=0, stale_peak=0)
    allocator.install(monkeypatch)
    model = calibrate(lambda h, w: allocator.hold(8 * h * w), [(1000, 1000), (2000, 2000)],
                      'toy', device=torch.device('cuda', 0))
    assert model.mb_per_mpix == pytest.approx(8e6 / 2**20)
    assert 'memory calibrated on cuda:0' in logged[0]


def test_a_device_whose_peak_cannot_be_read_names_the_fix():
    with pytest.raises(MemoryBudgetError, match=r'on meta .*memory_model=dict\(base_mb='):
        measure_peak_growth_mb(lambda: None, 'meta')


def test_calibration_measures_each_size_and_fits_the_slope(logged):
    calls = []

    def run_at(h, w):
        calls.append((h, w))
        return (torch.ones(16, h, w) * 2).sum()  # two maps of 16 x 4 bytes per pixel live

    model = calibrate(run_at, [(512, 512), (1024, 1024), (1536, 1536)], 'toy')
    assert calls == [(512, 512), (512, 512), (1024, 1024), (1536, 1536)]  # one warm-up
    assert model.mb_per_mpix == pytest.approx(2 * 16 * 4 * 1e6 / 2**20, rel=0.05)
    assert 'memory calibrated' in logged[0] and 'memory_model=dict(base_mb=' in logged[0]


def test_choice_takes_the_first_plan_that_fits_and_logs_every_estimate(logged):
    plans = [Plan('whole', 900.0), Plan('slide', 300.0, '512x512 stride 341')]
    assert _Planner()._choose_memory_plan(plans, 1000, 'img 4096x4096').name == 'whole'
    assert _Planner()._choose_memory_plan(plans, 500, 'img 4096x4096').name == 'slide'
    assert 'slide within max_memory=500 MB' in logged[-1]
    assert 'whole: 900 MB' in logged[-1] and 'slide 512x512 stride 341: 300 MB' in logged[-1]


def test_no_plan_within_the_budget_names_the_smallest_budget_that_would_do(logged):
    plans = [Plan('whole', 900.0), Plan('slide', 300.0)]
    with pytest.raises(MemoryBudgetError, match=r'max_memory to at least 300'):
        _Planner()._choose_memory_plan(plans, 200, 'img 4096x4096')


@pytest.mark.parametrize('budget', [None, 0, -5, '4G', True])
def test_a_bad_budget_is_named_with_the_fix(budget):
    with pytest.raises(MemoryBudgetError, match=r"mode='auto' needs max_memory.*e\.g\."):
        read_budget_mb(dict(mode='auto', max_memory=budget), 'LeanEncoderDecoder')
    assert read_budget_mb(dict(max_memory=3000), 'x') == 3000.0


@pytest.mark.parametrize('value', [dict(base_mb=1), dict(base_mb=1, mb_per_mpix=-1),
                                   dict(base_mb='1', mb_per_mpix=2), [1, 2]])
def test_a_malformed_memory_model_is_named(value):
    with pytest.raises(MemoryBudgetError, match=r'memory_model must be dict\(base_mb'):
        read_memory_model(value, 'LeanMaskRCNN')
    assert read_memory_model(dict(base_mb=10, mb_per_mpix=2), 'x') == MemoryModel(10.0, 2.0)
    assert read_memory_model(None, 'x') is None


class _Planner(MemoryPlanMixin):
    """The mixin both lean models use, with a stand-in calibration that counts its calls."""

    def __init__(self, given=None):
        self.test_settings = SimpleNamespace(memory_model=given)
        self.calibrations = 0

    def _calibrate_memory(self, inputs):
        self.calibrations += 1
        return MemoryModel(1.0, 2.0)


def test_the_plan_mixin_keeps_the_choice_logs_a_new_one_and_clears_it_when_none_fits(logged):
    planner, plans = _Planner(), [Plan('whole', 100.0), Plan('tiles', 40.0)]
    assert planner._choose_memory_plan(plans, 50, 'x') == plans[1]
    assert planner._choose_memory_plan(list(plans), 50, 'x') == plans[1]
    assert len(logged) == 1  # the previous batch's plans and budget: not logged again
    assert planner._choose_memory_plan(plans, 100, 'x') == plans[0] and len(logged) == 2
    assert planner.last_memory_plans == plans and planner.last_memory_plan == plans[0]
    with pytest.raises(MemoryBudgetError, match='at least 40'):
        planner._choose_memory_plan(plans, 10, 'x')
    assert planner.last_memory_plan is None


def test_the_given_line_wins_else_the_line_is_calibrated_once():
    planner = _Planner()
    assert planner.network_memory_model(None) == planner.network_memory_model(None) == (1, 2)
    assert planner.calibrations == 1 and planner.calibrated_memory_model == (1, 2)
    planner.test_settings.memory_model = MemoryModel(5.0, 6.0)
    assert planner.network_memory_model(None) == (5, 6) and planner.calibrations == 1
    assert _Planner(MemoryModel(5.0, 6.0)).network_memory_model(None) == (5, 6)


# ---------------------------------------------------------------- LeanEncoderDecoder's lines
def _auto_segmentor(width=24, **test_cfg):
    """A small Semantic FPN LeanEncoderDecoder of 8 classes (tests/test_lean_segmentation.py),
    its neck and head ``width`` channels wide, in mode='auto'."""
    from test_lean_segmentation import SEM_FPN, _pair
    heads = copy.deepcopy(SEM_FPN)
    heads['neck']['out_channels'] = width
    heads['decode_head'].update(in_channels=[width] * 4, channels=width)
    lean = _pair(heads, num_classes=8)[1]
    lean.test_cfg = dict(mode='auto', max_memory=1e9, **test_cfg)
    return lean


def test_the_post_processing_is_measured_once_per_batch_geometry(monkeypatch):
    """Each batch geometry (input size, each image's original shape, padding and flip; whole or
    windows) gets the line measured on its own geometry; a geometry seen before is not measured
    again (the network's line is given: only the post-processing's moves the estimates)."""
    from test_lean_segmentation import _meta, _samples

    from xcit_mm.models.segmentors import lean_encoder_decoder as module
    lean = _auto_segmentor(memory_model=dict(base_mb=0, mb_per_mpix=0), crop_size=(64, 64),
                           stride=(48, 48))
    lean._label_floor()  # the stream's own measurement, once per model structure: done first
    lines = []  # each measurement's line has a base of its own: 1000, 2000, ... MB

    def measure(run_at, sizes, device=None):
        lines.append(MemoryModel(1000.0 * (len(lines) + 1), 0.0))
        return lines[-1], []

    monkeypatch.setattr(module, 'measure_line', measure)
    geometries = {  # (input H, W), each image's (original shape, padding, flip), or None for
        # a batch without data samples
        'a': ((96, 112), [((96, 112), (0, 0, 0, 0), None)]),
        'ori_shape': ((96, 112), [((190, 222), (0, 0, 0, 0), None)]),
        'padding': ((96, 112), [((96, 112), (0, 8, 0, 0), None)]),
        'flip': ((96, 112), [((96, 112), (0, 0, 0, 0), 'vertical')]),
        'input': ((112, 96), [((112, 96), (0, 0, 0, 0), None)]),
        'batch': ((96, 112), [((96, 112), (0, 0, 0, 0), None)] * 2),
        'no_samples': ((96, 112), [None]),
        'no_samples_batch': ((96, 112), [None] * 2)}

    def post_lines(geometry):
        """The lines the plans whole and slide were given: the larger part of their estimates."""
        img_hw, images = geometries[geometry]
        inputs = torch.zeros(len(images), 3, *img_hw)
        metas = None if images[0] is None else _samples(
            [_meta(img_hw, ori, pad, flip) for ori, pad, flip in images])
        input_mb = module.INPUT_BYTES * inputs.numel() / mb.MB
        plans = {p.name: p.estimate_mb for p in lean.memory_plans(inputs, metas)}
        return [round((plans[plan] - input_mb) / module.MARGIN / 1000)
                for plan in ('whole', 'slide')]

    own_lines = [[2 * i + 1, 2 * i + 2] for i in range(len(geometries))]  # [1, 2], [3, 4], ...
    assert [post_lines(geometry) for geometry in geometries] == own_lines
    assert [post_lines(geometry) for geometry in geometries] == own_lines  # none measured again
    assert len(lines) == 2 * len(geometries)


def test_the_slide_plans_estimate_bounds_the_measured_peak_of_slide(monkeypatch, frozen_heap):
    """mode='auto' at the slide plan's own estimate (the tightest budget that picks it; the
    stream, tried before slide, ruled out as for a model that cannot stream) runs slide, and the
    peak growth of that predict, measured with the uint8 image and the float batch a door holds
    (which the estimate counts), is within the estimate and not far below it. Slide's
    post-processing (the windows' map) outweighs one window's network here."""
    from test_lean_segmentation import _meta, _samples
    S = 640
    lean = _auto_segmentor(width=64, crop_size=(256, 256), stride=(192, 192), lean_chunk_mb=4)
    allowed = lean.why_not
    monkeypatch.setattr(lean, 'why_not',
                        lambda path: 'ruled out by the test' if path == 'stream' else allowed(path))
    samples = _samples([_meta((S, S), (S, S))])

    def door():
        image = torch.randint(0, 256, (1, 3, S, S), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(0))
        return lean.predict(image.float(), samples)

    with torch.no_grad():
        plans = {plan.name: plan.estimate_mb
                 for plan in lean.memory_plans(torch.zeros(1, 3, S, S), samples)}
        lean.test_cfg['max_memory'] = plans['slide']
        peak_mb = measure_peak_growth_mb(door)
    report = f'estimates {plans}, slide peak {peak_mb:.1f} MB'
    assert sorted(plans) == ['slide', 'whole'] and plans['slide'] < plans['whole'], report
    assert lean.last_memory_plan.name == 'slide', report
    assert peak_mb <= plans['slide'] < 1.5 * peak_mb, report
