#!/usr/bin/env python
"""The high-resolution shapes job end to end, and its resolution curve, as committed artifacts.

    python tools/analysis_tools/shapes_hires_job.py --seeds 0 1
    python tools/analysis_tools/shapes_hires_job.py --curve-only
    python tools/analysis_tools/shapes_hires_job.py --example-only

For each seed: tools/train.py on configs/shapes/sem_fpn_xcit_shapes_cityscapes.py (the world is
generated first, timed on its own), then tools/test.py on the held-out 1024x2048 images, each
evaluation in its own process (wall time, peak RSS of that process from os.wait4): whole-image (the
config's LeanEncoderDecoder, mode='whole', its large maps in bands of rows) and the sliding window
at the training crop size, through LeanEncoderDecoder and through mmseg's own EncoderDecoder.
Writes docs/results/shapes_hires_sem_fpn.json. The resolution curve evaluates the first seed's
checkpoint whole-image at several test scales (the test pipeline's Resize scale_factor; labels are
scored at 1024x2048) and writes docs/results/shapes_hires_resolution_curve.{json,png}; an example
figure (a held-out image, its labels, both predictions) goes to
docs/results/shapes_hires_example.png.
"""
import argparse
import glob
import json
import os
import os.path as osp
import re
import subprocess
import sys
import time

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
sys.path.insert(0, ROOT)
from training_extras.run_results import cpu_description  # noqa: E402

CONFIG = 'configs/shapes/sem_fpn_xcit_shapes_cityscapes.py'
CROP, STRIDE = (256, 256), (192, 192)
# the config streams whole images in bands of rows (test_cfg.band_mb), which slide does not take
SLIDE = ['model.test_cfg.mode=slide', 'model.test_cfg.band_mb=None',
         f'model.test_cfg.crop_size={CROP}'.replace(' ', ''),
         f'model.test_cfg.stride={STRIDE}'.replace(' ', '')]
# the same windows through mmseg's own EncoderDecoder (same labels; its memory and time)
STOCK_SLIDE = ['model.type=EncoderDecoder'] + SLIDE
_ROW = re.compile(r'^\|\s*(\w+)\s*\|\s*([\d.]+|nan)\s*\|\s*([\d.]+|nan)\s*\|\s*$')


