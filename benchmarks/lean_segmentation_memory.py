"""Peak RSS growth and time of whole-image segmentation through ``mmseg.apis.inference_model``,
stock ``EncoderDecoder`` vs ``LeanEncoderDecoder``, one fresh process per point.

    python benchmarks/lean_segmentation_memory.py \
        --out docs/results/lean_segmentation_sem_fpn_s12_p16

Each point builds the config's model with random weights (``backbone.init_cfg=None``), runs one
64 px warm-up image, makes the test image (random uint8), frees the heap (``malloc_trim``),
resets the peak RSS and runs ``inference_model`` once: peak growth = VmHWM - VmRSS before the
call, under ``MALLOC_MMAP_THRESHOLD_=65536`` so the RSS follows live tensors (the method of
``xcit_benchmark/memory.py``, whose helpers it uses). ``full`` removes the test ``Resize`` (the
network runs at the image size). ``network`` measures the network alone on the preprocessed full
image (``LeanEncoderDecoder._network_forward`` vs stock ``decode_head.forward(extract_feat(x))``,
the logits at the head's resolution), e.g. for UperNet:

    python benchmarks/lean_segmentation_memory.py \
        --config configs/upernet_xcit_s12_p16_160k_ade20k.py \
        --points lean:network:2048 stock:network:2048 \
        --out docs/results/lean_segmentation_upernet_s12_p16

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
DEFAULT_CONFIG = 'configs/sem_fpn_xcit_s12_p16_80k_ade20k.py'
NETWORK_DOOR = 'network alone: lean _network_forward, stock decode_head.forward(extract_feat)'
# (segmentor, pipeline, size): the points, lean first (stock may be killed)
POINTS = [('lean', 'paper', 4096), ('stock', 'paper', 4096), ('lean', 'full', 2048),
          ('stock', 'full', 2048), ('lean', 'full', 4096), ('stock', 'full', 4096),
          ('lean', 'full', 8192)]


def child(point: dict) -> dict:
    import numpy as np
    import torch
    from mmengine.config import Config
    from mmseg.apis import inference_model, init_model
    from xcit_benchmark.memory import proc_status_kb
    cfg = Config.fromfile(point['config'])
    cfg.model.backbone.init_cfg = None
    cfg.model.backbone.norm_cfg = dict(type='BN', requires_grad=True)  # one CPU process
    if point['segmentor'] == 'stock':
        cfg.model.type = 'EncoderDecoder'
    if point['pipeline'] in ('full', 'network'):
        cfg.test_pipeline = [t for t in cfg.test_pipeline if t['type'] != 'Resize']
    torch.manual_seed(0)
    model = init_model(cfg, device='cpu')
    inference_model(model, np.zeros((64, 64, 3), np.uint8))
    img = test_image(point['size'])
    if point['pipeline'] == 'network':
        return network_point(model, img, point['segmentor'])
    base = settle_heap()
    start = time.perf_counter()
    result = inference_model(model, img)
    seconds = time.perf_counter() - start
    peak = proc_status_kb('VmHWM') * 1024
    labels = result.pred_sem_seg.data
    return dict(status='ok', peak_growth_mb=round((peak - base) / 2**20), time_s=round(seconds, 1),
                type=type(model).__name__, labels_shape=list(labels.shape),
                labels_sum=int(labels.sum()))


def network_point(model, img, segmentor: str) -> dict:
    """Peak growth and time of the network alone (no post-processing) on ``img``, preprocessed
    as ``inference_model`` does (the batch exists before the measurement)."""
    import torch
    from xcit_benchmark.memory import proc_status_kb
    with torch.no_grad():
        inputs = model.data_preprocessor(
            dict(inputs=[torch.from_numpy(img).permute(2, 0, 1).contiguous()]), False)['inputs']
        net = (model._network_forward if segmentor == 'lean'
               else lambda x: model.decode_head.forward(model.extract_feat(x)))
        base = settle_heap()
        start = time.perf_counter()
        logits = net(inputs)
        seconds = time.perf_counter() - start
    peak = proc_status_kb('VmHWM') * 1024
    return dict(status='ok', peak_growth_mb=round((peak - base) / 2**20), time_s=round(seconds, 1),
                type=type(model).__name__, logits_shape=list(logits.shape),
                logits_sha256=hashlib.sha256(logits.numpy().tobytes()).hexdigest())


def main():
    parser = points_parser(__doc__.split('\n')[0], DEFAULT_CONFIG,
                           'segmentor:pipeline:size, e.g. lean:full:4096')
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    points = ([tuple(p.split(':')) for p in args.points] if args.points else POINTS)
    rows = []
    for segmentor, pipeline, size in points:
        point = dict(config=args.config, segmentor=segmentor, pipeline=pipeline, size=int(size))
        result = run_point(__file__, point, int(args.limit_gb * 2**30), args.timeout)
        row = dict(point, **result)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        meta = dict(cpu=cpu_model(), threads=os.cpu_count(), command=' '.join(sys.argv),
                    door=', '.join(sorted({NETWORK_DOOR if p[1] == 'network' else
                                           'mmseg.apis.inference_model' for p in points})),
                    weights='random (init_cfg=None), BN',
                    note=args.note or 'one fresh process per point')
        write_artifact(args.out, meta, rows, ['segmentor', 'pipeline', 'size', 'status',
                                              'peak_growth_mb', 'time_s', 'note'])


if __name__ == '__main__':
    main()
