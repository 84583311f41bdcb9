"""The segmentation stream's label stage alone, at any image size, without the hours its trunk
takes there: the token maps of the image's size as zero files on disk (sparse: nothing is
written), the labels' graph as the stream builds it, and the peak growth of the resident set
(VmHWM) of UperNet's pooling pass over its whole coarsest level, then of the first N bands of
labels. Beside them, the estimate of the plan the stream picks with its maps on disk. Memory
follows the maps' shapes, not their values, so zero maps give the label stage's peaks at that
size; the trunk stage is measured by the tool itself (``large_image_tool.py``).

    python benchmarks/label_stage_peak.py --config CFG --shape H W --out docs/results/NAME \
        [--bands N] [--budget MB] [--threads T] [--token-dir DIR] [--update]

One process per point: run the command once per config and shape (``--update`` keeps the
artifact's other points)."""
import argparse
import json
import os
import os.path as osp
import sys
import time

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path[:0] = [ROOT, osp.join(ROOT, 'benchmarks')]
from xcit_benchmark.fresh_points import (add_artifact_arguments,  # noqa: E402
                                         random_segmentor, revision, run_metadata,
                                         write_updated)


def measure(config: str, height: int, width: int, bands: int, budget: float,
            token_dir: str) -> dict:
    """The pooling pass's and the first ``bands`` label bands' peak growth (MB) and times."""
    import itertools

    import torch

    from xcit_mm.models.inference.row_stream import TokenMaps, stream_rows
    from xcit_mm.models.inference.seg_stream import run_poolings
    from xcit_mm.models.utils.memory_budget import measure_peak_growth_mb
    model = random_segmentor(config).eval()
    backbone, hw = model.backbone, (height, width)
    plan = next(p for p in model._stream_plans(hw, 0, budget) if p.name == 'stream-disk')
    grid = [-(-side // backbone.patch_size) for side in hw]
    row = dict(config=osp.basename(config), height=height, width=width, budget_mb=budget,
               plan_estimate_mb=round(plan.estimate_mb), band_mb=plan.band_mb,
               plan_detail=plan.detail, revision=revision(), threads=torch.get_num_threads())
    with TokenMaps('cpu', token_dir) as maps, torch.no_grad():
        trunk = [maps.new((*grid, backbone.embed_dims)) for _ in backbone.out_indices]
        for token_map in trunk:  # the map's size, no byte written: rows read as zeros
            os.ftruncate(token_map.fd, token_map.file_row_bytes * grid[0])
        labels = model._labels_rows(trunk, hw, hw, (0, 0, 0, 0), hw, plan.band_mb)
        start = time.time()
        row['pooling_peak_mb'] = round(measure_peak_growth_mb(lambda: run_poolings(labels)))
        row['pooling_s'] = round(time.time() - start, 1)
        made = stream_rows(labels, plan.band_mb)
        rows_done = []

        def first_bands():
            for _, stop, _ in itertools.islice(made, bands):
                rows_done.append(stop)

        start = time.time()
        row['labels_peak_mb'] = round(measure_peak_growth_mb(first_bands))
        row.update(labels_bands=bands, labels_rows=rows_done[-1],
                   labels_s=round(time.time() - start, 1))
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--config', required=True)
    parser.add_argument('--shape', type=int, nargs=2, required=True, metavar=('H', 'W'))
    parser.add_argument('--bands', type=int, default=20, help='label bands measured (20)')
    parser.add_argument('--budget', type=float, default=4000,
                        help='the budget (MB) the plan is made for, as --max-memory (4000)')
    parser.add_argument('--token-dir', default=ROOT,
                        help='a folder on disk (default: the checkout)')
    add_artifact_arguments(parser)
    args = parser.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    row = measure(args.config, *args.shape, args.bands, args.budget, args.token_dir)
    print(json.dumps(row))
    write_updated(args.out, dict(run_metadata(), note=args.note), [row], lambda r: (
        r['config'], r['height'], r['width'], r['revision']), args.update)


if __name__ == '__main__':
    main()
