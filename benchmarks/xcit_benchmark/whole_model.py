"""``--whole-model CONFIG ...``: a whole detector / segmentor, train step or inference, by part.

A fresh process per config and round (random weights, SyncBN -> BN, synthetic images), with the
first config's detector settings: the heads' work depends on the detections. Method:
docs/benchmark_whole_model.md.
"""
import copy
import gc
import importlib
import importlib.util
import os
import os.path as osp
import statistics
import time
from typing import Callable, List, Optional, Sequence

import torch

from .fresh_points import (REPO, PartMeter, hooked, mallopt_mmap_threshold, measure,
                           write_artifact)
from .runner import run_memory_worker
from .timing import round_order, set_threads

PARTS_TRAIN = ('trunk', 'adapter', 'neck', 'heads', 'backward', 'optimizer')
PARTS_INFERENCE = PARTS_TRAIN[:4]
SCOPES = ('mmdet', 'mmseg')


class WholeModelError(ValueError):
    """A config that cannot be measured."""


def check_config_path(config: str) -> str:
    """The file of a path (else of the path in this repository: any working directory) or of
    ``mmdet::rel/path.py`` / ``mmseg::...`` (the installed package's configs, found without
    importing it): a usage error before any process starts."""
    scope, sep, rel = config.partition('::')
    if sep and (scope not in SCOPES or not rel):
        raise WholeModelError(f'config {config!r}: the prefix must be mmdet:: or mmseg::')
    spec = importlib.util.find_spec(scope) if sep else None
    for path in [osp.join(osp.dirname(spec.origin), '.mim', 'configs', rel)] if spec else [
            config, osp.join(REPO, config)]:
        if osp.isfile(path):
            return path
    raise WholeModelError(f'config {config!r} not found in the installed {scope} package'
                          if sep else f'config not found: {config!r}')


def load_whole_config(config: str):
    """The mmengine ``Config`` of :func:`check_config_path`'s file."""
    from mmengine.config import Config
    return Config.fromfile(check_config_path(config))


def drop_pretrained(obj):
    """Set every ``init_cfg`` of type Pretrained (and ``pretrained=``) to None, in place."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            cfgs = value if isinstance(value, list) else [value]
            pretrained = any(isinstance(c, dict) and c.get('type') == 'Pretrained' for c in cfgs)
            if key == 'init_cfg' and pretrained or key == 'pretrained' and isinstance(value, str):
                obj[key] = None
            else:
                drop_pretrained(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            drop_pretrained(value)
    return obj


def adamw_kernel_flags(cfg) -> dict:
    """The ``fused`` / ``foreach`` flags of a config's optimizer: AdamW's kernel, not its math."""
    optimizer = (cfg.get('optim_wrapper', None) or {}).get('optimizer', None) or {}
    return {key: optimizer[key] for key in ('fused', 'foreach') if key in optimizer}


def work_settings(config: str, detections: int = 100) -> dict:
    """What every config of a comparison shares, from the subject's ``config``."""
    cfg = load_whole_config(config)
    model = cfg.get('model', None) or {}
    two_stage = all(key in model for key in ('roi_head', 'train_cfg', 'test_cfg'))
    train, test = (model[k].to_dict() if two_stage else None for k in ('train_cfg', 'test_cfg'))
    return dict(det_train_cfg=train, det_test_cfg=test, detections=detections,
                adamw_flags=adamw_kernel_flags(cfg), source=config)


def build_whole_model(config: str, work: Optional[dict] = None):
    """(model, task, AdamW flags) of a config: random init, SyncBN -> BN, the ``work`` settings."""
    from mmengine.config import ConfigDict
    from mmengine.model import revert_sync_batchnorm
    from mmengine.registry import init_default_scope

    import xcit_mm  # noqa: F401  (registers XCiTBackbone)
    cfg = load_whole_config(config)
    scope = cfg.get('default_scope', None)
    if scope not in SCOPES or not isinstance(cfg.get('model', None), dict):
        raise WholeModelError(f'config {config!r}: needs default_scope mmdet or mmseg and a '
                              f'model dict (got scope {scope!r})')
    model_cfg = drop_pretrained(copy.deepcopy(cfg.model))  # a ConfigDict (test_cfg.mode ...)
    if work and work.get('det_train_cfg') is not None and 'roi_head' in model_cfg:
        model_cfg.update(train_cfg=ConfigDict(copy.deepcopy(work['det_train_cfg'])),
                         test_cfg=ConfigDict(copy.deepcopy(work['det_test_cfg'])))
        model_cfg.test_cfg.rcnn.update(score_thr=0.0, max_per_img=work['detections'])
    init_default_scope(scope)
    model = importlib.import_module(f'{scope}.registry').MODELS.build(model_cfg)
    model.init_weights()
    flags = work['adamw_flags'] if work else adamw_kernel_flags(cfg)
    return revert_sync_batchnorm(model), ('det' if scope == 'mmdet' else 'seg'), flags


