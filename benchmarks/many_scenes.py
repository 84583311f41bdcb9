"""Issue 57's many-scenes goal: a folder of scenes of mixed sizes, one of them corrupt, through
``tools/segment_large_image.py`` under torchrun, then the same command again.

    python benchmarks/many_scenes.py [--config CONFIG] [--scenes 20] [--ranks 2] \
        --out docs/results/many_scenes

The scenes: GeoTIFFs written by GDAL (through rasterio), sides drawn from ``SIDES``, one with a
broken tile. The model: CONFIG with random weights. Each run is the tool in fresh processes
(``torch.distributed.run``, one thread a rank); the artifact keeps each run's exit status, wall
time, the outputs in the folder, the summary and the error lines.
"""
import argparse
import os
import os.path as osp
import subprocess
import sys
import time

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path[:0] = [ROOT, osp.join(ROOT, 'benchmarks')]
from training_extras.run_results import cpu_description  # noqa: E402
from xcit_benchmark.fresh_points import random_segmentor, revision, write_artifact  # noqa: E402

CONFIG = 'configs/sem_fpn_xcit_s12_p16_80k_ade20k.py'
TOOL = osp.join(ROOT, 'tools', 'segment_large_image.py')
SIDES = (256, 384, 512, 768, 1024)  # a scene's height and width, drawn from these
BLOCK = 128


def make_scenes(folder: str, count: int, corrupt: int) -> list:
    """``count`` RGB GeoTIFFs (UTM 33N, 1 m pixels, tiled, deflate), smooth gradients and noise,
    each side drawn from SIDES; scene ``corrupt`` with garbage in one tile's bytes."""
    import numpy as np
    import rasterio
    import tifffile
    from rasterio.transform import from_origin
    rs = np.random.RandomState(0)
    os.makedirs(folder, exist_ok=True)
    scenes = []
    for i in range(count):
        h, w = (int(v) for v in rs.choice(SIDES, 2))
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([(xx * 255 // w + rs.randint(0, 32, (h, w))) % 256,
                        (yy * 255 // h + rs.randint(0, 32, (h, w))) % 256,
                        ((xx + yy) // 16 * 37) % 256]).astype(np.uint8)
        path = osp.join(folder, f'scene_{i:02d}.tif')
        with rasterio.open(path, 'w', driver='GTiff', height=h, width=w, count=3, dtype='uint8',
                           crs='EPSG:32633', transform=from_origin(500000 + 2000 * i, 4000000,
                                                                   1, 1),
                           tiled=True, blockxsize=BLOCK, blockysize=BLOCK,
                           compress='deflate') as dst:
            dst.write(img)
        scenes.append(dict(scene=osp.basename(path), height=h, width=w))
    with tifffile.TiffFile(osp.join(folder, scenes[corrupt]['scene'])) as tif:
        offset, size = tif.pages[0].dataoffsets[0], tif.pages[0].databytecounts[0]
    with open(osp.join(folder, scenes[corrupt]['scene']), 'r+b') as f:
        f.seek(offset + 2)
        f.write(bytes(range(256))[:size - 4])
    scenes[corrupt]['corrupt'] = True
    return scenes


def run_tool(args, checkpoint: str, scenes: str, out: str, port: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', str(args.ranks),
           '--master-addr', '127.0.0.1', '--master-port', str(port), TOOL,
           osp.join(ROOT, args.config), checkpoint, scenes, '--out', out, '--launcher', 'pytorch']
    began = time.time()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return dict(returncode=run.returncode, wall_s=round(time.time() - began, 1),
                outputs=sorted(f for f in os.listdir(out) if f.endswith('.tif')),
                summary=[line for line in run.stdout.splitlines()
                         if line.startswith(('scenes: ', 'failed: '))],
                error_lines=[line for line in run.stderr.splitlines()
                             if line.startswith('error: ')],
                command=' '.join(['torchrun', '--nproc-per-node', str(args.ranks)] + cmd[7:]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--config', default=CONFIG)
    p.add_argument('--scenes', type=int, default=20)
    p.add_argument('--corrupt', type=int, default=7, help='the broken scene')
    p.add_argument('--ranks', type=int, default=2)
    p.add_argument('--work-dir', default='/tmp/many_scenes')
    p.add_argument('--note', default='')
    p.add_argument('--out', required=True, help='artifact path without extension')
    args = p.parse_args(argv)
    import torch
    os.makedirs(args.work_dir, exist_ok=True)
    checkpoint = osp.join(args.work_dir, 'random.pth')
    torch.save(dict(state_dict=random_segmentor(osp.join(ROOT, args.config)).state_dict()),
               checkpoint)
    scenes = make_scenes(osp.join(args.work_dir, 'scenes'), args.scenes, args.corrupt)
    out = osp.join(args.work_dir, 'labels')
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        os.remove(osp.join(out, name))
    rows = []
    for i, run in enumerate(('first', 'again')):
        rows.append(dict(run=run, **run_tool(args, checkpoint, osp.join(args.work_dir, 'scenes'),
                                             out, 29700 + i)))
        print(rows[-1], flush=True)
    write_artifact(args.out, dict(
        command='python benchmarks/many_scenes.py ' + ' '.join(argv or sys.argv[1:]),
        cpu=cpu_description(), revision=revision(), config=args.config, ranks=args.ranks,
        threads_per_rank=1, scenes=scenes, megapixels=round(sum(
            s['height'] * s['width'] for s in scenes) / 1e6, 2), note=args.note), rows)


if __name__ == '__main__':
    main()
