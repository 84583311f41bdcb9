"""training_extras.run_results: the metrics quoted in README come from mmengine's own files."""
import json
import os.path as osp
import subprocess
import sys
from pathlib import Path

import pytest

from training_extras.run_results import collect_run_results

ROOT = Path(__file__).resolve().parents[1]


def _fake_run(work_dir: Path, records, log_lines):
    run = work_dir / '20261122_120000'
    (run / 'vis_data').mkdir(parents=True)
    (run / 'vis_data' / 'scalars.json').write_text(
        ''.join(json.dumps(r) + '\n' for r in records))
    (run / '20261122_120000.log').write_text(''.join(line + '\n' for line in log_lines))


@pytest.mark.parametrize('val', [{'coco/bbox_mAP_50': 0.64, 'coco/segm_mAP_50': 0.65},
                                 {'aAcc': 93.69, 'mIoU': 74.23, 'mAcc': 84.11}])
def test_last_validation_and_wall_time_of_mmdet_and_mmseg_runs(tmp_path, val):
    train = [{'lr': 1e-3, 'loss': 2.0, 'iter': 10, 'step': 10},
             {'lr': 0.0, 'loss': 0.5, 'iter': 20, 'step': 20}]
    _fake_run(tmp_path, [train[0], dict(val, step=10, time=0.1), train[1],
                         dict(val, step=20, data_time=0.0)],
              ['2026/11/22 12:00:00 - mmengine - INFO - start',
               'a line without a time stamp',
               '2026/11/22 12:04:38 - mmengine - INFO - end'])
    results = collect_run_results(str(tmp_path))
    assert results['metrics'] == val  # step / time keys dropped
    assert results['last_iter'] == 20 and results['final_loss'] == 0.5
    assert results['wall_seconds'] == 278.0


def test_cli_writes_the_artifact_and_names_a_missing_run(tmp_path, capsys):
    """A missing run is exit status 2 naming it (the tool's main); the real command line (its
    sys.path set-up and imports) writes the artifact."""
    import importlib.util
    tool = ROOT / 'tools' / 'analysis_tools' / 'collect_results.py'
    spec = importlib.util.spec_from_file_location('collect_results_tool', tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exc:
        module.main([str(tmp_path), '--command', 'x', '--out', str(tmp_path / 'r.json')])
    assert exc.value.code == 2 and 'no mmengine run in' in capsys.readouterr().err
    _fake_run(tmp_path, [{'lr': 1.0, 'loss': 1.0, 'iter': 1}, {'mIoU': 50.0, 'step': 1}],
              ['2026/11/22 12:00:00 - mmengine - INFO - a'])
    res = subprocess.run([sys.executable, str(tool), str(tmp_path), '--command', 'python x',
                          '--out', str(tmp_path / 'r.json'), '--note', 'idle'],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    stored = json.loads((tmp_path / 'r.json').read_text())
    assert stored['metrics'] == {'mIoU': 50.0} and stored['command'] == 'python x'
    assert stored['note'] == 'idle' and stored['wall_seconds'] is None


def test_readme_quick_start_table_quotes_the_committed_artifacts():
    """The quick-start rows of README.md are the artifacts' figures, and these meet the floors."""
    root = osp.dirname(osp.dirname(osp.abspath(__file__)))
    with open(osp.join(root, 'README.md')) as f:
        rows = [line for line in f if line.startswith(('| Mask R-CNN', '| Semantic FPN'))]
    assert len(rows) == 2, rows
    for row, name, quoted in (
            (rows[0], 'shapes_mask_rcnn', [('box AP50', 'coco/bbox_mAP_50', 3),
                                           ('box AP', 'coco/bbox_mAP', 3),
                                           ('mask AP50', 'coco/segm_mAP_50', 3)]),
            (rows[1], 'shapes_sem_fpn', [('mIoU', 'mIoU', 2), ('aAcc', 'aAcc', 2)])):
        with open(osp.join(root, 'docs', 'results', f'{name}.json')) as f:
            artifact = json.load(f)
        for label, key, digits in quoted:
            assert f'{label} {artifact["metrics"][key]:.{digits}f}' in row, (label, row)
        minutes, seconds = divmod(int(artifact['wall_seconds']), 60)
        assert f'{minutes} min {seconds} s' in row, row
        assert f'{artifact["last_iter"]} iterations' in row, row
        assert artifact['machine'].split(' (')[0] in row, row  # the CPU it ran on
    with open(osp.join(root, 'docs', 'results', 'shapes_mask_rcnn.json')) as f:
        assert json.load(f)['metrics']['coco/bbox_mAP_50'] >= 0.6
    with open(osp.join(root, 'docs', 'results', 'shapes_sem_fpn.json')) as f:
        assert json.load(f)['metrics']['mIoU'] >= 70
