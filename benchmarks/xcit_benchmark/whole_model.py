"""``--whole-model CONFIG ...``: a whole detector / segmentor, train step or inference, by part.

Each config is measured in a fresh process (random weights, SyncBN -> BN, CPU) on synthetic
images passed once through its ``data_preprocessor``. With random weights the number of
detections and positive RoIs depends on the model, and with it the heads' work: so every config
gets the first config's (the subject's) detector ``train_cfg`` / ``test_cfg``, inference keeps
exactly ``detections`` boxes (``score_thr=0``), and every optimizer is the same AdamW with the
subject's ``fused`` / ``foreach`` flags; the work done is counted per step (``work``).

Times come from steps under glibc's default malloc (as a training process runs); the peaks from
as many more steps under the 64 KiB mmap threshold (the RSS then follows the live tensors, but
every large tensor's page faults would be timed too). Each step is cut at the parts (trunk,
adapter, neck, heads, backward, optimizer) by wrappers that read the time and the peak RSS
since the previous boundary, then reset the peak. Round ``r`` measures every config once, in the
order rotated by ``r``; a record's figures are the medians over its rounds, and the ratios
subject / baseline the median (min-max) of the per-round ratios.
"""
import copy
import gc
import os
import os.path as osp
import statistics
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from xcit_mm.models.utils.memory_budget import (peak_rss_mb, release_free_heap, reset_peak_rss,
                                                rss_mb)

from .fresh_points import write_artifact
from .memory import main as memory_process_main
from .memory import mallopt_mmap_threshold, run_memory_worker
from .timing import round_order, set_threads

PARTS_TRAIN = ('trunk', 'adapter', 'neck', 'heads', 'backward', 'optimizer')
PARTS_INFERENCE = ('trunk', 'adapter', 'neck', 'heads')
SCOPES = ('mmdet', 'mmseg')


class WholeModelError(ValueError):
    """A config that cannot be measured."""


def check_config_path(config: str) -> None:
    scope, sep, rel = config.partition('::')
    if sep:
        if scope not in SCOPES or not rel:
            raise WholeModelError(f'config {config!r}: the prefix must be mmdet:: or mmseg::')
        return
    if not osp.isfile(config):
        raise WholeModelError(f'config not found: {config!r}')


def load_whole_config(config: str):
    """The mmengine ``Config`` of a path or of ``mmdet::rel/path.py`` / ``mmseg::...``."""
    from mmengine.config import Config
    check_config_path(config)
    if '::' in config:
        scope, rel = config.split('::', 1)
        import importlib
        pkg = importlib.import_module(scope)
        root = osp.dirname(pkg.__file__)
        for cand in (osp.join(root, '.mim', 'configs', rel), osp.join(root, 'configs', rel)):
            if osp.isfile(cand):
                return Config.fromfile(cand)
        raise WholeModelError(f'config {config!r} not found in the installed {scope} package')
    return Config.fromfile(config)


def drop_pretrained(obj):
    """Set every ``init_cfg`` of type Pretrained (and ``pretrained=``) to None, in place."""
    if isinstance(obj, dict):
        for key in list(obj):
            value = obj[key]
            if key == 'init_cfg':
                cfgs = value if isinstance(value, list) else [value]
                if any(isinstance(c, dict) and c.get('type') == 'Pretrained' for c in cfgs):
                    obj[key] = None
                    continue
            if key == 'pretrained' and isinstance(value, str):
                obj[key] = None
                continue
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
    """What every config of a comparison shares, read from the subject's ``config``."""
    cfg = load_whole_config(config)
    model = cfg.get('model', None) or {}
    two_stage = 'roi_head' in model and 'train_cfg' in model and 'test_cfg' in model

    def plain(value):
        return value.to_dict() if hasattr(value, 'to_dict') else value
    return dict(det_train_cfg=plain(model['train_cfg']) if two_stage else None,
                det_test_cfg=plain(model['test_cfg']) if two_stage else None,
                detections=detections, adamw_flags=adamw_kernel_flags(cfg), source=config)


