"""(model, resolution) points: FLOPs, fresh-process peak memory, interleaved timing; ``--onnx``,
``--compare`` and ratios A/B."""
import functools
import os
import os.path as osp
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .flops import point_flops
from .fresh_points import measure, run_fresh, run_metadata
from .models import ModelSpec, build_model, parse_model
from .timing import (make_step, measure_matmul_gflops, set_threads, time_figures,
                     time_interleaved, time_with_matmul)

# mmcv's ConvModule warns about mmpretrain's LPI conv (bias before a norm): not our concern
warnings.filterwarnings('ignore', message='Unnecessary conv bias before batch/instance norm')


def mem_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (8 GiB where it cannot be read)."""
    try:
        with open('/proc/meminfo') as f:
            return int(f.read().split('MemAvailable:')[1].split()[0]) * 1024
    except (OSError, IndexError):
        return 8 * 2 ** 30


def build_timed_model(spec: ModelSpec, device: str) -> Tuple[nn.Module, Callable]:
    """(model, forward) of ``spec``, seed 0; a ``+compile`` forward through Inductor with one
    static graph per input size (what a fixed-size deployment gets)."""
    torch.manual_seed(0)
    model, forward = build_model(spec, device)
    return model, torch.compile(forward, dynamic=False) if spec.compiled else forward


def memory_worker(cfg: dict) -> dict:
    """The peak memory of one point (``cfg``: model, resolution, ...), in a fresh process."""
    set_threads(cfg.get('threads'))
    device, spec, res = cfg['device'], parse_model(cfg['model']), cfg['resolution']
    model, forward = build_timed_model(spec, device)
    # a warm-up at 64 px; a compiled model's at the measured size (= compile: one static graph)
    batch, side = (cfg['batch'], res) if spec.compiled else (1, 64)
    make_step(model, forward, torch.randn(batch, 3, side, side, device=device), cfg['mode'],
              device, cfg['precision'])()
    step = make_step(model, forward, torch.randn(cfg['batch'], 3, res, res, device=device),
                     cfg['mode'], device, cfg['precision'])
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
    """:func:`memory_worker` (or whole_model's) in a fresh process, killed above ``limit_bytes`` of
    RSS ('oom') or after ``timeout_s`` ('timeout'); ``cpu_mem_mode`` 'process': glibc's malloc."""
    target = ('xcit_benchmark.whole_model:worker_main' if cfg.get('kind') == 'whole_model'
              else 'xcit_benchmark.runner:memory_worker')
    out = run_fresh(target, cfg, limit_bytes, timeout_s, threads=cfg.get('threads'),
                    live=cfg.get('cpu_mem_mode', 'live') == 'live')
    if out['rows'] and not out['killed']:
        return out['rows'][-1]
    return dict(status={'rss': 'oom', 'timeout': 'timeout'}.get(out['killed'], 'error'),
                note=f"memory worker {out['note']}" + (
                    ' (--mem-limit-gb)' if out['killed'] == 'rss' else ''))


log_stderr = functools.partial(print, file=sys.stderr)


@dataclass
class RunOptions:
    """Options shared by all points of one run (benchmark.py --help)."""

    batch: int = 1
    mode: str = 'inference'
    precision: str = 'fp32'
    device: str = 'cpu'
    threads: Optional[int] = None
    warmup: int = 1
    repeats: int = 5
    mem_iters: int = 2
    cpu_mem_mode: str = 'live'
    mem_limit_bytes: int = 8 * 2 ** 30
    mem_timeout_s: float = 1800.
    do_time: bool = True
    do_mem: bool = True
    quiet: bool = False


def run_points(points: Sequence[Tuple[ModelSpec, int]], opts: RunOptions,
               log: Callable[[str], None] = log_stderr) -> Tuple[List[dict], dict]:
    """(records, meta) of (spec, resolution) points. Per resolution: FLOPs, a memory process per
    point, then the interleaved timing of every point that fitted (models built once)."""
    if opts.device == 'cuda' and not torch.cuda.is_available():
        raise RuntimeError('--device cuda requested but torch.cuda.is_available() is False')
    set_threads(opts.threads)
    load, cores, threads = os.getloadavg()[0], os.cpu_count() or 1, torch.get_num_threads()
    if opts.device == 'cpu' and opts.do_time and load + threads > cores + 0.5 and threads > 1:
        log(f'WARNING: load average {load:.1f} on {cores} cores: with {threads} threads the '
            'OpenMP barriers wait for descheduled threads and CPU times are inflated several '
            'fold (and noisy). On a shared machine use --threads 1 for speed comparisons.')
    progress = (lambda message: None) if opts.quiet else log
    matmul_before = measure_matmul_gflops(opts.device)
    records: List[dict] = []
    built: Dict[str, Tuple[nn.Module, Callable]] = {}
    flops_models: Dict[str, Tuple[nn.Module, Callable]] = {}
    for res in sorted({r for _, r in points}):
        specs = [s for s, r in points if r == res]
        recs: Dict[str, dict] = {}
        for spec in specs:
            rec = new_record(opts, spec.name, spec.description, res, with_cp=spec.with_cp,
                             compiled=spec.compiled)
            progress(f'{spec.name}@{res}: flops / memory')
            rec.update(point_flops(spec, res, opts.mode, flops_models))
            if opts.do_mem:
                rec.update(run_memory_worker(dict(vars(opts), model=spec.name, resolution=res),
                                             opts.mem_limit_bytes, opts.mem_timeout_s))
            recs[spec.name] = rec
        if opts.do_time:
            steps = {}
            img = torch.randn(opts.batch, 3, res, res, device=opts.device)
            for spec in specs:
                if recs[spec.name]['status'] != 'ok':
                    continue
                if spec.name not in built:
                    built[spec.name] = build_timed_model(spec, opts.device)
                model, forward = built[spec.name]
                steps[spec.name] = make_step(model, forward, img, opts.mode, opts.device,
                                             opts.precision)
                if spec.compiled:  # the first call at this size compiles: timed on its own
                    recs[spec.name]['compile_s'] = time_interleaved(
                        {'compile': steps[spec.name]}, 0, 1, opts.device)['compile'][0]
            progress(f'timing {len(steps)} models at {res}')
            try:  # the reference matmul rate, interleaved with the models: same load
                times, mm = time_with_matmul(steps, opts.warmup, opts.repeats,
                                             opts.device) if steps else ({}, None)
            except torch.cuda.OutOfMemoryError as e:
                for name in steps:
                    recs[name].update(status='oom', note=f'CUDA OOM while timing: {e}'[:200])
                times = {}
                torch.cuda.empty_cache()
            for name, ts in times.items():
                recs[name].update(time_figures(ts, opts.batch), matmul_gflop_s=mm)
            del img, steps
        records.extend(recs[s.name] for s in specs)
    del flops_models
    matmul_after = measure_matmul_gflops(opts.device)
    for rec in records:
        rec.setdefault('matmul_gflop_s', (matmul_before + matmul_after) / 2)
        if 'ms_per_img' in rec and 'gflop_exec' in rec:
            rec['achieved_gflop_s'] = rec['gflop_exec'] / (rec['ms_per_img'] / 1e3)
            # against the matmul rate of this record: the one timed in the same rounds where it
            # was, else the mean of the calibrations before and after the run
            rec['matmul_frac'] = rec['achieved_gflop_s'] / rec['matmul_gflop_s']
    return records, run_meta(opts, matmul_before, matmul_after)


def new_record(opts: RunOptions, name: str, description: str, resolution: int, **extra) -> dict:
    """A point's record before its figures: what was measured, under which options."""
    record = dict(model=name, description=description, resolution=resolution, batch=opts.batch,
                  mode=opts.mode, precision=opts.precision, device=opts.device,
                  threads=opts.threads or torch.get_num_threads(), status='ok',
                  warmup=opts.warmup, repeats=opts.repeats, note='')
    return dict(record, **extra)


def run_meta(opts: RunOptions, matmul_before: float, matmul_after: float, **extra) -> dict:
    """The run's metadata: machine, software, load, the reference rates, the options."""
    return dict(run_metadata(), matmul_gflop_s_before=matmul_before,
                matmul_gflop_s_after=matmul_after, options=dict(vars(opts)), **extra)


def run_onnx_points(config: str, resolutions: Sequence[int], opts: RunOptions,
                    log: Callable[[str], None] = log_stderr) -> Tuple[List[dict], dict]:
    """``--onnx CONFIG``: the model (random init) exported at each resolution, checked against
    PyTorch (the ``note``), timed in ONNX Runtime against eager in the same rounds; per resolution
    the records ``<config stem>`` (eager), then ``<config stem>+onnxruntime``."""
    import onnxruntime

    from xcit_mm.deployment import (build_export_model, export_onnx, onnx_session, run_onnx,
                                    verify_onnx)
    if opts.device != 'cpu' or opts.mode != 'inference' or opts.precision != 'fp32':
        raise ValueError('--onnx times CPU fp32 inference only')
    set_threads(opts.threads)
    threads = opts.threads or torch.get_num_threads()
    torch.manual_seed(0)
    model = build_export_model(config)
    eager_name = osp.splitext(osp.basename(config))[0]
    ort_name = eager_name + '+onnxruntime'
    what = (f'{config}: {model.task} '
            f'{"image -> logits" if model.task == "seg" else "backbone + neck"}, random init; ')
    matmul_before = measure_matmul_gflops('cpu')
    records, exports = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for res in resolutions:
            path = os.path.join(tmp, f'model_{res}.onnx')
            t0 = time.perf_counter()
            export_onnx(model, path, (res, res), dynamic=False, batch=opts.batch)
            exports[res] = time.perf_counter() - t0
            check = verify_onnx(model, path, [(res, res)], threads=threads, batch=opts.batch)[0]
            note = (f'ONNX Runtime vs PyTorch at {res}x{res}: max abs diff {check["max_abs"]:.2e}, '
                    f'max rel diff {check["max_rel"]:.2e}')
            log(note)
            session = onnx_session(path, threads)
            image = torch.randn(opts.batch, 3, res, res)
            steps = {eager_name: make_step(model, model, image, 'inference', 'cpu', 'fp32'),
                     ort_name: lambda: run_onnx(session, image)}
            runtimes = {eager_name: 'PyTorch eager (no_grad)',
                        ort_name: f'ONNX Runtime {onnxruntime.__version__} CPU, static '
                                  f'{opts.batch}x3x{res}x{res}'}
            times, mm = time_with_matmul(steps, opts.warmup, opts.repeats, 'cpu')
            for name, ts in times.items():
                records.append(new_record(
                    opts, name, what + runtimes[name], res, with_cp=False, compiled=False,
                    matmul_gflop_s=mm, **time_figures(ts, opts.batch), note=note,
                    status='ok' if check['ok'] else 'mismatch'))
    return records, run_meta(opts, matmul_before, measure_matmul_gflops('cpu'),
                             onnx_config=config, onnxruntime=onnxruntime.__version__,
                             onnx_export_s=exports)


def median_paired_ratio(a: dict, b: dict) -> Optional[float]:
    """Median of the per-round time ratios of two records timed in the same interleaved rounds."""
    ta, tb = a.get('times_s'), b.get('times_s')
    if not ta or not tb or len(ta) != len(tb):
        return None
    return statistics.median(x / y for x, y in zip(ta, tb))


def ratio_rows(records: Sequence[dict], pairs: Sequence[Tuple[str, str]]) -> List[dict]:
    """Time and memory ratios A/B per resolution for the given (A, B) model-name pairs."""
    index = {(r['model'], r['resolution']): r for r in records}
    rows = []
    for a_name, b_name in pairs:
        for res in sorted({r['resolution'] for r in records}):
            a, b = index.get((a_name, res)), index.get((b_name, res))
            if a is None or b is None:
                continue
            row = dict(a=a_name, b=b_name, resolution=res)
            if a.get('ms_per_img') and b.get('ms_per_img'):
                row['time_ratio'] = a['ms_per_img'] / b['ms_per_img']
                row['paired_time_ratio'] = median_paired_ratio(a, b)
            if a.get('peak_mem_mb') and b.get('peak_mem_mb'):
                row['mem_ratio'] = a['peak_mem_mb'] / b['peak_mem_mb']
            row.update(a_ms=a.get('ms_per_img'), b_ms=b.get('ms_per_img'),
                       a_mb=a.get('peak_mem_mb'), b_mb=b.get('peak_mem_mb'))
            rows.append(row)
    return rows


def compare_pairs(specs: Sequence[ModelSpec]) -> Tuple[List[ModelSpec], List[Tuple[str, str]]]:
    """``--compare``: for every XCiT model, XCiTBackbone.forward_trunk vs mmpretrain's trunk."""
    out, pairs = [], []
    for spec in specs:
        if spec.family in ('xcit', 'xcit_trunk'):
            ours = parse_model(f'xcit_{spec.arch}_p{spec.patch}_trunk')
            port = parse_model(f'mmpretrain_xcit_{spec.arch}_p{spec.patch}')
            out += [s for s in (ours, port) if s not in out]
            pairs.append((ours.name, port.name))
    return out, pairs


def variants(specs: Sequence[ModelSpec], mode: str, pairs: List[Tuple[str, str]],
             suffix: str = '+cp') -> List[ModelSpec]:
    """``on``: every model's ``suffix`` variant where it has one; ``both``: the variant beside the
    model, (variant, model) added to ``pairs``."""
    out = []
    for s in specs:
        try:
            variant = s if mode == 'off' else parse_model(s.name + suffix)
        except ValueError:  # none: mmpretrain's port has no with_cp, or ``s`` is the variant
            variant = s
        if mode == 'both' and s != variant:
            out.append(s)
            pairs.append((variant.name, s.name))
        out.append(variant)
    return list(dict.fromkeys(out))


def check_same_trunk(arch: str, patch: int, resolution: int = 64) -> str:
    """A one-line verdict that ``--compare`` times the same computation: the port's weights,
    loaded through XCiTBackbone's ``Pretrained`` loader, give the same trunk maps."""
    name = f'same trunk check XCiT-{arch.upper()}/{patch}'
    try:
        port, _ = build_timed_model(parse_model(f'mmpretrain_xcit_{arch}_p{patch}'), 'cpu')
        with torch.no_grad():  # non-trivial BatchNorm statistics
            for m in port.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.1, 0.1)
                    m.running_var.uniform_(0.5, 1.5)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, 'port.pth')
            torch.save({'state_dict': {'backbone.' + k: v for k, v in
                                       port.state_dict().items()}}, path)
            from mmengine.registry import MODELS
            ours = MODELS.build(dict(type='XCiTBackbone', arch=arch, patch_size=patch,
                                     norm_cfg=dict(type='BN'),
                                     init_cfg=dict(type='Pretrained', checkpoint=path)))
            ours.init_weights()
        port.eval()  # (mmpretrain's train() returns None)
        img = torch.randn(1, 3, resolution, resolution)
        with torch.no_grad():
            a, b = ours.eval().forward_trunk(img), port(img)
        diff = max((x - y).abs().max().item() for x, y in zip(a, b))
        scale = max(y.abs().max().item() for y in b)
        return (f'{name}: port weights loaded into XCiTBackbone, max |diff| of the {len(a)} '
                f'trunk maps = {diff:.2e} (max |value| {scale:.2e})')
    except Exception as e:  # report, do not abort the benchmark
        return f'{name} not possible: {type(e).__name__}: {e}'
