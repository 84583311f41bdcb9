"""Train a detector (mmdet) or a segmentor (mmseg) with an XCiT backbone.

One script for both tasks: the config's ``default_scope`` ('mmdet' / 'mmseg', set by the upstream
base configs) decides which registries the Runner uses. Modelled on mmdet's and mmseg's
tools/train.py; the differences are

- the dataset is checked before anything is built (missing COCO / ADE20k -> a message saying what
  to download and where to put it), and the built-in shapes dataset is generated when a config asks
  for it (``shapes_world``), or regenerated, with a warning, when it was made with other arguments;
- a config path that does not exist gives ``error: config not found: PATH`` (exit status 2);
- a COCO annotation file that is not one (a JSON list, no ``images``...) is reported by name;
- every checkpoint the run will read (``--resume [PATH]``, ``load_from``, ``Pretrained``
  init_cfgs) is checked first: missing, truncated or pickled-code files stop the run with a
  message, and nothing beyond tensors and mmengine's own state is ever unpickled (URLs are
  downloaded into torch's hub cache and checked; see ``xcit_mm/models/utils/checkpoint_io.py``);
- ``--amp`` without a GPU trains under bfloat16 CPU autocast (``CPUAmpOptimWrapper``), since
  mmengine's ``AmpOptimWrapper`` needs a GPU; on a CPU without native bfloat16 (no
  ``avx512_bf16`` / ``amx_bf16``) that is several times slower than float32, and a warning says so;
- distributed runs also work without a GPU (gloo; see ``training_extras/dist_utils.py``); when
  another rank dies or hangs past ``env_cfg.dist_cfg.timeout`` (gloo: 1800 s by default), this
  rank stops with a message saying so instead of a gloo traceback;
- a checkpoint that cannot be written (full disk) and a training image that cannot be read stop
  the run with a message naming the file (``CheckpointSaveError``, ``SampleLoadError``; see
  docs/training_extras.md);
- the Runner is mmengine's own, as in mmdet's / mmseg's tools; released XCiT COCO / ADE20k
  files load as downloaded because ``XCiTBackbone`` converts their keys itself, and
  ``configs/_base_/training_extras.py`` switches on the hooks of ``training_extras`` in any config.

Examples::

    python tools/train.py configs/mask_rcnn_xcit_s12_p16_3x_coco.py
    tools/dist_train.sh configs/upernet_xcit_s12_p16_160k_ade20k.py 8
    python tools/train.py CONFIG --resume                   # latest checkpoint of the work dir
    python tools/train.py CONFIG --resume work_dirs/x/epoch_3.pth
"""
import argparse
import logging
import os.path as osp
import sys

# Use this checkout's xcit_mm even when it is not pip-installed (python tools/train.py ...).
_REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from mmengine.config import Config  # noqa: E402
from mmengine.logging import print_log  # noqa: E402
from mmengine.registry import RUNNERS  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

from training_extras import (CPU_AMP_TYPE, CheckpointSaveError,  # noqa: E402
                             NonFiniteLossError, SafeCheckpointHook, SampleLoadError,
                             amp_optim_wrapper_type, distributed_session)
from training_extras.checkpoint_check import check_pretrained, resolve_auto_resume  # noqa: E402
from training_extras.cpu_amp_optim_wrapper import warn_if_cpu_bf16_is_slow  # noqa: E402
from training_extras.dist_utils import lost_peer_message  # noqa: E402
from training_extras.hooks import shutdown_dataloader_workers  # noqa: E402
from training_extras.preflight import load_config, parse_tool_args, preflight  # noqa: E402
from xcit_mm.models.utils import check_checkpoint  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train a detector or segmentor (XCiT)')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument(
        '--resume',
        nargs='?',
        type=str,
        const='auto',
        help='resume from this checkpoint; without a path, from the latest checkpoint in the '
        'work dir (if any)')
    parser.add_argument(
        '--amp', action='store_true', default=False,
        help='enable automatic mixed precision training (the paper trained with fp16)')
    parser.add_argument(
        '--auto-scale-lr', action='store_true',
        help='scale the lr by (GPUs x batch per GPU) / auto_scale_lr.base_batch_size (16)')
    return parse_tool_args(parser, argv, 'train')


def build_cfg(args) -> Config:
    """Load the config and apply the command line, as mmdet's/mmseg's train.py do."""
    cfg = load_config(args)
    if args.amp:
        wrapper_type = cfg.optim_wrapper.get('type', 'OptimWrapper')
        if wrapper_type not in ('AmpOptimWrapper', CPU_AMP_TYPE):
            if wrapper_type != 'OptimWrapper':
                raise SystemExit(f'error: --amp needs optim_wrapper.type OptimWrapper, '
                                 f'got {wrapper_type}')
            cfg.optim_wrapper.type = 'AmpOptimWrapper'
            cfg.optim_wrapper.loss_scale = 'dynamic'
    use_cpu_amp(cfg)
    if (cfg.get('optim_wrapper') or {}).get('type') == CPU_AMP_TYPE:
        # bfloat16 is emulated, several times slower than float32, on CPUs without native support
        warn_if_cpu_bf16_is_slow()
    # Stop at the first NaN/inf loss; save and restore random states for exact resumption.

    if args.auto_scale_lr:
        if 'base_batch_size' not in cfg.get('auto_scale_lr', {}):
            raise SystemExit('error: --auto-scale-lr needs auto_scale_lr.base_batch_size in the '
                             'config')
        cfg.auto_scale_lr.enable = True

    # --resume PATH resumes from PATH; bare --resume from the work dir's latest checkpoint.
    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    return cfg


