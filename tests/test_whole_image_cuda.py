"""``benchmarks/peak_memory.py`` on CUDA, where a GPU is not needed: the GPU page quotes the
report of its committed artifact, whose budget points held (the run itself needs a GPU; its
series, one process per (backbone, path), are run on the CPU in test_whole_image_inference.py)."""
import json
import os
import os.path as osp
import shlex
import subprocess
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, osp.join(ROOT, 'benchmarks'))
import peak_memory as pm  # noqa: E402

ARTIFACT = osp.join(ROOT, 'docs', 'results', 'whole_image_cuda_h200.json')
STREAM_ARTIFACT = osp.join(ROOT, 'docs', 'results', 'whole_image_cuda_stream.json')


def test_the_gpu_page_quotes_the_artifact_and_every_budget_held(tmp_path, capsys):
    pm.main(['--report', ARTIFACT, '--png', str(tmp_path / 'art.png')])
    tables = capsys.readouterr().out
    assert osp.getsize(tmp_path / 'art.png') > 10_000
    with open(osp.join(ROOT, 'docs', 'benchmark_gpu.md')) as f:
        page = f.read()
    assert tables in page
    with open(ARTIFACT) as f:
        artifact = json.load(f)
    budget = [r for r in artifact['rows'] if r['path'] == 'auto']
    assert {r['plan'] for r in budget} == {'whole', 'stream'}
    for row in budget:
        assert row['peak_growth_mb'] <= row['estimate_mb'] <= row['max_memory']
        assert f"{row['estimate_mb']}, {row['peak_growth_mb']}" in page.replace('\n  ', ' ') \
            or f"estimate {row['estimate_mb']}, peak {row['peak_growth_mb']}" in page


@pytest.mark.parametrize('mode, artifact', [([], ARTIFACT), (['stream'], STREAM_ARTIFACT)])
def test_run_points_sh_runs_this_script_on_cuda_with_the_page_s_points(mode, artifact, tmp_path):
    """benchmarks/gpu/run_points.sh (and ``run_points.sh stream``) passes this script the
    arguments of the command that made the committed artifact, but for where it writes."""
    python = tmp_path / 'python'  # prints each call's arguments: the script runs nothing
    python.write_text('#!/bin/sh\necho "$@"\n')
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), OUT=str(tmp_path / 'out'),
               SITE=str(tmp_path / 'site'))
    calls = subprocess.run(['bash', osp.join(ROOT, 'benchmarks', 'gpu', 'run_points.sh'), *mode],
                           env=env, capture_output=True, text=True, check=True).stdout
    (command,) = [c for c in calls.splitlines() if c.startswith('benchmarks/peak_memory.py')]
    with open(artifact) as f:
        committed = json.load(f)['meta']['command']

    def parsed(line):
        argv = shlex.split(line)
        argv = argv[argv.index('benchmarks/peak_memory.py') + 1:]
        args = vars(pm.parse_args(pm.make_parser(), argv))
        return dict(args, log=osp.basename(args['log']), out=osp.basename(args['out']))

    assert parsed(command) == parsed(committed)
    assert parsed(command)['device'] == 'cuda'
