"""One fresh process per measured point: the runner of the lean-inference memory scripts.

``benchmarks/lean_{segmentation,detection}_memory.py`` and
``benchmarks/whole_image_inference.py`` measure whole-image inference
through mmseg's / mmdet's own API, one point (model, image size) per process, so that no point
inherits another's heap.
"""
import argparse
import csv
import gc
import json
import os
import subprocess
import sys
import time
from typing import Optional

from .memory import _release_free_heap, _reset_peak_rss, proc_status_kb


def test_image(size: int):
    """The measured image: random uint8, ``size`` x ``size`` x 3, the same for every point."""
    import numpy as np
    return np.random.RandomState(0).randint(0, 255, (size, size, 3), np.uint8)


def settle_heap() -> int:
    """Free what Python and malloc hold, reset the peak RSS and return the RSS now (bytes): the
    baseline of a peak-growth measurement (peak growth = VmHWM after the call - this)."""
    gc.collect()
    _release_free_heap()
    _reset_peak_rss()
    return proc_status_kb('VmRSS') * 1024


def run_point(script: str, point: dict, limit_bytes: int, timeout_s: float) -> dict:
    """Run ``script --child POINT`` in a fresh process (malloc returning freed memory at once, so
    the RSS follows live tensors) and return the JSON dict of its last output line; the child is
    killed above ``limit_bytes`` of RSS or after ``timeout_s`` (status 'killed')."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536')
    proc = subprocess.Popen([sys.executable, script, '--child', json.dumps(point)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start, rss = time.time(), 0
    while proc.poll() is None:
        try:
            with open(f'/proc/{proc.pid}/status') as f:
                rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmRSS'))
        except (OSError, StopIteration):
            rss = 0
        if rss > limit_bytes or time.time() - start > timeout_s:
            proc.kill()
            proc.wait()
            why = 'rss' if rss > limit_bytes else 'timeout'
            return dict(status='killed', note=f'{why}: RSS {rss / 2**30:.1f} GiB after '
                        f'{time.time() - start:.0f} s (limit {limit_bytes / 2**30:.1f} GiB)')
        time.sleep(0.05)
    out = proc.stdout.read().strip().splitlines()
    if proc.returncode == 0 and out:
        return json.loads(out[-1])
    err = proc.stderr.read().strip().splitlines()[-3:]
    return dict(status='error', note=f'exit {proc.returncode}: ' + ' | '.join(err))


def cpu_model() -> str:
    """The CPU's model name, as lscpu gives it."""
    try:
        out = subprocess.run(['lscpu'], capture_output=True, text=True).stdout
        return next(line.split(':', 1)[1].strip() for line in out.splitlines()
                    if line.startswith('Model name'))
    except (OSError, StopIteration):
        return 'unknown'


def write_artifact(out: str, meta: dict, rows: list, columns: list) -> None:
    """``out.json`` (meta and rows) and ``out.csv`` (``columns`` of each row)."""
    with open(out + '.json', 'w') as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(out + '.csv', 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction='ignore')
        writer.writeheader()
        writer.writerows(rows)


def points_parser(description: str, config: Optional[str],
                  points_help: Optional[str]) -> argparse.ArgumentParser:
    """The command line the fresh-point scripts share (``--child`` is the fresh process's own).

    ``config`` / ``points_help`` None leave out ``--config`` / ``--points``, for a script that
    chooses its configs and points its own way (``benchmarks/whole_image_inference.py``).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument('--child', help=argparse.SUPPRESS)
    if config is not None:
        parser.add_argument('--config', default=config, help='the XCiT config measured')
    parser.add_argument('--out', help='artifact path without extension (.json, .csv)')
    if points_help is not None:
        parser.add_argument('--points', nargs='*', help=points_help)
    parser.add_argument('--limit-gb', type=float, default=20.0)
    parser.add_argument('--timeout', type=float, default=1800.0)
    parser.add_argument('--note', help='what else ran on the machine, written into the artifact')
    return parser
