"""A training run's final metrics and wall time, read from the files mmengine wrote.

Every result quoted in README / docs comes from a committed artifact: after a run,
``tools/analysis_tools/collect_results.py WORK_DIR --out docs/results/NAME.json`` stores what this
module reads from the run's work dir (mmengine's ``<timestamp>/vis_data/scalars.json`` and
``<timestamp>/<timestamp>.log``).
"""
import glob
import json
import os
import os.path as osp
import platform
import re
from datetime import datetime
from typing import Optional

from .cpu_info import read_cpuinfo

_TIME = re.compile(r'^(\d{4}/\d{2}/\d{2} \d{2}:\d{2}:\d{2}) - mmengine')


def _latest_run(work_dir: str) -> str:
    runs = sorted(d for d in glob.glob(osp.join(work_dir, '*')) if osp.isfile(
        osp.join(d, 'vis_data', 'scalars.json')))
    if not runs:
        raise FileNotFoundError(f'no mmengine run in {work_dir} (expected '
                                f'<timestamp>/vis_data/scalars.json): train with tools/train.py '
                                f'--work-dir {work_dir} first')
    return runs[-1]


def _wall_seconds(log_file: str) -> Optional[float]:
    stamps = []
    with open(log_file) as f:
        for line in f:
            found = _TIME.match(line)
            if found:
                stamps.append(datetime.strptime(found.group(1), '%Y/%m/%d %H:%M:%S'))
    return (stamps[-1] - stamps[0]).total_seconds() if len(stamps) > 1 else None


def cpu_description() -> str:
    """'MODEL NAME (ISA extensions that change CPU speed), N cores', from /proc/cpuinfo."""
    name, flags = read_cpuinfo()
    isa = [f for f in ('avx2', 'avx512f', 'avx512_bf16', 'amx_tile') if f in (flags or ())]
    return (f'{name or platform.processor() or platform.machine()} '
            f'({", ".join(isa) or "no AVX2"}), {os.cpu_count()} cores')


def collect_run_results(work_dir: str) -> dict:
    """The last validation metrics, the last training iteration and the wall time of a run.

    Args:
        work_dir (str): The ``--work-dir`` of ``tools/train.py`` (its newest run is read).

    Returns:
        dict: ``run`` (timestamp dir), ``metrics`` (last validation record), ``last_iter`` and
        ``final_loss`` (last training record), ``wall_seconds`` (first to last log line).
    """
    run = _latest_run(work_dir)
    val, train = None, None
    with open(osp.join(run, 'vis_data', 'scalars.json')) as f:
        for line in f:
            record = json.loads(line)
            if 'loss' in record or 'lr' in record:  # a training record
                train = record
            else:  # validation: mmdet's 'coco/bbox_mAP'..., mmseg's 'mIoU'...
                val = record
    if val is None:
        raise ValueError(f'{run}: no validation record in vis_data/scalars.json')
    log_file = osp.join(run, osp.basename(run) + '.log')
    return dict(
        run=osp.basename(run),
        metrics={k: v for k, v in val.items() if k not in ('step', 'data_time', 'time')},
        last_iter=train.get('iter', train.get('step')) if train else None,
        final_loss=train.get('loss') if train else None,
        wall_seconds=_wall_seconds(log_file) if osp.isfile(log_file) else None)
