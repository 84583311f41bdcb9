"""Peak memory and time of whole-image inference through the mmseg / mmdet doors, fresh processes.

    python benchmarks/peak_memory.py --out docs/results/whole_image_inference
    python benchmarks/peak_memory.py --report docs/results/whole_image_inference.json

A point is (task, backbone, path, size), random weights. A CPU point runs in a process of its own
(a process keeps the heap its earlier calls grew); on CUDA one process runs a series. Method and
paths: docs/benchmark_high_resolution.md, benchmark_gpu.md, benchmark_gigapixel.md.
"""
import argparse
import contextlib
import functools
import hashlib
import importlib
import json
import os
import os.path as osp
import shlex
import sys
import time

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path[:0] = [ROOT, osp.join(ROOT, 'benchmarks')]  # xcit_mm of this checkout; xcit_benchmark
from xcit_benchmark.fresh_points import (MIB, PartMeter, cpu_model, hooked,  # noqa: E402
                                         kept_rows, measure, package_version, revision,
                                         run_fresh, test_image, write_artifact)
from xcit_benchmark.report import log_log_axes, md_table  # noqa: E402

TASKS = ('segmentor', 'detector')
BACKBONES = ('xcit', 'swin', 'vit', 'uper')
# a series' order; default: the config's test_cfg as it is (the segmentor then chooses its plan
# within the memory the process may use); bands: report only (REPORT_ONLY)
PATHS = ('bands', 'lean', 'stream', 'stream-disk', 'tiles', 'stock', 'auto', 'default')
# paths whose rows the artifacts keep and --report shows, but which no longer run: both models'
# band paths (band_mb with mode='whole') went into the stream, band_mb now its band size
REPORT_ONLY = {'bands': "both models' band paths went into the stream (test_cfg.mode='stream', "
                        'band_mb its band size): run --paths stream; the bands rows in '
                        'docs/results stay as measured, and --report still shows them'}
STREAMS = {'stream': 'memory', 'stream-disk': 'disk'}  # path: test_cfg.token_maps
# a path's model.test_cfg (auto: no limit while the warm-up calibrates; a point sets its budget)
TEST_CFGS = dict(auto=dict(mode='auto', max_memory=10**9), tiles=dict(mode='tiles'), **{
    path: dict(mode='stream', token_maps=maps) for path, maps in STREAMS.items()})
PIPELINES = ('full', 'paper', 'network')
SIZES = (1024, 2048, 4096, 8192)
CONFIGS = {
    ('segmentor', 'xcit'): 'configs/sem_fpn_xcit_s12_p16_80k_ade20k.py',
    ('segmentor', 'swin'): 'configs/benchmark/sem_fpn_swin_t_512x512_ade20k.py',
    ('segmentor', 'vit'): 'configs/benchmark/sem_fpn_vit_s16_ade20k.py',
    ('segmentor', 'uper'): 'configs/upernet_xcit_s12_p16_160k_ade20k.py',
    ('detector', 'xcit'): 'configs/mask_rcnn_xcit_s12_p16_3x_coco.py',
    ('detector', 'swin'): 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py',
    ('detector', 'vit'): 'configs/benchmark/mask_rcnn_vit_s16_coco.py',
}
# the series that have a path beyond lean and stock (bands: none, REPORT_ONLY; tiles: the
# detector's mode='tiles', the whole network per tile, as the stream's reference for time)
ONLY = {'auto': {('segmentor', 'xcit'), ('detector', 'xcit')}, 'bands': set(),
        'default': {('segmentor', 'xcit')}, 'tiles': {('detector', 'xcit')},
        **dict.fromkeys(STREAMS, {('segmentor', 'xcit'), ('segmentor', 'uper'),
                                  ('detector', 'xcit')})}
DOORS = {'segmentor': 'mmseg.apis.inference_model', 'detector': 'mmdet.apis.inference_detector'}
LABELS = {'xcit': 'XCiT-S12/16', 'swin': 'Swin-T', 'vit': 'ViT-S/16', 'uper': 'UperNet XCiT-S12/16',
          'segmentor': 'Semantic FPN', 'detector': 'Mask R-CNN'}
# the CSV's columns: those that some row has, and the note
COLUMNS = ['task', 'backbone', 'path', 'size', 'pipeline', 'device', 'max_memory', 'band_mb',
           'plan', 'detail', 'estimate_mb', 'status', 'peak_growth_mb', 'predict_peak_growth_mb',
           'max_reserved_mb', 'time_s', 'cpu_s', 'error_pct', 'digest', 'note']
# Mask R-CNN's parts whose peaks --parts reports: label=attribute path.method
PARTS = [p.partition('=')[::2] for p in (
    'data_preprocessor=data_preprocessor.forward backbone=backbone.forward '
    'backbone_trunk=backbone.forward_trunk neck=neck.forward lean_features=._lean_extract_feat '
    'rpn=rpn_head.predict lean_rpn=._lean_rpn_predict rpn_post=rpn_head.predict_by_feat '
    'lean_roi=._lean_roi_predict roi_bbox=roi_head.predict_bbox '
    'roi_mask_forward=roi_head._mask_forward mask_paste=roi_head.mask_head.predict_by_feat'
).split()]


