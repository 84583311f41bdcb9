"""Test (and evaluate) a detector (mmdet) or a segmentor (mmseg) with an XCiT backbone.

One script for both tasks; the config's ``default_scope`` decides. Modelled on mmdet's and mmseg's
tools/test.py, with the same dataset and checkpoint checks and CPU-distributed support as
tools/train.py. A released XCiT COCO / ADE20k file (official detection/ and
semantic_segmentation/ code) is evaluated as downloaded: ``XCiTBackbone`` converts its keys
in memory, whatever loads it. The checkpoint is read with ``torch.load(weights_only=True)``
before anything is built, so a missing, truncated or code-carrying file is refused with a message
naming it, and URLs are downloaded into torch's hub cache and checked before mmengine reads them.
In a distributed run (``tools/dist_test.sh``) every rank evaluates its share of the test set and
mmengine's evaluator gathers the predictions, so the metric is that of the whole set.
A config path that does not exist gives ``error: config not found: PATH`` (exit status 2).

``--out`` dumps the predictions:

- mmdet configs: a ``.pkl`` file (mmdet's ``DumpDetResults``; boxes, scores, labels, RLE masks),
  which ``mmdet``'s ``tools/analysis_tools/eval_metric.py`` can evaluate offline;
- mmseg configs: a directory that receives one PNG label map per image (mmseg's ``IoUMetric``
  ``output_dir``; ADE20k ids 0..150 with 0 = "other", like the official annotations), or, if the
  value ends with ``.pkl``, a pickle of the predicted data samples (mmengine ``DumpResults``).

``--show-dir DIR`` saves images with the predictions drawn on them (mmdet: ``DIR/<image name>``;
mmseg: ``DIR/vis_data/vis_image/``).

Examples::

    python tools/test.py configs/mask_rcnn_xcit_s12_p16_3x_coco.py \\
        https://dl.fbaipublicfiles.com/xcit/coco/maskrcnn_xcit_small_12_p16.pth --out results.pkl
    tools/dist_test.sh configs/upernet_xcit_s12_p16_160k_ade20k.py ckpt.pth 8 --show-dir vis
"""
import argparse
import os
import os.path as osp
import sys
from typing import Optional

_REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from mmengine.config import Config  # noqa: E402
from mmengine.registry import RUNNERS  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

from training_extras import distributed_session  # noqa: E402
from training_extras.dist_utils import lost_peer_message  # noqa: E402
from training_extras.hooks import shutdown_dataloader_workers  # noqa: E402
from training_extras.preflight import load_config, parse_tool_args, preflight  # noqa: E402
from xcit_mm.models.utils import check_checkpoint  # noqa: E402
from xcit_mm.models.utils.checkpoint_io import is_url  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Test (and evaluate) an XCiT model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file (path or URL)')
    parser.add_argument(
        '--work-dir', help='directory for logs and the file with the evaluation metrics')
    parser.add_argument(
        '--out',
        help='dump predictions: a .pkl file (detection, or segmentation samples), or a '
        'directory of PNG label maps (segmentation)')
    parser.add_argument(
        '--show-dir', help='directory where images with drawn predictions are saved')
    return parse_tool_args(parser, argv, 'test')


def _scope(cfg) -> str:
    return cfg.get('default_scope') or 'mmengine'


def enable_visualization(cfg, show_dir: str) -> None:
    """Turn on the visualization hook so that predictions are drawn into ``show_dir``.

    The path is made absolute: mmdet 3.3's ``DetVisualizationHook`` re-joins a relative
    ``test_out_dir`` with the work dir on every iteration, nesting it deeper each time.
    mmseg's ``SegVisualizationHook`` draws every ``interval``-th image (50 by default); all images
    are drawn here.
    """
    hooks = cfg.get('default_hooks', {})
    if 'visualization' not in hooks:
        raise SystemExit('error: --show-dir needs default_hooks.visualization in the config '
                         '(the mmdet/mmseg default_runtime bases provide it)')
    show_dir = osp.abspath(show_dir)
    hook = hooks['visualization']
    hook['draw'] = True
    if _scope(cfg) == 'mmdet':
        hook['test_out_dir'] = show_dir
    else:
        hook['interval'] = 1
        cfg.visualizer['save_dir'] = show_dir


def add_output_dump(cfg, runner, out: str) -> None:
    """Make the test loop also write the predictions to ``out`` (see the module docstring).

    For mmseg's directory output the evaluator config is changed, which must happen before the
    Runner builds it; call with ``runner=None`` first (config stage), then with the runner.
    """
    scope = _scope(cfg)
    is_pickle = out.endswith(('.pkl', '.pickle'))
    if scope == 'mmseg' and not is_pickle:
        if runner is None:
            evaluator = cfg.test_evaluator
            if not isinstance(evaluator, dict):
                raise SystemExit('error: --out DIR needs a single test_evaluator (IoUMetric)')
            evaluator['output_dir'] = osp.abspath(out)
            evaluator['keep_results'] = True
        return
    if runner is None:
        if not is_pickle:
            raise SystemExit(f'error: --out must be a .pkl file for {scope} configs, got {out}')
        return
    if scope == 'mmdet':
        from mmdet.evaluation import DumpDetResults
        runner.test_evaluator.metrics.append(DumpDetResults(out_file_path=out))
    else:
        from mmengine.evaluator import DumpResults
        runner.test_evaluator.metrics.append(DumpResults(out_file_path=out))


def build_cfg(args) -> Config:
    cfg = load_config(args)
    cfg.load_from = args.checkpoint
    if args.show_dir:
        enable_visualization(cfg, args.show_dir)
    if args.out:
        add_output_dump(cfg, None, args.out)
    return cfg


def evaluate(cfg, out: Optional[str] = None) -> None:
    """Build the Runner and evaluate (and dump predictions to ``out``).

    The Runner, and the DDP wrapper that holds the process group, is freed when this returns,
    before :func:`distributed_session` destroys the group (see there why that order matters).
    """
    runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
    if out:
        add_output_dump(cfg, runner, out)
    try:
        runner.test()
    except RuntimeError as e:  # another rank died or hangs: say so, not a gloo traceback
        message = lost_peer_message(e, cfg, job='testing')
        if message is None:
            raise
        runner.logger.error(message)
        raise SystemExit(f'error: {message}') from e
    finally:  # also after an error, which hooks do not see
        shutdown_dataloader_workers(runner)


def main(argv=None):
    args = parse_args(argv)
    cfg = build_cfg(args)

    # The process group is destroyed when the block ends, so that no rank aborts or hangs at exit.
    with distributed_session(cfg, args.launcher):
        # mmengine's LoggerHook dumps the test metrics to <log_dir>/<timestamp>.json on every
        # rank, and the ranks share that path: concurrent writes can corrupt it. Rank 0 logs.
        if int(os.environ.get('RANK', '0')) != 0:
            cfg.default_hooks.logger = None

        def check_file():
            cfg.load_from = check_checkpoint(args.checkpoint, 'checkpoint')

        # Before anything is built: a missing, truncated or pickled-code checkpoint is reported
        # by name; a URL is downloaded into torch's hub cache (after the cheaper data check),
        # checked, and loaded from there.
        local = not is_url(args.checkpoint)
        preflight(cfg, ('test', ), args.config, check_before_data=check_file if local else None,
                  check_checkpoints=None if local else check_file)

        evaluate(cfg, args.out)


if __name__ == '__main__':
    main()
