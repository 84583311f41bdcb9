# Copyright (c) xcit_mm contributors. All rights reserved.
"""mmdet's ``demo/image_demo.py`` (its command line) for XCiT detectors and segmentors alike.

The config's model type picks ``mmdet.apis.DetInferencer`` or ``mmseg.apis.MMSegInferencer``;
they write ``OUT_DIR/vis/<image>`` and the predictions (``OUT_DIR/preds/<image>.json`` or
``OUT_DIR/pred/<n>_pred.png``). A missing config or input, a bad checkpoint and one of another
model or task (``import xcit_mm`` checks every load) are one ``error: ...`` line, exit status 2.
"""
import argparse
import os.path as osp
import sys
import warnings

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))  # run from a checkout
if __name__ == '__main__':  # setuptools >= 80 warns at every mmengine import: keep stderr clear
    warnings.filterwarnings('ignore', message='pkg_resources is deprecated', category=UserWarning)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Draw the predictions of a detector or segmentor.')
    p.add_argument('inputs', help='input image file or folder')
    p.add_argument('model', metavar='config', help='mmdet detector or mmseg segmentor config')
    p.add_argument('--weights', default=None, help='checkpoint file or URL (default: random)')
    p.add_argument('--out-dir', default='outputs', help='folder for drawn images, predictions')
    p.add_argument('--device', default=None, help='default: cuda:0 if available, else cpu')
    p.add_argument('--pred-score-thr', type=float, default=0.3, help='bbox score threshold')
    p.add_argument('--batch-size', type=int, default=1, help='inference batch size')
    p.add_argument('--show', action='store_true', help='display each image in a window')
    p.add_argument('--no-save-vis', action='store_true', help='do not save drawn images')
    p.add_argument('--no-save-pred', action='store_true', help='do not save predictions')
    p.add_argument('--print-result', action='store_true', help='print the detections')
    return p.parse_args(argv)


def build_inferencer(config, weights=None, device='cpu'):
    """``DetInferencer`` or ``MMSegInferencer``, as the config's model type says."""
    from xcit_mm.apis import config_task, read_config
    if not config.endswith(('.py', '.json', '.yaml', '.yml')):
        raise ValueError(f'{config!r} is not a config file; give a checkpoint with --weights')
    cfg = read_config(config)
    if config_task(cfg) == 'det':
        from mmdet.apis import DetInferencer
        return DetInferencer(cfg, weights, device=device)
    from mmseg.apis import MMSegInferencer
    return MMSegInferencer(cfg, weights, device=device)


def main(argv=None) -> int:
    import torch
    from xcit_mm.apis import error_line
    from xcit_mm.models.utils import CheckpointError
    args = parse_args(argv)
    device = args.device or ('cuda:0' if torch.cuda.is_available() else 'cpu')
    out_dir = '' if args.no_save_vis and args.no_save_pred else args.out_dir
    kwargs = dict(batch_size=args.batch_size, show=args.show, out_dir=out_dir)
    try:
        if not osp.exists(args.inputs):
            raise FileNotFoundError(f'input not found: {args.inputs!r}')
        inferencer = build_inferencer(args.model, args.weights, device)
        takes = inferencer.visualize_kwargs | inferencer.postprocess_kwargs  # detector options
        kwargs.update({k: getattr(args, k) for k in ('pred_score_thr', 'no_save_vis',
                                                     'no_save_pred', 'print_result') if k in takes})
        inferencer(args.inputs, **kwargs)
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    if out_dir:
        print(f'results have been saved at {out_dir}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
