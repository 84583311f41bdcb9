"""Whole-image Semantic FPN inference on a CUDA device: peak memory and time, stock vs lean.

    python benchmarks/gpu/whole_image_cuda.py --out "$OUT/whole_image_cuda"        # on the GPU
    python benchmarks/gpu/whole_image_cuda.py --device cpu --sizes 128 256 --out /tmp/w  # a check
    python benchmarks/gpu/whole_image_cuda.py --report docs/results/whole_image_cuda_h200.json

The CUDA counterpart of ``benchmarks/whole_image_inference.py`` (segmentor task): Semantic FPN
with XCiT-S12/16, Swin-T or ViT-S/16 (its :data:`CONFIGS` and :func:`build_cfg`: random weights,
``Pretrained`` init dropped, the test ``Resize`` removed so the network runs at the image size),
run by the stock ``EncoderDecoder`` or the lean ``LeanEncoderDecoder`` through
``mmseg.apis.init_model`` / ``inference_model``, on square random uint8 images (seeded:
``xcit_benchmark.fresh_points.test_image``).

One child process per (backbone, path) series builds the model once (``torch.manual_seed(0)``
first, so stock and lean get the same weights), warms it up on a ``--warmup`` px image, then runs
the sizes in increasing order. For each size:

* ``peak_growth_mb``: on CUDA, after ``gc.collect()`` and ``torch.cuda.empty_cache()``,
  ``torch.cuda.reset_peak_memory_stats()``; then ``max_memory_allocated()`` after the call minus
  ``memory_allocated()`` before it (the weights and the caches are in the base, the input
  upload, the activations and the result in the growth). On the CPU (``--device cpu``): the peak
  RSS growth (VmHWM after the call minus the RSS before it, as whole_image_inference.py).
* ``max_reserved_mb``: ``max_memory_reserved()`` over the call (CUDA only): what the caching
  allocator held at its peak, weights included.
* ``time_s``: wall time of the call, CUDA synchronized before and after; the median of two calls
  when the first takes less than ``--repeat-below-s`` (5 s), else the one call (``times_s``
  lists them). The memory figures are the first call's.
* ``digest``: sha1 prefix of the ``pred_sem_seg`` labels (moved to the CPU), with
  ``labels_sum`` and ``out_shape``: equal digests mean equal labels (``stock_equals_lean`` in
  the artifact's meta).
* ``status``: ``ok``; ``oom`` on ``torch.cuda.OutOfMemoryError`` (``allocated_at_oom_mb``: what
  was allocated, weights included, at the peak before the failed allocation); ``error`` on any
  other exception (the note says which); ``skipped`` when not run: a smaller size of the
  series did not finish, or the budget was spent; ``killed`` when the child ran past the
  budget plus ``--grace-s``.

Series ``uper`` is UperNet XCiT-S12/16 (``configs/upernet_xcit_s12_p16_160k_ade20k.py``) in the
same way. Path ``auto`` (``--budgets SIZE:MB ...``, XCiT Semantic FPN) runs the lean model with
``test_cfg=dict(mode='auto', max_memory=MB)``: its memory line is calibrated on the device by the
warm-up call (which gets no budget limit), then each point records the plan the model chose, its
estimate (``estimate_mb``) and the measured growth of the whole door call.

No new point starts after ``--budget-s`` seconds from the start. The artifact (``--out`` + .json
and .csv, rewritten after every point) has the rows and a meta with the device, versions and
settings; a progress line per point goes to stdout, each child's own output to
``<out>_<backbone>_<path>.log``.
"""
import argparse
import gc
import hashlib
import json
import os
import os.path as osp
import statistics
import subprocess
import sys
import threading
import time

HERE = osp.dirname(osp.abspath(__file__))
BENCH = osp.dirname(HERE)
ROOT = osp.dirname(BENCH)
for _path in (ROOT, BENCH):  # xcit_mm from this checkout; whole_image_inference, xcit_benchmark
    if _path not in sys.path:
        sys.path.insert(0, _path)
from whole_image_inference import (CONFIGS, LABELS, MODEL_TYPES,  # noqa: E402
                                   build_cfg, digest_agreement, package_version)
