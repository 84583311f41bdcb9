"""``benchmarks/gpu/whole_image_cuda.py``: the order of its series, its budget points, and the
GPU page quoting the committed artifact through ``--report`` (the run itself needs a GPU)."""
import json
import os.path as osp
import shutil
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, osp.join(ROOT, 'benchmarks', 'gpu'))
import whole_image_cuda as wic  # noqa: E402

ARTIFACT = osp.join(ROOT, 'docs', 'results', 'whole_image_cuda_h200.json')


def test_xcit_pair_then_its_budget_points_then_the_other_series():
    args = wic.parse_args(['--backbones', 'xcit', 'uper', '--budgets', '8192:16000', '4096:4000'])
    assert wic.series(args) == [('xcit', 'lean'), ('xcit', 'stock'), ('xcit', 'auto'),
                                ('uper', 'lean'), ('uper', 'stock')]
    assert args.budgets == [[8192, 16000], [4096, 4000]]
    assert ('xcit', 'auto') not in wic.series(wic.parse_args(['--budgets']))


def test_the_gpu_page_quotes_the_artifact_and_every_budget_held(tmp_path, capsys):
    copy = tmp_path / 'art.json'
    shutil.copy(ARTIFACT, copy)
    wic.main(['--report', str(copy)])
    tables = capsys.readouterr().out
    assert osp.getsize(tmp_path / 'art.png') > 10_000
    with open(osp.join(ROOT, 'docs', 'benchmark_gpu.md')) as f:
        page = f.read()
    assert tables in page
    with open(ARTIFACT) as f:
        artifact = json.load(f)
    budget = [r for r in artifact['rows'] if r['path'] == 'auto']
    assert {r['plan'] for r in budget} == {'whole', 'slide'}
    for row in budget:
        assert row['peak_growth_mb'] <= row['estimate_mb'] <= row['max_memory']
        assert f"{row['estimate_mb']}, {row['peak_growth_mb']}" in page.replace('\n  ', ' ') \
            or f"estimate {row['estimate_mb']}, peak {row['peak_growth_mb']}" in page


@pytest.mark.parametrize('argv', [['--budgets', '8192'], ['--budgets', 'a:b']])
def test_a_malformed_budget_point_is_a_usage_error(argv):
    with pytest.raises(SystemExit):
        wic.parse_args(argv)
