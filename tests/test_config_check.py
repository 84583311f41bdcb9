"""Config mistakes end in one clear line, before mmengine's environment and config dump."""
import os.path as osp

import pytest
from mmengine.config import Config

from training_extras.preflight import ConfigError, check_backbone_config

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
DET = osp.join(REPO, 'configs', 'mask_rcnn_xcit_s12_p16_3x_coco.py')
SEG = osp.join(REPO, 'configs', 'sem_fpn_xcit_s12_p8_80k_ade20k.py')


# each tool once and each setting once: both tools call the same check_backbone_config, and the
# backbone's own errors for each setting are tested in tests/test_xcit_backbone.py. The tools'
# main in this process: a command line's exit status and error line are test_tools.py's
# test_cli_reports_missing_ade_data.
@pytest.mark.parametrize('tool, option, message', [
    ('train', 'model.backbone.arch=s13', "model.backbone: Unknown XCiT arch 's13'"),
    ('test', 'model.backbone.patch_size=14', 'model.backbone: patch_size must be 8 or 16'),
])
def test_a_wrong_backbone_setting_is_one_line_before_the_dump(
        tool, option, message, tmp_path, train_tool, test_tool, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [DET, str(tmp_path / 'unused.pth')] if tool == 'test' else [DET]
    with pytest.raises(SystemExit) as info:
        (train_tool if tool == 'train' else test_tool).main(args + ['--cfg-options', option])
    assert str(info.value.code).startswith(f'error: {message}'), info.value.code
    assert '\n' not in str(info.value.code)
    assert not (tmp_path / 'work_dirs').exists()  # no Runner was built (it makes the work dir)


def test_every_published_backbone_config_passes_the_check():
    for path in (DET, SEG, osp.join(REPO, 'configs', 'upernet_xcit_m24_p8_160k_ade20k.py')):
        check_backbone_config(Config.fromfile(path))
    cfg = Config.fromfile(SEG)
    cfg.model.backbone.frozen_stages = 40
    with pytest.raises(ConfigError, match=r'model.backbone: frozen_stages must be in \[-1, 12\]'):
        check_backbone_config(cfg)
