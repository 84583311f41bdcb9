"""``--whole-model CONFIG ...``: a whole detector / segmentor, train step or inference, by part.

Each config is measured in a FRESH PROCESS (the memory worker mechanism of :mod:`.memory`,
dispatched by ``cfg['kind'] == 'whole_model'``): the model is built from the config with random
initialisation (every ``init_cfg`` of type ``Pretrained`` set to None, nothing downloaded),
SyncBN reverted to BN, on the CPU.  The input is one synthetic image of the given size (several
with ``--batch``), passed once through the config's ``data_preprocessor`` (untimed): a detector
gets 3 boxes with labels and box-shaped masks, a segmentor a random label map.  A train step is
``model.loss`` + backward of the summed losses + one AdamW step; inference is ``model.predict``
under ``torch.no_grad`` in eval mode.

Equal work (:func:`work_settings`, :func:`equalise_work`): with random weights the number of
detections, proposals and positive RoIs depends on the model, and with it the work of the RoI and
mask heads.  So every config gets the FIRST config's (the subject's) detector ``train_cfg`` /
``test_cfg`` (proposal counts, NMS, RoI sampler), inference keeps exactly ``detections`` boxes per
image (``rcnn.score_thr=0``, ``rcnn.max_per_img=detections``), and every config's optimizer is
built the same way: ``torch.optim.AdamW`` over all trainable parameters, lr 1e-4, weight decay
0.05, with the subject config's ``fused`` / ``foreach`` flags (torch's default kernel when it sets
none).  The work actually done is counted per step (``work``: RoIs into the box and mask heads,
detections per image) so that a difference shows.

Steady state: one untimed warm-up step, then ``repeats`` timed steps under glibc's default malloc
(as a training process runs), then the memory pass: ``mallopt(M_MMAP_THRESHOLD, 64 KiB)`` (for
``cpu_mem_mode='live'``; every tensor then gets its own mapping, so the RSS peak follows the live
tensors), ``malloc_trim(0)``, the RSS baseline and ``repeats`` more steps whose peaks are read.
Times come from the timed steps only: with the mmap threshold every large tensor is mapped and
unmapped, and its page faults would be timed too (``mem_pass_time_ms`` keeps those step times).
Every step is cut at part boundaries by wrappers around the model's
``backbone.forward_trunk`` (XCiT only), ``backbone.forward``, ``neck.forward``, the end of the
forward and of the backward: at each boundary the time is taken, the peak RSS since the previous
boundary is read (``VmHWM`` of ``/proc/self/status``) and the peak is reset (``5`` written to
``/proc/self/clear_refs``).  So the parts are:

* ``trunk``: ``XCiTBackbone.forward_trunk`` if the backbone is XCiT, else the whole backbone;
* ``adapter``: the rest of XCiT's forward (0 for other backbones);
* ``neck``; ``heads``: the rest of the forward (RPN / RoI / decode heads, losses or
  post-processing);
* ``backward`` (train only) and ``optimizer`` (train only, the AdamW step).

Per part: median time over the timed steps, and ``peak_mb`` = the highest RSS reached during the
part minus the RSS at the start of the step (max over the memory steps); ``peak_mem_mb`` of the
whole step is the highest of those.  Per-part memory is approximate (the RSS includes what the
libraries keep); the times of the parts sum to the step time (the boundary reads cost
microseconds).

Rounds (:func:`run_whole_models`): round ``r`` measures every config once, each in its own fresh
process, in the order of the configs rotated by ``r``; a record's headline figures are the
medians over its rounds, and :func:`whole_model_ratios` gives, for the first config (the subject)
against each other one (a baseline), the median, min and max of the per-round ratios of step
time and peak memory.
"""
import copy
import gc
import os
import os.path as osp
import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .memory import (LIVE_MMAP_THRESHOLD, _mallopt_mmap_threshold, _release_free_heap,
                     _reset_peak_rss, proc_status_kb, run_memory_worker)
