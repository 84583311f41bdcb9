"""Peak RSS growth and time of whole-image Mask R-CNN through ``mmdet.apis.inference_detector``:
XCiT stock ``MaskRCNN`` vs ``LeanMaskRCNN``, and Swin-T stock, one fresh process per point.

    python benchmarks/lean_detection_memory.py \
        --out docs/results/lean_detection_mask_rcnn_s12_p16

Each point builds the config's model with random weights (``backbone.init_cfg=None``, BN for one
CPU process), sets ``test_cfg.rcnn.score_thr=0`` (both models keep ``max_per_img`` = 100
detections), sets the test ``Resize`` to the image's own size (the network runs at full
resolution, scale factor 1) and drops ``LoadAnnotations``, runs one 64 px warm-up image, makes the
test image (random uint8), frees the heap (``malloc_trim``), resets the peak RSS and runs
``inference_detector`` once: peak growth = VmHWM - VmRSS before the call, under
``MALLOC_MMAP_THRESHOLD_=65536`` so the RSS follows live tensors (the method and helpers of
``xcit_benchmark/memory.py``, as ``lean_segmentation_memory.py``). ``parts`` gives, for each part
of the model that ran (wrapped methods), the growth when it started and the peak growth while it
ran (the peak counter is reset at each part's start; the overall peak folds them all in).
The parent kills a child above ``--limit-gb`` (status 'killed').
"""
import hashlib
import json
import os
import os.path as osp
import sys
import time

HERE = osp.dirname(osp.abspath(__file__))
sys.path.insert(0, HERE)
from xcit_benchmark.fresh_points import (cpu_model, points_parser,  # noqa: E402
                                         run_point, settle_heap, test_image,
                                         write_artifact)
XCIT_CONFIG = 'configs/mask_rcnn_xcit_s12_p16_3x_coco.py'
SWIN_CONFIG = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py'
# (model, size): lean first (stock may be killed)
POINTS = [('xcit-lean', 2048), ('xcit-stock', 2048), ('swin-stock', 2048),
          ('xcit-lean', 4096), ('xcit-stock', 4096), ('swin-stock', 4096)]
# (label, attribute path from the detector, method): what ``parts`` reports
PARTS = [('data_preprocessor', 'data_preprocessor', 'forward'),
         ('backbone', 'backbone', 'forward'), ('backbone_trunk', 'backbone', 'forward_trunk'),
         ('neck', 'neck', 'forward'), ('lean_features', '', '_lean_extract_feat'),
         ('rpn', 'rpn_head', 'predict'), ('lean_rpn', '', '_lean_rpn_predict'),
         ('rpn_post', 'rpn_head', 'predict_by_feat'), ('lean_roi', '', '_lean_roi_predict'),
         ('roi_bbox', 'roi_head', 'predict_bbox'),
         ('roi_mask_forward', 'roi_head', '_mask_forward'),
         ('mask_paste', 'roi_head.mask_head', 'predict_by_feat')]


def build_cfg(point: dict):
    from mmengine.config import Config
    model_name, size = point['model'], point['size']
    if model_name.startswith('swin'):
        import mmdet
        cfg = Config.fromfile(osp.join(osp.dirname(mmdet.__file__), '.mim', 'configs',
                                       SWIN_CONFIG[len('mmdet::'):]))
    else:
        cfg = Config.fromfile(point['config'])
    cfg.model.backbone.init_cfg = None
    if model_name.startswith('xcit'):
        cfg.model.backbone.norm_cfg = dict(type='BN', requires_grad=True)  # one CPU process
        cfg.model.type = 'LeanMaskRCNN' if model_name == 'xcit-lean' else 'MaskRCNN'
    cfg.model.test_cfg.rcnn.score_thr = 0.0
    pipeline = []  # inference_detector reads test_dataloader.dataset.pipeline
    for t in cfg.test_dataloader.dataset.pipeline:
        if t['type'] == 'LoadAnnotations':
            continue
        if t['type'] == 'Resize':
            t = dict(t, scale=(size, size), keep_ratio=True)
        pipeline.append(t)
    cfg.test_dataloader.dataset.pipeline = pipeline
    return cfg


