"""Peak memory of one (backbone, resolution) point in a fresh process (``python -m
xcit_benchmark.memory CFG_JSON`` prints ``WORKER_MARK + json(result)``): what the forward (or
train step, with the gradients) needs on top of the weights and the input, measured after the
build, a warm-up call (code pages, thread pools) and the input, by :func:`.fresh_points.measure`.
"""
import json
import os
import sys
import traceback
import warnings

import torch

from .fresh_points import LIVE_MALLOC, measure, run_process
from .models import build_model, compile_forward, parse_model
from .timing import make_step, set_threads

WORKER_MARK = '@@XCIT_BENCHMARK_WORKER@@'
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mem_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (8 GiB where it cannot be read)."""
    try:
        with open('/proc/meminfo') as f:
            return int(f.read().split('MemAvailable:')[1].split()[0]) * 1024
    except (OSError, IndexError):
        return 8 * 2 ** 30


def mallopt_mmap_threshold(nbytes: int) -> bool:
    """glibc ``mallopt(M_MMAP_THRESHOLD, nbytes)`` in this process from now on: what
    ``MALLOC_MMAP_THRESHOLD_`` does for a new one."""
    try:
        import ctypes
        return bool(ctypes.CDLL('libc.so.6').mallopt(-3, int(nbytes)))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def worker_main(cfg: dict) -> dict:
    """Measure the peak memory of one point (``cfg``: model, resolution, batch, mode,
    precision, device, threads, mem_iters); runs in a fresh process."""
    set_threads(cfg.get('threads'))
    device, spec, res = cfg['device'], parse_model(cfg['model']), cfg['resolution']
    torch.manual_seed(0)
    model, forward = build_model(spec, device)
    if spec.compiled:  # warm up (= compile) at the measured size: one static graph
        forward = compile_forward(forward)
        tiny = torch.randn(cfg['batch'], 3, res, res, device=device)
    else:
        tiny = torch.randn(1, 3, 64, 64, device=device)
    make_step(model, forward, tiny, cfg['mode'], device, cfg['precision'])()
    del tiny
    img = torch.randn(cfg['batch'], 3, res, res, device=device)
    step = make_step(model, forward, img, cfg['mode'], device, cfg['precision'])
    try:
        _, peak, base, _ = measure(lambda: [step() for _ in range(cfg['mem_iters'])], device)
    except torch.cuda.OutOfMemoryError as e:
        return dict(status='oom', note=f'CUDA OOM: {str(e).splitlines()[0]}')
    threshold = os.environ.get('MALLOC_MMAP_THRESHOLD_')
    method = ('cuda max_memory_allocated - memory_allocated before the call(s)' if device == 'cuda'
              else 'fresh process: VmHWM - VmRSS after build, 64px warm-up, input and '
              'malloc_trim; ' + (f'MALLOC_MMAP_THRESHOLD_={threshold} (live tensors)'
                                 if threshold else 'glibc default malloc (process RSS)'))
    return dict(status='ok', peak_mem_mb=peak, mem_base_mb=base, mem_method=method, note='')


def run_memory_worker(cfg: dict, limit_bytes: int, timeout_s: float) -> dict:
    """:func:`worker_main` (or, for ``cfg['kind'] == 'whole_model'``, the whole-model module's) in
    a fresh process, killed above ``limit_bytes`` of RSS (status 'oom') or after ``timeout_s``
    ('timeout'); ``cfg['cpu_mem_mode']`` 'process' keeps glibc's default malloc."""
    env = {k: v for k, v in os.environ.items() if k != 'MALLOC_MMAP_THRESHOLD_'}
    env['PYTHONPATH'] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get('PYTHONPATH')) if p)
    if cfg.get('threads'):
        env['OMP_NUM_THREADS'] = env['MKL_NUM_THREADS'] = str(cfg['threads'])
    if cfg.get('cpu_mem_mode', 'live') == 'live':
        env.update(LIVE_MALLOC)
    module = 'xcit_benchmark.' + ('whole_model' if cfg.get('kind') == 'whole_model' else 'memory')
    out = run_process([sys.executable, '-m', module, json.dumps(cfg)],
                      limit_bytes, timeout_s, env=env, cwd=PACKAGE_PARENT)
    if out['killed'] == 'rss':
        return dict(status='oom', note=f"killed at RSS {out['rss'] / 2**30:.1f} GiB > "
                    f'--mem-limit-gb {limit_bytes / 2**30:.1f}')
    if out['killed']:
        return dict(status='timeout', note=f'memory worker ran > {timeout_s:.0f} s')
    for line in out['lines']:
        if line.startswith(WORKER_MARK):
            return json.loads(line[len(WORKER_MARK):])
    reason = ('killed by signal 9 (kernel OOM killer?)' if out['returncode'] == -9
              else f"exit code {out['returncode']}")
    return dict(status='error', note=f'memory worker failed ({reason}): '
                + ' | '.join(out['stderr'].strip().splitlines()[-3:]))


def main(argv=None, worker=None) -> int:
    """A memory process: ``worker`` (default :func:`worker_main`; the whole-model module
    passes its own) on the config ``argv[0]``, its result on the marked last line."""
    # mmcv's ConvModule warns about mmpretrain's LPI conv (bias before a norm): not our concern
    warnings.filterwarnings('ignore', message='Unnecessary conv bias before batch/instance norm')
    try:
        cfg = json.loads((sys.argv[1:] if argv is None else argv)[0])
        result = (worker or worker_main)(cfg)
    except Exception as e:  # reported to the parent, which records status='error'
        traceback.print_exc()
        result = dict(status='error', note=f'{type(e).__name__}: {e}'[:300])
    print(WORKER_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
