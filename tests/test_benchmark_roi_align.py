"""Tests of benchmarks/benchmark_roi_align.py: its cases, a tiny end-to-end run, its JSON / CSV /
Markdown outputs, its command-line errors and the docs' table.

No timing assertions: the machine is shared and timings are noise here.
"""
import csv
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = (dict(name='tiny', map=(1, 4, 12, 12), stride=4, rois=5, output=3, sampling_ratio=2),
        dict(name='tiny_adaptive', map=(1, 4, 12, 12), stride=4, rois=5, output=2,
             sampling_ratio=0))


def test_builtin_cases(roi_align_bench):
    cases = {c['name']: c for c in roi_align_bench.CASES}
    assert {'shapes_bbox', 'shapes_mask', 'coco_bbox', 'coco_mask'} <= set(cases)
    assert cases['shapes_bbox']['map'] == (4, 64, 40, 40) and cases['shapes_bbox']['rois'] == 128
    assert cases['coco_mask']['map'] == (2, 256, 200, 304) and cases['coco_mask']['output'] == 14
    # RoIs of a real case: deterministic, inside the image, valid boxes, all batch indices
    feat, rois, weight = roi_align_bench.make_inputs(cases['shapes_bbox'])
    again = roi_align_bench.make_inputs(cases['shapes_bbox'])[1]
    assert feat.shape == (4, 64, 40, 40) and weight.shape == (128, 64, 7, 7)
    assert rois.shape == (128, 5) and (rois == again).all()
    assert set(rois[:, 0].long().tolist()) == {0, 1, 2, 3}
    assert (rois[:, 1:3] >= 0).all() and (rois[:, 3:] <= 160).all()
    assert (rois[:, 3:] > rois[:, 1:3]).all()


def test_main_writes_json_csv_and_markdown(roi_align_bench, tmp_path, capsys):
    argv = ['--cases', 'tiny', 'tiny_adaptive', '--repeats', '2', '--warmup', '1', '--quiet',
            '--threads', '1', '--out-dir', str(tmp_path), '--name', 'rb']
    assert roi_align_bench.main(argv, cases=roi_align_bench.CASES + TINY) == 0
    printed = capsys.readouterr().out
    assert 'tiny_adaptive' in printed and 'wrote' in printed

    with open(tmp_path / 'rb.json') as f:
        data = json.load(f)
    meta, records = data['meta'], data['records']
    assert meta['threads'] == 1 and meta['torch'] and meta['mmcv']
    assert meta['command'].endswith(' '.join(argv)) and meta['date']
    assert [r['case'] for r in records] == ['tiny', 'tiny_adaptive']
    for rec in records:
        assert rec['max_diff_out'] < 1e-4 and rec['max_diff_grad'] < 1e-4
        for key in ('mmcv_fwd_ms', 'gather_fwd_ms', 'mmcv_fwd_bwd_ms', 'gather_fwd_bwd_ms'):
            assert rec[key] > 0 and len(rec['times'][key]) == 2
            assert all(v > 0 for v in rec['times'][key])
        assert rec['fwd_speedup'] == pytest.approx(rec['mmcv_fwd_ms'] / rec['gather_fwd_ms'])
    with open(tmp_path / 'rb.csv') as f:
        rows = list(csv.DictReader(f))
    assert [r['case'] for r in rows] == ['tiny', 'tiny_adaptive'] and rows[0]['map'] == '1x4x12x12'

    assert roi_align_bench.main(['--markdown', str(tmp_path / 'rb.json')]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + len(records) and lines[0].startswith('| case |')
    for line, rec in zip(lines[2:], records):
        assert line.startswith(f"| {rec['case']} | 1x4x12x12 | 5 |")
    assert lines[2:] == roi_align_bench.markdown_table(records).splitlines()[2:]


def test_unknown_case_is_an_argparse_error(roi_align_bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        roi_align_bench.main(['--cases', 'nope', '--out-dir', str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and all(c['name'] in err for c in roi_align_bench.CASES)
    assert not os.listdir(tmp_path)


def test_docs_table_quotes_the_committed_artifact(roi_align_bench, capsys):
    """docs/benchmark_shapes.md shows the RoIAlign table exactly as --markdown renders the JSON."""
    artifact = os.path.join(ROOT, 'docs', 'benchmark', 'roi_align_cpu.json')
    assert roi_align_bench.main(['--markdown', artifact]) == 0
    rendered = capsys.readouterr().out.strip().splitlines()
    with open(os.path.join(ROOT, 'docs', 'benchmark_shapes.md')) as f:
        doc = f.read()
    assert len(rendered) == 2 + len(roi_align_bench.CASES)
    missing = [line for line in rendered if line not in doc]
    assert not missing, f'docs/benchmark_shapes.md does not quote roi_align_cpu.json: {missing}'