def equalise_work(model_cfg, work: Optional[dict]) -> None:
    """Give a detector's model config the shared ``work`` settings, in place."""
    if not work or work.get('det_train_cfg') is None or 'roi_head' not in model_cfg:
        return
    from mmengine.config import ConfigDict
    model_cfg['train_cfg'] = ConfigDict(copy.deepcopy(work['det_train_cfg']))
    test_cfg = ConfigDict(copy.deepcopy(work['det_test_cfg']))
    test_cfg.rcnn.score_thr = 0.0
    test_cfg.rcnn.max_per_img = work['detections']
    model_cfg['test_cfg'] = test_cfg


def build_whole_model(config: str, work: Optional[dict] = None):
    """(model, task, AdamW kernel flags) of a config: random init, SyncBN -> BN, on the CPU."""
    from mmengine.model import revert_sync_batchnorm
    from mmengine.registry import init_default_scope

    import xcit_mm  # noqa: F401  (registers XCiTBackbone)
    cfg = load_whole_config(config)
    scope = cfg.get('default_scope', None)
    if scope not in SCOPES or not isinstance(cfg.get('model', None), dict):
        raise WholeModelError(f'config {config!r}: needs default_scope mmdet or mmseg and a '
                              f'model dict (got scope {scope!r})')
    model_cfg = drop_pretrained(copy.deepcopy(cfg.model))  # a ConfigDict (test_cfg.mode ...)
    equalise_work(model_cfg, work)
    init_default_scope(scope)
    if scope == 'mmdet':
        from mmdet.registry import MODELS
    else:
        from mmseg.registry import MODELS
    model = MODELS.build(model_cfg)
    model.init_weights()
    model = revert_sync_batchnorm(model)
    flags = work['adamw_flags'] if work else adamw_kernel_flags(cfg)
    return model, ('det' if scope == 'mmdet' else 'seg'), flags


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
            sample = DetDataSample(metainfo=meta)
            sample.gt_instances = InstanceData(bboxes=boxes, labels=torch.tensor([0, 1, 2]),
                                               masks=BitmapMasks(masks, h, w))
            sample.ignored_instances = InstanceData(bboxes=torch.zeros(0, 4),
                                                    labels=torch.zeros(0, dtype=torch.long))
        else:
            from mmengine.structures import PixelData
            from mmseg.structures import SegDataSample
            num_classes = getattr(model.decode_head, 'num_classes', 2)
            label = torch.randint(0, num_classes, (1, h, w), generator=g)
            sample = SegDataSample(metainfo=meta)
            sample.gt_sem_seg = PixelData(data=label)
        samples.append(sample)
    data = model.data_preprocessor(dict(inputs=images, data_samples=samples), training)
    return data['inputs'], data['data_samples']


class PartClock:
    """Boundary marks of one step: time, peak RSS (MB) since the previous mark (then reset)."""

    def __init__(self):
        self.marks: List[Tuple[str, float, float]] = []
        self.start_rss = 0.
        self.t0 = 0.

    def start(self):
        reset_peak_rss()
        self.start_rss = rss_mb()
        self.marks = []
        self.t0 = time.perf_counter()

    def mark(self, name: str):
        t = time.perf_counter()
        peak = peak_rss_mb()
        reset_peak_rss()
        self.marks.append((name, t, peak))

    def parts(self, names: Sequence[str]) -> dict:
        """{part: (seconds, peak MB over the step start)}; parts absent from the marks = 0."""
        out = {n: [0., 0] for n in names}
        prev = self.t0
        for name, t, peak in self.marks:
            out[name][0] += t - prev
            out[name][1] = max(out[name][1], peak - self.start_rss)
            prev = t
        return {k: tuple(v) for k, v in out.items()}


def _wrap(obj, attr: str, after: Callable[[], None]):
    """``obj.attr`` (a bound method) calling ``after()`` when it returns."""
    fn = getattr(obj, attr)

    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        after()
        return out
    setattr(obj, attr, wrapped)