# ---------------------------------------------------------------------------- the child
def build_cfg(point: dict):
    """A series' config: its path's model, random weights, full resolution; a detector gets the
    XCiT config's test settings, ``score_thr=0``: the same RoI work for every backbone."""
    from xcit_benchmark.whole_model import drop_pretrained, load_whole_config
    cfg = load_whole_config(point['config'])
    drop_pretrained(cfg.model)
    seg, path = point['task'] == 'segmentor', point['path']
    cfg.model.type = ('' if path == 'stock' else 'Lean') + ('EncoderDecoder' if seg else 'MaskRCNN')
    full = point.get('pipeline', 'full') != 'paper'
    if seg:  # inference_model reads cfg.test_pipeline
        cfg.test_pipeline = [t for t in cfg.test_pipeline if t['type'] != 'Resize' or not full]
    else:  # inference_detector reads the test dataloader's
        xcit = load_whole_config(CONFIGS[('detector', 'xcit')])
        cfg.model.test_cfg = xcit.model.test_cfg
        cfg.model.test_cfg.rcnn.score_thr = 0.0
        pipeline = cfg.test_dataloader.dataset.pipeline
        for t in pipeline:
            if t['type'] == 'Resize' and full:  # scale factor 1: the image's own size
                t.pop('scale', None)
                t.update(scale_factor=1.0, keep_ratio=True)
        pipeline[:] = [t for t in pipeline if t['type'] != 'LoadAnnotations']
    cfg.model.test_cfg.update(TEST_CFGS.get(path, {}))
    if seg and path in ('lean', 'stock'):  # the whole image: the configs name no mode now
        cfg.model.test_cfg.setdefault('mode', 'whole')
    if point.get('band_mb'):  # a budget point's
        cfg.model.test_cfg.band_mb = point['band_mb']
    if point.get('mask_format'):  # the detector's lean modes
        cfg.model.test_cfg.mask_format = point['mask_format']
    return cfg


def output_digest(task: str, result) -> dict:
    """A sha256 prefix of the output (equal digests: identical outputs), its shape and sums."""
    import torch
    digest = hashlib.sha256()

    def add(*tensors):  # 64 MB pieces (32768² labels: 8 GB): the bytes of the whole tensors
        for tensor in tensors:
            for piece in tensor.detach().contiguous().view(-1).split(2**23):
                digest.update(piece.cpu().numpy())

    if isinstance(result, torch.Tensor):  # the network's logits
        add(result)
        out = dict(out_shape=list(result.shape))
    elif task == 'segmentor':
        labels = result.pred_sem_seg.data
        add(labels)
        out = dict(labels_sum=int(labels.sum()), out_shape=list(labels.shape))
    elif isinstance(result.pred_instances.masks, list):  # mask_format='rle'
        import pycocotools.mask as mask_utils
        pred = result.pred_instances
        add(pred.bboxes, pred.labels, pred.scores)
        for rle in pred.masks:
            digest.update(rle['counts'])
        size = pred.masks[0]['size'] if len(pred) else list(result.ori_shape)
        out = dict(num_dets=len(pred), out_shape=[len(pred)] + list(size), mask_format='rle',
                   mask_pixels=sum(int(mask_utils.area(rle)) for rle in pred.masks))
    else:
        pred = result.pred_instances
        add(pred.bboxes, pred.labels, pred.scores, *pred.masks)  # a mask at a time: same bytes
        out = dict(num_dets=len(pred), out_shape=list(pred.masks.shape),
                   mask_pixels=sum(int(m.count_nonzero()) for m in pred.masks))
    return dict(digest=digest.hexdigest()[:16], **out)


def part_meter(model) -> PartMeter:
    """A meter of the methods of :data:`PARTS` that ``model`` has (``--parts``)."""
    meter = PartMeter()
    for label, where in PARTS:
        path, _, method = where.rpartition('.')
        obj = functools.reduce(getattr, filter(None, path.split('.')), model)
        if hasattr(obj, method):
            setattr(obj, method, meter.wrap(getattr(obj, method), label))
    return meter


