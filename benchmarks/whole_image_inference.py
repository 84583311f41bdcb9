"""Whole-image inference at high resolution: peak RSS growth and time, one fresh process per point.

    python benchmarks/whole_image_inference.py --out docs/results/whole_image_inference
    python benchmarks/whole_image_inference.py --plot docs/results/whole_image_inference.json
    python benchmarks/whole_image_inference.py --markdown docs/results/whole_image_inference.json

A point is (task, backbone, path, size): Semantic FPN (mmseg ``FPN`` + ``FPNHead``, 150 classes)
or Mask R-CNN (100 detections kept: ``score_thr=0``), with XCiT-S12/16, Swin-T or ViT-S/16
(DeiT-S + mmseg's ``MultiLevelNeck``) in the same neck and heads (:data:`CONFIGS`), run by the
stock (``EncoderDecoder`` / ``MaskRCNN``) or the lean (``LeanEncoderDecoder`` / ``LeanMaskRCNN``)
model, or (path ``bands``: XCiT only) ``LeanMaskRCNN`` / ``LeanEncoderDecoder`` with
``test_cfg.band_mb`` (the stride-4 maps in bands of rows, and the segmentor's stem and labels:
equal to the others up to float rounding), on
a square random image through the upstream doors (``mmseg.apis.inference_model``,
``mmdet.apis.inference_detector``) at full resolution: the segmentation test ``Resize`` is
removed; the detection one gets ``scale_factor=1.0`` (mmdet's rescaling reads the scale factor it
records), so the network runs at the image size either way.

Each point runs in a fresh process (``xcit_benchmark.fresh_points``): random weights
(``Pretrained`` init dropped), SyncBN reverted to BN by the doors, one 64 px warm-up call, then
the test image, ``malloc_trim``, a reset of the peak RSS and the measured call; peak growth =
VmHWM - VmRSS before the call, under ``MALLOC_MMAP_THRESHOLD_=65536`` so that the RSS follows the
live tensors (the method of ``xcit_benchmark/memory.py``). The parent kills a child whose RSS
passes ``--limit-gb`` (status ``killed``). The sizes run in increasing order; a point whose RSS,
extrapolated from its series' previous size, would pass the limit is not run (status
``skipped``, the estimate in its note: memory grows at least linearly with the pixels, so the
estimate is a lower bound), nor is any size after a killed, failed or skipped one.
"""
import argparse
import hashlib
import json
import os
import os.path as osp
import sys
import time
from typing import Optional

HERE = osp.dirname(osp.abspath(__file__))
ROOT = osp.dirname(HERE)
sys.path.insert(0, HERE)
if ROOT not in sys.path:  # xcit_mm from this checkout, installed or not
    sys.path.insert(1, ROOT)
from xcit_benchmark.fresh_points import (cpu_model, points_parser,  # noqa: E402
                                         run_point, settle_heap, test_image,
                                         write_artifact)

TASKS = ('segmentor', 'detector')
BACKBONES = ('xcit', 'swin', 'vit')
PATHS = ('stock', 'lean', 'bands')
# the (task, backbone) series that the ``bands`` path applies to, and its band size (MB)
BANDED = {('detector', 'xcit'), ('segmentor', 'xcit')}
BAND_MB = 64
SIZES = (1024, 2048, 4096, 8192)
CONFIGS = {
    ('segmentor', 'xcit'): 'configs/sem_fpn_xcit_s12_p16_80k_ade20k.py',
    ('segmentor', 'swin'): 'configs/benchmark/sem_fpn_swin_t_512x512_ade20k.py',
    ('segmentor', 'vit'): 'configs/benchmark/sem_fpn_vit_s16_ade20k.py',
    ('detector', 'xcit'): 'configs/mask_rcnn_xcit_s12_p16_3x_coco.py',
    ('detector', 'swin'): 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py',
    ('detector', 'vit'): 'configs/benchmark/mask_rcnn_vit_s16_coco.py',
}
# every detector gets this config's test_cfg (then score_thr=0): the same RPN / RoI work
DET_TEST_CFG_FROM = CONFIGS[('detector', 'xcit')]
MODEL_TYPES = {('segmentor', 'stock'): 'EncoderDecoder',
               ('segmentor', 'lean'): 'LeanEncoderDecoder',
               ('segmentor', 'bands'): 'LeanEncoderDecoder',
               ('detector', 'stock'): 'MaskRCNN', ('detector', 'lean'): 'LeanMaskRCNN',
               ('detector', 'bands'): 'LeanMaskRCNN'}
