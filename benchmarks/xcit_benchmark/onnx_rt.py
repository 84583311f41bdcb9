"""``--onnx CONFIG``: a whole exported model timed in ONNX Runtime against PyTorch eager.

The config's model (random init) is exported by :mod:`xcit_mm.deployment` (static axes at each
resolution; a segmentor: image -> logits, a detector: backbone + neck), checked against PyTorch
(``verify_onnx``, in the record's ``note``), then both are timed in the same interleaved rounds,
ONNX Runtime with ``intra_op_num_threads`` = torch's thread count.
"""
import os
import os.path as osp
import tempfile
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .runner import RunOptions, log_stderr, run_meta
from .timing import measure_matmul_gflops, set_threads, time_figures, time_with_matmul


def onnx_model_names(config: str) -> Tuple[str, str]:
    """(PyTorch, ONNX Runtime) record names for a config: ``<stem>`` and ``<stem>+onnxruntime``."""
    stem = osp.splitext(osp.basename(config))[0]
    return stem, stem + '+onnxruntime'


def run_onnx_points(config: str, resolutions: Sequence[int], opts: RunOptions,
                    checkpoint: Optional[str] = None,
                    log: Callable[[str], None] = log_stderr) -> Tuple[List[dict], dict]:
    """Time ONNX Runtime vs PyTorch eager for ``config`` at each square resolution."""
    import onnxruntime

    from xcit_mm.deployment import (build_export_model, export_onnx, onnx_session, run_onnx,
                                    verify_onnx)
    if opts.device != 'cpu' or opts.mode != 'inference' or opts.precision != 'fp32':
        raise ValueError('--onnx times CPU fp32 inference only')
    set_threads(opts.threads)
    threads = opts.threads or torch.get_num_threads()
    torch.manual_seed(0)
    model = build_export_model(config, checkpoint)
    eager_name, ort_name = onnx_model_names(config)
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

            def eager_step():
                with torch.no_grad():
                    model(image)

            steps = {eager_name: eager_step, ort_name: lambda: run_onnx(session, image)}
            times, mm = time_with_matmul(steps, opts.warmup, opts.repeats, 'cpu')
            for name, ts in times.items():
                runtime = (f'ONNX Runtime {onnxruntime.__version__} CPU, static '
                           f'{opts.batch}x3x{res}x{res}' if name == ort_name else
                           'PyTorch eager (no_grad)')
                records.append(dict(
                    model=name, description=f'{config}: {model.task} '
                    f'{"image -> logits" if model.task == "seg" else "backbone + neck"}, '
                    f'random init; {runtime}', resolution=res, batch=opts.batch,
                    mode='inference', precision='fp32', device='cpu', threads=threads,
                    with_cp=False, status='ok' if check['ok'] else 'mismatch',
                    warmup=opts.warmup, repeats=opts.repeats, note=note, compiled=False,
                    matmul_gflop_s=mm, **time_figures(ts, opts.batch)))
    return records, run_meta(opts, matmul_before, measure_matmul_gflops('cpu'),
                             onnx_config=config, onnxruntime=onnxruntime.__version__,
                             onnx_export_s=exports)
