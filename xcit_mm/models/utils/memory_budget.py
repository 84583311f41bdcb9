"""Whole image or pieces within a memory budget: the estimate and the choice behind ``mode='auto'``.

A lean model's peak grows linearly with its pixels (XCA is linear in the tokens), so a line through
peaks at a few small sizes predicts any size; each model lists its plans, the first that fits runs.
"""
import contextlib
import ctypes
import gc
import logging
import math
import os.path as osp
import statistics
from typing import Callable, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from mmengine.logging import print_log

MB = 2**20


class MemoryBudgetError(ValueError):
    """A budget no plan fits, or a malformed budget setting."""


class MemoryModel(NamedTuple):
    """Peak memory growth of one model's call as ``base_mb + mb_per_mpix * megapixels``."""
    base_mb: float
    mb_per_mpix: float

    def estimate_mb(self, num_pixels: float) -> float:
        return self.base_mb + self.mb_per_mpix * num_pixels / 1e6

    @classmethod
    def fit(cls, points: Sequence[Tuple[float, float]]) -> 'MemoryModel':
        """Least-squares line through ``(num_pixels, peak_mb)`` points, its slope kept
        non-negative and its base raised so that it never undercuts a point it was fitted on."""
        if len({p for p, _ in points}) < 2:
            raise MemoryBudgetError('calibrating a memory model needs peaks at two or more sizes')
        xs = [p / 1e6 for p, _ in points]
        ys = [float(m) for _, m in points]
        slope = max(statistics.linear_regression(xs, ys).slope, 0.0)
        base = max(0.0, max(y - slope * x for x, y in zip(xs, ys)))
        return cls(base_mb=base, mb_per_mpix=slope)


def _status_kb(key: str) -> int:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1])
    raise OSError(f'{key} is not in /proc/self/status')


def release_free_heap() -> None:
    """glibc's ``malloc_trim(0)`` (a no-op without glibc): a measured call cannot reuse pages an
    earlier call left resident."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL('libc.so.6').malloc_trim(0)


def reset_peak_rss() -> None:
    """Set the kernel's peak resident set (``VmHWM``) to the current one (Linux >= 4.0)."""
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')


def rss_mb() -> float:
    return _status_kb('VmRSS') / 1024


def peak_rss_mb() -> float:
    """The peak resident set since the last :func:`reset_peak_rss`, in MB."""
    return _status_kb('VmHWM') / 1024


def measure_peak_growth_mb(call: Callable[[], object], device=None) -> float:
    """By how much ``call()`` raised the memory in use at its peak (MB) on ``device`` (default
    CPU): the resident set's (``VmHWM``) or the CUDA caching allocator's tensors."""
    device = torch.device('cpu' if device is None else device)
    fix = 'give the line instead: test_cfg.memory_model=dict(base_mb=..., mb_per_mpix=...)'
    gc.collect()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / MB
        call()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / MB - base
    if device.type != 'cpu':
        raise MemoryBudgetError(
            f'cannot measure peak memory on {device} (only the CPU and CUDA devices); {fix}')
    release_free_heap()
    try:
        reset_peak_rss()
        base = rss_mb()
    except OSError as e:
        raise MemoryBudgetError(f'cannot measure peak memory here ({e}); {fix}') from e
    call()
    return peak_rss_mb() - base


def measure_line(run_at: Callable[[int, int], object], sizes: Iterable[Tuple[int, int]],
                 device=None) -> Tuple[MemoryModel, List[Tuple[int, float]]]:
    """The line through ``run_at(h, w)``'s peak growth at ``sizes`` and its ``(pixels, MB)``
    points; the first size runs once unmeasured before (first calls set up memory that stays)."""
    sizes = list(sizes)
    run_at(*sizes[0])
    points = [(h * w, measure_peak_growth_mb(lambda: run_at(h, w), device)) for h, w in sizes]
    return MemoryModel.fit(points), points


def calibrate(run_at: Callable[[int, int], object], sizes: Iterable[Tuple[int, int]],
              what: str, fixed_mb: float = 0.0, fixed_what: str = '',
              device=None) -> MemoryModel:
    """:func:`measure_line` plus ``fixed_mb`` (a part the same at any size), logged with the
    ``memory_model`` setting that skips calibrating."""
    line, points = measure_line(run_at, sizes, device)
    model = MemoryModel(line.base_mb + fixed_mb, line.mb_per_mpix)
    measured = ', '.join(f'{int(p**0.5)}^2 px: {m:.0f} MB' for p, m in points)
    if fixed_what:
        measured += f'; {fixed_what}: {fixed_mb:.0f} MB more'
    where = '' if device is None or torch.device(device).type == 'cpu' else f' on {device}'
    print_log(f'{what}: memory calibrated{where} ({measured}): peak ~ {model.base_mb:.0f} MB + '
              f'{model.mb_per_mpix:.0f} MB per megapixel; set test_cfg.memory_model='
              f'dict(base_mb={math.ceil(model.base_mb)}, '
              f'mb_per_mpix={math.ceil(model.mb_per_mpix)}) to skip this calibration',
              logger='current')
    return model


