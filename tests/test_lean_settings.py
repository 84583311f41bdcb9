"""The lean models' ``test_cfg``: read into settings when the model is built, read again (and so
checked again) only after it changed, in both ``LeanEncoderDecoder`` and ``LeanMaskRCNN``.

The models are the small ones of test_lean_segmentation / test_lean_detection; the keys expected in
the messages are those docs/lean_segmentation.md and docs/lean_detection.md list.
"""
import copy

import pytest
import torch
from mmengine.config import ConfigDict
from mmengine.registry import init_default_scope

import xcit_mm  # noqa: F401  (registers XCiTBackbone and the lean models)
from test_lean_detection import _meta, _model_cfg, _predict
from test_lean_segmentation import BACKBONE, SEM_FPN

pytestmark = pytest.mark.usefixtures('one_torch_thread')
MISSPELT = r"unknown test_cfg key\(s\) \['max_memroy'\]; the keys are \[.*'max_memory'"


def _segmentor(**test_cfg):
    """A small LeanEncoderDecoder, mode='whole' unless given (its default chooses: the tests of
    that are test_segmentation_memory_budget.py's)."""
    from mmseg.registry import MODELS
    init_default_scope('mmseg')
    return MODELS.build(dict(type='LeanEncoderDecoder', backbone=BACKBONE,
                             **copy.deepcopy(SEM_FPN),
                             test_cfg=ConfigDict(dict(mode='whole'), **test_cfg))).eval()


def _detector(**test_cfg):
    from mmdet.registry import MODELS
    cfg = _model_cfg()
    cfg.test_cfg.update(test_cfg)
    return MODELS.build(dict(cfg, type='LeanMaskRCNN')).eval()


def _predict_any(model):
    x = torch.randn(1, 3, 64, 64)
    if type(model).__name__ == 'LeanMaskRCNN':
        return _predict(model, x, [_meta((64, 64), (64, 64), (64, 64))])
    with torch.no_grad():
        return model.predict(x)


BUILD = dict(segmentor=_segmentor, detector=_detector)


@pytest.mark.parametrize('kind', BUILD)
def test_an_unknown_key_fails_the_build_naming_the_known_ones(kind):
    with pytest.raises(ValueError, match=MISSPELT):
        BUILD[kind](max_memroy=4000)
    with pytest.raises(ValueError, match=r"only apply to mode='auto'"):
        BUILD[kind](mode='whole', max_memory=4000)  # would run with no budget


@pytest.mark.parametrize('kind', BUILD)
def test_test_cfg_is_read_once_and_again_after_each_change(kind, monkeypatch):
    model = BUILD[kind]()
    reads = []
    real = model.SETTINGS.from_cfg
    monkeypatch.setattr(model.SETTINGS, 'from_cfg',
                        lambda *args, **kwargs: reads.append(1) or real(*args, **kwargs))
    _predict_any(model)
    _predict_any(model)
    assert reads == []  # read at build, not at predict
    model.test_cfg.max_memroy = 4000  # as a user sets it after the build
    with pytest.raises(ValueError, match=MISSPELT):
        _predict_any(model)
    model.test_cfg.pop('max_memroy')
    model.test_cfg['max_memory'] = 4000  # as benchmarks/peak_memory.py sets it
    with pytest.raises(ValueError, match=r"\['max_memory'\] only apply to mode='auto'"):
        _predict_any(model)
    model.test_cfg.mode = 'auto'  # the change takes effect
    assert model.test_settings.max_memory == 4000.0 and model.test_settings.mode == 'auto'
    model.test_cfg = ConfigDict(model.test_cfg, band_mb=0)  # a new object is read as well
    with pytest.raises(ValueError, match='band_mb must be a positive number of MB'):
        _predict_any(model)
    model.test_cfg.update(band_mb=64, lean=False)
    with pytest.raises(ValueError, match="mode='auto' needs the lean predict"):
        _predict_any(model)
    model.test_cfg.update(band_mb=None, max_memory=None, mode='whole')
    reads.clear()
    _predict_any(model)  # stock predict with lean=False
    _predict_any(model)
    assert len(reads) == 1 and model.test_settings.lean is False


def test_segmentor_window_defaults():
    """mode='auto' without crop_size: the data preprocessor's size, else mmseg's usual 512 crop,
    the stride two thirds of it (as mmseg's slide configs); mode='slide' needs both keys."""
    from xcit_mm.models.inference.settings import SegmentorSettings
    read = SegmentorSettings.from_cfg
    auto = dict(mode='auto', max_memory=1000)
    assert (read(auto).crop_size, read(auto).stride) == ((512, 512), (341, 341))
    got = read(auto, default_crop=(90, 60))
    assert (got.crop_size, got.stride) == ((90, 60), (60, 40))
    got = read(dict(auto, crop_size=(64, 64), stride=(64, 32)))
    assert (got.crop_size, got.stride) == ((64, 64), (64, 32))
    with pytest.raises(ValueError, match=r'needs crop_size=\(h, w\).*got \(0, 5\)'):
        read(dict(auto, crop_size=(0, 5)))
    with pytest.raises(ValueError, match=r'needs stride=\(h, w\).*got None'):
        read(dict(mode='slide', crop_size=(64, 64)))