def measure_point(model, infer, point: dict, spec: dict) -> dict:
    """The figures of one call at ``point['size']``; a failure is a row, not the end."""
    import torch
    from xcit_mm.models.utils.memory_budget import rss_mb
    device, size, task, path = spec['device'], point['size'], point['task'], point['path']
    cuda, img, pipeline = device.startswith('cuda'), test_image(size), point.get('pipeline', 'full')
    call = lambda: infer(model, img)  # noqa: E731
    if pipeline == 'network':  # the network alone on the preprocessed image
        inputs = model.data_preprocessor(
            dict(inputs=[torch.from_numpy(img).permute(2, 0, 1).contiguous()]), False)['inputs']
        net = (model._network_forward if path != 'stock'
               else lambda x: model.decode_head.forward(model.extract_feat(x)))
        call = lambda: net(inputs)  # noqa: E731
    at_predict = []
    if path == 'auto':  # the memory when predict starts: the input exists
        in_use = (lambda: torch.cuda.memory_allocated(device) / MIB) if cuda else rss_mb
        model.test_cfg['max_memory'] = point['max_memory']
        model.predict = hooked(model.predict, before=lambda: at_predict.append(in_use()))
    meter = part_meter(model) if spec.get('parts') and task == 'detector' else None
    if meter:
        call = hooked(call, before=lambda: setattr(meter, 'base', rss_mb()))
    try:
        with torch.no_grad():
            cpu_start = time.process_time()  # CPU seconds: comparable on a shared machine
            result, growth, base, seconds = measure(call, device)
            cpu_seconds = time.process_time() - cpu_start
            row = dict(status='ok', peak_growth_mb=round(max(growth, meter.peak if meter else 0)),
                       base_mb=round(base), type=type(model).__name__,
                       threads=torch.get_num_threads(), **output_digest(task, result))
            if cuda:
                row['max_reserved_mb'] = round(torch.cuda.max_memory_reserved(device) / MIB)
            if pipeline == 'full' and tuple(result.img_shape) != (size, size):
                row.update(status='error', note=f'the network ran at {result.img_shape}, not '
                           f'at the image size {size}')
            del result
            times = [seconds]
            if seconds < spec.get('repeat_below_s', 0):  # a second call: the mean of two
                times.append(measure(call, device)[3])
    except torch.cuda.OutOfMemoryError as e:
        return dict(status='oom', note=(str(e).strip().splitlines() or ['OutOfMemoryError'])[0],
                    allocated_at_oom_mb=round(torch.cuda.max_memory_allocated(device) / MIB))
    except Exception as e:  # noqa: BLE001
        return dict(status='error', note=f'{type(e).__name__}: {str(e).strip()[:300]}')
    row['time_s'] = round(sum(times) / len(times), 3)
    row['cpu_s'] = round(cpu_seconds, 1)  # the first call's, all threads (wall time x threads
    # on an idle machine; less where other jobs take the cores)
    if len(times) > 1:
        row['times_s'] = [round(t, 3) for t in times]
    if meter:
        row['parts'] = meter.parts
    if path == 'default' and model.last_memory_plan is not None:  # what the model chose
        plan = model.last_memory_plan
        row.update(plan=plan.name, detail=plan.detail, estimate_mb=round(plan.estimate_mb))
    if path == 'auto':
        plan, predict_mb = model.last_memory_plan, base + growth - at_predict[0]
        line = (model.calibrated_memory_model
                or model.test_cfg.get('memory_model', {}).values())  # calibrated, or given
        row.update(plan=plan.name, detail=plan.detail, estimate_mb=round(plan.estimate_mb),
                   estimates={p.name: round(p.estimate_mb)
                              for p in model.last_memory_plans},
                   predict_peak_growth_mb=round(predict_mb),
                   error_pct=round(100 * (predict_mb - plan.estimate_mb) / plan.estimate_mb, 1),
                   within_budget=bool(predict_mb <= point['max_memory']),
                   door_within_budget=bool(growth <= point['max_memory']),
                   memory_model=list(line))
    return row


def device_info(device: str) -> dict:
    """The device and the versions that change the figures."""
    import torch
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, device=device,
                threads=torch.get_num_threads(), device_name=cpu_model())
    if device.startswith('cuda'):
        props, cudnn = torch.cuda.get_device_properties(device), torch.backends.cudnn
        info.update(device_name=props.name, device_total_mb=round(props.total_memory / MIB),
                    cudnn=cudnn.version(),
                    allow_tf32=[cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32])
    return info


def child(spec: dict):
    """Build the series' model once, warm it up, measure its points: a row each, as it comes."""
    import numpy as np
    import torch

    import xcit_mm  # noqa: F401  (the lean models and XCiTBackbone, also for upstream configs)
    points, model, previous = spec['points'], None, None
    for point in points:
        with contextlib.redirect_stdout(sys.stderr):
            why = why_not(previous, point, spec['deadline'])
            if not why and model is None:  # built for the first point that runs
                cfg = build_cfg(points[0])  # (Config.fromfile made its custom_imports)
                module, _, name = DOORS[points[0]['task']].rpartition('.')
                apis = importlib.import_module(module)  # the door and its init_model/_detector
                infer, init = getattr(apis, name), getattr(apis, name.replace('inference', 'init'))
                torch.manual_seed(0)
                model = init(cfg, device=spec['device'])
                infer(model, np.zeros((spec['warmup'],) * 2 + (3,), np.uint8))  # pools, calibration
            row = dict(point, **(why or measure_point(model, infer, point, spec)))
        yield row
        previous = previous if point['path'] == 'auto' else row


