"""tools/train.py, tools/test.py and their helpers in training_extras (CPU only, no real data).

Training and resuming on the built-in shapes data are covered by tests/test_shapes.py; here the
tools are exercised up to the point where they hand over to mmengine's Runner, plus the CPU
distributed pieces in a one-process gloo group.
"""
import contextlib
import gc
import json
import logging
import os
import os.path as osp
import socket
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config

from shapes_world import ensure_shapes_world
from training_extras import (CPUDistributedDataParallel, DatasetNotFoundError, check_data,
                             distributed_session, find_missing_data, init_cpu_dist,
                             init_distributed, prepare_cpu_distributed_cfg)

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
COCO_CFG = osp.join(REPO, 'configs', 'mask_rcnn_xcit_t12_p16_3x_coco.py')
ADE_CFG = osp.join(REPO, 'configs', 'upernet_xcit_t12_p16_160k_ade20k.py')


def _coco_overrides(root):
    root = str(root).rstrip('/') + '/'
    return {
        'train_dataloader.dataset.data_root': root,
        'val_dataloader.dataset.data_root': root,
        'test_dataloader.dataset.data_root': root,
        'val_evaluator.ann_file': root + 'annotations/instances_val2017.json',
        'test_evaluator.ann_file': root + 'annotations/instances_val2017.json',
    }


def _make_coco(root):
    for d in ('annotations', 'train2017', 'val2017'):
        (root / d).mkdir(parents=True, exist_ok=True)
    for split in ('train', 'val'):
        (root / 'annotations' / f'instances_{split}2017.json').write_text(
            '{"images": [], "annotations": [], "categories": []}')


# ----------------------------------------------------------------------------- data check
def test_missing_coco_gives_download_instructions(tmp_path):
    cfg = Config.fromfile(COCO_CFG)
    root = tmp_path / 'coco'
    cfg.merge_from_dict(_coco_overrides(root))
    with pytest.raises(DatasetNotFoundError) as info:
        check_data(cfg, splits=('train', 'val'), config_name='coco.py')
    message = str(info.value)
    assert 'Dataset not found for coco.py' in message
    assert f'{root}/annotations/instances_train2017.json' in message
    assert f'{root}/train2017' in message and f'{root}/val2017' in message
    assert 'http://images.cocodataset.org/zips/train2017.zip' in message
    assert 'annotations_trainval2017.zip' in message
    assert '--cfg-options' in message and 'val_evaluator.ann_file=' in message
    wheres = {where for where, _, _ in info.value.missing}
    assert wheres == {'train_dataloader', 'val_dataloader'}  # evaluator file == val ann file

    _make_coco(root)
    check_data(cfg, splits=('train', 'val', 'test'))  # complete -> no error
    (root / 'annotations' / 'instances_val2017.json').unlink()
    missing = find_missing_data(cfg, splits=('test', ))
    assert [(w, k) for w, k, _ in missing] == [('test_dataloader', 'annotation file')]


def test_missing_ade_gives_download_instructions(tmp_path):
    cfg = Config.fromfile(ADE_CFG)
    root = tmp_path / 'ade' / 'ADEChallengeData2016'
    cfg.merge_from_dict({'train_dataloader.dataset.data_root': str(root),
                         'val_dataloader.dataset.data_root': str(root)})
    with pytest.raises(DatasetNotFoundError) as info:
        check_data(cfg)
    message = str(info.value)
    assert 'ADEChallengeData2016.zip' in message
    assert f'{root}/images/training' in message and f'{root}/annotations/validation' in message
    assert 'train_dataloader.dataset.data_root=/path/to/ADEChallengeData2016' in message
    for sub in ('images/training', 'images/validation', 'annotations/training',
                'annotations/validation'):
        (root / sub).mkdir(parents=True)
    check_data(cfg)


def test_data_check_skips_disabled_loops_and_remote_paths(tmp_path):
    cfg = Config.fromfile(COCO_CFG)
    cfg.merge_from_dict(_coco_overrides(tmp_path / 'nowhere'))
    cfg.val_cfg = None  # no validation during training -> val data not needed
    assert {w for w, _, _ in find_missing_data(cfg)} == {'train_dataloader'}
    cfg.train_dataloader.dataset.data_root = 's3://bucket/coco/'
    assert find_missing_data(cfg) == []
    # Wrapped datasets (RepeatDataset / ConcatDataset) are looked through.
    inner = cfg.val_dataloader.dataset
    cfg.train_dataloader.dataset = dict(type='ConcatDataset', datasets=[
        dict(type='RepeatDataset', times=2, dataset=inner)])
    assert {w for w, _, _ in find_missing_data(cfg)} == {'train_dataloader'}


