"""ONNX export and ONNX Runtime (issue 13, part 3): tools/deployment/export_onnx.py and
xcit_mm.deployment.

The small shapes configs (XCiT D=128: Sem-FPN p16, Mask R-CNN p8) are exported with dynamic axes
and run by ONNX Runtime at the export size and at a second, padded size; the relative difference
to PyTorch must stay under 1e-4 (it is ~1e-6).

onnx and onnxruntime are part of the install (tools/install.sh, the ``onnx`` extra): where they
are missing, every test that needs them FAILS with the install command (``onnx_packages``), and
the tests that need neither (the exported module's arithmetic, the package importing without
them) still run.

The Sem-FPN model is built once (``seg_model``) and exported once, through the command line
(``seg_cli``); the other Sem-FPN tests reuse both.
"""
import contextlib
import io
import json
import os
import shutil
import sys

import pytest
import torch
import torch.nn as nn

from background import background_process

import xcit_mm.deployment as deployment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, 'tools', 'deployment', 'export_onnx.py')
SEG_CFG = os.path.join(ROOT, 'configs', 'shapes', 'sem_fpn_xcit_shapes_ade.py')
DET_CFG = os.path.join(ROOT, 'configs', 'shapes', 'mask_rcnn_xcit_shapes_coco.py')


def _import_onnx_packages():
    try:
        import onnx
        import onnxruntime
    except ImportError as e:
        pytest.fail(f'{type(e).__name__}: {e}. onnx and onnxruntime are part of the install: run '
                    "`bash tools/install.sh` (or pip install 'xcit_mm[onnx]')", pytrace=False)
    return onnx, onnxruntime


@pytest.fixture(scope='module')
def onnx_packages():
    """(onnx, onnxruntime); a test using it fails (not skips) where they are missing."""
    return _import_onnx_packages()


def test_onnx_and_onnxruntime_are_installed():
    onnx, ort = _import_onnx_packages()
    assert onnx.__version__ and ort.__version__


# one torch thread and a frozen heap for the timing code (fixtures of conftest.py)
pytestmark = pytest.mark.usefixtures('one_torch_thread', 'frozen_heap')


# ---------------------------------------------------------------------------------------------
# Sem-FPN: built once, exported once through the command line
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def seg_model():
    """The exported module of the Sem-FPN shapes config (random init), built once."""
    return deployment.build_export_model(SEG_CFG)


@pytest.fixture(scope='module')
def seg_cli(onnx_tool, onnx_packages, seg_model, tmp_path_factory):
    """``export_onnx.py SEG_CFG --shape 160 160 --dynamic --verify`` with the model building
    served by ``seg_model`` (the arguments it got are recorded): exit status, printed text, the
    file."""
    path = str(tmp_path_factory.mktemp('onnx') / 'sem_fpn.onnx')
    builds = []

    def build(*args, **kwargs):
        builds.append((args, kwargs))
        return seg_model

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deployment, 'build_export_model', build)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = onnx_tool.main([SEG_CFG, '--out', path, '--shape', '160', '160',
                                     '--dynamic', '--verify'])
    return dict(status=status, out=out.getvalue(), err=err.getvalue(), path=path,
                builds=builds)


def test_sem_fpn_exports_and_verifies_at_two_sizes(seg_cli, onnx_packages):
    """image -> per-class logits at the input size; ORT equals PyTorch at 160x160 (export) and
    192x144 (dynamic axes); the file carries the task, the classes and its axes."""
    onnx, _ = onnx_packages
    text = seg_cli['out']
    assert seg_cli['status'] == 0, text + seg_cli['err']
    assert seg_cli['builds'] == [((SEG_CFG, None, None), {})]
    assert 'verify 160x160: OK' in text and 'verify 192x144: OK' in text, text
    assert 'logits   1x4x192x144' in text
    model = onnx.load(seg_cli['path'])
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta['xcit_mm.task'] == 'seg' and meta['xcit_mm.dynamic'] == 'True'
    assert meta['xcit_mm.export_shape'] == '160x160'
    assert meta['xcit_mm.classes'] == 'background,circle,square,triangle'
    assert [i.name for i in model.graph.input] == ['image']
    assert [o.name for o in model.graph.output] == ['logits']