# ---------------------------------------------------------------------------- the parent
def why_not(previous, point: dict, deadline: float = float('inf'), limit_mb=None) -> dict:
    """``{}`` to run ``point``, else its skipped row's fields, from the deadline and its series'
    previous point (a budget point stands alone): after one that did not finish larger sizes
    cannot fit either; memory grows at least linearly with the pixels, so the previous RSS plus
    its growth times the pixel ratio bounds the peak."""
    if time.time() > deadline:
        return dict(status='skipped', note='not run: the budget was spent')
    if previous is None or point['path'] == 'auto':
        return {}
    if previous['status'] != 'ok':
        return dict(status='skipped', note=f"not run: {previous['status']} at {previous['size']}")
    growth, base = previous['peak_growth_mb'], previous.get('base_mb', 0)
    ratio = (point['size'] / previous['size']) ** 2
    estimate = base + growth * ratio
    if limit_mb is None or estimate <= limit_mb:
        return {}
    return dict(status='skipped', extrapolated_mb=round(growth * ratio),
                note=f'not run: extrapolated peak RSS {estimate / 1024:.1f} GiB (RSS {base} MB '
                f"+ {ratio:g} x growth {growth} MB at {previous['size']}) > "
                f'limit {limit_mb / 1024:.1f} GiB')


def point_key(row: dict) -> tuple:
    """What identifies a point in an artifact (``--update`` replaces rows by it)."""
    return (row['task'], row['backbone'], row['path'], row['size'], row.get('pipeline', 'full'),
            row.get('max_memory'), row.get('band_mb'), row.get('mask_format'))


def series_key(row: dict) -> tuple:
    return point_key(row)[:3] + point_key(row)[4:]


def plan(args, configs: dict) -> list:
    """The points in the order they run: size by size, then the budget points as given."""
    extra = {} if args.pipeline == 'full' else dict(pipeline=args.pipeline)
    if getattr(args, 'mask_format', None):
        extra['mask_format'] = args.mask_format
    if args.device != 'cpu':
        extra['device'] = args.device
    series = [(t, b) for t in args.tasks for b in args.backbones if (t, b) in configs]
    points = [dict(task=t, backbone=b, path=p, size=s, config=configs[(t, b)], **extra)
              for s in sorted(args.sizes) for t, b in series
              for p in sorted(set(args.paths) - {'auto'}, key=PATHS.index)
              if (t, b) in ONLY.get(p, configs) and [p, s] not in getattr(args, 'skip', [])]
    if 'auto' in args.paths:
        points += [dict(task=t, backbone=b, path='auto', size=s, config=configs[(t, b)], **extra,
                        max_memory=mb, **({'band_mb': band[0]} if band else {}))
                   for t, b in series if (t, b) in ONLY['auto'] for s, mb, *band in args.budgets]
    return points


def groups(points: list, device: str) -> list:
    """The points of each child: one on the CPU; on CUDA a series, in command-line order."""
    if device == 'cpu':
        return [[p] for p in points]
    keys = list(dict.fromkeys(series_key(p) for p in points))
    first = [k[:2] for k in keys]
    keys.sort(key=lambda k: (first.index(k[:2]), PATHS.index(k[2])))
    return [[p for p in points if series_key(p) == k] for k in keys]


def run_child(group: list, spec: dict, args, on_row) -> None:
    """One child for ``group``; a point it did not report (killed, crashed) becomes a row."""
    def reported(row):
        if 'task' in row:  # not the exception's row: the point it stopped at gets one below
            on_row(row)

    seconds = min(args.timeout, spec['deadline'] + args.grace_s - time.time())
    out = run_fresh('peak_memory:child', dict(spec, points=group), args.limit_gb * 2**30,
                    max(seconds, 0), on_row=reported)
    done = {point_key(row) for row in out['rows'] if 'task' in row}
    if args.log:
        with open(args.log, 'a') as f:
            f.write(out['stderr'])
    missing = [p for p in group if point_key(p) not in done]
    if missing:
        status = 'killed' if out['killed'] else 'error'
        on_row(dict(missing[0], status=status, note=out['note']))
        for point in missing[1:]:
            on_row(dict(point, status='skipped', note=f"not run: {status} at {missing[0]['size']}"))