def read_memory_model(value, owner: str) -> Optional[MemoryModel]:
    """``test_cfg.memory_model`` (a dict with ``base_mb`` and ``mb_per_mpix``) or None."""
    if value is None:
        return None
    if not (isinstance(value, dict) and set(value) == {'base_mb', 'mb_per_mpix'}
            and all(isinstance(v, (int, float)) and v >= 0 for v in value.values())):
        raise MemoryBudgetError(
            f'{owner}: test_cfg.memory_model must be dict(base_mb=..., mb_per_mpix=...) with '
            f'non-negative numbers (the line a calibration logs), got {value!r}')
    return MemoryModel(float(value['base_mb']), float(value['mb_per_mpix']))


def read_budget_mb(test_cfg, owner: str) -> float:
    """``test_cfg.max_memory`` in MB, checked: mode='auto' needs a positive number."""
    budget = test_cfg.get('max_memory')
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise MemoryBudgetError(
            f"{owner}: test_cfg mode='auto' needs max_memory, the memory (MB) inference may add, "
            f'as a positive number, e.g. max_memory=8000; got {budget!r}')
    return float(budget)


# Where the memory this process may use is read (tests point them at files of their own).
CGROUP_ROOT = '/sys/fs/cgroup'
PROC_SELF_CGROUP = '/proc/self/cgroup'
PROC_MEMINFO = '/proc/meminfo'
# cgroup v1 reports "no limit" as a page-rounded 2**63 - 1; above this a limit means none.
CGROUP_V1_UNLIMITED = 2**62


class Budget(NamedTuple):
    """A memory budget (MB) and where it came from, in words for the log."""
    mb: float
    source: str