class WorkCounter:
    """RoIs entering a detector's box and mask RoI extractors during one step."""

    def __init__(self, model):
        self.bbox_rois = self.mask_rois = 0
        roi_head = getattr(model, 'roi_head', None)
        for name, attr in (('bbox_roi_extractor', 'bbox_rois'), ('mask_roi_extractor',
                                                                 'mask_rois')):
            extractor = getattr(roi_head, name, None)
            if extractor is not None:
                extractor.register_forward_pre_hook(self._counter(attr))

    def _counter(self, attr):
        def hook(module, args):
            setattr(self, attr, getattr(self, attr) + int(args[1].shape[0]))
        return hook

    def reset(self):
        self.bbox_rois = self.mask_rois = 0


def instrument(model, clock: PartClock) -> bool:
    """Put the part boundaries on ``model``; returns whether the backbone is XCiT."""
    from xcit_mm.models.backbones.xcit import XCiTBackbone
    backbone = model.backbone
    is_xcit = isinstance(backbone, XCiTBackbone)
    if is_xcit:
        _wrap(backbone, 'forward_trunk', lambda: clock.mark('trunk'))
        _wrap(backbone, 'forward', lambda: clock.mark('adapter'))
    else:
        _wrap(backbone, 'forward', lambda: clock.mark('trunk'))
    if getattr(model, 'neck', None) is not None:
        _wrap(model.neck, 'forward', lambda: clock.mark('neck'))
    return is_xcit


def worker_main(cfg: dict) -> dict:
    """Measure one config in this fresh process (``cfg``: config, height, width, batch, mode,
    repeats, threads, mem_pass 'live' or 'process', work)."""
    set_threads(cfg.get('threads'))
    torch.manual_seed(0)
    model, task, adamw_flags = build_whole_model(cfg['config'], cfg.get('work'))
    train = cfg['mode'] == 'train'
    model.train(train)
    inputs, samples = synthetic_batch(model, task, cfg['height'], cfg['width'], cfg['batch'],
                                      train)
    clock = PartClock()
    counter = WorkCounter(model)
    detections: List[int] = []
    is_xcit = instrument(model, clock)
    names = PARTS_TRAIN if train else PARTS_INFERENCE
    if train:
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                  weight_decay=0.05, **adamw_flags)

        def step():
            optim.zero_grad(set_to_none=True)
            losses = model.loss(inputs, samples)
            loss, _ = model.parse_losses(losses)
            clock.mark('heads')
            loss.backward()
            clock.mark('backward')
            optim.step()
            clock.mark('optimizer')
    else:
        def step():
            with torch.no_grad():
                results = model.predict(inputs, samples)
            clock.mark('heads')
            if task == 'det':
                detections[:] = [len(r.pred_instances) for r in results]

    def run(repeats):
        """(step seconds, per-part (seconds, peak MB over the step start), start RSS MB)."""
        out = []
        for _ in range(repeats):
            counter.reset()
            clock.start()
            step()
            out.append((clock.marks[-1][1] - clock.t0, clock.parts(names), clock.start_rss))
        return out

    clock.start()
    step()  # warm-up
    gc.collect()
    timed = run(cfg['repeats'])
    work = dict(bbox_rois=counter.bbox_rois, mask_rois=counter.mask_rois)
    if detections:
        work['detections_per_image'] = list(detections)

    live = cfg.get('mem_pass', 'live') == 'live' and mallopt_mmap_threshold(65536)
    gc.collect()
    release_free_heap()
    reset_peak_rss()
    base = rss_mb()
    measured = run(cfg['repeats'])
    peak = max(start_rss - base + max(p for _, p in parts.values())
               for _, parts, start_rss in measured)
    n_params = sum(p.numel() for p in model.parameters())
    med = statistics.median
    result = dict(status='ok', task=task, backbone=type(model.backbone).__name__,
                  is_xcit=is_xcit, params_m=n_params / 1e6,
                  time_ms=med(t for t, _, _ in timed) * 1e3,
                  times_ms=[t * 1e3 for t, _, _ in timed],
                  mem_pass_time_ms=med(t for t, _, _ in measured) * 1e3,
                  peak_mem_mb=peak, mem_base_mb=base,
                  parts={n: dict(time_ms=med(parts[n][0] for _, parts, _ in timed) * 1e3,
                                 peak_mb=max(parts[n][1] for _, parts, _ in measured))
                         for n in names},
                  work=work, adamw_flags=adamw_flags,
                  memory_mode='mmap threshold 64 KiB' if live else 'glibc default malloc',
                  note='')
    return result


