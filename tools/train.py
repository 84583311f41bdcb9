"""Train a detector (mmdet) or a segmentor (mmseg) with an XCiT backbone.

One script for both tasks: the config's ``default_scope`` ('mmdet' / 'mmseg', set by the upstream
base configs) decides which registries the Runner uses. Modelled on mmdet's and mmseg's
tools/train.py; the differences are

- the dataset is checked before anything is built (missing COCO / ADE20k -> a message saying what
  to download and where to put it), and the built-in shapes dataset is generated when a config asks
  for it (``shapes_world``);
- distributed runs also work without a GPU (gloo; see ``xcit_mm/utils/cpu_dist.py``);
- mmengine's own checkpoint classes are allow-listed for torch's ``weights_only`` loading so that
  ``--resume`` works with torch >= 2.6.

Examples::

    python tools/train.py configs/mask_rcnn_xcit_s12_p16_3x_coco.py
    tools/dist_train.sh configs/upernet_xcit_s12_p16_160k_ade20k.py 8
    python tools/train.py CONFIG --resume                   # latest checkpoint of the work dir
    python tools/train.py CONFIG --resume work_dirs/x/epoch_3.pth
"""
import argparse
import os
import os.path as osp
import sys

# Use this checkout's xcit_mm even when it is not pip-installed (python tools/train.py ...).
_REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from mmengine.config import Config, DictAction  # noqa: E402
from mmengine.registry import RUNNERS  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

from xcit_mm.checkpoint import allow_runner_checkpoints  # noqa: E402
from xcit_mm.utils import (DatasetNotFoundError, check_data, ensure_shapes_world,  # noqa: E402
                           init_distributed)


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
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override settings in the config, key=value pairs (e.g. '
        'train_dataloader.dataset.data_root=/data/coco/); lists as key="[a,b]" or key=a,b; '
        'quotes are needed and no white space is allowed')
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')
    # torch.distributed.launch passes --local-rank (torch >= 2.0) or --local_rank.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def build_cfg(args) -> Config:
    """Load the config and apply the command line, as mmdet's/mmseg's train.py do."""
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)

    # work_dir: command line > config > ./work_dirs/<config name>
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])

    if args.amp:
        wrapper_type = cfg.optim_wrapper.get('type', 'OptimWrapper')
        if wrapper_type != 'AmpOptimWrapper':
            if wrapper_type != 'OptimWrapper':
                raise SystemExit(f'error: --amp needs optim_wrapper.type OptimWrapper, '
                                 f'got {wrapper_type}')
            cfg.optim_wrapper.type = 'AmpOptimWrapper'
            cfg.optim_wrapper.loss_scale = 'dynamic'

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


def main(argv=None):
    args = parse_args(argv)
    # torch >= 2.6 loads checkpoints with weights_only=True; mmengine's resume state pickles its
    # own classes (HistoryBuffer, ...), which must be allow-listed first.
    allow_runner_checkpoints()
    cfg = build_cfg(args)

    # Before the Runner: rank-aware data preparation needs the process group, and CPU-only
    # machines need gloo + a CPU DDP wrapper (no-op for --launcher none).
    init_distributed(cfg, args.launcher)
    ensure_shapes_world(cfg, splits=('train', 'val'))
    try:
        check_data(cfg, splits=('train', 'val'), config_name=args.config)
    except DatasetNotFoundError as e:
        raise SystemExit(f'error: {e}')
    if args.resume not in (None, 'auto') and not osp.isfile(args.resume) \
            and '://' not in args.resume:
        raise SystemExit(f'error: --resume checkpoint not found: {osp.abspath(args.resume)}')

    if 'runner_type' not in cfg:
        runner = Runner.from_cfg(cfg)
    else:
        runner = RUNNERS.build(cfg)
    runner.train()


if __name__ == '__main__':
    main()