DOORS = {'segmentor': 'mmseg.apis.inference_model', 'detector': 'mmdet.apis.inference_detector'}
LABELS = {'xcit': 'XCiT-S12/16', 'swin': 'Swin-T', 'vit': 'ViT-S/16',
          'segmentor': 'Semantic FPN', 'detector': 'Mask R-CNN'}
COLUMNS = ['task', 'backbone', 'path', 'size', 'status', 'peak_growth_mb', 'time_s', 'digest',
           'note']
MIB = 2**20


# ---------------------------------------------------------------------------- the child
def resolve_config(config: str) -> str:
    """A repository-relative config path made to work from any directory (``mmdet::`` /
    ``mmseg::`` names are left to ``xcit_benchmark.whole_model.load_whole_config``)."""
    if '::' in config or osp.isfile(config) or not osp.isfile(osp.join(ROOT, config)):
        return config
    return osp.join(ROOT, config)


def build_cfg(point: dict):
    """The config of ``point``: the model type of its path, no ``Pretrained`` weights, a
    full-resolution test pipeline, and for a detector the shared test settings with
    ``score_thr=0`` (exactly ``max_per_img`` detections, the same RoI-head work for every
    backbone)."""
    import copy

    from mmengine.config import ConfigDict
    from xcit_benchmark.whole_model import drop_pretrained, load_whole_config
    cfg = load_whole_config(resolve_config(point['config']))
    drop_pretrained(cfg.model)
    cfg.model.type = MODEL_TYPES[(point['task'], point['path'])]
    if point['task'] == 'segmentor':
        # inference_model reads cfg.test_pipeline
        cfg.test_pipeline = [t for t in cfg.test_pipeline if t['type'] != 'Resize']
        if point['path'] == 'bands':
            cfg.model.test_cfg.band_mb = BAND_MB
        return cfg
    shared = load_whole_config(resolve_config(DET_TEST_CFG_FROM))
    cfg.model.test_cfg = ConfigDict(copy.deepcopy(shared.model.test_cfg.to_dict()))
    cfg.model.test_cfg.rcnn.score_thr = 0.0
    if point['path'] == 'bands':
        cfg.model.test_cfg.band_mb = BAND_MB
    pipeline = []  # inference_detector reads test_dataloader.dataset.pipeline
    for t in cfg.test_dataloader.dataset.pipeline:
        if t['type'] == 'LoadAnnotations':
            continue
        if t['type'] == 'Resize':  # scale factor 1: the image's own size, recorded
            t = dict(t, scale_factor=1.0, keep_ratio=True)
            t.pop('scale', None)
        pipeline.append(t)
    cfg.test_dataloader.dataset.pipeline = pipeline
    return cfg