from xcit_benchmark.fresh_points import settle_heap, test_image, write_artifact  # noqa: E402
from xcit_benchmark.memory import proc_status_kb  # noqa: E402

TASK = 'segmentor'
BACKBONES = ('xcit', 'swin', 'vit', 'uper')
PATHS = ('lean', 'stock')  # lean first in each backbone: its pair is complete even if cut short
SERIES_CONFIGS = dict({b: CONFIGS[(TASK, b)] for b in ('xcit', 'swin', 'vit')},
                      uper='configs/upernet_xcit_s12_p16_160k_ade20k.py')
SERIES_LABELS = dict(LABELS, uper='UperNet XCiT-S12/16')
# the budget points' default: 8192^2 whole within one budget and in windows within another,
# and 4096^2 in windows
BUDGETS = ((8192, 40000), (8192, 16000), (4096, 4000))
NO_LIMIT_MB = 10**9  # the warm-up's budget: it calibrates the line, whatever it costs
SIZES = (1024, 2048, 4096, 8192)
COLUMNS = ['task', 'backbone', 'path', 'size', 'device', 'max_memory', 'plan', 'estimate_mb',
           'status', 'peak_growth_mb',
           'max_reserved_mb', 'time_s', 'digest', 'note']
MIB = 2**20
ROW, START, INFO = 'ROW ', 'START ', 'INFO '  # the child's protocol lines on stdout


# ---------------------------------------------------------------------------- the child
def output_digest(result) -> dict:
    """sha1 prefix of the labels (moved to the CPU), their sum and shape."""
    labels = result.pred_sem_seg.data.detach().cpu().contiguous()
    return dict(digest=hashlib.sha1(labels.numpy().tobytes()).hexdigest()[:16],
                labels_sum=int(labels.sum()), out_shape=list(labels.shape))


def timed_call(infer, model, img, device: str):
    """``infer(model, img)`` once: (result, seconds, peak growth MB, max reserved MB or None,
    base MB). The caller frees the result."""
    import torch
    if not device.startswith('cuda'):
        base = settle_heap()
        start = time.perf_counter()
        result = infer(model, img)
        seconds = time.perf_counter() - start
        peak = proc_status_kb('VmHWM') * 1024
        return result, seconds, (peak - base) / MIB, None, base / MIB
    from xcit_mm.models.utils.memory_budget import measure_peak_growth_mb
    free_device(device)
    held = {}

    def call():  # timed from the synchronisation before it to the one after its kernels
        start = time.perf_counter()
        held['result'] = infer(model, img)
        torch.cuda.synchronize(device)
        held['seconds'] = time.perf_counter() - start

    base = torch.cuda.memory_allocated(device)
    growth = measure_peak_growth_mb(call, device)  # the peak that mode='auto' measures
    reserved = torch.cuda.max_memory_reserved(device) / MIB
    return held['result'], held['seconds'], growth, reserved, base / MIB


def free_device(device: str) -> None:
    """Drop what Python and the CUDA caching allocator hold but no longer use."""
    import torch
    gc.collect()
    if device.startswith('cuda'):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure(infer, model, size: int, device: str, repeat_below_s: float) -> dict:
    """One point: the figures of the first call at ``size``, the median time of two calls when
    the first is shorter than ``repeat_below_s``."""
    import torch
    img = test_image(size)
    try:
        result, seconds, growth, reserved, base = timed_call(infer, model, img, device)
    except torch.cuda.OutOfMemoryError as e:
        text = str(e).strip()
        row = dict(status='oom', note=text.splitlines()[0][:300] if text else 'OutOfMemoryError')
        if device.startswith('cuda'):  # allocated at the peak before the failed allocation
            row['allocated_at_oom_mb'] = round(torch.cuda.max_memory_allocated(device) / MIB)
    except Exception as e:  # noqa: BLE001 (any failure is a row, not the end of the run)
        row = dict(status='error', note=f'{type(e).__name__}: {str(e).strip()[:300]}')
    else:
        shape = tuple(result.img_shape)  # what the pipeline gave the network
        row = dict(status='ok', peak_growth_mb=round(growth), base_mb=round(base),
                   max_reserved_mb=None if reserved is None else round(reserved),
                   type=type(model).__name__, **output_digest(result))
        del result
        times = [seconds]
        if shape != (size, size):
            row.update(status='error', note=f'the network ran at {shape}, not at {size}')
        elif seconds < repeat_below_s:
            free_device(device)
            again, seconds, _, _, _ = timed_call(infer, model, img, device)
            del again
            times.append(seconds)
        row.update(time_s=round(statistics.median(times), 3),
                   times_s=[round(t, 3) for t in times])
    free_device(device)
    return row