def synthetic_batch(model, task: str, h: int, w: int, batch: int, training: bool):
    """(inputs, data_samples) after the model's data_preprocessor, for ``batch`` random images."""
    import numpy as np
    g = torch.Generator().manual_seed(0)
    images, samples = [], []
    for _ in range(batch):
        images.append(torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8))
        meta = dict(img_shape=(h, w), ori_shape=(h, w), scale_factor=(1., 1.))
        if task == 'det':
            from mmdet.structures import DetDataSample
            from mmdet.structures.mask import BitmapMasks
            from mmengine.structures import InstanceData
            fr = [(0.1, 0.1, 0.4, 0.5), (0.3, 0.2, 0.9, 0.7), (0.5, 0.6, 0.8, 0.95)]
            boxes = torch.tensor([[x0 * w, y0 * h, x1 * w, y1 * h] for x0, y0, x1, y1 in fr])
            masks = np.zeros((3, h, w), dtype=np.uint8)
            for i, (x0, y0, x1, y1) in enumerate(boxes.int().tolist()):
                masks[i, y0:y1, x0:x1] = 1
            sample = DetDataSample(metainfo=meta, gt_instances=InstanceData(
                bboxes=boxes, labels=torch.tensor([0, 1, 2]), masks=BitmapMasks(masks, h, w)),
                ignored_instances=InstanceData(bboxes=torch.zeros(0, 4),
                                               labels=torch.zeros(0, dtype=torch.long)))
        else:
            from mmengine.structures import PixelData
            from mmseg.structures import SegDataSample
            num_classes = getattr(model.decode_head, 'num_classes', 2)
            sample = SegDataSample(metainfo=meta, gt_sem_seg=PixelData(
                data=torch.randint(0, num_classes, (1, h, w), generator=g)))
        samples.append(sample)
    data = model.data_preprocessor(dict(inputs=images, data_samples=samples), training)
    return data['inputs'], data['data_samples']


def count_rois(model) -> dict:
    """``{'bbox_rois': n, 'mask_rois': n}``, counted by the detector's RoI extractors."""
    counts = dict(bbox_rois=0, mask_rois=0)
    for key in counts:
        extractor = getattr(getattr(model, 'roi_head', None), key[:-5] + '_roi_extractor', None)
        if extractor is not None:
            extractor.register_forward_pre_hook(
                lambda module, args, key=key: counts.update({key: counts[key] + len(args[1])}))
    return counts