def config_name(config: str) -> str:
    return osp.splitext(osp.basename(config.split('::')[-1]))[0]


ROUND_KEYS = ('status', 'note', 'time_ms', 'times_ms', 'mem_pass_time_ms', 'peak_mem_mb',
              'mem_base_mb', 'parts', 'work')


def _median_record(rec: dict, per_round: Sequence[dict]) -> None:
    """``rec``'s figures, in place: medians over its ok rounds; its status the first failure."""
    ok = [p for p in per_round if p.get('status') == 'ok']
    failed = [p for p in per_round if p.get('status') != 'ok']
    if failed:
        rec['status'] = failed[0].get('status')
        rec['note'] = '; '.join(f'round {p["round"] + 1}: {p.get("status")} {p.get("note", "")}'
                                .strip() for p in failed)
    else:
        rec['status'], rec['note'] = 'ok', ''
    rec['rounds_ok'] = len(ok)
    if not ok:
        return
    for key in ('task', 'backbone', 'is_xcit', 'params_m', 'adamw_flags', 'memory_mode', 'work'):
        if key in ok[0]:
            rec[key] = ok[0][key]
    med = statistics.median
    rec['time_ms'] = med(p['time_ms'] for p in ok)
    rec['peak_mem_mb'] = med(p['peak_mem_mb'] for p in ok)
    rec['mem_base_mb'] = med(p['mem_base_mb'] for p in ok)
    rec['round_times_ms'] = [p['time_ms'] for p in ok]
    rec['round_peaks_mb'] = [p['peak_mem_mb'] for p in ok]
    rec['times_ms'] = [t for p in ok for t in p.get('times_ms', [])]
    rec['parts'] = {part: dict(time_ms=med(p['parts'][part]['time_ms'] for p in ok),
                               peak_mb=med(p['parts'][part]['peak_mb'] for p in ok))
                    for part in ok[0]['parts']}


def run_whole_models(configs: Sequence[str], mode: str, height: int, width: int, batch: int = 1,
                     repeats: int = 3, threads: Optional[int] = None,
                     cpu_mem_mode: str = 'process', limit_bytes: float = 8 * 2 ** 30,
                     timeout_s: float = 1800., log: Optional[Callable[[str], None]] = None,
                     rounds: int = 1, work: Optional[dict] = None) -> List[dict]:
    """One record per config, a fresh process per config and round, rounds interleaved so that
    a drift of a shared machine hits all configs alike; a config that fails is not measured in
    later rounds. ``per_round`` keeps each round's figures, with its position and load."""
    n = len(configs)
    per_round: List[List[dict]] = [[] for _ in configs]
    dead = set()
    for r in range(rounds):
        for pos, i in enumerate(round_order(range(n), r)):
            if i in dead:
                continue
            config = configs[i]
            if log:
                log(f'round {r + 1}/{rounds}, {pos + 1}/{n}: {config} ({mode}, {height}x{width}, '
                    f'batch {batch}) ...')
            # the worker starts under glibc's default malloc; its memory pass switches
            cfg = dict(kind='whole_model', mode=mode, height=height, width=width,
                       config=config if '::' in config else osp.abspath(config),
                       batch=batch, repeats=repeats, threads=threads, cpu_mem_mode='process',
                       mem_pass=cpu_mem_mode, work=work)
            load = os.getloadavg()[0] if hasattr(os, 'getloadavg') else None
            t0 = time.time()
            res = run_memory_worker(cfg, int(limit_bytes), timeout_s)
            point = dict(round=r, position=pos, loadavg_1m=load, **res)
            point.setdefault('status', 'error')
            per_round[i].append(point)
            if point['status'] != 'ok':
                dead.add(i)
                msg = f'{point["status"]} {point.get("note", "")}'.strip()
            else:
                msg = (f'{point["time_ms"]:.0f} ms/step, peak +{point["peak_mem_mb"]:.0f} MB')
            if log:
                log(f'round {r + 1}/{rounds}, {pos + 1}/{n}: {config_name(config)}: {msg} '
                    f'({time.time() - t0:.0f} s)')
    records = []
    for i, config in enumerate(configs):
        rec = dict(model=config_name(config), config=config, mode=mode, height=height,
                   width=width, batch=batch, repeats=repeats, rounds=rounds, threads=threads)
        _median_record(rec, per_round[i])
        # the build facts (task, backbone, params, ...) are the record's; a round keeps its figures
        rec['per_round'] = [{k: v for k, v in p.items() if k in ROUND_KEYS or k in
                             ('round', 'position', 'loadavg_1m')} for p in per_round[i]]
        records.append(rec)
    return records


