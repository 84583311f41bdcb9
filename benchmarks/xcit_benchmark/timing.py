"""Steps (one inference call or one train step) and their interleaved timing: round r runs every
step once, in an order rotated by r, so slow drifts of a shared machine hit all models alike; a
float32 ``torch.mm`` step timed in the same rounds gives the machine's reference rate."""
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


def sync(device: str):
    if device == 'cuda':
        torch.cuda.synchronize()


def make_step(model: nn.Module, forward: Callable, img: torch.Tensor, mode: str, device: str,
              precision: str) -> Callable[[], None]:
    """One inference call (``no_grad``) or one train step (forward, ``sum(out.float().mean())``,
    backward, ``grad = None``: every step allocates the gradients); ``amp``: bf16 CPU, fp16 CUDA."""
    if mode not in ('inference', 'train') or precision not in ('fp32', 'amp'):
        raise ValueError(f'unknown mode {mode!r} or precision {precision!r}')
    model.train(mode == 'train')
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = (contextlib.nullcontext if precision == 'fp32' else lambda: torch.autocast(
        device, dtype=torch.bfloat16 if device == 'cpu' else torch.float16))

    def step():
        if mode == 'inference':
            with torch.no_grad(), autocast():
                forward(img)
            return
        with autocast():
            loss = sum(o.float().mean() for o in forward(img))
        try:
            loss.backward()
        finally:  # also where the backward fails (the FLOP counter's fake tensors)
            for p in params:
                p.grad = None
    return step


def make_matmul_step(device: str) -> Callable[[], None]:
    """The reference step: ``MATMUL_CALLS`` float32 ``MATMUL_SIZE``² ``torch.mm``."""
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device) for _ in 'ab')
    return lambda: [torch.mm(a, b) for _ in range(MATMUL_CALLS)]


def measure_matmul_gflops(device: str, repeats: int = 10) -> float:
    """Rate of the reference step alone (median over ``repeats`` steps), in GFLOP/s."""
    return time_with_matmul({}, 1, repeats, device)[1]


def time_with_matmul(steps: Dict[str, Callable[[], None]], warmup: int, repeats: int,
                     device: str):
    """(times of :func:`time_interleaved`, GFLOP/s of the reference step timed with them)."""
    times = time_interleaved(dict(steps, **{MATMUL_STEP: make_matmul_step(device)}), warmup,
                             repeats, device)
    seconds = statistics.median(times.pop(MATMUL_STEP))
    return times, 2 * MATMUL_SIZE ** 3 * MATMUL_CALLS / seconds / 1e9


def time_figures(times: Sequence[float], batch: int) -> dict:
    """Median and quartiles per image (ms), images/s, of the timed calls of a point."""
    per_img = [t / batch for t in times]
    q = statistics.quantiles(per_img, n=4) if len(per_img) > 1 else per_img * 3
    med = statistics.median(per_img)
    return dict(ms_per_img=med * 1e3, ms_p25=q[0] * 1e3, ms_p75=q[2] * 1e3, imgs_per_s=1.0 / med,
                times_s=list(times))


def round_order(items: Sequence, r: int) -> list:
    """``items`` rotated by ``r``: the order of interleaved round ``r``."""
    items = list(items)
    shift = r % len(items) if items else 0
    return items[shift:] + items[:shift]


def time_interleaved(steps: Dict[str, Callable[[], None]], warmup: int, repeats: int,
                     device: str) -> Dict[str, List[float]]:
    """``warmup`` calls of every step, then ``repeats`` rounds in :func:`round_order`, gc off."""
    for _ in range(warmup):
        for step in steps.values():
            step()
            sync(device)
    times: Dict[str, List[float]] = {name: [] for name in steps}
    gc.collect()
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            for name in round_order(steps, r):
                sync(device)
                t0 = time.perf_counter()
                steps[name]()
                sync(device)
                times[name].append(time.perf_counter() - t0)
    finally:
        if gc_enabled:
            gc.enable()
    return times
