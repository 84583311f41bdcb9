"""One image's stream on 1 process, then sharded over N processes (gloo, one machine): each rank's
peak RSS (and its peak by the end of the trunk stage) and wall time, the bytes it gave to the
exchanges per XCA layer, and the share of labels that differ from one process's.

    python benchmarks/sharded_stream.py --size 8192 --worlds 1 2 --threads 1 \
        --out docs/results/sharded_stream_cpu

Semantic FPN XCiT-S12/16 (random weights; ``--config`` for another), a smooth synthetic image made
row by row (no image file), token maps in memory. Every world runs in fresh processes
(``torch.multiprocessing`` spawn); a rank's RSS floor is its ``ru_maxrss`` once the model is built,
before the stream. The labels of each world go to one uint8 file that every rank writes its
slab's rows into, compared with world 1's afterwards.
"""
import argparse
import datetime
import json
import os
import os.path as osp
import platform
import resource
import sys
import tempfile
import time

import numpy as np

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path[:0] = [ROOT, osp.join(ROOT, 'benchmarks')]
from xcit_benchmark.fresh_points import random_segmentor, revision, write_artifact  # noqa: E402

CONFIG = 'configs/sem_fpn_xcit_s12_p16_80k_ade20k.py'


def read_rows(size: int, start: int, stop: int) -> np.ndarray:
    """Rows ``start..stop-1`` of a smooth synthetic image (BGR uint8), the same on every rank."""
    y = np.arange(start, stop, dtype=np.float32)[:, None, None] / size
    x = np.arange(size, dtype=np.float32)[None, :, None] / size
    phase = np.array([0., 2., 4.], dtype=np.float32)
    return (127.5 + 127.5 * np.sin(13 * x + 7 * y * y + phase) * np.cos(5 * y - 3 * x)).astype(
        np.uint8)


def rank_main(rank: int, world: int, args, work: str) -> None:
    import torch
    torch.set_num_threads(args.threads)
    shard = None
    if world > 1:
        torch.distributed.init_process_group(
            'gloo', init_method=f'file://{work}/store_{world}', rank=rank, world_size=world,
            timeout=datetime.timedelta(hours=6))
        from xcit_mm.models.inference.sharding import Shard
        shard = Shard()
    model = random_segmentor(args.config)
    model.test_cfg = dict(mode='stream')
    size = args.size
    labels = np.memmap(osp.join(work, f'labels_{world}.u8'), np.uint8, 'r+', shape=(size, size))
    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if shard is not None:
        torch.distributed.barrier()
    start = time.time()
    rows, trunk = 0, {}

    def progress(done, total, stage):  # the trunk stage's peak, read as the labels start
        if stage == 'labels' and not trunk:
            trunk.update(peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                         wall=time.time() - start)

    for first, stop, band in model.stream_labels(lambda a, b: read_rows(size, a, b),
                                                 (size, size), shard=shard, progress=progress):
        labels[first:stop] = band.numpy().astype(np.uint8)
        rows += stop - first
    wall = time.time() - start
    labels.flush()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    layer_bytes = sorted({b for what, b in shard.exchanges if what == 'XCA sums'}) if shard else []
    row = dict(world=world, rank=rank, size=size, wall_s=round(wall, 1),
               peak_rss_mb=round(peak), floor_mb=round(floor), growth_mb=round(peak - floor),
               trunk_peak_rss_mb=round(trunk['peak']), trunk_wall_s=round(trunk['wall'], 1),
               label_rows=rows, xca_sums_bytes_per_layer=layer_bytes,
               exchanges=len(shard.exchanges) if shard else 0,
               bytes_sent=shard.bytes_sent if shard else 0)
    with open(osp.join(work, f'row_{world}_{rank}.json'), 'w') as f:
        json.dump(row, f)
    if shard is not None:
        torch.distributed.destroy_process_group()


def cpu_model() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            return next(line.split(':', 1)[1].strip() for line in f if 'model name' in line)
    except (OSError, StopIteration):
        return platform.processor()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=int, default=1024)
    parser.add_argument('--worlds', type=int, nargs='+', default=[1, 2])
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--config', default=CONFIG)
    parser.add_argument('--out', default='docs/results/sharded_stream_cpu')
    parser.add_argument('--note', default='')
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp
    rows = []
    meta = dict(command='python benchmarks/sharded_stream.py ' + ' '.join(argv or sys.argv[1:]),
                config=args.config, cpu=cpu_model(), cores=os.cpu_count(),
                commit=revision(), load_1min_start=os.getloadavg()[0], note=args.note)
    with tempfile.TemporaryDirectory(prefix='sharded_stream_') as work:
        for world in args.worlds:
            np.memmap(osp.join(work, f'labels_{world}.u8'), np.uint8, 'w+',
                      shape=(args.size, args.size)).flush()
            mp.spawn(rank_main, args=(world, args, work), nprocs=world, join=True)
            ranks = []
            for rank in range(world):
                with open(osp.join(work, f'row_{world}_{rank}.json')) as f:
                    ranks.append(json.load(f))
            first = args.worlds[0]
            if world != first:
                shape = (args.size, args.size)
                one = np.memmap(osp.join(work, f'labels_{first}.u8'), np.uint8, 'r', shape=shape)
                mine = np.memmap(osp.join(work, f'labels_{world}.u8'), np.uint8, 'r', shape=shape)
                differ = sum(int((one[a:a + 1024] != mine[a:a + 1024]).sum())
                             for a in range(0, args.size, 1024))
                for row in ranks:
                    row.update(labels_differ=differ,
                               labels_differ_share=differ / float(args.size) ** 2)
            rows += ranks
            meta['load_1min_end'] = os.getloadavg()[0]
            print(json.dumps(ranks))
            write_artifact(args.out, meta, rows)


if __name__ == '__main__':
    main()