def device_info(device: str) -> dict:
    """The device, torch and CUDA versions, and the settings that change the numbers."""
    import torch
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, device=device,
                threads=torch.get_num_threads(), python=sys.version.split()[0])
    if device.startswith('cuda'):
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, device_total_mb=round(props.total_memory / MIB),
                    cudnn=torch.backends.cudnn.version(),
                    cudnn_benchmark=torch.backends.cudnn.benchmark,
                    cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                    matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32)
    else:
        info['device_name'] = 'cpu'
    return info


def child(spec: dict) -> None:
    """Run one (backbone, path) series in this process; protocol lines on stdout."""
    import numpy as np
    import torch
    from mmengine.utils import import_modules_from_strings

    import xcit_mm  # noqa: F401  (LeanEncoderDecoder and XCiTBackbone)
    device = spec['device']
    # the child's stdout carries the protocol: every other print goes to stderr (the log)
    protocol, sys.stdout = sys.stdout, sys.stderr

    def send(tag, payload):
        protocol.write(tag + json.dumps(payload) + '\n')
        protocol.flush()

    point = dict(task=TASK, backbone=spec['backbone'], path=spec['path'],
                 config=SERIES_CONFIGS[spec['backbone']])
    auto = spec['path'] == 'auto'
    cfg = build_cfg(dict(point, path='lean') if auto else point)
    if auto:
        cfg.model.test_cfg.update(mode='auto', max_memory=NO_LIMIT_MB)
    if cfg.get('custom_imports', None):
        import_modules_from_strings(**cfg.custom_imports)
    from mmseg.apis import inference_model, init_model
    info = device_info(device)
    send(INFO, info)
    torch.manual_seed(0)
    model = init_model(cfg, device=device)
    warm = inference_model(model, np.zeros((spec['warmup'], spec['warmup'], 3), np.uint8))
    del warm
    free_device(device)
    stop = None  # why the remaining sizes are not run
    points = ([(size, None) for size in sorted(spec['sizes'])] if not auto
              else [tuple(p) for p in spec['budgets']])
    for size, budget_mb in points:
        row = dict(point, size=size, device=device)
        del row['config']
        if auto:
            row['max_memory'] = model.test_cfg['max_memory'] = budget_mb
        if stop is None and time.time() > spec['deadline']:
            stop = 'not run: the budget was spent'
        if stop is not None:
            send(ROW, dict(row, status='skipped', note=stop))
            continue
        send(START, row)
        start = time.time()
        row.update(measure(inference_model, model, size, device, spec['repeat_below_s']))
        row['point_wall_s'] = round(time.time() - start, 1)
        if auto and row['status'] == 'ok':  # the plan of the measured (first) call
            plans = {p.name: round(p.estimate_mb) for p in model.last_memory_plans}
            row.update(plan=model.last_memory_plan.name,
                       estimate_mb=round(model.last_memory_plan.estimate_mb), estimates=plans,
                       within_budget=row['peak_growth_mb'] <= budget_mb)
        send(ROW, row)
        if row['status'] != 'ok' and not auto:
            stop = f"not run: {row['status']} at {size}"