def run(args, configs: dict, runner=run_child) -> list:
    """Run (or skip) every point, writing the artifact after each row."""
    start = time.time()
    points = plan(args, configs)
    kept, earlier = [], {}
    if args.update:  # the rows this run does not measure stay
        again = {point_key(p) for p in points}
        artifact = load_artifact(args.out + '.json')
        kept, earlier = kept_rows(artifact, lambda r: point_key(r) in again)
    meta = dict(command='python ' + shlex.join(sys.argv), cpu=cpu_model(),
                threads=int(os.environ.get('OMP_NUM_THREADS') or os.cpu_count()),
                torch=package_version('torch'), mmdet=package_version('mmdet'),
                mmseg=package_version('mmsegmentation'), mmcv=package_version('mmcv'),
                mmengine=package_version('mmengine'), limit_gb=args.limit_gb,
                sizes=sorted(set(args.sizes) | {r['size'] for r in kept}), budgets=args.budgets,
                doors=DOORS, configs={f'{t}:{b}': c for (t, b), c in configs.items()},
                weights='random (Pretrained init dropped)', device_info=device_info(args.device),
                note=args.note or 'one fresh process per point', revision=revision(),
                complete=False, **earlier)
    rows, last, deadline = [], {}, start + args.budget_s
    clock = dict(time=time.time(), load=os.getloadavg()[0])

    def on_row(row):
        now, load = time.time(), os.getloadavg()[0]  # near 1 per core: the point ran alone
        row.update(point_wall_s=round(now - clock['time'], 1), load_before=clock['load'],
                   load_after=load, revision=meta['revision'])
        clock.update(time=now, load=load)
        rows.append(row)
        if row['path'] != 'auto':
            last[series_key(row)] = row
        print(json.dumps(row), flush=True)
        write(args.out, meta, kept + rows)

    spec = dict(device=args.device, warmup=args.warmup, repeat_below_s=args.repeat_below_s,
                parts=args.parts, deadline=deadline)
    for group in groups(points, args.device):  # a series' child skips its own points
        previous = last.get(series_key(group[0])) if len(group) == 1 else None
        why = why_not(previous, group[0], deadline, args.limit_gb * 1024)
        clock.update(time=time.time(), load=os.getloadavg()[0])
        if why:
            for point in group:
                on_row(dict(point, **why))
        else:
            runner(group, spec, args, on_row)
    meta.update(complete=True, wall_s=round(time.time() - start, 1),
                stock_equals_lean=digest_agreement(kept + rows))
    write(args.out, meta, kept + rows)
    return rows


def write(out, meta: dict, rows: list) -> None:
    if out:
        write_artifact(out, meta, rows, [c for c in COLUMNS if c == 'note' or any(
            c in r for r in rows)])


def digest_agreement(rows: list, path: str = 'lean', other: str = 'stock') -> dict:
    """``{'task:backbone:size': digest of path == digest of other}`` where both ran."""
    ran = {point_key(r): r.get('digest') for r in rows if r['status'] == 'ok'}
    return {f'{k[0]}:{k[1]}:{k[3]}': d == ran[k[:2] + (other,) + k[3:]] for k, d in ran.items()
            if k[2] == path and k[:2] + (other,) + k[3:] in ran}


# ---------------------------------------------------------------------------- reports
def load_artifact(path: str) -> dict:
    """The ``{"meta", "rows"}`` of an artifact of this script (ValueError otherwise)."""
    try:
        with open(path) as f:
            artifact = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f'cannot read {path!r}: {e}') from None
    if all({'task', 'backbone', 'path', 'size', 'status'} <= set(r) for r in artifact['rows']):
        return artifact
    raise ValueError(f'{path!r} is not an artifact of peak_memory.py')


def cell(row, cuda: bool) -> str:
    """'+MB, s' ('+MB (reserved), s' on CUDA) or why there is no figure."""
    if row is None:
        return ''
    if row['status'] == 'ok':
        reserved = f" ({row['max_reserved_mb']})" if cuda else ''
        digits = 2 if cuda else 1 if row['time_s'] < 10 else 0
        return f"+{row['peak_growth_mb']} MB{reserved}, {row['time_s']:.{digits}f} s"
    if row['status'] == 'skipped' and row.get('extrapolated_mb'):
        return f"skipped (>= +{row['extrapolated_mb']} MB)"
    return row['status']


def agreement(rows: list) -> str:
    """Which stock and lean (and bands, stream and lean) outputs are equal."""
    def name(key):
        return f"{LABELS[key.split(':')[1]]} {key.split(':')[2]}²"

    def order(item):
        _, backbone, size = item[0].split(':')
        return BACKBONES.index(backbone), int(size)

    same = sorted(digest_agreement(rows).items(), key=order)
    equal, differ = ([name(k) for k, v in same if v is flag] for flag in (True, False))
    texts = []
    if same or any(r['path'] == 'stock' for r in rows):
        texts.append('Stock and lean outputs equal (digest): ' + (', '.join(equal) or 'none')
                     + (f"; **different**: {', '.join(differ)}" if differ else ''))
    for path, label in (('bands', 'Bands (`band_mb`)'), ('stream', 'Stream'),
                        ('stream-disk', 'Stream (token maps on disk)')):
        pairs = sorted(digest_agreement(rows, path, 'lean').items(), key=order)
        if pairs:
            texts.append(f'{label} and lean: ' + ', '.join(
                f"{name(k)} {'equal' if v else 'differ (float rounding)'}" for k, v in pairs))
    return '. '.join(texts) + '.' if texts else ''