def use_cpu_amp(cfg) -> bool:
    """Without a GPU, replace ``AmpOptimWrapper`` (which asserts a GPU) by CPU bfloat16 autocast.

    Returns:
        bool: True if the config was changed.
    """
    wrapper = cfg.get('optim_wrapper', {})
    if wrapper.get('type') != 'AmpOptimWrapper' or amp_optim_wrapper_type() == 'AmpOptimWrapper':
        return False
    dtype = wrapper.get('dtype', None)
    if dtype not in (None, 'bfloat16'):
        raise SystemExit(f'error: mixed precision without a GPU runs in bfloat16 (CPU autocast); '
                         f'optim_wrapper.dtype={dtype!r} is not possible here. Remove it or set '
                         f'--cfg-options optim_wrapper.dtype=bfloat16.')
    wrapper.pop('loss_scale', None)
    wrapper.pop('use_fsdp', None)
    wrapper.type = CPU_AMP_TYPE
    wrapper.dtype = 'bfloat16'
    return True


def _saves_several(cfg, checkpoint_hook) -> bool:
    """Whether the CheckpointHook will write more than one checkpoint (True when unsure)."""
    train_cfg = cfg.get('train_cfg') or {}
    by_epoch = checkpoint_hook.get('by_epoch', True)
    total = train_cfg.get('max_epochs' if by_epoch else 'max_iters')
    interval = checkpoint_hook.get('interval', -1)
    if not isinstance(total, int) or not isinstance(interval, int) or interval <= 0:
        return True
    return total // interval > 1


def check_checkpoints(cfg, args) -> None:
    """Check every checkpoint the run will read, before any work (see
    xcit_mm.models.utils.checkpoint_io).

    ``--resume PATH`` / a bare ``--resume`` (the work dir's latest checkpoint) must be training
    checkpoints, ``load_from`` must hold weights, and every ``Pretrained`` init_cfg must exist;
    URLs are downloaded into torch's hub cache, checked, and replaced by the local copy. Nothing is
    unpickled beyond tensors and mmengine's own training state.

    Raises:
        CheckpointError: naming the file, the problem and the fix.
    """
    if args.resume == 'auto':
        latest = resolve_auto_resume(cfg.work_dir)
        if latest is not None:
            cfg.load_from = latest
    elif args.resume is not None:
        cfg.load_from = check_checkpoint(args.resume, '--resume checkpoint', kind='resume')
    elif cfg.get('load_from'):
        cfg.load_from = check_checkpoint(cfg.load_from, 'load_from checkpoint')
    check_pretrained(cfg)
    checkpoint_hook = cfg.get('default_hooks', {}).get('checkpoint') or {}
    # SafeCheckpointHook writes the new checkpoint before deleting the old one; mmengine's own
    # CheckpointHook deletes first.
    safe = checkpoint_hook.get('type') in ('SafeCheckpointHook', SafeCheckpointHook) or any(
        str(hook.get('type')).endswith('AtomicCheckpointHook')
        for hook in cfg.get('custom_hooks') or [])
    if not safe and checkpoint_hook.get('max_keep_ckpts', -1) == 1 and \
            _saves_several(cfg, checkpoint_hook):
        print_log(
            'default_hooks.checkpoint.max_keep_ckpts=1: mmengine deletes the previous checkpoint '
            'before it writes the next one, so a job killed while saving is left without any '
            'checkpoint to resume from. Keep at least 2 for long runs.',
            logger='current', level=logging.WARNING)


def _where(runner) -> str:
    """'iteration N/M' of a runner, without building anything."""
    loop = getattr(runner, '_train_loop', None)
    total = getattr(loop, 'max_iters', None) if not isinstance(loop, dict) else None
    return f'iteration {runner.iter + 1}' + (f'/{total}' if total else '')


def train(cfg) -> None:
    """Build the Runner and train.

    The Runner, and the DDP wrapper that holds the process group, is freed when this returns,
    before :func:`distributed_session` destroys the group (see there why that order matters).
    """
    # as mmdet's / mmseg's tools/train.py: mmengine's Runner unless the config names another
    runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
    try:
        runner.train()
    except (NonFiniteLossError, CheckpointSaveError, SampleLoadError) as e:
        # a clear message instead of a traceback through mmengine (or relayed from a worker)
        runner.logger.error(str(e))
        raise SystemExit(f'error: {e}') from e
    except RuntimeError as e:  # another rank died or hangs: say so, not a gloo traceback
        message = lost_peer_message(e, cfg, _where(runner))
        if message is None:
            raise
        runner.logger.error(message)
        raise SystemExit(f'error: {message}') from e
    finally:  # also after an error, which hooks do not see (see shutdown_dataloader_workers)
        shutdown_dataloader_workers(runner)


def main(argv=None):
    args = parse_args(argv)
    cfg = build_cfg(args)

    # Before the Runner: rank-aware data preparation needs the process group, and CPU-only
    # machines need gloo + a CPU DDP wrapper (no-op for --launcher none). The group is destroyed
    # when the block ends, so that no rank aborts or hangs at exit.
    with distributed_session(cfg, args.launcher):
        preflight(cfg, ('train', 'val'), args.config,
                  check_checkpoints=lambda: check_checkpoints(cfg, args))
        train(cfg)


if __name__ == '__main__':
    main()
