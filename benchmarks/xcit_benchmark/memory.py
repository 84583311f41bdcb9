"""Peak memory of one (model, resolution) point, measured in a FRESH PROCESS per point.

CPU: growth of the peak resident set (``VmHWM`` of ``/proc/self/status``, reset through
``/proc/self/clear_refs``) over the resident set after the model build, a 64 px warm-up call (it
faults in code pages, creates thread pools), the input creation and ``malloc_trim(0)`` (so freed
warm-up pages cannot hide reuse); the worker runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so that
the RSS peak follows the live tensors (``cpu_mem_mode='process'`` keeps glibc's defaults: the RSS
a plain process shows).  CUDA: ``torch.cuda.max_memory_allocated()`` growth over
``torch.cuda.memory_allocated()`` at the same moment.  So it is the memory the forward (or train
step, incl. the parameter gradients) needs on top of the weights and the input.

:func:`run_memory_worker` (parent side) starts ``python -m xcit_benchmark.worker`` which
runs :func:`worker_main` and prints its result after :data:`WORKER_MARK`.
"""
import gc
import json
import os
import subprocess
import sys
import time

import torch

from xcit_mm.models.utils.memory_budget import release_free_heap, reset_peak_rss

from .models import build_model, compile_forward, parse_model
from .timing import make_step, set_threads

WORKER_MARK = '@@XCIT_BENCHMARK_WORKER@@'
WORKER_MODULE = 'xcit_benchmark.worker'
# the directory that holds this package (benchmarks/)
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_kb(path: str, key: str) -> int:
    """Value in kB of ``key:`` in a /proc file such as ``/proc/self/status``."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'{key} not found in {path}')


def proc_status_kb(key: str, pid: str = 'self') -> int:
    """Value in kB of ``key`` in ``/proc/<pid>/status``."""
    return read_kb(f'/proc/{pid}/status', key)


def mem_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (8 GiB where it cannot be read)."""
    try:
        return read_kb('/proc/meminfo', 'MemAvailable') * 1024
    except (OSError, RuntimeError):
        return 8 * 2 ** 30


# glibc's mmap threshold of the 'live' memory mode: every block of 64 KiB or more (every tensor
# that matters) gets its own mapping, unmapped when freed, so the RSS follows the live tensors.
LIVE_MMAP_THRESHOLD = 65536


def _mallopt_mmap_threshold(nbytes: int) -> bool:
    """glibc ``mallopt(M_MMAP_THRESHOLD, nbytes)`` in this process from now on (the dynamic
    threshold is then off); what ``MALLOC_MMAP_THRESHOLD_`` does for a new process."""
    try:
        import ctypes
        return bool(ctypes.CDLL('libc.so.6').mallopt(-3, int(nbytes)))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


# the kernel's peak counter and glibc's heap, as xcit_mm's memory budget measures them
_release_free_heap = release_free_heap
_reset_peak_rss = reset_peak_rss


def worker_main(cfg: dict) -> dict:
    """Measure the peak memory of one point; runs inside a fresh process.

    Args:
        cfg: dict with model, resolution, batch, mode, precision, device, threads, mem_iters.

    Returns:
        dict: ``status`` ('ok' | 'oom' | 'error'), ``peak_mem_mb``, ``mem_base_mb``,
        ``mem_method``, ``note``.
    """
    set_threads(cfg.get('threads'))
    device = cfg['device']
    spec = parse_model(cfg['model'])
    torch.manual_seed(0)
    model, forward = build_model(spec, device)
    res = cfg['resolution']
    if spec.compiled:  # warm up (= compile) at the measured size: one static graph
        forward = compile_forward(forward)
        tiny = torch.randn(cfg['batch'], 3, res, res, device=device)
    else:
        tiny = torch.randn(1, 3, 64, 64, device=device)
    make_step(model, forward, tiny, cfg['mode'], device, cfg['precision'])()
    del tiny
    img = torch.randn(cfg['batch'], 3, res, res, device=device)
    step = make_step(model, forward, img, cfg['mode'], device, cfg['precision'])
    gc.collect()
    _release_free_heap()
    try:
        if device == 'cuda':
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            for _ in range(cfg['mem_iters']):
                step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            method = 'cuda max_memory_allocated - memory_allocated before the call(s)'
        else:
            _reset_peak_rss()
            base = proc_status_kb('VmRSS') * 1024
            for _ in range(cfg['mem_iters']):
                step()
            peak = proc_status_kb('VmHWM') * 1024
            threshold = os.environ.get('MALLOC_MMAP_THRESHOLD_')
            method = ('fresh process: VmHWM - VmRSS after build, 64px warm-up, input and '
                      'malloc_trim; ' + (f'MALLOC_MMAP_THRESHOLD_={threshold} (live tensors)'
                                         if threshold else 'glibc default malloc (process RSS)'))
    except torch.cuda.OutOfMemoryError as e:
        return dict(status='oom', note=f'CUDA OOM: {str(e).splitlines()[0]}')
    return dict(status='ok', peak_mem_mb=(peak - base) / 2 ** 20, mem_base_mb=base / 2 ** 20,
                mem_method=method, note='')