def _read_int(path: str) -> Optional[int]:
    """The integer a cgroup file holds; None where the file is absent, unreadable or says
    ``max`` (cgroup v2's "no limit")."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _memory_cgroups() -> List[Tuple[str, str, str, str]]:
    """``(version, mount, path, (limit file, usage file))`` of the process's memory cgroups, from
    ``/proc/self/cgroup``: the v2 hierarchy (``0::path``) and v1's ``memory`` controller."""
    try:
        with open(PROC_SELF_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(':', 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == '0' and not controllers:
            # pure v2 mounts the hierarchy at the root; the hybrid layout under unified/
            for mount in (CGROUP_ROOT, osp.join(CGROUP_ROOT, 'unified')):
                if osp.exists(osp.join(mount, 'cgroup.controllers')):
                    found.append(('v2', mount, path, ('memory.max', 'memory.current')))
                    break
        elif 'memory' in controllers.split(','):
            found.append(('v1', osp.join(CGROUP_ROOT, 'memory'), path,
                          ('memory.limit_in_bytes', 'memory.usage_in_bytes')))
    return found


def cgroup_room() -> Optional[Budget]:
    """The least room (limit minus usage) over the process's memory cgroups and every cgroup
    above them, as the kernel reclaims or kills at the first limit reached; None without a
    limit. A container sees its own cgroup at the mount's root, where the path named in
    ``/proc/self/cgroup`` (the host's) does not exist: then the root is the process's."""
    best = None
    for version, mount, path, (limit_file, usage_file) in _memory_cgroups():
        folder = osp.join(mount, path.lstrip('/'))
        if not osp.isdir(folder):
            folder = mount
        while True:
            limit, usage = (_read_int(osp.join(folder, name)) for name in (limit_file, usage_file))
            if limit is not None and usage is not None and not (
                    version == 'v1' and limit >= CGROUP_V1_UNLIMITED):
                room = Budget(max(limit - usage, 0) / MB,
                              f'cgroup {version} {limit_file} - {usage_file} of {folder}')
                best = room if best is None or room.mb < best.mb else best
            if osp.normpath(folder) == osp.normpath(mount):
                break
            folder = osp.dirname(folder)
    return best


def meminfo_available() -> Optional[Budget]:
    """``MemAvailable`` of ``/proc/meminfo`` (free memory plus what the kernel can reclaim at
    once); None where the file or the line is absent (not Linux, kernels before 3.14)."""
    try:
        with open(PROC_MEMINFO) as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return Budget(int(line.split()[1]) / 1024, f'MemAvailable in {PROC_MEMINFO}')
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_budget(device=None) -> Optional[Budget]:
    """The memory this process may still use on ``device`` (default CPU), for a budget nobody
    set: on the CPU the smaller of its cgroups' room and the system's available memory (either
    alone misleads: a container's limit is not in ``MemAvailable``, and a cgroup without a limit
    says nothing of the machine); on CUDA the device's free memory plus what the caching
    allocator holds unused (it reuses that first). None where none of these can be read."""
    device = torch.device('cpu' if device is None else device)
    if device.type == 'cuda':
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return Budget((free + cached) / MB, f'free memory of {device} (torch.cuda.mem_get_info, '
                      'plus the caching allocator\'s unused blocks)')
    if device.type != 'cpu':
        return None
    known = [b for b in (cgroup_room(), meminfo_available()) if b is not None]
    return min(known, key=lambda b: b.mb) if known else None


class Plan(NamedTuple):
    """One way to run an image, its peak estimate, its pieces in words, a stream's band size, a
    detector stream's core columns per window of features (None: the whole width)."""
    name: str
    estimate_mb: float
    detail: str = ''
    band_mb: Optional[float] = None
    window_cores: Optional[int] = None


class MemoryPlanMixin:
    """Calibrate, plan and choose for both lean models, which give ``memory_plans`` (in the order
    tried) and ``_calibrate_memory``; ``calibrated_memory_model`` and ``last_memory_plan`` (None
    after a budget no plan fits) say what was measured and chosen, for a benchmark."""
    calibrated_memory_model: Optional[MemoryModel] = None
    last_memory_plans: Sequence[Plan] = ()
    last_memory_plan: Optional[Plan] = None
    _last_budget: Optional[float] = None
    _last_logged_decision: Optional[tuple] = None

    def network_memory_model(self, inputs: torch.Tensor) -> MemoryModel:
        """``test_cfg.memory_model`` if given (it wins over an earlier calibration), else the line
        ``_calibrate_memory`` measures once per model."""
        given = self.test_settings.memory_model
        if given is not None:
            return given
        if self.calibrated_memory_model is None:
            self.calibrated_memory_model = self._calibrate_memory(inputs)
        return self.calibrated_memory_model

    def _choose_memory_plan(self, plans: List[Plan], budget_mb: float, what: str,
                            source: Optional[str] = None) -> Plan:
        """The first of ``plans`` within ``budget_mb``, logged unless the previous batch had these
        plans and budget (a test set of one image size); else an error naming the fix.
        ``source``: where a budget nobody set came from (:func:`process_budget`); that budget
        moves from call to call, so its choice is logged once per plan chosen, not per call."""
        last = self.last_memory_plan
        if last is not None and (plans, budget_mb) == (self.last_memory_plans, self._last_budget):
            return last
        self.last_memory_plans, self._last_budget, self.last_memory_plan = plans, budget_mb, None
        listing = '; '.join(f'{p.name}{" " + p.detail if p.detail else ""}: {p.estimate_mb:.0f} MB'
                            for p in plans)
        within = (f'max_memory={budget_mb:.0f} MB' if source is None else
                  f'{budget_mb:.0f} MB, the memory this process may use ({source}; '
                  'test_cfg.max_memory sets a budget)')
        for plan in plans:
            if plan.estimate_mb <= budget_mb:
                self._log_decision(None if source is None else (plan.name, source),
                                   f'{what}: {plan.name} within {within} (estimates: {listing})')
                self.last_memory_plan = plan
                return plan
        smallest = min(plans, key=lambda p: p.estimate_mb)
        print_log(f'{what}: no plan within {within} ({listing})',
                  logger='current', level=logging.ERROR)
        fix = (f'raise test_cfg.max_memory to at least {smallest.estimate_mb:.0f}'
               if source is None else
               f'free memory, or set test_cfg.max_memory={smallest.estimate_mb:.0f} to run the '
               'smallest plan anyway')
        raise MemoryBudgetError(
            f'{what}: no way to run within {within} (estimates: {listing}); {fix} or use '
            'smaller windows / tiles')

    def _log_decision(self, key: Optional[tuple], message: str,
                      level: int = logging.INFO) -> None:
        """Log ``message`` unless the last decision logged had the same ``key`` (None: always),
        so that a test set of many image sizes gets a line per change of path, not per image."""
        if key is None or key != self._last_logged_decision:
            print_log(message, logger='current', level=level)
        self._last_logged_decision = key
