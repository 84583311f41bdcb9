"""Whole-image inference within ``test_cfg.max_memory``: the plan chosen, its estimate, the
measured peak and the estimate's error, one fresh process per point.

    python benchmarks/memory_budget.py --out docs/results/memory_budget

Each point builds the paper config with random weights (BN for one CPU process) at full resolution
(segmentation: the test ``Resize`` removed; detection: ``Resize`` to the image's own size,
``score_thr=0`` so 100 detections are pasted), with ``model.test_cfg`` ``mode='auto'`` and the
point's ``max_memory``. A 64 px warm-up call goes through the same door first: it calibrates the
model's memory line (logged) and sets up thread pools. Then the heap is freed, the peak RSS reset,
and the door (``mmseg.apis.inference_model`` / ``mmdet.apis.inference_detector``) runs once on a
random uint8 image under ``MALLOC_MMAP_THRESHOLD_=65536`` (the method of the other fresh-point
scripts): ``peak_growth_mb`` is the whole call, the test pipeline included;
``predict_peak_growth_mb`` the same peak over the RSS when ``predict`` starts (the preprocessed
input exists), which ``max_memory`` bounds and the model's ``last_memory_plan`` estimates
(``error_pct``). The parent kills a child above ``--limit-gb``.
"""
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
CONFIGS = dict(seg='configs/sem_fpn_xcit_s12_p16_80k_ade20k.py',
               det='configs/mask_rcnn_xcit_s12_p16_3x_coco.py')
# (task, image size, max_memory MB): for each task two budgets at 4096^2, one above the whole
# image's need and one below it, and the segmentor at 8192^2, where the whole image cannot run
POINTS = [('seg', 4096, 8000), ('seg', 4096, 4000), ('seg', 8192, 16000),
          ('det', 4096, 8000), ('det', 4096, 3500)]


def build_cfg(task: str, size: int, budget_mb: float, band_mb=None):
    """The paper config at full resolution, random weights, ``mode='auto'`` within the budget
    (detector: ``band_mb``, if given, makes the stride-4 level in bands in every plan)."""
    from mmengine.config import Config
    cfg = Config.fromfile(CONFIGS[task])
    cfg.model.backbone.init_cfg = None
    cfg.model.backbone.norm_cfg = dict(type='BN', requires_grad=True)  # one CPU process
    cfg.model.test_cfg.update(mode='auto', max_memory=budget_mb)
    if task == 'seg':
        cfg.test_pipeline = [t for t in cfg.test_pipeline if t['type'] != 'Resize']
    else:
        cfg.model.test_cfg.rcnn.score_thr = 0.0
        cfg.model.test_cfg.band_mb = band_mb
        pipeline = [t for t in cfg.test_dataloader.dataset.pipeline
                    if t['type'] != 'LoadAnnotations']
        for t in pipeline:
            if t['type'] == 'Resize':
                t.update(scale=(size, size), keep_ratio=True)
        cfg.test_dataloader.dataset.pipeline = pipeline
    return cfg


def child(point: dict) -> dict:
    import numpy as np
    import torch
    from xcit_benchmark.memory import proc_status_kb
    if point['task'] == 'seg':
        from mmseg.apis import inference_model as infer
        from mmseg.apis import init_model as init
    else:
        from mmdet.apis import inference_detector as infer
        from mmdet.apis import init_detector as init
    torch.manual_seed(0)
    model = init(build_cfg(point['task'], point['size'], point['max_memory'],
                           point.get('band_mb')), device='cpu')
    infer(model, np.zeros((64, 64, 3), np.uint8))  # calibrates the memory line
    img = test_image(point['size'])
    predict, at_predict = model.predict, []

    def predict_noting_rss(*args, **kwargs):  # the RSS when predict starts: the input exists
        at_predict.append(proc_status_kb('VmRSS') * 1024)
        return predict(*args, **kwargs)

    model.predict = predict_noting_rss
    base = settle_heap()
    start = time.perf_counter()
    infer(model, img)
    seconds = time.perf_counter() - start
    peak = proc_status_kb('VmHWM') * 1024
    door_mb, predict_mb = (peak - base) / 2**20, (peak - at_predict[0]) / 2**20
    plan = model.last_memory_plan
    line = getattr(model, 'memory_model', None) or model.calibrated_memory_model
    return dict(status='ok', plan=plan.name, detail=plan.detail,
                estimate_mb=round(plan.estimate_mb), peak_growth_mb=round(door_mb),
                predict_peak_growth_mb=round(predict_mb),
                error_pct=round(100 * (predict_mb - plan.estimate_mb) / plan.estimate_mb, 1),
                within_budget=bool(predict_mb <= point['max_memory']),
                door_within_budget=bool(door_mb <= point['max_memory']),
                time_s=round(seconds, 1), memory_model=list(line))


def main():
    parser = points_parser(__doc__.split('\n')[0], None, 'task:size:max_memory_mb[:band_mb], '
                           'e.g. seg:4096:3000 or det:4096:3500:64 (task seg or det; band_mb: '
                           'detector only)')
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    points = [p.split(':') for p in args.points] if args.points else POINTS
    rows = []
    for task, size, budget, *band in points:
        if band and task != 'det':
            parser.error(f'--points {task}:{size}:{budget}:{band[0]}: band_mb is for det only')
        point = dict(task=task, config=CONFIGS[task], size=int(size), max_memory=float(budget),
                     band_mb=float(band[0]) if band else None)
        row = dict(point, **run_point(__file__, point, int(args.limit_gb * 2**30), args.timeout))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        meta = dict(cpu=cpu_model(), threads=os.cpu_count(), command='python ' + ' '.join(sys.argv),
                    doors='mmseg.apis.inference_model, mmdet.apis.inference_detector',
                    weights='random (init_cfg=None), BN',
                    note=args.note or 'one fresh process per point')
        write_artifact(args.out, meta, rows, ['task', 'size', 'max_memory', 'band_mb', 'status',
                                              'plan', 'detail', 'estimate_mb',
                                              'predict_peak_growth_mb', 'peak_growth_mb',
                                              'error_pct', 'within_budget', 'time_s', 'note'])


if __name__ == '__main__':
    main()