def run_memory_worker(cfg: dict, limit_bytes: int, timeout_s: float) -> dict:
    """Run :func:`worker_main` in a fresh Python process and return its result.

    The parent polls the child's resident set every 50 ms and kills it above ``limit_bytes``
    (reported as ``status='oom'``), so that a point that does not fit never reaches the kernel's
    OOM killer on a shared machine.

    Args:
        cfg: Worker config (see :func:`worker_main`; ``cpu_mem_mode`` 'live' | 'process').
        limit_bytes: RSS above which the child is killed.
        timeout_s: Wall-clock limit of the child.

    Returns:
        dict: The worker's result, or ``status`` 'oom' / 'timeout' / 'error' with a ``note``.
    """
    env = os.environ.copy()
    env['PYTHONPATH'] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get('PYTHONPATH')) if p)
    if cfg.get('threads'):
        env['OMP_NUM_THREADS'] = env['MKL_NUM_THREADS'] = str(cfg['threads'])
    if cfg.get('cpu_mem_mode', 'live') == 'live':
        # A fixed mmap threshold turns off glibc's dynamic one: every block >= 64 KiB (every
        # tensor that matters) gets its own mapping, unmapped when freed, so the RSS peak follows
        # the live tensors.  With the default, freed blocks stay in the heap and the peak varies
        # +-15% run to run and overstates the need by up to 2x (measured on XCiT-S12/16 @512).
        env['MALLOC_MMAP_THRESHOLD_'] = str(LIVE_MMAP_THRESHOLD)
    else:
        env.pop('MALLOC_MMAP_THRESHOLD_', None)
    cmd = [sys.executable, '-m', WORKER_MODULE, json.dumps(cfg)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=PACKAGE_PARENT)
    start, max_rss = time.time(), 0
    while True:
        try:
            out, err = proc.communicate(timeout=0.05)
            break
        except subprocess.TimeoutExpired:
            try:
                max_rss = max(max_rss, proc_status_kb('VmRSS', str(proc.pid)) * 1024)
            except (OSError, RuntimeError):
                pass  # the process is exiting
            if max_rss > limit_bytes or time.time() - start > timeout_s:
                proc.kill()
                proc.communicate()
                if max_rss > limit_bytes:
                    return dict(status='oom', note=f'killed at RSS {max_rss / 2**30:.1f} GiB > '
                                f'--mem-limit-gb {limit_bytes / 2**30:.1f}')
                return dict(status='timeout', note=f'memory worker ran > {timeout_s:.0f} s')
    for line in out.splitlines():
        if line.startswith(WORKER_MARK):
            return json.loads(line[len(WORKER_MARK):])
    tail = ' | '.join(err.strip().splitlines()[-3:])
    reason = 'killed by signal 9 (kernel OOM killer?)' if proc.returncode == -9 else \
        f'exit code {proc.returncode}'
    return dict(status='error', note=f'memory worker failed ({reason}): {tail}')