def per_megapixel(grid: list, series: list, key: str = 'time_s') -> list:
    """A table of ``key`` (a call's seconds: wall ``time_s``, or ``cpu_s``) per megapixel, a
    column per series, and each stream's over the bands' and the tiles' (the paths it replaces or
    competes with) where the artifact has them."""
    def rate(row):
        ok = row and row['status'] == 'ok' and row.get(key) is not None
        return row[key] / (row['size'] ** 2 / 2**20) if ok else None

    pairs = [(b, p, ref) for b, p in series if p in STREAMS
             for ref in ('bands', 'tiles') if (b, ref) in series]
    rows = []
    for size in sorted({r['size'] for r in grid}):
        at = {(r['backbone'], r['path']): rate(r) for r in grid if r['size'] == size}
        ratios = [at.get((b, p)) and at.get((b, ref)) and at[b, p] / at[b, ref]
                  for b, p, ref in pairs]
        rows.append([f'{size}²'] + [f'{v:.3g}' if v else ''
                                    for v in [at.get(s) for s in series] + ratios])
    header = (['image'] + [f'{LABELS[b]} {p}' for b, p in series]
              + [f'{p} / {ref}' for _, p, ref in pairs])
    what = 'Time' if key == 'time_s' else 'CPU seconds (all threads; fairer on a shared machine)'
    return [f'{what} per megapixel (s / Mpx, 1 Mpx = 2^20 px):', '', md_table(header, rows), '']


def markdown(artifact: dict) -> str:
    """A table per task (a row per size, a column per series), agreement, budgets, the machine."""
    rows, meta = artifact['rows'], artifact.get('meta', {})
    cuda = any('max_reserved_mb' in r for r in rows)
    paths = (('lean', 'stock') if cuda else ('stock', 'lean', 'bands')) + (
        'stream', 'stream-disk', 'tiles')
    lines = []
    for task in TASKS:
        grid = [r for r in rows if r['task'] == task and r['path'] != 'auto']
        if not grid:
            continue
        series = [(b, p) for b in BACKBONES for p in paths
                  if any((r['backbone'], r['path']) == (b, p) for r in grid)]
        if not cuda:
            lines += [f"**{LABELS[task]}** (`{DOORS[task]}`), peak RSS growth and time of the "
                      'call:', '']
        keys = sorted({(r['size'], r.get('pipeline', 'full')) for r in grid})
        at = {(r['backbone'], r['path'], r['size'], r.get('pipeline', 'full')): r for r in grid}
        lines.append(md_table(['image'] + [f'{LABELS[b]} {p}' for b, p in series], [
            [f'{size}²' + ('' if pipeline == 'full' else f' ({pipeline})')]
            + [cell(at.get((*s, size, pipeline)), cuda) for s in series]
            for size, pipeline in keys]))
        text = agreement(grid)
        lines += ['', text, ''] if text else ['']
        if not any(r['path'] == 'stock' for r in grid):  # the stream's artifacts
            lines += per_megapixel(grid, series)
            if all(r.get('cpu_s') is not None for r in grid if r['status'] == 'ok'):
                lines += per_megapixel(grid, series, 'cpu_s')
    budget = [r for r in rows if r['path'] == 'auto']
    if budget:
        tasks = len({r['task'] for r in budget}) > 1  # which model, where both are there
        lines += [md_table(
            ['image', '`max_memory`', 'plan', 'estimate', 'peak growth', 'reserved', 'time'],
            [[f"{r['size']}²{' ' + LABELS[r['task']] if tasks else ''}", str(r['max_memory']),
              r.get('plan', r['status'])] + [str(r.get(k, '')) for k in (
                  'estimate_mb', 'peak_growth_mb', 'max_reserved_mb', 'time_s')] for r in budget],
            'lrlrrrr'), '']
    info = meta.get('device_info', {})
    if cuda:
        lines.append(f"{info['device_name']}, torch {info['torch']}, CUDA {info['cuda']}, cuDNN "
                     f"{info['cudnn']}; cells: peak growth of allocated memory (max reserved, "
                     'weights included), time of the call.')
    elif meta:
        lines.append(f"{meta.get('cpu', '?')}, {meta.get('threads', '?')} threads, torch "
                     f"{meta.get('torch', '?')}, limit {meta.get('limit_gb', '?')} GiB RSS"
                     + ('' if meta.get('complete', True) else ' (incomplete run)') + '.')
    return '\n'.join(lines).rstrip() + '\n'


