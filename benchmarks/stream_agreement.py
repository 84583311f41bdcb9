"""Labels and logits of the stream against the whole lean path on one image, at sizes where both
fit: the share of pixels whose label differs and the largest logit difference.

    python benchmarks/stream_agreement.py --device cuda --sizes 4096 8192 --out FILE.json

Semantic FPN and UperNet XCiT-S12/16 (random weights), one seeded image per size.
"""
import argparse
import json
import os.path as osp
import sys
import time

import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path[:0] = [ROOT, osp.join(ROOT, 'benchmarks')]
from xcit_benchmark.fresh_points import random_segmentor, write_artifact  # noqa: E402

CONFIGS = dict(sem_fpn='configs/sem_fpn_xcit_s12_p16_80k_ade20k.py',
               upernet='configs/upernet_xcit_s12_p16_160k_ade20k.py')


def agreement(model, size: int, device: str) -> dict:
    """Whole and stream on one seeded image of ``size``²: labels and the head's logits."""
    from xcit_mm.models.inference.row_stream import TokenMaps, materialize
    from xcit_mm.models.inference.seg_stream import logits_rows
    gen = torch.Generator(device=device).manual_seed(size)
    x = torch.randn(1, 3, size, size, generator=gen, device=device)
    row = dict(size=size)
    with torch.no_grad():
        model.test_cfg = dict(mode='whole')
        logits = model._network_forward(x)
        whole = model.predict(x)[0].pred_sem_seg.data
        model.test_cfg = dict(mode='stream')
        start = time.time()
        stream = model.predict(x)[0].pred_sem_seg.data
        row['stream_s'] = round(time.time() - start, 2)
        row['labels_differ'] = int((whole != stream).sum())
        row['labels_differ_share'] = row['labels_differ'] / whole.numel()
        del whole, stream
        band_mb = model._stream_plans((size, size), held_mb=0)[0].band_mb  # no budget
        with TokenMaps(x.device) as maps:
            trunk = model.backbone.stream_trunk(lambda a, b: x[:, :, a:b], (size, size), maps,
                                                band_mb)
            levels = [model.backbone.level_rows(m, i, (size, size)) for i, m in enumerate(trunk)]
            streamed = materialize(logits_rows(levels, getattr(model, 'neck', None),
                                               model.decode_head), band_mb)
        row['logits_max_abs_diff'] = float((streamed - logits).abs().max())
        row['logits_max_abs'] = float(logits.abs().max())
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default='cpu')
    p.add_argument('--sizes', type=int, nargs='+', default=[1024, 2048])
    p.add_argument('--heads', nargs='+', default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument('--no-tf32', action='store_true',
                   help="cuDNN convolutions in float32 (torch's default lets them use TF32)")
    p.add_argument('--out', required=True, help='FILE.json (and FILE.csv)')
    args = p.parse_args(argv)
    torch.backends.cudnn.allow_tf32 = not args.no_tf32  # (torch's default: True)
    rows = []
    device = torch.cuda.get_device_name(0) if args.device.startswith('cuda') else 'cpu'
    for head in args.heads:
        model = random_segmentor(osp.join(ROOT, CONFIGS[head]), args.device)
        for size in args.sizes:
            try:
                row = dict(head=head, **agreement(model, size, args.device))
            except torch.OutOfMemoryError:
                row = dict(head=head, size=size, status='oom')
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
            write_artifact(osp.splitext(args.out)[0], dict(
                command=' '.join(sys.argv), device=device, torch=torch.__version__,
                cudnn_tf32=torch.backends.cudnn.allow_tf32), rows)
        del model


if __name__ == '__main__':
    main()