def output_digest(task: str, result) -> dict:
    """What identifies the output, so that stock and lean can be compared: a sha256 prefix of
    the labels (and their sum) for a segmentor; of boxes, labels, scores and masks for a
    detector (equal digests = identical results)."""
    digest = hashlib.sha256()
    if task == 'segmentor':
        labels = result.pred_sem_seg.data
        digest.update(labels.contiguous().numpy().tobytes())
        return dict(digest=digest.hexdigest()[:16], labels_sum=int(labels.sum()),
                    out_shape=list(labels.shape))
    pred = result.pred_instances
    for key in ('bboxes', 'labels', 'scores'):
        digest.update(pred[key].contiguous().numpy().tobytes())
    mask_pixels = 0
    for mask in pred.masks:  # one at a time: all N x H x W at 8192^2 is the result's size again
        digest.update(mask.contiguous().numpy().tobytes())  # the same bytes as the whole tensor's
        mask_pixels += int(mask.count_nonzero())
    return dict(digest=digest.hexdigest()[:16], num_dets=len(pred),
                out_shape=list(pred.masks.shape), mask_pixels=mask_pixels)


def child(point: dict) -> dict:
    """Measure one point in this (fresh) process: build through the task's ``init_*`` door,
    warm up on 64 px, then the peak RSS growth and wall time of one call at ``point['size']``."""
    import numpy as np
    import torch
    from mmengine.utils import import_modules_from_strings

    import xcit_mm  # noqa: F401  (the lean models and XCiTBackbone, also for upstream configs)
    from xcit_benchmark.memory import proc_status_kb
    cfg = build_cfg(point)
    if cfg.get('custom_imports', None):
        import_modules_from_strings(**cfg.custom_imports)
    if point['task'] == 'segmentor':
        from mmseg.apis import inference_model as infer
        from mmseg.apis import init_model as init
    else:
        from mmdet.apis import inference_detector as infer
        from mmdet.apis import init_detector as init
    torch.manual_seed(0)
    model = init(cfg, device='cpu')
    infer(model, np.zeros((64, 64, 3), np.uint8))
    size = point['size']
    img = test_image(size)
    base = settle_heap()
    start = time.perf_counter()
    result = infer(model, img)
    seconds = time.perf_counter() - start
    peak = proc_status_kb('VmHWM') * 1024
    shape = tuple(result.img_shape)  # what the pipeline gave the network
    if shape != (size, size):
        raise RuntimeError(f'the network ran at {shape}, not at the image size {size}')
    return dict(status='ok', peak_growth_mb=round((peak - base) / MIB),
                base_mb=round(base / MIB), time_s=round(seconds, 1), type=type(model).__name__,
                threads=torch.get_num_threads(), **output_digest(point['task'], result))


# ---------------------------------------------------------------------------- the parent
def skip_reason(previous: Optional[dict], size: int, limit_mb: float) -> Optional[str]:
    """Why the point of ``size`` is not run, from its series' previous (smaller) point; None:
    run it.

    Memory grows at least linearly with the pixels, so the previous point's RSS before the call
    plus its growth scaled by the pixel ratio is a lower bound of this point's peak RSS: above
    the limit, running it would only end in a kill after minutes of a 2-core machine. After a
    point that did not finish (killed, failed, skipped) larger sizes cannot fit either.
    """
    if previous is None:
        return None
    if previous['status'] != 'ok':
        return f"not run: {previous['status']} at {previous['size']}"
    ratio = (size / previous['size']) ** 2
    estimate = previous.get('base_mb', 0) + previous['peak_growth_mb'] * ratio
    if estimate <= limit_mb:
        return None
    return (f"not run: extrapolated peak RSS {estimate / 1024:.1f} GiB (RSS "
            f"{previous.get('base_mb', 0)} MB + {ratio:g} x growth {previous['peak_growth_mb']} "
            f"MB at {previous['size']}) > limit {limit_mb / 1024:.1f} GiB")


def extrapolated_mb(previous: dict, size: int) -> Optional[int]:
    """The peak growth :func:`skip_reason` extrapolates to ``size`` (None after a failure)."""
    if previous is None or previous['status'] != 'ok':
        return None
    return round(previous['peak_growth_mb'] * (size / previous['size']) ** 2)