def _ratio_stats(pairs: Sequence[Tuple[float, float]]) -> dict:
    """Median / min / max of the ratios a / b (b <= 0 left out) and the ratios."""
    ratios = [a / b for a, b in pairs if b > 0]
    if not ratios:
        return dict(median=None, min=None, max=None, values=[])
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios),
                values=ratios)


def whole_model_ratios(records: Sequence[dict]) -> List[dict]:
    """Subject (the first record) / each baseline: the per-round ratios of step time and peak,
    over the rounds both were ok in, and of each part's median time."""
    if len(records) < 2:
        return []
    subject = records[0]
    rows = []
    for base in records[1:]:
        a = {p['round']: p for p in subject.get('per_round', []) if p.get('status') == 'ok'}
        b = {p['round']: p for p in base.get('per_round', []) if p.get('status') == 'ok'}
        common = sorted(set(a) & set(b))
        time_ = _ratio_stats([(a[r]['time_ms'], b[r]['time_ms']) for r in common])
        peak = _ratio_stats([(a[r]['peak_mem_mb'], b[r]['peak_mem_mb']) for r in common])
        row = dict(subject=subject['model'], baseline=base['model'],
                   subject_config=subject['config'], baseline_config=base['config'],
                   rounds=len(common),
                   time_ratio=time_['median'], time_ratio_min=time_['min'],
                   time_ratio_max=time_['max'], time_ratios=time_['values'],
                   peak_ratio=peak['median'], peak_ratio_min=peak['min'],
                   peak_ratio_max=peak['max'], peak_ratios=peak['values'],
                   subject_time_ms=subject.get('time_ms'), baseline_time_ms=base.get('time_ms'),
                   subject_peak_mb=subject.get('peak_mem_mb'),
                   baseline_peak_mb=base.get('peak_mem_mb'))
        if common:
            sp, bp = subject.get('parts') or {}, base.get('parts') or {}
            row['part_time_ratios'] = {
                part: (sp[part]['time_ms'] / bp[part]['time_ms']
                       if bp.get(part, {}).get('time_ms') else None)
                for part in sp}
        rows.append(row)
    return rows


def flat_rows(records: Sequence[dict]) -> List[dict]:
    """CSV rows, one per record, the parts as ``<part>_ms`` / ``<part>_peak_mb`` columns."""
    rows = []
    lists = ('parts', 'times_ms', 'per_round', 'round_times_ms', 'round_peaks_mb')
    for r in records:
        row = {k: v for k, v in r.items() if k not in lists}
        for key, values in (('time_ms', r.get('round_times_ms')),
                            ('peak_mem_mb', r.get('round_peaks_mb'))):
            row[f'{key}_min'] = min(values) if values else ''
            row[f'{key}_max'] = max(values) if values else ''
        for part in PARTS_TRAIN:
            p = (r.get('parts') or {}).get(part, {})
            row[f'{part}_ms'] = p.get('time_ms', '')
            row[f'{part}_peak_mb'] = p.get('peak_mb', '')
        rows.append(row)
    return rows


def write_whole_outputs(records: Sequence[dict], meta: dict, out_dir: str,
                        name: str) -> List[str]:
    """``<name>.csv`` (:func:`flat_rows`) and ``<name>.json`` (``{"meta", "records"}``)."""
    return write_artifact(osp.join(out_dir, name), meta, records, key='records',
                          csv_rows=flat_rows(records))


if __name__ == '__main__':  # the whole-model memory process (run_memory_worker starts it)
    sys.exit(memory_process_main(worker=worker_main))