class PartMeter:
    """Wraps methods; records RSS growth at entry and the peak growth while each ran (parts that
    run inside another reset the peak counter: every reset folds the peak so far into the
    overall peak and into each part still running)."""

    def __init__(self, base: int):
        from xcit_benchmark.memory import proc_status_kb
        self.kb, self.base, self.peak, self.parts, self.open = proc_status_kb, base, 0, [], []

    def fold(self):
        from xcit_benchmark.memory import _reset_peak_rss
        peak = self.kb('VmHWM') * 1024 - self.base
        self.peak = max(self.peak, peak)
        self.open = [max(p, peak) for p in self.open]
        _reset_peak_rss()

    def wrap(self, obj, method: str, label: str):
        inner = getattr(obj, method)

        def wrapped(*args, **kwargs):
            self.fold()
            start = self.kb('VmRSS') * 1024 - self.base
            self.open.append(start)
            out = inner(*args, **kwargs)
            self.fold()
            peak = self.open.pop()
            self.parts.append(dict(part=label, start_mb=round(start / 2**20),
                                   peak_mb=round(peak / 2**20)))
            return out

        setattr(obj, method, wrapped)


def child(point: dict) -> dict:
    import numpy as np
    import torch
    from mmdet.apis import inference_detector, init_detector
    from xcit_benchmark.memory import _reset_peak_rss, proc_status_kb
    cfg = build_cfg(point)
    torch.manual_seed(0)
    model = init_detector(cfg, device='cpu')
    inference_detector(model, np.zeros((64, 64, 3), np.uint8))
    img = test_image(point['size'])
    base = settle_heap()
    meter = PartMeter(base)
    if point.get('parts', True):
        for label, path, method in PARTS:
            obj = model
            for name in filter(None, path.split('.')):
                obj = getattr(obj, name)
            if hasattr(obj, method):
                meter.wrap(obj, method, label)
    _reset_peak_rss()
    start = time.perf_counter()
    result = inference_detector(model, img)
    seconds = time.perf_counter() - start
    meter.fold()
    pred = result.pred_instances
    assert tuple(result.img_shape) == (point['size'],) * 2, result.img_shape  # full resolution
    digest = hashlib.sha256()  # of the results: equal digests = identical detections
    for key in ('bboxes', 'labels', 'scores', 'masks'):
        digest.update(pred[key].contiguous().numpy().tobytes())
    return dict(status='ok', peak_growth_mb=round(meter.peak / 2**20), time_s=round(seconds, 1),
                type=type(model).__name__, num_dets=len(pred), masks_shape=list(pred.masks.shape),
                masks_dtype=str(pred.masks.dtype), mask_pixels=int(pred.masks.sum()),
                results_sha256=digest.hexdigest()[:16],
                parts=meter.parts)


def main():
    parser = points_parser(__doc__.split('\n')[0], XCIT_CONFIG,
                           'model:size (xcit-lean, xcit-stock, swin-stock), e.g. xcit-lean:4096')
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    points = [tuple(p.split(':')) for p in args.points] if args.points else POINTS
    rows = []
    for model_name, size in points:
        point = dict(config=args.config, model=model_name, size=int(size))
        result = run_point(__file__, point, int(args.limit_gb * 2**30), args.timeout)
        row = dict(point, **result)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        meta = dict(cpu=cpu_model(), threads=os.cpu_count(), command='python ' + ' '.join(sys.argv),
                    door='mmdet.apis.inference_detector', weights='random (init_cfg=None)',
                    swin_config=SWIN_CONFIG,
                    note=args.note or 'one fresh process per point; score_thr=0, 100 detections')
        write_artifact(args.out, meta, rows, ['model', 'size', 'status', 'peak_growth_mb',
                                              'time_s', 'num_dets', 'results_sha256', 'note'])

if __name__ == '__main__':
    main()