def test_the_segmentor_chooses_unless_a_mode_is_set():
    """No mode (or mode=None): 'auto', within the memory the process may use unless max_memory
    is given; lean=False without a mode is stock's predict, not an error. The detector keeps
    'whole' and its 'auto' still needs max_memory (issue 56)."""
    from xcit_mm.models.inference.settings import DetectorSettings, SegmentorSettings
    from xcit_mm.models.utils.memory_budget import MemoryBudgetError
    read = SegmentorSettings.from_cfg
    assert (read({}).mode, read({}).max_memory) == ('auto', None)
    assert read(dict(mode=None, max_memory=3000)).max_memory == 3000.0
    assert (read(dict(lean=False)).mode, read(dict(lean=False)).lean) == ('whole', False)
    assert read(dict(mode='whole')).mode == 'whole'
    assert DetectorSettings.from_cfg({}).mode == 'whole'
    with pytest.raises(MemoryBudgetError, match='needs max_memory'):
        DetectorSettings.from_cfg(dict(mode='auto'))


GIB = 2**30
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 writes for "no limit"


def _write(root, files: dict):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# /proc/self/cgroup, the files under the cgroup mount, MemAvailable (kB); the budget (MB) and the
# file it came from
BUDGET_CASES = {
    # v2, the tighter room one level up (the kernel acts at the first limit reached)
    'v2': ('0::/job/step\n', {'cgroup.controllers': 'memory',
                              'job/memory.max': str(6 * GIB), 'job/memory.current': str(5 * GIB),
                              'job/step/memory.max': str(4 * GIB),
                              'job/step/memory.current': str(GIB)},
           8 * 2**20, 1024, 'cgroup v2 memory.max - memory.current of {root}/job'),
    'v2_no_limit': ('0::/job\n', {'cgroup.controllers': 'memory', 'job/memory.max': 'max',
                                  'job/memory.current': str(GIB)},
                    3 * 2**20, 3072, 'MemAvailable'),
    'v2_hybrid': ('1:memory:/\n0::/job\n',
                  {'unified/cgroup.controllers': '', 'unified/job/memory.max': str(2 * GIB),
                   'unified/job/memory.current': str(GIB // 2),
                   'memory/memory.limit_in_bytes': str(V1_UNLIMITED),
                   'memory/memory.usage_in_bytes': str(GIB)},
                  8 * 2**20, 1536, 'cgroup v2 memory.max - memory.current of {root}/unified/job'),
    'v1': ('5:cpu:/\n4:memory:/docker/abc\n',
           {'memory/docker/abc/memory.limit_in_bytes': str(2 * GIB),
            'memory/docker/abc/memory.usage_in_bytes': str(GIB // 4)},
           8 * 2**20, 1792, 'cgroup v1 memory.limit_in_bytes - memory.usage_in_bytes of '
           '{root}/memory/docker/abc'),
    # a container: its own cgroup at the mount's root, the host's path absent
    'v1_container': ('4:memory:/host/path\n', {'memory/memory.limit_in_bytes': str(3 * GIB),
                                               'memory/memory.usage_in_bytes': str(GIB)},
                     8 * 2**20, 2048, 'cgroup v1 memory.limit_in_bytes'),
    'v1_unlimited': ('4:memory:/\n', {'memory/memory.limit_in_bytes': str(V1_UNLIMITED),
                                      'memory/memory.usage_in_bytes': str(GIB)},
                     5 * 2**20, 5120, 'MemAvailable'),
    'meminfo_only': (None, {}, 2 * 2**20, 2048, 'MemAvailable in {meminfo}'),
    'nothing': (None, {}, None, None, None),
}


@pytest.mark.parametrize('case', list(BUDGET_CASES))
def test_process_budget_from_cgroup_v2_v1_and_meminfo(case, tmp_path, monkeypatch):
    """The budget nobody set: the least room of the process's memory cgroups and those above,
    and MemAvailable, the smaller; None where nothing can be read."""
    from xcit_mm.models.utils import memory_budget
    proc_cgroup, files, available_kb, expected_mb, source = BUDGET_CASES[case]
    root, meminfo = tmp_path / 'cgroup', tmp_path / 'meminfo'
    _write(root, files)
    if proc_cgroup is not None:
        (tmp_path / 'self_cgroup').write_text(proc_cgroup)
    if available_kb is not None:
        meminfo.write_text(f'MemTotal:       {2 * available_kb} kB\n'
                           f'MemFree:        {available_kb // 2} kB\n'
                           f'MemAvailable:   {available_kb} kB\n')
    monkeypatch.setattr(memory_budget, 'CGROUP_ROOT', str(root))
    monkeypatch.setattr(memory_budget, 'PROC_SELF_CGROUP', str(tmp_path / 'self_cgroup'))
    monkeypatch.setattr(memory_budget, 'PROC_MEMINFO', str(meminfo))
    budget = memory_budget.process_budget()
    if expected_mb is None:
        assert budget is None
        return
    assert budget.mb == pytest.approx(expected_mb)
    assert budget.source.startswith(source.format(root=root, meminfo=meminfo)), budget.source


def test_process_budget_on_cuda_counts_the_allocators_unused_blocks(monkeypatch):
    """On CUDA: the device's free memory plus the blocks torch's caching allocator holds unused
    (it reuses them before asking the device)."""
    from xcit_mm.models.utils import memory_budget
    cuda = memory_budget.torch.cuda
    monkeypatch.setattr(cuda, 'mem_get_info', lambda device=None: (3 * GIB, 8 * GIB))
    monkeypatch.setattr(cuda, 'memory_reserved', lambda device=None: GIB)
    monkeypatch.setattr(cuda, 'memory_allocated', lambda device=None: GIB // 4)
    budget = memory_budget.process_budget('cuda:0')
    assert budget.mb == pytest.approx(3 * 1024 + 768)
    assert budget.source.startswith('free memory of cuda:0'), budget.source
