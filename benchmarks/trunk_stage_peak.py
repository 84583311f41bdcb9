"""The segmentation stream's trunk stage alone (``XCiTBackbone.stream_trunk``) at several band
sizes: the peak growth of the resident set (VmHWM) beyond the token maps, which is what the
stream's plan counts as the trunk's work in bands (``TRUNK_WORK_BANDS`` in
``lean_encoder_decoder.py``). Random pixels; the maps in memory (their MB are taken off) or on
disk (``--token-dir``); a warm-up run first, as one-time allocations are not the trunk's work.

    python benchmarks/trunk_stage_peak.py --config CFG --shape H W --bands 8 32 128 \
        --out docs/results/NAME [--token-dir DIR] [--threads T] [--update]

The bands run from the smallest up, so that no measurement reuses the pages of a larger one."""
import argparse
import json
import os.path as osp
import sys
import time

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path[:0] = [ROOT, osp.join(ROOT, 'benchmarks')]
from xcit_benchmark.fresh_points import (add_artifact_arguments,  # noqa: E402
                                         random_segmentor, revision, run_metadata,
                                         write_updated)


def measure(config: str, height: int, width: int, bands, token_dir) -> list:
    """A row per band: the trunk's peak growth, the token maps it holds in memory, the rest."""
    import torch

    from xcit_mm.models.inference.row_stream import TokenMaps
    from xcit_mm.models.utils.memory_budget import measure_peak_growth_mb
    backbone = random_segmentor(config).eval().backbone
    image = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(0))
    small = image[:, :, :256, :256]

    def trunk(pixels, band_mb: float) -> None:
        with TokenMaps('cpu', token_dir) as maps, torch.no_grad():
            backbone.stream_trunk(lambda a, b: pixels[:, :, a:b], tuple(pixels.shape[2:]), maps,
                                  band_mb)

    trunk(small, min(bands))
    _, maps_mb = backbone.token_maps_mb((height, width))
    in_memory = 0 if token_dir else maps_mb
    rows = []
    for band_mb in sorted(bands):
        start = time.time()
        peak = measure_peak_growth_mb(lambda: trunk(image, band_mb))
        work = peak - in_memory
        rows.append(dict(config=osp.basename(config), height=height, width=width,
                         band_mb=band_mb, maps=('disk' if token_dir else 'memory'),
                         peak_growth_mb=round(peak), maps_in_memory_mb=round(in_memory),
                         work_mb=round(work), work_bands=round(work / band_mb, 2),
                         wall_s=round(time.time() - start, 1), revision=revision(),
                         threads=torch.get_num_threads()))
        print(json.dumps(rows[-1]))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--config', required=True)
    parser.add_argument('--shape', type=int, nargs=2, required=True, metavar=('H', 'W'))
    parser.add_argument('--bands', type=float, nargs='+', default=[8, 32, 128])
    parser.add_argument('--token-dir', default=None, help='maps on disk here (default: memory)')
    add_artifact_arguments(parser)
    args = parser.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    rows = measure(args.config, *args.shape, args.bands, args.token_dir)
    write_updated(args.out, dict(run_metadata(), note=args.note), rows, lambda r: (
        r['config'], r['height'], r['width'], r['band_mb'], r['maps']), args.update)


if __name__ == '__main__':
    main()