def test_train_tool_exits_with_the_message(tmp_path, train_tool):
    options = [f'{k}={v}' for k, v in _coco_overrides(tmp_path / 'coco').items()]
    with pytest.raises(SystemExit) as info:
        train_tool.main([COCO_CFG, '--work-dir', str(tmp_path / 'w'), '--cfg-options', *options])
    assert 'cocodataset.org' in str(info.value.code)
    assert not (tmp_path / 'w').exists()  # nothing was built


def test_cli_reports_missing_ade_data(tmp_path):
    """The real command line (script imports, sys.path set-up, exit status)."""
    root = tmp_path / 'ADEChallengeData2016'
    proc = subprocess.run(
        [sys.executable, osp.join(REPO, 'tools', 'test.py'), ADE_CFG,
         'https://example.invalid/ckpt.pth', '--cfg-options',
         f'test_dataloader.dataset.data_root={root}'],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'ADEChallengeData2016.zip' in proc.stderr
    assert f'{root}/images/validation' in proc.stderr


# ----------------------------------------------------------------------------- tool options
def test_train_options(train_tool, tmp_path):
    args = train_tool.parse_args([COCO_CFG, '--resume', '--amp', '--auto-scale-lr'])
    cfg = train_tool.build_cfg(args)
    assert cfg.resume is True and cfg.load_from is None
    # mmengine's AmpOptimWrapper needs a GPU; without one --amp means bfloat16 CPU autocast.
    expected = 'AmpOptimWrapper' if torch.cuda.is_available() else 'CPUAmpOptimWrapper'
    assert cfg.optim_wrapper.type == expected
    assert cfg.auto_scale_lr.enable is True
    assert cfg.work_dir == osp.join('./work_dirs', 'mask_rcnn_xcit_t12_p16_3x_coco')
    args = train_tool.parse_args([ADE_CFG, '--resume', 'ckpt.pth', '--work-dir', str(tmp_path),
                                  '--cfg-options', 'train_cfg.max_iters=10', '--launcher', 'slurm'])
    cfg = train_tool.build_cfg(args)
    assert (cfg.resume, cfg.load_from, cfg.work_dir) == (True, 'ckpt.pth', str(tmp_path))
    assert (cfg.train_cfg.max_iters, cfg.launcher) == (10, 'slurm')
    cfg = train_tool.build_cfg(train_tool.parse_args([ADE_CFG]))
    assert (cfg.resume, cfg.launcher) == (False, 'none')


def test_test_options(test_tool, tmp_path):
    det = test_tool.build_cfg(test_tool.parse_args(
        [COCO_CFG, 'ckpt.pth', '--show-dir', 'vis', '--out', 'res.pkl']))
    assert det.load_from == 'ckpt.pth'
    hook = det.default_hooks.visualization
    assert hook.draw is True and hook.test_out_dir == osp.abspath('vis')
    with pytest.raises(SystemExit):
        test_tool.build_cfg(test_tool.parse_args([COCO_CFG, 'ckpt.pth', '--out', 'dir']))

    seg = test_tool.build_cfg(test_tool.parse_args(
        [ADE_CFG, 'ckpt.pth', '--show-dir', 'vis', '--out', str(tmp_path / 'png')]))
    assert seg.default_hooks.visualization.draw is True
    assert seg.default_hooks.visualization.interval == 1
    assert seg.visualizer.save_dir == osp.abspath('vis')
    assert seg.test_evaluator.output_dir == str(tmp_path / 'png')

    with pytest.raises(SystemExit) as info:
        test_tool.main([ADE_CFG, str(tmp_path / 'missing.pth')])
    assert 'checkpoint not found' in str(info.value.code)


# ----------------------------------------------------------------------------- config path
def test_missing_config_is_one_line_not_a_traceback(tmp_path, train_tool, test_tool, capsys):
    """A mistyped config path: argparse-style ``error: config not found: PATH``, exit status 2."""
    missing = str(tmp_path / 'configs' / 'no_such_config.py')
    for run in (lambda: train_tool.main([missing]),
                lambda: test_tool.main([missing, str(tmp_path / 'ckpt.pth')])):
        with pytest.raises(SystemExit) as info:
            run()
        assert info.value.code == 2
        assert capsys.readouterr().err.strip() == f'error: config not found: {missing}'


def test_both_tools_end_with_the_same_options(train_tool, test_tool, monkeypatch, capsys):
    """--local-rank (torch.distributed.launch) becomes LOCAL_RANK unless a launcher set it; each
    tool's --cfg-options example names the dataloader that tool reads."""
    for tool, args, dataloader in ((train_tool, [ADE_CFG], 'train_dataloader'),
                                   (test_tool, [ADE_CFG, 'ckpt.pth'], 'test_dataloader')):
        monkeypatch.delenv('LOCAL_RANK', raising=False)
        parsed = tool.parse_args(args + ['--local-rank', '3', '--launcher', 'pytorch'])
        assert (parsed.local_rank, parsed.launcher, os.environ['LOCAL_RANK']) == (3, 'pytorch', '3')
        monkeypatch.setenv('LOCAL_RANK', '1')
        tool.parse_args(args + ['--local_rank', '3'])
        assert os.environ['LOCAL_RANK'] == '1'
        with pytest.raises(SystemExit):
            tool.parse_args(['--help'])
        assert f'{dataloader}.dataset.data_root=/data/coco/' in capsys.readouterr().out


# ----------------------------------------------------------------------------- --amp on a CPU
@pytest.mark.usefixtures('cpu_only')  # run on the CPU, also where a GPU is present
@pytest.mark.parametrize('native_bf16', [False, True, None])
def test_amp_warns_once_on_a_cpu_without_native_bf16(train_tool, monkeypatch, native_bf16):
    """--amp on a CPU without avx512_bf16 / AMX: one warning (measured slowdown, advice to train
    in float32) per process; none where bfloat16 is native or the CPU cannot be told."""
    import training_extras.cpu_amp_optim_wrapper as amp
    monkeypatch.setattr(amp, 'cpu_has_native_bf16', lambda: native_bf16)
    monkeypatch.setattr(amp, '_warned_slow_bf16', False)
    monkeypatch.delenv('RANK', raising=False)
    logged = []
    monkeypatch.setattr(amp, 'print_log', lambda msg, **kw: logged.append((msg, kw)))
    for _ in range(2):
        cfg = train_tool.build_cfg(train_tool.parse_args([ADE_CFG, '--amp']))
        assert cfg.optim_wrapper.type == 'CPUAmpOptimWrapper'
    train_tool.build_cfg(train_tool.parse_args([ADE_CFG]))  # float32: never a warning
    if native_bf16 is False:
        assert len(logged) == 1
        message, kwargs = logged[0]
        assert kwargs['level'] == logging.WARNING
        assert 'avx512_bf16' in message and 'several times slower' in message
        assert 'drop --amp' in message
    else:
        assert logged == []


def test_cpu_bf16_detection_reads_the_cpu_flags(tmp_path):
    from training_extras.cpu_amp_optim_wrapper import cpu_has_native_bf16
    cpuinfo = tmp_path / 'cpuinfo'
    cpuinfo.write_text('processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n')
    assert cpu_has_native_bf16(str(cpuinfo)) is False
    cpuinfo.write_text('processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n')
    assert cpu_has_native_bf16(str(cpuinfo)) is True
    cpuinfo.write_text('processor\t: 0\nflags\t\t: fpu avx512f amx_tile amx_bf16\n')
    assert cpu_has_native_bf16(str(cpuinfo)) is True
    cpuinfo.write_text('processor\t: 0\nFeatures\t: fp asimd sve bf16\n')  # Arm
    assert cpu_has_native_bf16(str(cpuinfo)) is True
    assert cpu_has_native_bf16(str(tmp_path / 'absent')) is None


# ----------------------------------------------------------------------------- shapes data
_TINY_WORLD = dict(task='coco', num_train=2, num_val=1, image_size=32, seed=0, progress=False)


def test_shapes_world_generated_only_when_missing(tmp_path):
    root = tmp_path / 'shapes'
    cfg = Config(dict(shapes_world=dict(root=str(root), **_TINY_WORLD)))
    assert ensure_shapes_world(cfg) is True
    assert (root / 'shapes_world.json').is_file()
    stamp = (root / 'annotations' / 'instances_train.json').stat().st_mtime_ns
    assert ensure_shapes_world(cfg) is False  # same arguments: kept as it is
    assert (root / 'annotations' / 'instances_train.json').stat().st_mtime_ns == stamp
    assert ensure_shapes_world(Config(dict(model=dict()))) is False
    empty = tmp_path / 'empty'
    empty.mkdir()
    cfg.shapes_world.root = str(empty)
    assert ensure_shapes_world(cfg) is True and (empty / 'shapes_world.json').is_file()


def test_stale_shapes_world_is_regenerated_with_a_warning(tmp_path, monkeypatch):
    """A world left by a run with other arguments (``--cfg-options shapes_world.num_train=8``) is
    not used silently: it is regenerated as the config asks, and the log says so."""
    import mmengine.logging
    logged = []
    monkeypatch.setattr(mmengine.logging, 'print_log',
                        lambda msg, **kw: logged.append((msg, kw.get('level'))))
    root = tmp_path / 'shapes'
    small = Config(dict(shapes_world=dict(root=str(root), **dict(_TINY_WORLD, num_train=1))))
    assert ensure_shapes_world(small) is True
    cfg = Config(dict(shapes_world=dict(root=str(root), **_TINY_WORLD)))
    assert ensure_shapes_world(cfg) is True
    with open(root / 'shapes_world.json') as f:
        meta = json.load(f)
    assert (meta['num_train'], meta['train']['images']) == (2, 2)
    assert len(os.listdir(root / 'train')) == 2
    [(message, level)] = logged
    assert level == logging.WARNING and 'regenerating' in message
    assert 'num_train=1 (wanted num_train=2)' in message and str(root) in message


def test_foreign_data_at_the_shapes_root_is_refused_not_deleted(tmp_path, train_tool):
    from shapes_world.shapes import ShapesWorldError
    root = tmp_path / 'shapes'
    root.mkdir()
    (root / 'mine.txt').write_text('keep')
    cfg = Config(dict(shapes_world=dict(root=str(root), **_TINY_WORLD)))
    with pytest.raises(ShapesWorldError, match='not a generated shapes world'):
        ensure_shapes_world(cfg)
    assert (root / 'mine.txt').read_text() == 'keep'
    with pytest.raises(ShapesWorldError, match='needs a root'):
        ensure_shapes_world(Config(dict(shapes_world=dict(task='coco'))))
    # tools/train.py: a one-line error instead of a traceback
    with pytest.raises(SystemExit) as info:
        train_tool.main([osp.join(REPO, 'configs', 'shapes', 'mask_rcnn_xcit_shapes_coco.py'),
                         '--work-dir', str(tmp_path / 'w'), '--cfg-options',
                         f'shapes_world.root={root}'])
    assert str(info.value.code).startswith(f'error: shapes_world.root {root} already exists')


# ----------------------------------------------------------------------------- launch scripts
_FAKE_COMMAND = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$FAKE_RECORD"
if [ "$(basename "$0")" = srun ]; then shift 8; exec "$@"; fi
"""


@pytest.mark.parametrize('script, args', [
    ('dist_train.sh', ['CFG', '2', '--amp']),
    ('dist_test.sh', ['CFG', 'CKPT', '2']),
    ('slurm_train.sh', ['PART', 'JOB', 'CFG', 'WORK']),
    ('slurm_test.sh', ['PART', 'JOB', 'CFG', 'CKPT']),
])
def test_launch_scripts_use_the_python_in_PYTHON(tmp_path, script, args):
    """tools/{dist,slurm}_{train,test}.sh start $PYTHON (default python), as tools/install.sh."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name in ('my-python', 'srun'):
        (bin_dir / name).write_text(_FAKE_COMMAND)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / 'record.txt'
    env = dict(os.environ, PYTHON=str(bin_dir / 'my-python'), FAKE_RECORD=str(record),
               PATH=f'{bin_dir}:{os.environ["PATH"]}')
    proc = subprocess.run(['bash', osp.join(REPO, 'tools', script)] + args, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = record.read_text().splitlines()
    assert calls[-1].startswith('my-python '), calls
    tool = 'train.py' if 'train' in script else 'test.py'
    assert osp.join('tools', tool) in calls[-1] and 'CFG' in calls[-1]


# ----------------------------------------------------------------------------- CPU distributed
def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_prepare_cpu_distributed_cfg():
    cfg = Config.fromfile(ADE_CFG)
    assert cfg.env_cfg.dist_cfg.backend == 'nccl'
    prepare_cpu_distributed_cfg(cfg)
    assert cfg.env_cfg.dist_cfg.backend == 'gloo'
    assert cfg.model_wrapper_cfg == dict(type='CPUDistributedDataParallel',
                                         broadcast_buffers=False, find_unused_parameters=False)
    cfg.model_wrapper_cfg = dict(type='MMDistributedDataParallel', find_unused_parameters=True)
    prepare_cpu_distributed_cfg(cfg)
    assert cfg.model_wrapper_cfg == dict(type='CPUDistributedDataParallel',
                                         find_unused_parameters=True)
    cfg.model_wrapper_cfg = dict(type='MMFullyShardedDataParallel')
    with pytest.raises(ValueError, match='cannot run on CPU'):
        prepare_cpu_distributed_cfg(cfg)
    assert init_distributed(cfg, 'none') is False


@pytest.mark.usefixtures('cpu_only')  # run on the CPU, also where a GPU is present
def test_cpu_ddp_in_a_gloo_group(monkeypatch):
    import torch.distributed as dist
    from mmengine.registry import MODEL_WRAPPERS
    for key, value in dict(OMPI_COMM_WORLD_RANK='0', OMPI_COMM_WORLD_SIZE='1',
                           OMPI_COMM_WORLD_LOCAL_RANK='0', MASTER_ADDR='127.0.0.1',
                           MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(key, value)
    for key in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    init_cpu_dist('mpi', timeout=60)
    ddp = None
    try:
        assert dist.get_backend() == 'gloo' and dist.get_world_size() == 1

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = torch.nn.Conv2d(3, 4, 3)
                self.bn = torch.nn.SyncBatchNorm(4)

            def forward(self, x):
                return self.bn(self.conv(x))

        net = Net()
        weight = net.bn.weight
        # As mmengine's Runner.wrap_model builds it: device_ids is always passed.
        ddp = MODEL_WRAPPERS.build(dict(type='CPUDistributedDataParallel'),
                                   default_args=dict(module=net, device_ids=[0]))
        assert isinstance(ddp, CPUDistributedDataParallel) and ddp.device_ids is None
        assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.modules())
        assert ddp.module.bn.weight is weight  # same Parameter: optimizer/ckpt unaffected
        ddp(torch.randn(2, 3, 8, 8)).sum().backward()
        assert weight.grad is not None
    finally:
        # DDP first: its C++ Reducer must not hold the group's last reference (see
        # training_extras.distributed_session), or destroying the group can deadlock.
        ddp = None
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.usefixtures('cpu_only')  # run on the CPU, also where a GPU is present
@pytest.mark.parametrize('failing', [False, True])
def test_distributed_session_destroys_the_group(monkeypatch, failing):
    """The tools run inside distributed_session: the gloo group exists inside the block and is
    gone after it, also when the block raises (a rank exiting with a live gloo group can abort
    with SIGABRT after its work is done)."""
    import torch.distributed as dist
    for key, value in dict(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1',
                           MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(key, value)
    cfg = Config.fromfile(ADE_CFG)
    with pytest.raises(SystemExit) if failing else contextlib.nullcontext():
        with distributed_session(cfg, 'pytorch') as is_distributed:
            assert is_distributed and dist.is_initialized() and dist.get_backend() == 'gloo'
            assert cfg.model_wrapper_cfg.type == 'CPUDistributedDataParallel'
            if failing:
                raise SystemExit('error: a tool failing inside the block')
    assert not dist.is_initialized()
    with distributed_session(cfg, 'none') as is_distributed:
        assert is_distributed is False and not dist.is_initialized()


# The 2-process CPU runs (tools/dist_train.sh and tools/dist_test.sh, mmdet and mmseg, metric of
# the gathered predictions == single-process metric, DDP's gradient strides) are in
# tests/test_reliability.py.