def plot(artifact: dict, png: str) -> None:
    """Peak memory and time against the image size: a row per task, a colour per backbone, a line
    style per path; points over the limit drawn at it, budget points as (-), their peak (v)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    rows, meta = artifact['rows'], artifact.get('meta', {})
    cuda = any('max_reserved_mb' in r for r in rows)
    info = meta.get('device_info', {})
    limit = info.get('device_total_mb', 0) / 1024 if cuda else meta.get('limit_gb', 20.0)
    colours = dict(xcit='tab:blue', swin='tab:orange', vit='tab:green', uper='tab:purple')
    styles = {'lean': dict(linestyle='-', linewidth=2.4, alpha=0.55),
              'stock': dict(linestyle='--', linewidth=1.4),
              'bands': dict(linestyle='-.', linewidth=1.8),
              'stream': dict(linestyle='-', linewidth=1.4, marker='s'),
              'stream-disk': dict(linestyle=':', linewidth=1.8, marker='D'),
              'tiles': dict(linestyle=(0, (5, 1, 1, 1)), linewidth=1.4, marker='^')}
    tasks = [t for t in TASKS if any(r['task'] == t for r in rows)]
    sizes = sorted({r['size'] for r in rows})
    fig, axes = plt.subplots(len(tasks), 2, figsize=(9, 3.5 * len(tasks) + 0.7), squeeze=False)
    for (ax_mem, ax_time), task in zip(axes, tasks):
        for b, backbone in enumerate(BACKBONES):
            for p, path in enumerate(styles):
                series = sorted((r for r in rows if (r['task'], r['backbone'], r['path'])
                                 == (task, backbone, path)), key=lambda r: r['size'])
                ok = [r for r in series if r['status'] == 'ok']
                style = dict(dict(color=colours[backbone], marker='o', markersize=4),
                             **styles[path])
                ax_mem.plot([r['size'] for r in ok], [r['peak_growth_mb'] / 1024 for r in ok],
                            **style)
                ax_time.plot([r['size'] for r in ok], [r['time_s'] for r in ok], **style)
                shift = 2 ** (0.05 * (3 * b + p - 4))  # side by side around the size
                for status, marker in (('killed', 'x'), ('oom', 'x'), ('skipped', '^')):
                    over = [r['size'] * shift for r in series if r['status'] == status]
                    ax_mem.plot(over, [limit] * len(over), marker=marker, linestyle='none',
                                markersize=6, markerfacecolor='none', color=colours[backbone],
                                alpha=1.0 if path == 'stock' else 0.6)
        for r in rows:
            if (r['task'], r['path'], r['status']) == (task, 'auto', 'ok'):
                x = r['size'] * (1.06 if r['plan'] != 'whole' else 0.94)
                ax_mem.plot([x], [r['max_memory'] / 1024], marker='_', markersize=14, color='k')
                ax_mem.plot([x], [r['peak_growth_mb'] / 1024], marker='v', color='k')
                ax_time.plot([x], [r['time_s']], marker='v', color='k')
        ax_mem.axhline(limit, color='grey', linestyle=':', linewidth=1)
        log_log_axes(ax_mem, sizes, f"peak {'allocated' if cuda else 'RSS'} growth (GiB)",
                     f'{LABELS[task]}: peak memory')
        log_log_axes(ax_time, sizes, 'time of the call (s)', f'{LABELS[task]}: time')
    used = {r['backbone'] for r in rows}
    handles = ([Line2D([], [], color=c, linewidth=2, label=LABELS[b])
                for b, c in colours.items() if b in used]
               + [Line2D([], [], color='black', label=p, **s) for p, s in styles.items()
                  if any(r['path'] == p for r in rows)]
               + [Line2D([], [], color='grey', linestyle=':', label=f'limit {limit:.3g} GiB'),
                  Line2D([], [], color='black', marker='x', linestyle='none',
                         label='killed over the limit' + (' / out of memory' if cuda else '')),
                  Line2D([], [], color='black', marker='^', markerfacecolor='none',
                         linestyle='none', label='skipped (extrapolated over it)')])
    if any(r['path'] == 'auto' for r in rows):
        handles.append(Line2D([], [], color='black', marker='v', linestyle='none',
                              label="mode='auto': peak (v) under max_memory (-)"))
    fig.legend(handles=handles, loc='lower center', ncol=4, fontsize=8, frameon=False)
    threads = {r.get('threads') for r in rows if r.get('threads')} or {meta.get('threads', '?')}
    fig.suptitle('Whole-image inference at full resolution, '
                 + (info.get('device_name') if cuda else meta.get('cpu', 'CPU'))
                 + ('' if cuda else f", {meta.get('threads', '?')} threads"
                    + (f"\n(rows of {' and '.join(map(str, sorted(threads)))} threads: times "
                       'not comparable across them)' if len(threads) > 1 else '')),
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.8 / fig.get_figheight(), 1, 0.97 if len(threads) < 2 else 0.95))
    fig.savefig(png, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------- command line
def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    add = p.add_argument
    add('--report', metavar='JSON', help='print the tables of an artifact and draw its plot')
    add('--png', help='where --report draws (default: the JSON path, .png)')
    add('--also', metavar='JSON', nargs='+', default=[],
        help="--report: draw these artifacts' stream and tiles rows (ok) too")
    add('--tasks', nargs='+', choices=TASKS, default=list(TASKS))
    add('--backbones', nargs='+', choices=BACKBONES, default=['xcit', 'swin', 'vit'])
    add('--paths', nargs='+', choices=PATHS, default=['stock', 'lean'],
        help='auto: XCiT only; tiles: the XCiT detector only; bands: report only (went into '
             'the stream)')
    add('--sizes', nargs='+', type=int, default=list(SIZES), help='multiples of 32, >= 64')
    add('--skip', nargs='+', default=[], metavar='PATH:SIZE', help='points not to run')
    add('--budgets', nargs='+', default=[], metavar='SIZE:MB[:BAND_MB]', help='auto: max_memory')
    add('--pipeline', choices=PIPELINES, default='full',
        help="paper: the config's test Resize; network: the segmentor's network alone")
    add('--config', action='append', metavar='TASK:BACKBONE=PATH', help='another config')
    add('--parts', action='store_true', help="Mask R-CNN: the peak of each part too (CPU)")
    add('--mask-format', choices=('bitmap', 'rle'),
        help="Mask R-CNN's test_cfg.mask_format (stream, stream-disk, tiles and auto paths)")
    add('--device', default='cpu', help='cpu, cuda or cuda:N')
    add('--warmup', type=int, default=64, help='warm-up image size (px)')
    add('--repeat-below-s', type=float, default=0.0, help='time a shorter call twice (mean)')
    add('--limit-gb', type=float, default=20.0, help='RSS limit of a child (CPU)')
    add('--timeout', type=float, default=1800.0, help='seconds per child')
    add('--budget-s', type=float, default=float('inf'), help='no point starts after this')
    add('--grace-s', type=float, default=120.0, help='kill a child this long after --budget-s')
    add('--out', help='artifact path without extension (.json, .csv)')
    add('--update', action='store_true', help='keep the rows at --out this run does not measure')
    add('--note', help='what else ran on the machine')
    add('--log', help="append the children's stderr here")
    return p


def parse_args(parser, argv):
    """The command line, checked: a bad argument stops before any point runs (exit 2)."""
    args = parser.parse_args(argv)
    if args.report:
        return args
    bad = [s for s in args.sizes if s < 64 or s % 32]
    if bad:
        parser.error(f'--sizes {bad}: each size must be a multiple of 32 and at least 64')
    if len(set(args.sizes)) != len(args.sizes):
        parser.error('--sizes: each size once')
    if not (args.limit_gb > 0 and args.timeout > 0):
        parser.error('--limit-gb and --timeout must be positive')
    gone = [p for p in args.paths if p in REPORT_ONLY]
    if gone:
        parser.error(f'--paths {gone[0]}: {REPORT_ONLY[gone[0]]}')
    if 'auto' in args.paths and not args.budgets:
        parser.error('--paths auto needs --budgets')
    if args.mask_format and (args.tasks != ['detector'] or set(args.paths) - {
            'stream', 'stream-disk', 'tiles', 'auto'}):
        parser.error('--mask-format: --tasks detector and --paths among stream, stream-disk, '
                     'tiles, auto (the modes that read test_cfg.mask_format)')
    if args.pipeline == 'network' and args.tasks != ['segmentor']:
        parser.error('--pipeline network: --tasks segmentor only')
    try:
        args.budgets = [[int(v) for v in b.split(':')] for b in args.budgets]
        assert all(len(b) in (2, 3) for b in args.budgets)
    except (ValueError, AssertionError):
        parser.error('--budgets takes SIZE:MB[:BAND_MB] points of whole numbers, e.g. 8192:16000')
    try:
        args.skip = [[p, int(s)] for p, s in (v.split(':') for v in args.skip)]
    except ValueError:
        parser.error('--skip takes PATH:SIZE points, e.g. lean:32768')
    from xcit_benchmark.whole_model import WholeModelError, check_config_path
    args.configs = dict(CONFIGS)
    for value in args.config or []:
        key, _, path = value.partition('=')
        key = tuple(key.split(':'))
        if key not in CONFIGS or not path:
            parser.error(f'--config {value!r}: expected TASK:BACKBONE=PATH, one of {CONFIGS}')
        try:
            check_config_path(path)
        except WholeModelError as e:
            parser.error(f'--config {value!r}: {e}')
        args.configs[key] = path
    if args.update:
        try:
            load_artifact(f'{args.out}.json' if args.out else '')
        except ValueError as e:
            parser.error(f'--update needs --out naming an artifact of this script: {e}')
    return args


def main(argv=None):
    """Measure (exit status 1 when a point failed), or report on an artifact."""
    parser = make_parser()
    args = parse_args(parser, argv)
    if args.report:
        try:
            artifact = load_artifact(args.report)
            also = [row for path in args.also for row in load_artifact(path)['rows']]
        except ValueError as e:
            parser.error(str(e))
        also = [r for r in also if (r['path'] in STREAMS or r['path'] == 'tiles')
                and r['status'] == 'ok']
        plot(dict(artifact, rows=artifact['rows'] + also),
             args.png or osp.splitext(args.report)[0] + '.png')
        print(markdown(artifact), end='')
        return
    rows = run(args, args.configs)
    if any(r['status'] == 'error' for r in rows):
        sys.exit(1)


if __name__ == '__main__':
    main()