def test_verify_mismatch_is_exit_status_1(onnx_tool, seg_cli, seg_model, monkeypatch,
                                          tmp_path, capsys):
    """A too strict --tolerance: the command reports the mismatch and exits with status 1 (the
    file of ``seg_cli`` is checked again, at its export size)."""
    monkeypatch.setattr(deployment, 'build_export_model', lambda *args, **kwargs: seg_model)
    monkeypatch.setattr(deployment, 'export_onnx',
                        lambda model, out, *args, **kwargs: shutil.copy(seg_cli['path'], out))
    out = str(tmp_path / 'strict.onnx')
    assert onnx_tool.main([SEG_CFG, '--out', out, '--shape', '160', '160', '--verify',
                           '--tolerance', '1e-12']) == 1
    captured = capsys.readouterr()
    assert 'verify 160x160: MISMATCH' in captured.out, captured.out
    assert 'error: ONNX Runtime differs from PyTorch' in captured.err


def test_segmentor_logits_are_the_segmentors_inference(seg_model):
    """The exported module computes what EncoderDecoder.encode_decode does (whole inference)."""
    image = torch.randn(1, 3, 96, 128)
    with torch.no_grad():
        want = seg_model.model.encode_decode(image, [dict(img_shape=(96, 128))])
        got = seg_model(image)
    torch.testing.assert_close(got, want)


def test_benchmark_onnx_option(bench, seg_model, onnx_packages, monkeypatch, tmp_path, capsys):
    """benchmark.py --onnx CONFIG: PyTorch eager and ONNX Runtime records, timed in the same
    rounds, the (static) file checked against PyTorch first (note), the ratio ONNX Runtime /
    eager.  In this process, on ``seg_model``; the reference matmul step at 256 instead of 1024
    (its rate is not checked here: 1/64 of the work)."""
    from xcit_benchmark import timing
    _, ort = onnx_packages
    monkeypatch.setattr(deployment, 'build_export_model', lambda *args, **kwargs: seg_model)
    monkeypatch.setattr(timing, 'MATMUL_SIZE', 256)
    threads = torch.get_num_threads()
    try:
        assert bench.main(['--onnx', SEG_CFG, '--resolutions', '64', '--repeats', '2',
                           '--warmup', '0', '--threads', '1', '--out-dir', str(tmp_path),
                           '--quiet']) == 0
    finally:
        torch.set_num_threads(threads)
    assert 'sem_fpn_xcit_shapes_ade+onnxruntime' in capsys.readouterr().out
    with open(tmp_path / 'onnx.json') as f:
        data = json.load(f)
    names = [r['model'] for r in data['records']]
    assert names == ['sem_fpn_xcit_shapes_ade', 'sem_fpn_xcit_shapes_ade+onnxruntime']
    for r in data['records']:
        assert r['status'] == 'ok' and len(r['times_s']) == 2 and r['ms_per_img'] > 0
        assert 'max rel diff' in r['note']
    assert data['meta']['ratios'][0]['a'] == 'sem_fpn_xcit_shapes_ade+onnxruntime'
    assert data['meta']['onnxruntime'] == ort.__version__


# ---------------------------------------------------------------------------------------------
# Mask R-CNN, the exporter's pieces, bad inputs
# ---------------------------------------------------------------------------------------------
def test_mask_rcnn_backbone_and_neck(onnx_packages, tmp_path):
    """A Mask R-CNN config exports backbone + FPN: 5 maps at strides 4..64, equal in ORT at the
    export size and a padded second size."""
    from xcit_mm.deployment import build_export_model, export_onnx, verify_onnx
    model = build_export_model(DET_CFG)
    assert model.task == 'det' and model.output_names == [f'feat{i}' for i in range(5)]
    path = export_onnx(model, str(tmp_path / 'mask_rcnn.onnx'), (128, 160), dynamic=True)
    results = verify_onnx(model, path, [(128, 160), (150, 200)])
    for r in results:
        assert r['ok'], r
        assert r['max_rel'] < 1e-4
    assert [o['shape'][-2:] for o in results[1]['outputs']] == \
        [[38, 50], [19, 25], [10, 13], [5, 7], [3, 4]]