from .timing import round_order, set_threads

PARTS_TRAIN = ('trunk', 'adapter', 'neck', 'heads', 'backward', 'optimizer')
PARTS_INFERENCE = ('trunk', 'adapter', 'neck', 'heads')
SCOPES = ('mmdet', 'mmseg')


class WholeModelError(ValueError):
    """A config that cannot be measured (missing, unreadable, not a detector / segmentor)."""


def check_config_path(config: str) -> None:
    """Raise :class:`WholeModelError` unless ``config`` is a file or ``mmdet::`` / ``mmseg::``."""
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
    """The ``fused`` / ``foreach`` flags a config gives its optimizer (torch's defaults when
    unset): they choose AdamW's update kernel, not the arithmetic."""
    optimizer = (cfg.get('optim_wrapper', None) or {}).get('optimizer', None) or {}
    return {key: optimizer[key] for key in ('fused', 'foreach') if key in optimizer}


def work_settings(config: str, detections: int = 100) -> dict:
    """What every config of a comparison shares, read from the subject's ``config``: the
    detector's ``train_cfg`` / ``test_cfg`` (None for a segmentor), the number of detections
    kept per image at inference, and the AdamW kernel flags (JSON-ready)."""
    cfg = load_whole_config(config)
    model = cfg.get('model', None) or {}
    two_stage = 'roi_head' in model and 'train_cfg' in model and 'test_cfg' in model

    def plain(value):
        return value.to_dict() if hasattr(value, 'to_dict') else value
    return dict(det_train_cfg=plain(model['train_cfg']) if two_stage else None,
                det_test_cfg=plain(model['test_cfg']) if two_stage else None,
                detections=detections, adamw_flags=adamw_kernel_flags(cfg), source=config)


def equalise_work(model_cfg, work: Optional[dict]) -> None:
    """Give a detector's model config the shared ``work`` settings (in place): the subject's
    ``train_cfg`` / ``test_cfg``, and inference that keeps exactly ``work['detections']`` boxes
    per image (no score threshold).  Segmentors and ``work=None`` are left as they are."""
    if not work or work.get('det_train_cfg') is None or 'roi_head' not in model_cfg:
        return
    from mmengine.config import ConfigDict
    model_cfg['train_cfg'] = ConfigDict(copy.deepcopy(work['det_train_cfg']))
    test_cfg = ConfigDict(copy.deepcopy(work['det_test_cfg']))
    test_cfg.rcnn.score_thr = 0.0
    test_cfg.rcnn.max_per_img = work['detections']
    model_cfg['test_cfg'] = test_cfg


def build_whole_model(config: str, work: Optional[dict] = None):
    """(model, task, AdamW kernel flags) for a config: random init, SyncBN -> BN, on the CPU;
    with ``work`` (:func:`work_settings`) the shared detector settings and optimizer flags."""
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
    """Boundary marks of one step: time, peak RSS since the previous mark (then reset)."""

    def __init__(self):
        self.marks: List[Tuple[str, float, int]] = []
        self.start_rss = 0
        self.t0 = 0.

    def start(self):
        _reset_peak_rss()
        self.start_rss = proc_status_kb('VmRSS') * 1024
        self.marks = []
        self.t0 = time.perf_counter()

    def mark(self, name: str):
        t = time.perf_counter()
        peak = proc_status_kb('VmHWM') * 1024
        _reset_peak_rss()
        self.marks.append((name, t, peak))

    def parts(self, names: Sequence[str]) -> dict:
        """{part: (seconds, peak bytes over the step start)}; parts absent from the marks = 0."""
        out = {n: [0., 0] for n in names}
        prev = self.t0
        for name, t, peak in self.marks:
            out[name][0] += t - prev
            out[name][1] = max(out[name][1], peak - self.start_rss)
            prev = t
        return {k: tuple(v) for k, v in out.items()}


