"""Peak RSS and time of ``tools/segment_large_image.py`` on a tiled BigTIFF, one process a run.

    python benchmarks/large_image_tool.py --size 16384 --budgets none 3000 [--update] \
        --out docs/results/large_image_tool.json

The input (made once in ``--work-dir``): a ``--size``² tiled RGB BigTIFF; the model: Semantic FPN
XCiT-S12/16, random weights. Each run is the tool in a fresh process: its ``ru_maxrss``, its time.
"""
import argparse
import json
import os
import os.path as osp
import subprocess
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path[:0] = [ROOT, osp.join(ROOT, 'benchmarks')]
from training_extras.run_results import cpu_description  # noqa: E402
from xcit_benchmark.fresh_points import (kept_rows, random_segmentor, revision,  # noqa: E402
                                         write_artifact)

CONFIG = 'configs/sem_fpn_xcit_s12_p16_80k_ade20k.py'
TILE = 512


def budget_mb(value: str):
    """``--budgets`` item: MB, or ``none`` for no budget (argparse names a bad one)."""
    return None if value == 'none' else float(value)


def make_image(path: str, size: int) -> None:
    """A tiled RGB BigTIFF of ``size``² px written tile by tile (never whole), georeferenced."""
    import numpy as np
    import tifffile
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:TILE, 0:TILE]

    def tiles():
        for ty in range(0, size, TILE):
            for tx in range(0, size, TILE):
                base = np.stack([(xx + tx) * 255 // size, (yy + ty) * 255 // size,
                                 ((xx + yy + tx + ty) // 64) % 256], axis=-1)
                noise = rng.integers(0, 32, (TILE, TILE, 3))
                yield ((base + noise) % 256).astype(np.uint8)

    geo = [(33550, 'd', 3, (0.5, 0.5, 0.0), False),
           (33922, 'd', 6, (0.0, 0.0, 0.0, 500000.0, 4000000.0, 0.0), False),
           (34735, 'H', 16, (1, 1, 0, 3, 1024, 0, 1, 1, 1025, 0, 1, 1, 3072, 0, 1, 32633), False)]
    with tifffile.TiffWriter(path + '.partial', bigtiff=True) as tif:
        tif.write(tiles(), shape=(size, size, 3), dtype='uint8', tile=(TILE, TILE),
                  photometric='rgb', compression='zlib', extratags=geo)
    os.replace(path + '.partial', path)


def run_tool(image: str, checkpoint: str, out: str, budget, token_dir: str) -> dict:
    """The tool in a fresh process: exit status, wall time, the child's peak RSS."""
    cmd = [sys.executable, osp.join(ROOT, 'tools/segment_large_image.py'), osp.join(ROOT, CONFIG),
           checkpoint, image, '--out', out, '--token-dir', token_dir]
    if budget is not None:
        cmd += ['--max-memory', str(budget)]
    # a wrapper process a run: its children's ru_maxrss is then this run's peak alone
    wrapper = ('import json, resource, subprocess, sys, time; start = time.time(); '
               'rc = subprocess.run(sys.argv[1:]).returncode; print(json.dumps([rc, '
               'time.time() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))')
    proc = subprocess.run([sys.executable, '-c', wrapper] + cmd, capture_output=True, text=True)
    returncode, wall, peak_kb = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(max_memory=budget, returncode=returncode, wall_s=round(wall, 1),
                peak_rss_mb=round(peak_kb / 1024),
                stderr_tail=proc.stderr.strip().splitlines()[-3:],
                out_bytes=osp.getsize(out) if osp.exists(out) else None,
                token_dir_left=sorted(os.listdir(token_dir)), command=' '.join(cmd[1:]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--size', type=int, default=16384)
    p.add_argument('--budgets', nargs='+', type=budget_mb, default=[None, 3000.0],
                   help="--max-memory of each run ('none': no budget)")
    p.add_argument('--work-dir', default='/tmp/large_image_tool')
    p.add_argument('--out', required=True, help='FILE.json (and FILE.csv), rows added as they come')
    p.add_argument('--update', action='store_true',
                   help="keep the artifact's rows of other sizes and budgets")
    args = p.parse_args(argv)
    token_dir = osp.join(args.work_dir, 'tokens')
    os.makedirs(token_dir, exist_ok=True)  # and the work directory
    image = osp.join(args.work_dir, f'input_{args.size}.tif')
    checkpoint = osp.join(args.work_dir, 'sem_fpn_xcit_s12_p16_random.pth')
    baseline_image = osp.join(args.work_dir, 'input_256.tif')
    for path, size in ((image, args.size), (baseline_image, 256)):
        if not osp.exists(path):
            make_image(path, size)
    if not osp.exists(checkpoint):  # the tool takes the config's palette
        import torch
        torch.save(dict(state_dict=random_segmentor(osp.join(ROOT, CONFIG)).state_dict()),
                   checkpoint)
    rows, earlier = [], {}
    out = osp.splitext(args.out)[0]  # .json (and .csv)
    if args.update and osp.exists(out + '.json'):  # the rows this run does not measure stay
        with open(out + '.json') as f:
            artifact = json.load(f)
        again = {(args.size, budget) for budget in args.budgets}
        rows, earlier = kept_rows(artifact, lambda r: (r['size'], r['max_memory']) in again)
    baseline = run_tool(baseline_image, checkpoint, osp.join(args.work_dir, 'labels_256.tif'),
                        None, token_dir)
    for budget in args.budgets:
        row = dict(size=args.size, image_bytes=osp.getsize(image), revision=revision(),
                   **run_tool(image, checkpoint, osp.join(args.work_dir, f'labels_{budget}.tif'),
                              budget, token_dir))
        print(json.dumps(row), flush=True)
        rows.append(row)
        write_artifact(out, dict(
            command=' '.join(sys.argv), **earlier, cpu=cpu_description(), threads=os.cpu_count(),
            baseline_peak_rss_mb=baseline['peak_rss_mb'], baseline_note='the same tool on a '
            '256² image: Python, torch, mmseg and the model, the floor of every run'), rows)


if __name__ == '__main__':
    main()