def worker_main(cfg: dict) -> dict:
    """Measure one config in this fresh process: times under glibc's default malloc (as training
    runs), then peaks under the 64 KiB mmap threshold (``mem_pass='live'``)."""
    set_threads(cfg.get('threads'))
    torch.manual_seed(0)
    model, task, adamw_flags = build_whole_model(cfg['config'], cfg.get('work'))
    train = cfg['mode'] == 'train'
    model.train(train)
    inputs, samples = synthetic_batch(model, task, cfg['height'], cfg['width'], cfg['batch'],
                                      train)
    clock, counts, detections = PartMeter(), count_rois(model), []
    from xcit_mm.models.backbones.xcit import XCiTBackbone
    backbone, neck = model.backbone, getattr(model, 'neck', None)
    is_xcit = isinstance(backbone, XCiTBackbone)  # the part boundaries
    if is_xcit:
        backbone.forward_trunk = hooked(backbone.forward_trunk, after=lambda: clock.mark('trunk'))
    backbone.forward = hooked(backbone.forward,
                              after=lambda: clock.mark('adapter' if is_xcit else 'trunk'))
    if neck is not None:
        neck.forward = hooked(neck.forward, after=lambda: clock.mark('neck'))
    names = PARTS_TRAIN if train else PARTS_INFERENCE
    optim = train and torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                        lr=1e-4, weight_decay=0.05, **adamw_flags)

    def step():
        if not train:
            with torch.no_grad():
                results = model.predict(inputs, samples)
            clock.mark('heads')
            detections[:] = [len(r.pred_instances) for r in results] if task == 'det' else []
            return
        optim.zero_grad(set_to_none=True)
        loss, _ = model.parse_losses(model.loss(inputs, samples))
        clock.mark('heads')
        loss.backward()
        clock.mark('backward')
        optim.step()
        clock.mark('optimizer')

    def run(repeats):
        """(step seconds, per-part (seconds, peak MB over the step start), start RSS MB)."""
        out = []
        for _ in range(repeats):
            counts.update(bbox_rois=0, mask_rois=0)
            clock.start()
            step()
            out.append((clock.marks[-1][1] - clock.t0, clock.sequence(names), clock.base))
        return out

    clock.start()
    step()  # warm-up
    gc.collect()
    timed = run(cfg['repeats'])
    work = dict(counts)
    if detections:
        work['detections_per_image'] = list(detections)
    live = cfg.get('mem_pass', 'live') == 'live' and mallopt_mmap_threshold(65536)
    measured, _, base, _ = measure(lambda: run(cfg['repeats']))  # base: RSS after malloc_trim
    med = statistics.median
    return dict(status='ok', task=task, backbone=type(model.backbone).__name__,
                is_xcit=is_xcit, params_m=sum(p.numel() for p in model.parameters()) / 1e6,
                time_ms=med(t for t, _, _ in timed) * 1e3, times_ms=[t * 1e3 for t, _, _ in timed],
                mem_pass_time_ms=med(t for t, _, _ in measured) * 1e3,
                peak_mem_mb=max(start - base + max(p for _, p in parts.values())
                                for _, parts, start in measured), mem_base_mb=base,
                parts={n: dict(time_ms=med(parts[n][0] for _, parts, _ in timed) * 1e3,
                               peak_mb=max(parts[n][1] for _, parts, _ in measured))
                       for n in names},
                work=work, adamw_flags=adamw_flags,
                memory_mode='mmap threshold 64 KiB' if live else 'glibc default malloc', note='')


def config_name(config: str) -> str:
    return osp.splitext(osp.basename(config.split('::')[-1]))[0]


BUILD_KEYS = ('task', 'backbone', 'is_xcit', 'params_m', 'adamw_flags', 'memory_mode')


def _median_record(rec: dict, per_round: Sequence[dict]) -> dict:
    """``rec`` with its rounds: medians over the ok ones, its status the first failure; the build
    facts are the record's, each round keeps its figures (``per_round``)."""
    ok = [p for p in per_round if p.get('status') == 'ok']
    failed = [p for p in per_round if p.get('status') != 'ok']
    rec['status'] = failed[0].get('status') if failed else 'ok'
    rec['note'] = '; '.join(f'round {p["round"] + 1}: {p.get("status")} {p.get("note", "")}'
                            .strip() for p in failed)
    rec['rounds_ok'] = len(ok)
    if ok:
        rec.update({key: ok[0][key] for key in BUILD_KEYS + ('work',) if key in ok[0]})
        med = statistics.median
        for key in ('time_ms', 'peak_mem_mb', 'mem_base_mb'):
            rec[key] = med(p[key] for p in ok)
        rec.update(round_times_ms=[p['time_ms'] for p in ok],
                   round_peaks_mb=[p['peak_mem_mb'] for p in ok],
                   times_ms=[t for p in ok for t in p.get('times_ms', [])])
        rec['parts'] = {part: {key: med(p['parts'][part][key] for p in ok)
                               for key in ('time_ms', 'peak_mb')} for part in ok[0]['parts']}
    rec['per_round'] = [{k: v for k, v in p.items() if k not in BUILD_KEYS} for p in per_round]
    return rec