def test_adaptive_avg_pool_replacement_is_exact():
    """UperNet's pyramid pooling is exported through averaging matrices (dynamic sizes); they
    equal nn.AdaptiveAvgPool2d for every output size and uneven bins."""
    from xcit_mm.deployment.onnx import _adaptive_avg_pool_traceable
    for size in (1, 2, 3, 6, (2, 5)):
        pool = nn.AdaptiveAvgPool2d(size)
        for hw in ((16, 16), (13, 9), (7, 20)):
            x = torch.randn(2, 4, *hw, dtype=torch.float64)
            torch.testing.assert_close(_adaptive_avg_pool_traceable(pool, x), pool(x))


def test_bad_inputs_are_one_error_line(onnx_tool, onnx_packages, tmp_path, capsys):
    """Exit status 2 and one 'error:' line, before anything is exported."""
    other = tmp_path / 'classifier.py'
    other.write_text("default_scope = 'mmpretrain'\nmodel = dict(type='ImageClassifier')\n")
    cascade = tmp_path / 'cascade.py'
    cascade.write_text(f"_base_ = ['{SEG_CFG}']\nmodel = dict(type='CascadeEncoderDecoder')\n")
    cases = [
        ([SEG_CFG, str(tmp_path / 'missing.pth')], 'checkpoint not found'),
        ([str(tmp_path / 'missing.py')], 'config not found'),
        ([str(other)], "default_scope is 'mmpretrain'"),
        ([str(cascade)], "segmentor type 'CascadeEncoderDecoder' is not supported"),
        ([TOOL], 'cannot read config'),
    ]
    for argv, message in cases:
        out = tmp_path / 'x.onnx'
        assert onnx_tool.main(argv + ['--out', str(out), '--shape', '64', '64']) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith('error: ') and message in err and '\n' not in err, (argv, err)
        assert not out.exists()
    assert onnx_tool.main([SEG_CFG, '--out', str(tmp_path / 'x.onnx'), '--shape', '16', '64']) == 2
    assert 'error: image sides must be >= 32 px' in capsys.readouterr().err
    assert onnx_tool.main([SEG_CFG, '--out', str(tmp_path / 'x.onnx'), '--shape', '64', '64',
                           '--dynamic', '--verify-shape', '64', '16']) == 2
    assert 'got --verify-shape [64, 16]' in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# without onnx (a fresh process, started with the module: it runs meanwhile on the other core)
# ---------------------------------------------------------------------------------------------
BLOCK_ONNX = r'''
import sys
class Block:
    blocked = {'onnx', 'onnxruntime'}
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in self.blocked:
            raise ImportError(f'blocked {name}')
block = Block()
sys.meta_path.insert(0, block)
import xcit_mm, xcit_mm.apis, xcit_mm.deployment
from xcit_mm.deployment import check_onnx_runtime
try:
    check_onnx_runtime()
except ImportError as e:
    print('@@', e)
block.blocked.discard('onnx')  # onnx alone: enough for an export, not for --verify
print('@@ export only:', check_onnx_runtime(need_runtime=False)[1])
try:
    check_onnx_runtime()
except ImportError as e:
    print('@@', e)
'''
BLOCK_TEST = 'test_package_imports_without_onnx'


@pytest.fixture(scope='module', autouse=True)
def blocked_import_run(request, tmp_path_factory):
    """The process of ``test_package_imports_without_onnx``, started with the module (if that
    test is selected) so that it runs on the second core meanwhile; killed at the end of the
    module if still running."""
    if not any(item.name == BLOCK_TEST for item in request.session.items):
        yield None
        return
    out_dir = tmp_path_factory.mktemp('onnx_blocked')
    with background_process([sys.executable, '-c', BLOCK_ONNX], out_dir, cwd=ROOT) as proc:
        yield proc, out_dir


def test_package_imports_without_onnx(blocked_import_run):
    """xcit_mm, xcit_mm.apis and xcit_mm.deployment import where onnx / onnxruntime cannot be
    imported; the export then says how to install them."""
    proc, out_dir = blocked_import_run
    returncode = proc.wait(timeout=300)
    stdout = (out_dir / 'stdout.txt').read_text()
    assert returncode == 0, (out_dir / 'stderr.txt').read_text()
    assert "@@ ONNX export needs the onnx package: pip install 'xcit_mm[onnx]'" in stdout
    assert '@@ export only: None' in stdout
    assert "@@ --verify needs onnxruntime: pip install 'xcit_mm[onnx]'" in stdout