# ---------------------------------------------------------------------------- the parent
def run_series(args, backbone: str, path: str, deadline: float, on_row, meta: dict) -> None:
    """Start the child of one series, read its protocol lines (``on_row`` for each row) and
    turn a crash or a kill into rows for the point in progress and the sizes after it."""
    spec = dict(backbone=backbone, path=path, sizes=sorted(args.sizes), device=args.device,
                deadline=deadline, warmup=args.warmup, repeat_below_s=args.repeat_below_s,
                budgets=args.budgets)
    keys = (args.budgets if path == 'auto'  # the points of the series, as (size, max_memory)
            else [(size, None) for size in sorted(args.sizes)])
    env = dict(os.environ)
    if args.device == 'cpu':  # RSS that follows the live tensors (whole_image_inference.py)
        env['MALLOC_MMAP_THRESHOLD_'] = '65536'
    log_path = f'{args.out}_{backbone}_{path}.log' if args.out else os.devnull
    done, current = set(), None
    with open(log_path, 'w') as log:
        proc = subprocess.Popen([sys.executable, osp.abspath(__file__), '--child',
                                 json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                                stderr=log, text=True)
        killed = threading.Event()

        def kill():
            killed.set()
            proc.kill()

        timer = threading.Timer(max(0.0, deadline + args.grace_s - time.time()), kill)
        timer.daemon = True
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith(INFO):
                    info = json.loads(line[len(INFO):])
                    meta.setdefault('device_info', info)
                elif line.startswith(START):
                    current = json.loads(line[len(START):])
                elif line.startswith(ROW):
                    row = json.loads(line[len(ROW):])
                    done.add((row['size'], row.get('max_memory')))
                    current = None
                    on_row(row)
            proc.wait()
        finally:
            timer.cancel()
    if len(done) == len(keys):
        return
    # the child died or was killed: the point in progress, then every size left
    if killed.is_set():
        status, why = 'killed', (f'killed: past the budget + grace ({args.budget_s:g} + '
                                 f'{args.grace_s:g} s)')
    else:
        status, why = 'error', f'child exit {proc.returncode}: ' + log_tail(log_path)
    stop = None
    for size, budget_mb in keys:
        if (size, budget_mb) in done:
            continue
        row = dict(task=TASK, backbone=backbone, path=path, size=size, device=args.device)
        if budget_mb is not None:
            row['max_memory'] = budget_mb
        if stop is None and (current is None or (current['size'], current.get('max_memory'))
                             == (size, budget_mb)):
            row.update(status=status, note=why)
            stop = f'not run: {status} at {size}'
        else:
            row.update(status='skipped', note=stop or why)
        on_row(row)


def series(args) -> list:
    """(backbone, path) of each child in the order run: XCiT's pair, its budget points (path
    ``auto``, with ``--budgets``), then the other backbones' pairs."""
    order = [(b, p) for b in args.backbones for p in args.paths]
    if args.budgets and 'xcit' in args.backbones:
        order.insert(len(args.paths), ('xcit', 'auto'))
    return order


def log_tail(path: str, lines: int = 3) -> str:
    """The last lines of a child's log, on one line."""
    try:
        with open(path) as f:
            return ' | '.join(line.strip() for line in f.read().strip().splitlines()[-lines:])
    except OSError:
        return '(no log)'


def run(args) -> list:
    """Every series, one child each, within the budget; the artifact after every row."""
    start = time.time()
    deadline = start + args.budget_s
    rows = []
    meta = dict(command='python ' + ' '.join(sys.argv), task=TASK,
                door='mmseg.apis.inference_model',
                configs={b: SERIES_CONFIGS[b] for b in args.backbones},
                model_types={p: MODEL_TYPES[(TASK, p)] for p in args.paths},
                budgets=args.budgets,
                sizes=sorted(args.sizes), warmup=args.warmup, budget_s=args.budget_s,
                repeat_below_s=args.repeat_below_s, weights='random (Pretrained init dropped)',
                image='xcit_benchmark.fresh_points.test_image (RandomState(0) uint8)',
                digest='sha1 of pred_sem_seg labels (int64, CPU), first 16 hex digits',
                memory=('CUDA: max_memory_allocated - memory_allocated before the call, after '
                        'empty_cache + reset_peak_memory_stats; CPU: VmHWM - RSS before'),
                mmengine=package_version('mmengine'),
                mmcv=package_version('mmcv-lite') if package_version('mmcv') == 'not installed'
                else package_version('mmcv'),
                mmseg=package_version('mmsegmentation'), complete=False)

    def on_row(row):
        rows.append(row)
        print(progress(row), flush=True)
        if args.out:
            write_artifact(args.out, meta, rows, COLUMNS)

    for backbone, path in series(args):
        if time.time() > deadline:
            keys = args.budgets if path == 'auto' else [(size, None) for size in args.sizes]
            for size, budget_mb in keys:
                on_row(dict(task=TASK, backbone=backbone, path=path, size=size,
                            device=args.device, status='skipped',
                            note='not run: the budget was spent',
                            **({} if budget_mb is None else dict(max_memory=budget_mb))))
            continue
        run_series(args, backbone, path, deadline, on_row, meta)
    meta['complete'] = True
    meta['wall_s'] = round(time.time() - start, 1)
    meta['stock_equals_lean'] = digest_agreement(rows)
    if args.out:
        write_artifact(args.out, meta, rows, COLUMNS)
    return rows


def progress(row: dict) -> str:
    """One line per point."""
    what = (f"{SERIES_LABELS[row['backbone']]:<11} {row['path']:<5} {row['size']:>5}px "
            f"{row['status']:<7}")
    if 'max_memory' in row:
        what += f" max_memory={row['max_memory']}"
        if row['status'] == 'ok':
            what += f" plan={row['plan']} estimate={row['estimate_mb']} MB"
    if row['status'] == 'ok':
        reserved = row.get('max_reserved_mb')
        return (what + f" +{row['peak_growth_mb']} MB"
                + ('' if reserved is None else f" (reserved {reserved} MB)")
                + f" {row['time_s']:.3f} s {row['digest']}")
    return what + ' ' + str(row.get('note', ''))


def markdown(artifact: dict) -> str:
    """The artifact's tables: peak growth (reserved) and time per size and series; the budget
    points with their plan, estimate and peak; which stock and lean labels are equal."""
    rows, meta = artifact['rows'], artifact['meta']

    def cell(row):
        if row is None:
            return ''
        if row['status'] != 'ok':
            return row['status']
        return (f"+{row['peak_growth_mb']} MB ({row['max_reserved_mb']}), "
                f"{row['time_s']:.2f} s")

    grid = [r for r in rows if r['path'] != 'auto']
    series = [(b, p) for b in BACKBONES for p in PATHS
              if any((r['backbone'], r['path']) == (b, p) for r in grid)]
    lines = ['| image | ' + ' | '.join(f'{SERIES_LABELS[b]} {p}' for b, p in series) + ' |',
             '|---|' + '---:|' * len(series)]
    for size in sorted({r['size'] for r in grid}):
        at = {(r['backbone'], r['path']): r for r in grid if r['size'] == size}
        lines.append(f'| {size}² | ' + ' | '.join(cell(at.get(s)) for s in series) + ' |')
    same = meta.get('stock_equals_lean', {})
    lines += ['', 'Stock and lean labels equal (digest) at ' + (
        f'all {len(same)} points where both ran' if same and all(same.values()) else
        'only ' + ', '.join(k for k, v in same.items() if v)) + '.', '']
    budget = [r for r in rows if r['path'] == 'auto']
    if budget:
        lines += ['| image | `max_memory` | plan | estimate | peak growth | reserved | time |',
                  '|---|---:|---|---:|---:|---:|---:|']
        for r in budget:
            lines.append(f"| {r['size']}² | {r['max_memory']} | {r.get('plan', r['status'])} | "
                         f"{r.get('estimate_mb', '')} | {r.get('peak_growth_mb', '')} | "
                         f"{r.get('max_reserved_mb', '')} | {r.get('time_s', '')} |")
        lines.append('')
    info = meta['device_info']
    lines.append(f"{info['device_name']}, torch {info['torch']}, CUDA {info['cuda']}, cuDNN "
                 f"{info['cudnn']}; cells: peak growth of allocated memory (max reserved, "
                 'weights included), time of the call.')
    return '\n'.join(lines) + '\n'


def plot(artifact: dict, png: str) -> None:
    """Peak growth of allocated memory against the image size (log-log): a colour per series,
    solid lean over dashed stock; the budget points as their budget (bar) and peak (dot)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    rows, info = artifact['rows'], artifact['meta']['device_info']
    colours = dict(xcit='tab:blue', swin='tab:orange', vit='tab:green', uper='tab:purple')
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for backbone, colour in colours.items():
        for path, style in (('lean', dict(linestyle='-', linewidth=2.4, alpha=0.6)),
                            ('stock', dict(linestyle='--', linewidth=1.3))):
            ok = sorted((r for r in rows if (r['backbone'], r['path'], r['status'])
                         == (backbone, path, 'ok')), key=lambda r: r['size'])
            if ok:
                ax.plot([r['size'] for r in ok], [r['peak_growth_mb'] / 1024 for r in ok],
                        marker='o', markersize=4, color=colour,
                        label=f'{SERIES_LABELS[backbone]} {path}', **style)
    for r in rows:
        if r['path'] == 'auto' and r['status'] == 'ok':
            x = r['size'] * (1.06 if r['plan'] == 'slide' else 0.94)
            ax.plot([x], [r['max_memory'] / 1024], marker='_', markersize=14, color='black')
            ax.plot([x], [r['peak_growth_mb'] / 1024], marker='v', color='black',
                    linestyle='none')
    ax.plot([], [], marker='v', color='black', linestyle='none',
            label="mode='auto': peak (v) under max_memory (-)")
    sizes = sorted({r['size'] for r in rows})
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xticks(sizes, [f'{s}²' for s in sizes])
    ax.set_xlabel('image size (px)')
    ax.set_ylabel('peak allocated growth (GiB)')
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2, frameon=False)
    ax.set_title(f"Whole-image segmentation through inference_model, {info['device_name']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--child', help=argparse.SUPPRESS)
    parser.add_argument('--report', metavar='JSON',
                        help='print the Markdown tables of an artifact and draw its plot '
                             '(the .json path with .png)')
    parser.add_argument('--out', default=osp.join(os.environ.get('OUT', '.'), 'whole_image_cuda'),
                        help='artifact path without extension (.json, .csv); default '
                             '$OUT/whole_image_cuda')
    parser.add_argument('--device', default='cuda', help="'cuda' (default), 'cuda:N' or 'cpu'")
    parser.add_argument('--sizes', type=int, nargs='+', default=list(SIZES))
    parser.add_argument('--backbones', nargs='+', choices=BACKBONES, default=list(BACKBONES))
    parser.add_argument('--paths', nargs='+', choices=PATHS, default=list(PATHS))
    parser.add_argument('--budgets', nargs='*', default=[f'{s}:{m}' for s, m in BUDGETS],
                        help="SIZE:MB points of the lean XCiT Semantic FPN in mode='auto' "
                             '(none: no such points)')
    parser.add_argument('--budget-s', type=float, default=300.0,
                        help='no point starts after this many seconds from the start')
    parser.add_argument('--grace-s', type=float, default=120.0,
                        help='a child still running this long after the budget is killed')
    parser.add_argument('--warmup', type=int, default=256, help='warm-up image size (px)')
    parser.add_argument('--repeat-below-s', type=float, default=5.0,
                        help='a call shorter than this is timed twice (median)')
    args = parser.parse_args(argv)
    if args.out and args.out.endswith('.json'):
        args.out = args.out[:-len('.json')]
    args.sizes = sorted(set(args.sizes))
    try:
        args.budgets = [[int(v) for v in b.split(':')] for b in args.budgets]
    except ValueError:
        args.budgets = None
    if args.budgets is None or any(len(b) != 2 for b in args.budgets):
        parser.error('--budgets takes SIZE:MB points of whole numbers, e.g. 8192:16000')
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            artifact = json.load(f)
        plot(artifact, args.report[:-len('.json')] + '.png')
        print(markdown(artifact), end='')
        return
    if args.child:
        child(json.loads(args.child))
        return
    if args.out and osp.dirname(args.out):
        os.makedirs(osp.dirname(args.out), exist_ok=True)
    rows = run(args)
    ok = sum(r['status'] == 'ok' for r in rows)
    print(f'{ok} of {len(rows)} points ok' + (f'; artifact {args.out}.json' if args.out else ''))


if __name__ == '__main__':
    main()