def _wrap(obj, attr: str, after: Callable[[], None]):
    """Replace ``obj.attr`` (a bound method) by one that calls ``after()`` when it returns."""
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
    """Measure one config in this (fresh) process; see the module doc.

    Args:
        cfg: dict with config, height, width, batch, mode, repeats, threads, mem_pass ('live':
            the memory pass under the mmap threshold, 'process': glibc's defaults) and work
            (:func:`work_settings` of the subject, or None: each config's own settings).
    """
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
        """(step seconds, per-part (seconds, peak bytes over the step start), start RSS)."""
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

    live = (cfg.get('mem_pass', 'live') == 'live'
            and _mallopt_mmap_threshold(LIVE_MMAP_THRESHOLD))
    gc.collect()
    _release_free_heap()
    _reset_peak_rss()
    base = proc_status_kb('VmRSS') * 1024
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
                  peak_mem_mb=peak / 2 ** 20, mem_base_mb=base / 2 ** 20,
                  parts={n: dict(time_ms=med(parts[n][0] for _, parts, _ in timed) * 1e3,
                                 peak_mb=max(parts[n][1] for _, parts, _ in measured) / 2 ** 20)
                         for n in names},
                  work=work, adamw_flags=adamw_flags,
                  memory_mode='mmap threshold 64 KiB' if live else 'glibc default malloc',
                  note='')
    return result


def config_name(config: str) -> str:
    """Record name of a config: its file stem."""
    return osp.splitext(osp.basename(config.split('::')[-1]))[0]


ROUND_KEYS = ('status', 'note', 'time_ms', 'times_ms', 'mem_pass_time_ms', 'peak_mem_mb',
              'mem_base_mb', 'parts', 'work')


def _median_record(rec: dict, per_round: Sequence[dict]) -> None:
    """Headline figures of ``rec`` from its rounds (in place): medians over the ok rounds of the
    step time, the peak, the baseline and every part's time and peak; status = the first failure
    (its round named in ``note``), else ok."""
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
    """One record per config; every measurement is a fresh process (:func:`worker_main`).

    ``rounds`` interleaved rounds: round ``r`` measures every config once, in the order of
    ``configs`` rotated by ``r`` (:func:`.timing.round_order`), so a slow drift of a shared
    machine hits all configs alike.  A config that fails in a round (OOM, timeout, error) is not
    measured in the later rounds.  ``work`` (:func:`work_settings`, usually of ``configs[0]``) is
    given to every worker: the same detector settings and optimizer for all; None keeps each
    config's own.  ``cpu_mem_mode`` picks the memory pass ('live' or 'process'); the steps are
    timed under glibc's default malloc either way.

    Each record keeps its rounds in ``per_round`` (round index, position in that round's order,
    load average at its start, and the worker's status, ``time_ms`` (median of its ``repeats``
    steps), ``times_ms``, ``peak_mem_mb``, ``mem_base_mb`` and ``parts``), in round order.  The
    headline ``time_ms``, ``peak_mem_mb``, ``mem_base_mb`` and every part's ``time_ms`` /
    ``peak_mb`` are the medians over the ok rounds; ``round_times_ms`` / ``round_peaks_mb`` list
    the per-round figures and ``times_ms`` all timed steps, round after round.
    """
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
            # the worker process starts with glibc's default malloc ('process'); its memory pass
            # switches to the mmap threshold itself when mem_pass is 'live'
            # (the worker runs elsewhere: a path is made absolute)
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
    """Median / min / max of the ratios a / b (pairs with b <= 0 left out) and the ratios."""
    ratios = [a / b for a, b in pairs if b > 0]
    if not ratios:
        return dict(median=None, min=None, max=None, values=[])
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios),
                values=ratios)


def whole_model_ratios(records: Sequence[dict]) -> List[dict]:
    """Subject (the first record) / each other record (a baseline): per-round ratios of the step
    time and of the peak memory, over the rounds in which both were ok, with their median, min
    and max; and the ratio of each part's median time."""
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