def run(args, log, env=None):
    """Run ``python args`` in ROOT; (wall seconds, peak RSS MiB of that process, output)."""
    start = time.time()
    with open(log, 'w') as f:
        proc = subprocess.Popen([sys.executable] + args, cwd=ROOT, stdout=f, env=env,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    with open(log) as f:
        out = f.read()
    if proc.returncode:
        sys.exit(f'failed ({proc.returncode}): python {" ".join(args)}\n{out[-4000:]}')
    return round(wall, 1), round(usage.ru_maxrss / 1024, 1), out  # ru_maxrss: KiB on Linux


def evaluate(config, ckpt, work_dir, options=()):
    """tools/test.py in its own process: mIoU, aAcc, mAcc, per-class IoU, wall, peak RSS."""
    args = ['tools/test.py', config, ckpt, '--work-dir', work_dir]
    if options:
        args += ['--cfg-options'] + list(options)
    os.makedirs(work_dir, exist_ok=True)
    # malloc returns a freed tensor's memory at once (not for training: it slows it down), so
    # the peak RSS follows the live tensors rather than what the heap kept from earlier ones
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536')
    wall, rss, out = run(args, osp.join(work_dir, 'test_stdout.log'), env)
    metrics = {k: float(v) for k, v in re.findall(r'\b(aAcc|mIoU|mAcc): ([\d.]+)', out)[-3:]}
    per_class = {m.group(1): float(m.group(2)) for m in map(_ROW.match, out.splitlines())
                 if m and m.group(2) != 'nan'}
    return dict(metrics, class_IoU=per_class, wall_seconds=wall, peak_rss_mib=rss)


def train_and_evaluate(config, seed, work_root, max_iters):
    work = osp.join(work_root, f'seed{seed}')
    opts = [f'randomness.seed={seed}', f'train_cfg.val_begin={max_iters + 1}']  # tested below
    wall, rss, _ = run(['tools/train.py', config, '--work-dir', work, '--cfg-options'] + opts,
                       osp.join(work_root, f'train_seed{seed}.log'))
    ckpt = osp.join(work, f'iter_{max_iters}.pth')
    loss, times = None, []
    for path in glob.glob(osp.join(work, '*', 'vis_data', 'scalars.json')):
        with open(path) as f:  # the training records (mmengine's logger window of 50 iters)
            records = [json.loads(line) for line in f if '"loss"' in line]
        loss = records[-1]['loss'] if records else loss
        times = [r['time'] for r in records if 'time' in r]
    whole = evaluate(config, ckpt, osp.join(work, 'test_whole'))
    slide = evaluate(config, ckpt, osp.join(work, 'test_slide'), SLIDE)
    stock_slide = evaluate(config, ckpt, osp.join(work, 'test_stock_slide'), STOCK_SLIDE)
    return dict(seed=seed, train_seconds=wall, train_peak_rss_mib=rss, final_loss=loss,
                # s/iter at each log line: a CPU shared with another job shows as outliers
                train_seconds_per_iter_median=round(sorted(times)[len(times) // 2], 3)
                if times else None,
                train_seconds_per_iter_max=round(max(times), 3) if times else None,
                checkpoint=ckpt, whole=whole, slide=slide, stock_slide=stock_slide,
                whole_minus_slide_mIoU=round(whole['mIoU'] - slide['mIoU'], 2))


def curve(config, ckpt, work_root, scales, out_json, out_png, command, num_images):
    points = []
    for s in scales:
        r = evaluate(config, ckpt, osp.join(work_root, f'curve_{s}'),
                     [f'test_dataloader.dataset.pipeline.1.scale_factor={s}'])
        points.append(dict(scale=s, input_hw=[round(1024 * s), round(2048 * s)], **r))
        print(f'scale {s}: mIoU {r["mIoU"]}', flush=True)
    result = dict(command=command, machine=cpu_description(), config=config, checkpoint=ckpt,
                  training_scales='RandomResize ratio 0.25-1.0 of 1024x2048, 256x256 crops',
                  points=points)
    _dump(result, out_json)
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4.5, 3), dpi=100)
    ax.plot(scales, [p['mIoU'] for p in points], 'o-', label='whole image')
    ax.set_xscale('log', base=2)
    ax.set_xticks(scales, [str(s) for s in scales])
    ax.set_xlabel('test scale (x 1024x2048)')
    ax.set_ylabel(f'mIoU (held-out, {num_images} images)')
    ax.set_title('shapes hi-res: mIoU vs test scale', fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png)
    return result


def example_figure(config, ckpt, png):
    """The held-out image with the largest shape (the most interior no window can classify), its
    labels and seed 0's predictions whole-image and with the sliding window
    (``mmseg.apis.inference_model``), side by side."""
    import numpy as np
    from mmengine import Config, ConfigDict
    from mmseg.apis import inference_model, init_model
    from PIL import Image
    from shapes_world.shapes_seg import ShapesCityscapesDataset
    cfg = Config.fromfile(config)
    root = osp.join(ROOT, cfg.data_root)
    truths = sorted(glob.glob(osp.join(root, 'gtFine', 'val', '*', '*_labelTrainIds.png')))
    truth = max(truths, key=lambda path: int((np.asarray(Image.open(path)) > 0).sum()))
    image = glob.glob(osp.join(root, 'leftImg8bit', 'val', '*', osp.basename(truth).replace(
        'gtFine_labelTrainIds', 'leftImg8bit')))[0]
    palette = np.array(ShapesCityscapesDataset.METAINFO['palette'], dtype=np.uint8)
    panels = [('image', np.asarray(Image.open(image).convert('RGB'))),
              ('labels', palette[np.asarray(Image.open(truth))])]
    model = init_model(cfg, ckpt, device='cpu')
    for title, test_cfg in (('whole image', dict(cfg.model.test_cfg)),
                            ('sliding window 256', dict(mode='slide', crop_size=CROP,
                                                        stride=STRIDE))):
        model.test_cfg = ConfigDict(test_cfg)  # LeanEncoderDecoder reads it at each predict
        labels = inference_model(model, image).pred_sem_seg.data[0].numpy()
        panels.append((title, palette[labels]))
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(12, 2.2), dpi=100)
    for ax, (title, panel) in zip(axes, panels):
        ax.imshow(panel[::4, ::4])
        ax.set_title(title, fontsize=9)
        ax.axis('off')
    fig.text(0.5, 0.02, 'labels: black background, red circle, blue square, green triangle',
             ha='center', fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(png)


def _dump(obj, path):
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(obj, f, indent=2)
        f.write('\n')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--config', default=CONFIG)
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1])
    p.add_argument('--work-root', default='work_dirs/shapes_hires')
    p.add_argument('--out', default='docs/results/shapes_hires_sem_fpn.json')
    p.add_argument('--scales', type=float, nargs='+', default=[0.5, 0.75, 1.0, 1.5, 2.0])
    p.add_argument('--curve-out', default='docs/results/shapes_hires_resolution_curve.json')
    p.add_argument('--curve-png', default='docs/results/shapes_hires_resolution_curve.png')
    p.add_argument('--example-png', default='docs/results/shapes_hires_example.png')
    p.add_argument('--example-only', action='store_true',
                   help="only the example figure, from the first seed's existing checkpoint")
    p.add_argument('--note', help='conditions of the run, e.g. other jobs on the machine')
    p.add_argument('--no-curve', action='store_true', help='skip the resolution curve')
    p.add_argument('--curve-only', action='store_true',
                   help='only the curve, from the first seed\'s existing checkpoint')
    args = p.parse_args(argv)
    for key in ('work_root', 'out', 'curve_out', 'curve_png', 'example_png'):
        setattr(args, key, osp.abspath(getattr(args, key)))
    os.makedirs(args.work_root, exist_ok=True)
    os.chdir(ROOT)  # the config's data_root and the tools are relative to the repository
    command = 'python tools/analysis_tools/shapes_hires_job.py ' + ' '.join(
        argv if argv is not None else sys.argv[1:])
    from mmengine import Config
    cfg = Config.fromfile(osp.join(ROOT, args.config))
    max_iters = cfg.train_cfg.max_iters
    ckpt0 = osp.join(args.work_root, f'seed{args.seeds[0]}', f'iter_{max_iters}.pth')
    if args.example_only:
        example_figure(osp.join(ROOT, args.config), ckpt0, args.example_png)
        return
    if not args.curve_only:
        from shapes_world import ensure_shapes_world
        start = time.time()
        generated = ensure_shapes_world(cfg)
        gen_seconds = round(time.time() - start, 1) if generated else None
        runs = []
        for seed in args.seeds:
            runs.append(train_and_evaluate(args.config, seed, args.work_root, max_iters))
            print(json.dumps(runs[-1], indent=2), flush=True)
        w = [r['whole']['mIoU'] for r in runs]
        s = [r['slide']['mIoU'] for r in runs]
        d = [r['whole_minus_slide_mIoU'] for r in runs]
        summary = dict(
            whole_mIoU=w, slide_mIoU=s, whole_minus_slide=d,
            seed_spread_whole=round(max(w) - min(w), 2),
            seed_spread_slide=round(max(s) - min(s), 2),
            whole_beats_slide_by_more_than_seed_spread=bool(
                min(d) > max(max(w) - min(w), max(s) - min(s))),
            stock_slide_mIoU_equals_slide=all(
                r['stock_slide']['mIoU'] == r['slide']['mIoU'] for r in runs),
            whole_peak_rss_below_slide=all(
                r['whole']['peak_rss_mib'] < min(r['slide']['peak_rss_mib'],
                                                 r['stock_slide']['peak_rss_mib'])
                for r in runs),
            whole_faster_than_slide=all(
                r['whole']['wall_seconds'] < min(r['slide']['wall_seconds'],
                                                 r['stock_slide']['wall_seconds'])
                for r in runs))
        _dump(dict(command=command, machine=cpu_description(), config=args.config,
                   world=dict(cfg.shapes_world), world_generation_seconds=gen_seconds,
                   max_iters=max_iters, slide=dict(crop_size=CROP, stride=STRIDE),
                   summary=summary, runs=runs, note=args.note), args.out)
        print(json.dumps(summary, indent=2))
    if not args.no_curve:
        example_figure(osp.join(ROOT, args.config), ckpt0, args.example_png)
        curve(args.config, ckpt0, args.work_root, args.scales, args.curve_out, args.curve_png,
              command, cfg.shapes_world['num_val'])


if __name__ == '__main__':
    main()
