"""The command line and the checks ``tools/train.py`` and ``tools/test.py`` share before they build
the Runner.

Both tools end with the same options (:func:`parse_tool_args`), load the config the same way
(:func:`load_config`), and check, in this order, the backbone settings of the config, the built-in
shapes dataset (generated when the config asks for it), the dataset of the splits they read, and
every checkpoint they will read. A problem of the user's files or config is one of
:data:`PREFLIGHT_ERRORS`, and stops the tool with ``error: <message>`` instead of a traceback,
before anything is built.
"""
import os
import os.path as osp
import sys
from typing import Callable, Optional, Sequence

import torch
from mmengine.config import Config, DictAction
from mmengine.registry import MODELS, DefaultScope, init_default_scope
from shapes_world import ensure_shapes_world
from shapes_world.shapes import ShapesWorldError
from xcit_mm.models.utils.checkpoint_io import CheckpointError

from .data_check import AnnotationFormatError, DatasetNotFoundError, check_data


class ConfigError(ValueError):
    """A config that cannot build the model it describes; the message names the key to fix."""


# What the checks raise for a problem of the user's files or config.
PREFLIGHT_ERRORS = (ShapesWorldError, DatasetNotFoundError, AnnotationFormatError,
                    CheckpointError, ConfigError)


def parse_tool_args(parser, argv, split: str):
    """Add the options both tools end with, parse ``argv`` and refuse a config path that does not
    exist; ``split`` ('train' / 'test') names the dataloader in the ``--cfg-options`` example."""
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help=f'override settings in the config, key=value pairs (e.g. '
        f'{split}_dataloader.dataset.data_root=/data/coco/); lists as key="[a,b]" or key=a,b; '
        'quotes are needed and no white space is allowed')
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')
    # torch.distributed.launch passes --local-rank (torch >= 2.0) or --local_rank.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if not osp.isfile(args.config):  # as argparse: one line and status 2, not a traceback
        print(f'error: config not found: {args.config}', file=sys.stderr)
        raise SystemExit(2)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def load_config(args) -> Config:
    """Load the config and apply the shared options, as mmdet's / mmseg's tools do; the work dir
    is ``--work-dir``, else the config's, else ./work_dirs/<config name>."""
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    return cfg


def preflight(cfg, splits: Sequence[str], config_name: str,
              check_checkpoints: Optional[Callable[[], None]] = None,
              check_before_data: Optional[Callable[[], None]] = None) -> None:
    """Check a run before its Runner is built: the backbone settings
    (:func:`check_backbone_config`), ``check_before_data``
    (cheap checks a tool wants first, e.g. a local checkpoint file), the shapes world of
    ``splits`` (:func:`~shapes_world.ensure_shapes_world`), the dataset of ``splits``
    (:func:`~training_extras.data_check.check_data`), then ``check_checkpoints`` (last, so that
    URLs are downloaded only once the cheaper checks pass).

    Args:
        cfg (Config): The run's config; the checks may update it (a generated world, a
            checkpoint replaced by its checked local copy).
        splits (Sequence[str]): The dataset splits the run reads ('train', 'val', 'test').
        config_name (str): The config path, named in the data check's messages.
        check_checkpoints (callable, optional): The tool's checkpoint checks, called without
            arguments after the data checks.
        check_before_data (callable, optional): Called without arguments after the backbone
            check, before the data checks.

    Raises:
        SystemExit: ``error: <message>`` for any of :data:`PREFLIGHT_ERRORS`.
    """
    try:
        check_backbone_config(cfg)
        if check_before_data is not None:
            check_before_data()
        ensure_shapes_world(cfg, splits=splits)
        check_data(cfg, splits=splits, config_name=config_name)
        if check_checkpoints is not None:
            check_checkpoints()
    except PREFLIGHT_ERRORS as e:
        raise SystemExit(f'error: {e}')


def check_backbone_config(cfg) -> None:
    """Build ``cfg.model.backbone`` alone (its arguments are checked at construction), so that a
    wrong ``arch`` or ``patch_size`` ends in one line before the Runner dumps the config."""
    backbone = (cfg.get('model') or {}).get('backbone')
    if not isinstance(backbone, dict) or backbone.get('type') != 'XCiTBackbone':
        return
    scope = cfg.get('default_scope')
    if scope and DefaultScope.get_current_instance() is None:
        init_default_scope(scope)
    backbone = dict(backbone, init_cfg=None)  # the weights are checked separately
    try:
        with torch.device('meta'):  # no memory, no initialisation: only the arguments matter
            MODELS.build(backbone)
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(f'model.backbone: {error}') from error