def format_whole_ratios(rows: Sequence[dict]) -> str:
    """One line per baseline: median (min-max) of the per-round ratios, time and peak memory."""
    def fmt(row, key):
        if row.get(key) is None:
            return 'n/a'
        return f'{row[key]:.2f}x ({row[key + "_min"]:.2f}-{row[key + "_max"]:.2f})'
    lines = []
    for row in rows:
        n = row['rounds']
        lines.append(f'{row["subject"]} / {row["baseline"]}: time {fmt(row, "time_ratio")}, '
                     f'peak memory {fmt(row, "peak_ratio")}, {n} round{"s" * (n != 1)}')
    return '\n'.join(lines)


def flat_rows(records: Sequence[dict]) -> List[dict]:
    """CSV rows: one per record (the medians over its rounds, and the min / max over the rounds
    of the step time and peak), the parts as ``<part>_ms`` / ``<part>_peak_mb`` columns."""
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


def format_whole_table(records: Sequence[dict]) -> str:
    """Printed table: per config the step time / peak (medians over the rounds, with the
    per-round range), then the parts (medians over the rounds)."""
    lines = []
    for r in records:
        head = f'{r["model"]} [{r["mode"]}, {r["height"]}x{r["width"]}, batch {r["batch"]}]'
        if r.get('status') != 'ok':
            lines.append(f'{head}: {r.get("status")} {r.get("note", "")}')
            continue
        n = r.get('rounds_ok', 1)
        times, peaks = r.get('round_times_ms') or [], r.get('round_peaks_mb') or []
        spread = ''
        if len(times) > 1:
            spread = (f'; per round {min(times):.0f}-{max(times):.0f} ms, '
                      f'+{min(peaks):.0f}-{max(peaks):.0f} MB')
        lines.append(f'{head}: {r["time_ms"]:.1f} ms/step, peak RSS +{r["peak_mem_mb"]:.0f} MB '
                     f'(median of {n} round{"s" * (n != 1)} x {r["repeats"]} '
                     f'step{"s" * (r["repeats"] != 1)}{spread}), {r["params_m"]:.1f} M params, '
                     f'backbone {r["backbone"]}')
        work = r.get('work') or {}
        if work.get('bbox_rois') or work.get('mask_rois'):
            dets = work.get('detections_per_image')
            lines.append(f'  work per step: {work["bbox_rois"]} box RoIs, {work["mask_rois"]} mask '
                         f'RoIs' + (f', detections per image {dets}' if dets else ''))
        lines.append(f'  {"part":<10} {"ms":>10} {"%":>6} {"peak MB":>9}')
        for part, p in r['parts'].items():
            pct = 100 * p['time_ms'] / r['time_ms'] if r['time_ms'] else 0
            lines.append(f'  {part:<10} {p["time_ms"]:>10.1f} {pct:>6.1f} {p["peak_mb"]:>9.0f}')
    return '\n'.join(lines)


def write_whole_outputs(records: Sequence[dict], meta: dict, out_dir: str,
                        name: str) -> List[str]:
    """``<name>.csv`` (:func:`flat_rows`) and ``<name>.json`` (``{"meta", "records"}``, parts
    nested as ``records[i]["parts"][part] = {"time_ms", "peak_mb"}``, the rounds as
    ``records[i]["per_round"]``; the CLI puts :func:`whole_model_ratios` in
    ``meta["ratios"]``)."""
    import csv
    import json
    os.makedirs(out_dir, exist_ok=True)
    rows = flat_rows(records)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    csv_path = osp.join(out_dir, f'{name}.csv')
    with open(csv_path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    json_path = osp.join(out_dir, f'{name}.json')
    with open(json_path, 'w') as f:
        json.dump(dict(meta=meta, records=list(records)), f, indent=1)
    return [csv_path, json_path]
