"""Steps (one inference call or one train step) and their interleaved timing.

The repeats are *interleaved* across models (round r runs every step once, in an order rotated by
r), so slow drifts of a shared machine hit all models alike.  A float32 1024x1024 ``torch.mm``
step (:data:`MATMUL_STEP`) timed in the same rounds gives the reference rate of the machine.
"""
import contextlib
import gc
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

MATMUL_STEP = '__matmul_fp32_1024__'
MATMUL_SIZE, MATMUL_CALLS = 1024, 4


def set_threads(threads: Optional[int]):
    """``torch.set_num_threads(threads)`` unless ``threads`` is None or 0."""
    if threads:
        torch.set_num_threads(threads)


def autocast_context(device: str, precision: str):
    """Autocast context for ``precision`` ('fp32': none; 'amp': bf16 on CPU, fp16 on CUDA)."""
    if precision == 'fp32':
        return contextlib.nullcontext()
    if precision != 'amp':
        raise ValueError(f'unknown precision {precision!r}')
    dtype = torch.bfloat16 if device == 'cpu' else torch.float16
    return torch.autocast(device_type=device, dtype=dtype)


def make_step(model: nn.Module, forward: Callable, img: torch.Tensor, mode: str, device: str,
              precision: str) -> Callable[[], None]:
    """A zero-argument callable running one inference call or one train step.

    Inference: ``model.eval()`` and the forward under ``torch.no_grad()``.  Train step:
    ``model.train()``, forward, ``loss = sum(out.float().mean())``, backward, gradients dropped
    (``grad = None``, so every step allocates them, as a real step before ``optimizer.step``)."""
    if mode == 'inference':
        model.eval()

        def step():
            with torch.no_grad(), autocast_context(device, precision):
                forward(img)
    elif mode == 'train':
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]

        def step():
            with autocast_context(device, precision):
                outs = forward(img)
                loss = sum(o.float().mean() for o in outs)
            loss.backward()
            for p in params:
                p.grad = None
    else:
        raise ValueError(f'unknown mode {mode!r}')
    return step


def _sync(device: str):
    if device == 'cuda':
        torch.cuda.synchronize()


def make_matmul_step(device: str) -> Callable[[], None]:
    """A step of ``MATMUL_CALLS`` float32 1024x1024 ``torch.mm`` (the reference rate)."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device)

    def step():
        for _ in range(MATMUL_CALLS):
            torch.mm(a, b)
    return step


def matmul_gflops(step_seconds: float) -> float:
    """GFLOP/s of one :func:`make_matmul_step` call that took ``step_seconds``."""
    return 2 * MATMUL_SIZE ** 3 * MATMUL_CALLS / step_seconds / 1e9


def measure_matmul_gflops(device: str, repeats: int = 10) -> float:
    """Rate of a float32 1024x1024 ``torch.mm`` (median over ``repeats`` steps), in GFLOP/s."""
    step = make_matmul_step(device)
    times = time_interleaved({MATMUL_STEP: step}, 1, repeats, device)[MATMUL_STEP]
    return matmul_gflops(statistics.median(times))


def time_figures(times: Sequence[float], batch: int) -> dict:
    """Median and quartiles per image (ms), images/s, of the timed calls of a point."""
    per_img = [t / batch for t in times]
    q = statistics.quantiles(per_img, n=4) if len(per_img) > 1 else per_img * 3
    med = statistics.median(per_img)
    return dict(ms_per_img=med * 1e3, ms_p25=q[0] * 1e3, ms_p75=q[2] * 1e3, imgs_per_s=1.0 / med,
                times_s=list(times))


def round_order(items: Sequence, r: int) -> list:
    """``items`` rotated by ``r``: the order of interleaved round ``r`` (round 0 in the given
    order, round 1 starting at the second item, ...)."""
    items = list(items)
    if not items:
        return []
    shift = r % len(items)
    return items[shift:] + items[:shift]


def time_interleaved(steps: Dict[str, Callable[[], None]], warmup: int, repeats: int,
                     device: str) -> Dict[str, List[float]]:
    """Time several steps with interleaved repeats.

    Warm-up: ``warmup`` calls of every step.  Then ``repeats`` rounds; round ``r`` calls every step
    once, in the list order rotated by ``r``.  The garbage collector is off while timing."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
            _sync(device)
    times: Dict[str, List[float]] = {name: [] for name in names}
    gc.collect()
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            for name in round_order(names, r):
                _sync(device)
                t0 = time.perf_counter()
                steps[name]()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
    finally:
        if gc_enabled:
            gc.enable()
    return times