def plan(tasks, backbones, paths, sizes) -> list:
    """The points in the order they run: size by size (smallest first), so that every point's
    series has run its smaller sizes before it; lean before stock (stock may be killed)."""
    return [(task, backbone, path, size) for size in sorted(sizes) for task in tasks
            for backbone in backbones for path in sorted(paths, key=PATHS[::-1].index)
            if path != 'bands' or (task, backbone) in BANDED]


def run(args, configs: dict, runner=run_point) -> list:
    """Run (or skip) every point of the plan, writing the artifact after each one."""
    limit_mb = args.limit_gb * 1024
    points = plan(args.tasks, args.backbones, args.paths, args.sizes)
    kept, earlier = kept_rows(args, points)
    rows, last = [], {}
    meta = dict(cpu=cpu_model(), threads=int(os.environ.get('OMP_NUM_THREADS') or os.cpu_count()),
                command='python ' + ' '.join(sys.argv), torch=package_version('torch'),
                mmdet=package_version('mmdet'), mmseg=package_version('mmsegmentation'),
                limit_gb=args.limit_gb, sizes=sorted(args.sizes), doors=DOORS,
                configs={f'{t}:{b}': c for (t, b), c in configs.items()},
                det_test_cfg=DET_TEST_CFG_FROM, model_types={f'{t}:{p}': m for (t, p), m in
                                                             MODEL_TYPES.items()},
                weights='random (Pretrained init dropped), BN',
                note=args.note or 'one fresh process per point', complete=False)
    if earlier:
        meta['earlier_commands'] = earlier
        meta['sizes'] = sorted({r['size'] for r in kept} | set(args.sizes))
    for task, backbone, path, size in points:
        point = dict(task=task, backbone=backbone, path=path, size=size,
                     config=configs[(task, backbone)])
        previous = last.get((task, backbone, path))
        why = skip_reason(previous, size, limit_mb)
        start = time.time()
        if why:
            result = dict(status='skipped', note=why)
            estimate = extrapolated_mb(previous, size)
            if estimate is not None:
                result['extrapolated_mb'] = estimate
        else:
            load_before = os.getloadavg()[0]
            result = runner(__file__, point, int(args.limit_gb * 2**30), args.timeout)
            result['point_wall_s'] = round(time.time() - start, 1)
            # the 1-minute load average around the point: near 1 means it ran alone
            result['load_before'], result['load_after'] = load_before, os.getloadavg()[0]
        row = dict(point, **result)
        rows.append(row)
        last[(task, backbone, path)] = row
        print(json.dumps(row), flush=True)
        if args.out:
            write_artifact(args.out, meta, kept + rows, COLUMNS)
    meta['complete'] = True
    meta['stock_equals_lean'] = digest_agreement(kept + rows)
    if args.out:
        write_artifact(args.out, meta, kept + rows, COLUMNS)
    return rows


def kept_rows(args, points: list):
    """With ``--update``: the rows of the artifact at ``--out`` that this run does not measure
    again, and the commands that measured them; else nothing."""
    if not args.update:
        return [], []
    artifact = load_artifact(args.out + '.json')
    again = set(points)
    kept = [r for r in artifact['rows']
            if (r['task'], r['backbone'], r['path'], r['size']) not in again]
    meta = artifact.get('meta', {})
    return kept, meta.get('earlier_commands', []) + [meta.get('command', '?')]