def run_whole_models(configs: Sequence[str], mode: str, height: int, width: int, batch: int = 1,
                     repeats: int = 3, threads: Optional[int] = None,
                     cpu_mem_mode: str = 'process', limit_bytes: float = 8 * 2 ** 30,
                     timeout_s: float = 1800., log: Optional[Callable[[str], None]] = None,
                     rounds: int = 1, work: Optional[dict] = None) -> List[dict]:
    """A record per config (a process per config and round, none after a failure); ``per_round``
    keeps each round's figures, position and load."""
    n, log = len(configs), log or (lambda message: None)
    per_round: List[List[dict]] = [[] for _ in configs]
    for r in range(rounds):
        for pos, i in enumerate(round_order(range(n), r)):
            if per_round[i] and per_round[i][-1]['status'] != 'ok':
                continue
            config, where = configs[i], f'round {r + 1}/{rounds}, {pos + 1}/{n}'
            log(f'{where}: {config} ({mode}, {height}x{width}, batch {batch}) ...')
            # the worker starts under glibc's default malloc; its memory pass switches
            cfg = dict(kind='whole_model', mode=mode, height=height, width=width, batch=batch,
                       config=config, repeats=repeats, threads=threads,
                       cpu_mem_mode='process', mem_pass=cpu_mem_mode, work=work)
            t0 = time.time()
            point = dict(round=r, position=pos, loadavg_1m=os.getloadavg()[0],
                         **run_memory_worker(cfg, int(limit_bytes), timeout_s))
            per_round[i].append(point)
            msg = (f'{point["time_ms"]:.0f} ms/step, peak +{point["peak_mem_mb"]:.0f} MB'
                   if point['status'] == 'ok' else
                   f'{point["status"]} {point.get("note", "")}'.strip())
            log(f'{where}: {config_name(config)}: {msg} ({time.time() - t0:.0f} s)')
    return [_median_record(dict(model=config_name(config), config=config, mode=mode,
                                height=height, width=width, batch=batch, repeats=repeats,
                                rounds=rounds, threads=threads), points)
            for config, points in zip(configs, per_round)]


def whole_model_ratios(records: Sequence[dict]) -> List[dict]:
    """Subject (the first record) / each baseline: median, min, max of the per-round ratios of
    step time and peak over the rounds both were ok in; each part's median time ratio."""
    if len(records) < 2:
        return []
    subject, rows = records[0], []
    a = {p['round']: p for p in subject.get('per_round', []) if p.get('status') == 'ok'}
    for base in records[1:]:
        b = {p['round']: p for p in base.get('per_round', []) if p.get('status') == 'ok'}
        common = sorted(set(a) & set(b))
        row = dict(subject=subject['model'], baseline=base['model'],
                   subject_config=subject['config'], baseline_config=base['config'],
                   rounds=len(common))
        for name, key, unit in (('time', 'time_ms', 'ms'), ('peak', 'peak_mem_mb', 'mb')):
            ratios = [a[r][key] / b[r][key] for r in common if b[r][key] > 0]
            stats = (statistics.median(ratios), min(ratios), max(ratios)) if ratios else (None,) * 3
            for suffix, value in zip(('', '_min', '_max', 's'), stats + (ratios,)):
                row[f'{name}_ratio{suffix}'] = value
            row[f'subject_{name}_{unit}'], row[f'baseline_{name}_{unit}'] = (
                subject.get(key), base.get(key))
        if common:
            sp, bp = subject.get('parts') or {}, base.get('parts') or {}
            row['part_time_ratios'] = {part: (sp[part]['time_ms'] / bp[part]['time_ms']
                                              if bp.get(part, {}).get('time_ms') else None)
                                       for part in sp}
        rows.append(row)
    return rows


def write_whole_outputs(records: Sequence[dict], meta: dict, out_dir: str,
                        name: str) -> List[str]:
    """``<name>.json`` and ``<name>.csv``: a row per record, the parts as ``<part>_ms`` /
    ``<part>_peak_mb`` columns, the rounds' range as ``*_min`` / ``*_max``."""
    rows = []
    for r in records:
        row = {k: v for k, v in r.items() if k not in ('parts', 'times_ms', 'per_round',
                                                       'round_times_ms', 'round_peaks_mb')}
        for key, values in (('time_ms', r.get('round_times_ms')),
                            ('peak_mem_mb', r.get('round_peaks_mb'))):
            low_high = (min(values), max(values)) if values else ('', '')
            row[f'{key}_min'], row[f'{key}_max'] = low_high
        for part in PARTS_TRAIN:
            p = (r.get('parts') or {}).get(part, {})
            row[f'{part}_ms'], row[f'{part}_peak_mb'] = p.get('time_ms', ''), p.get('peak_mb', '')
        rows.append(row)
    return write_artifact(osp.join(out_dir, name), meta, records, key='records', csv_rows=rows)
