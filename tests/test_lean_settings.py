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
    from mmseg.registry import MODELS
    init_default_scope('mmseg')
    return MODELS.build(dict(type='LeanEncoderDecoder', backbone=BACKBONE,
                             **copy.deepcopy(SEM_FPN), test_cfg=ConfigDict(test_cfg))).eval()


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
        BUILD[kind](max_memory=4000)  # mode 'whole' would run with no budget


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