def package_version(name: str) -> str:
    """The installed version of ``name`` (without importing it)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return 'not installed'


def digest_agreement(rows: list) -> dict:
    """``{'task:backbone:size': stock digest == lean digest}`` where both ran."""
    ran = {(r['task'], r['backbone'], r['path'], r['size']): r.get('digest')
           for r in rows if r['status'] == 'ok'}
    return {f'{t}:{b}:{s}': ran[(t, b, 'stock', s)] == ran[(t, b, 'lean', s)]
            for (t, b, p, s) in ran if p == 'lean' and (t, b, 'stock', s) in ran}


def band_agreement(rows: list) -> dict:
    """``{'task:backbone:size': bands digest == lean digest}`` where both ran (bands may differ
    from lean in the last bits of the stride-4 maps, and so in the outputs)."""
    ran = {(r['task'], r['backbone'], r['path'], r['size']): r.get('digest')
           for r in rows if r['status'] == 'ok'}
    return {f'{t}:{b}:{s}': ran[(t, b, 'bands', s)] == ran[(t, b, 'lean', s)]
            for (t, b, p, s) in ran if p == 'bands' and (t, b, 'lean', s) in ran}


# ---------------------------------------------------------------------------- reports
def load_artifact(path: str) -> dict:
    """The ``{"meta", "rows"}`` of a JSON written by this script (ValueError otherwise)."""
    try:
        with open(path) as f:
            artifact = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f'cannot read {path!r}: {e}') from None
    if not (isinstance(artifact, dict) and isinstance(artifact.get('rows'), list)
            and all(set(COLUMNS[:5]) <= set(r) for r in artifact['rows'])):
        raise ValueError(f'{path!r} is not an artifact of whole_image_inference.py')
    return artifact


def cell(row: Optional[dict]) -> str:
    """One table cell: '+MB, s' or why there is no figure."""
    if row is None:
        return ''
    if row['status'] == 'ok':
        seconds = row['time_s']
        return f"+{row['peak_growth_mb']} MB, {seconds:.{1 if seconds < 10 else 0}f} s"
    if row['status'] == 'skipped' and row.get('extrapolated_mb'):
        return f"skipped (>= +{row['extrapolated_mb']} MB)"
    return row['status']


def markdown(artifact: dict) -> str:
    """The Markdown tables of an artifact: one per task, a row per size, a column per
    (backbone, path) that ran, and which stock / lean outputs are equal."""
    rows, meta = artifact['rows'], artifact.get('meta', {})
    lines = []
    for task in TASKS:
        task_rows = [r for r in rows if r['task'] == task]
        if not task_rows:
            continue
        series = [(b, p) for b in BACKBONES for p in PATHS
                  if any(r['backbone'] == b and r['path'] == p for r in task_rows)]
        lines += [f"**{LABELS[task]}** (`{DOORS[task]}`), peak RSS growth and time of the call:",
                  '', '| image | ' + ' | '.join(f'{LABELS[b]} {p}' for b, p in series) + ' |',
                  '|---|' + '---:|' * len(series)]
        for size in sorted({r['size'] for r in task_rows}):
            at = {(r['backbone'], r['path']): r for r in task_rows if r['size'] == size}
            lines.append(f'| {size}² | ' + ' | '.join(cell(at.get(s)) for s in series) + ' |')
        same = digest_agreement(task_rows)
        equal = sorted((k for k, v in same.items() if v), key=_sort_key)
        differ = sorted((k for k, v in same.items() if not v), key=_sort_key)
        text = 'Stock and lean outputs equal (digest): ' + (', '.join(map(_pair, equal)) or 'none')
        if differ:
            text += '; **different**: ' + ', '.join(map(_pair, differ))
        banded = band_agreement(task_rows)
        if banded:
            text += ('. Bands (`band_mb`) and lean: ' + ', '.join(
                f"{_pair(k)} {'equal' if v else 'differ (float rounding)'}"
                for k, v in sorted(banded.items(), key=lambda kv: _sort_key(kv[0]))))
        lines += ['', text + '.', '']
    if meta:
        lines.append(f"{meta.get('cpu', '?')}, {meta.get('threads', '?')} threads, torch "
                     f"{meta.get('torch', '?')}, limit {meta.get('limit_gb', '?')} GiB RSS"
                     + ('' if meta.get('complete', True) else ' (incomplete run)') + '.')
    return '\n'.join(lines).rstrip() + '\n'


def _sort_key(key: str):
    """Backbone order, then size, of a ``task:backbone:size`` key."""
    task, backbone, size = key.split(':')
    return BACKBONES.index(backbone), int(size)


def _pair(key: str) -> str:
    """'XCiT-S12/16 1024²' for a ``task:backbone:size`` key."""
    _, backbone, size = key.split(':')
    return f'{LABELS[backbone]} {size}²'


def plot(artifact: dict, png: str) -> None:
    """Peak memory and time against the image size (log-log), a row per task: a colour per
    backbone, solid lean under dashed stock (so that equal figures show both); killed and skipped
    points are drawn at the limit (their peak RSS is at least that), side by side so that none
    hides another; failed points are left out."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator
    rows, meta = artifact['rows'], artifact.get('meta', {})
    limit_gb = meta.get('limit_gb', 20.0)
    colours = {'xcit': 'tab:blue', 'swin': 'tab:orange', 'vit': 'tab:green'}
    styles = {'lean': dict(linestyle='-', linewidth=2.4, alpha=0.55),
              'stock': dict(linestyle='--', linewidth=1.4),
              'bands': dict(linestyle='-.', linewidth=1.8)}
    tasks = [t for t in TASKS if any(r['task'] == t for r in rows)]
    sizes = sorted({r['size'] for r in rows})
    fig, axes = plt.subplots(len(tasks), 2, figsize=(9, 3.5 * len(tasks) + 0.7), squeeze=False)
    for (ax_mem, ax_time), task in zip(axes, tasks):
        for b, backbone in enumerate(BACKBONES):
            for p, path in enumerate(('lean', 'stock', 'bands')):
                series = sorted((r for r in rows if (r['task'], r['backbone'], r['path'])
                                 == (task, backbone, path)), key=lambda r: r['size'])
                ok = [r for r in series if r['status'] == 'ok']
                style = dict(color=colours[backbone], marker='o', markersize=4, **styles[path])
                ax_mem.plot([r['size'] for r in ok], [r['peak_growth_mb'] / 1024 for r in ok],
                            **style)
                ax_time.plot([r['size'] for r in ok], [r['time_s'] for r in ok], **style)
                shift = 2 ** (0.05 * (3 * b + p - 4))  # side by side around the size
                for status, marker in (('killed', 'x'), ('skipped', '^')):
                    over = [r['size'] * shift for r in series if r['status'] == status]
                    ax_mem.plot(over, [limit_gb] * len(over), marker=marker, linestyle='none',
                                markersize=6, markerfacecolor='none', color=colours[backbone],
                                alpha=1.0 if path == 'stock' else 0.6)
        ax_mem.axhline(limit_gb, color='grey', linestyle=':', linewidth=1)
        ax_mem.set_ylabel('peak RSS growth (GiB)')
        ax_time.set_ylabel('time of the call (s)')
        for ax, what in ((ax_mem, 'peak memory'), (ax_time, 'time')):
            ax.set_xscale('log', base=2)
            ax.set_yscale('log')
            ax.set_xticks(sizes, [f'{s}²' for s in sizes])
            ax.set_xlim(sizes[0] / 1.25, sizes[-1] * 1.25)
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f'{v:g}'))
            ax.yaxis.set_minor_locator(LogLocator(base=10, subs=()))
            ax.set_xlabel('image size (px)')
            ax.set_title(f'{LABELS[task]}: {what}', fontsize=10)
            ax.grid(True, which='major', alpha=0.3)
    handles = ([Line2D([], [], color=c, linewidth=2, label=LABELS[b])
                for b, c in colours.items()]
               + [Line2D([], [], color='black', label=p, **s) for p, s in styles.items()]
               + [Line2D([], [], color='grey', linestyle=':', label=f'limit {limit_gb:g} GiB'),
                  Line2D([], [], color='black', marker='x', linestyle='none',
                         label='killed over the limit'),
                  Line2D([], [], color='black', marker='^', markerfacecolor='none',
                         linestyle='none', label='skipped (extrapolated over it)')])
    fig.legend(handles=handles, loc='lower center', ncol=4, fontsize=8, frameon=False)
    fig.suptitle('Whole-image inference at full resolution, ' + meta.get('cpu', 'CPU')
                 + f", {meta.get('threads', '?')} threads", fontsize=11)
    fig.tight_layout(rect=(0, 0.8 / fig.get_figheight(), 1, 0.97))
    fig.savefig(png, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------- command line
def parse_config_overrides(parser, values) -> dict:
    """``CONFIGS`` with the ``--config TASK:BACKBONE=PATH`` replacements (usage error if bad)."""
    configs = dict(CONFIGS)
    for value in values or []:
        key, sep, path = value.partition('=')
        task, _, backbone = key.partition(':')
        if not sep or (task, backbone) not in CONFIGS or not path:
            parser.error(f'--config {value!r}: expected TASK:BACKBONE=PATH with TASK in '
                         f'{TASKS} and BACKBONE in {BACKBONES}')
        scope, two_colons, rel = path.partition('::')
        if (two_colons and (scope not in ('mmdet', 'mmseg') or not rel)) or \
                (not two_colons and not osp.isfile(resolve_config(path))):
            parser.error(f'--config {value!r}: no such config file')
        configs[(task, backbone)] = path
    return configs


def make_parser() -> argparse.ArgumentParser:
    """The command line (``xcit_benchmark.fresh_points.points_parser`` plus this script's)."""
    parser = points_parser(__doc__.split('\n')[0], None, None)
    parser.add_argument('--tasks', nargs='+', choices=TASKS, default=list(TASKS))
    parser.add_argument('--backbones', nargs='+', choices=BACKBONES, default=list(BACKBONES))
    parser.add_argument('--paths', nargs='+', choices=PATHS, default=list(PATHS))
    parser.add_argument('--sizes', nargs='+', type=int, default=list(SIZES),
                        help='square image sizes (px), multiples of 32, at least 64')
    parser.add_argument('--config', action='append', metavar='TASK:BACKBONE=PATH',
                        help='measure another config for a (task, backbone), e.g. a small model')
    parser.add_argument('--update', action='store_true',
                        help='keep the rows of the artifact at --out that this run does not '
                        'measure (one artifact from several runs)')
    parser.add_argument('--plot', metavar='JSON', help='plot an artifact (no measurement)')
    parser.add_argument('--png', default=osp.join(ROOT, 'docs', 'whole_image_inference.png'),
                        help='where --plot writes')
    parser.add_argument('--markdown', metavar='JSON',
                        help='print the Markdown tables of an artifact (no measurement)')
    return parser


def main(argv=None):
    """Measure the points (or, with ``--child``, one point), or report on an artifact; exit
    status 2 for a bad argument, 1 when a point failed."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.plot or args.markdown:
        if args.plot and args.markdown:
            parser.error('--plot and --markdown: one at a time')
        try:
            artifact = load_artifact(args.plot or args.markdown)
        except ValueError as e:
            parser.error(str(e))
        if args.plot:
            plot(artifact, args.png)
            print(f'wrote {args.png}')
        else:
            print(markdown(artifact), end='')
        return
    bad = [s for s in args.sizes if s < 64 or s % 32]
    if bad:
        parser.error(f'--sizes {bad}: each size must be a multiple of 32 and at least 64')
    if len(set(args.sizes)) != len(args.sizes):
        parser.error('--sizes: each size once')
    if not args.limit_gb > 0 or not args.timeout > 0:
        parser.error('--limit-gb and --timeout must be positive')
    configs = parse_config_overrides(parser, args.config)
    if args.update:
        try:
            load_artifact(f'{args.out}.json' if args.out else '')
        except ValueError as e:
            parser.error(f'--update needs --out naming an artifact of this script: {e}')
    rows = run(args, configs)
    if any(r['status'] == 'error' for r in rows):
        sys.exit(1)


if __name__ == '__main__':
    main()
