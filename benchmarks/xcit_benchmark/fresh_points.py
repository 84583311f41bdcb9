"""What every fresh-process measurement shares: the child process under an RSS and time limit,
the peak of one call (xcit_mm's ``measure_peak_growth_mb``, what ``mode='auto'`` calibrates with:
a benchmark and a memory budget mean the same megabytes), the test image, the artifact files."""
import csv
import gc
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from training_extras.cpu_info import read_cpuinfo
from xcit_mm.models.utils.memory_budget import (measure_peak_growth_mb, peak_rss_mb,
                                                reset_peak_rss, rss_mb)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_PARENT = os.path.join(REPO, 'benchmarks')  # xcit_benchmark and the scripts

MIB = 2**20
# glibc: every block of 64 KiB or more (every tensor that matters) gets its own mapping,
# unmapped when freed, so that the RSS follows the live tensors (default malloc keeps freed
# blocks: the peaks vary run to run and overstate the need)
LIVE_MALLOC = dict(MALLOC_MMAP_THRESHOLD_='65536')
ROW = '@@ROW '  # a child's result lines on stdout, JSON (every other line is ignored)


def mallopt_mmap_threshold(nbytes: int) -> bool:
    """glibc ``mallopt(M_MMAP_THRESHOLD, nbytes)`` in this process from now on: what
    ``MALLOC_MMAP_THRESHOLD_`` does for a new one."""
    try:
        import ctypes
        return bool(ctypes.CDLL('libc.so.6').mallopt(-3, int(nbytes)))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def test_image(size: int):
    """The measured image: random uint8, the same for every point."""
    import numpy as np
    return np.random.RandomState(0).randint(0, 255, (size, size, 3), np.uint8)


def measure(call, device='cpu'):
    """(result, peak growth MB, memory in use before the call MB, seconds) of ``call()``."""
    import torch
    cuda, held = str(device).startswith('cuda'), {}

    def timed():
        held['base'] = torch.cuda.memory_allocated(device) / MIB if cuda else rss_mb()
        start, held['result'] = time.perf_counter(), call()
        if cuda:
            torch.cuda.synchronize(device)
        held['seconds'] = time.perf_counter() - start

    gc.collect()
    if cuda:  # what the caching allocator holds unused is not the call's
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    growth = measure_peak_growth_mb(timed, device)
    return held['result'], growth, held['base'], held['seconds']


def hooked(fn, before=None, after=None):
    """``fn`` calling ``before()`` ahead of it and ``after()`` when it returns."""
    def call(*args, **kwargs):
        if before:
            before()
        out = fn(*args, **kwargs)
        if after:
            after()
        return out
    return call


class PartMeter:
    """Time and peak RSS growth (MB over ``base``, the RSS at :meth:`start`) of a call's parts:
    each boundary folds the kernel's peak since the last one into each open part, then resets it."""

    def __init__(self):
        self.parts = []  # the parts of :meth:`wrap`, as they end
        self.start()

    def start(self):
        reset_peak_rss()
        self.base, self.peak, self.t0 = rss_mb(), 0.0, time.perf_counter()
        self.open, self.marks = [], []

    def fold(self) -> float:
        """The peak since the last boundary, folded into the call's and each open part's."""
        peak = peak_rss_mb() - self.base
        self.peak, self.open = max(self.peak, peak), [max(p, peak) for p in self.open]
        reset_peak_rss()
        return peak

    def mark(self, name: str):
        """The end of part ``name``, which began at the previous mark (or the start)."""
        self.marks.append((name, time.perf_counter(), self.fold()))

    def sequence(self, names) -> dict:
        """{part: (seconds, peak MB)} of the marks since the start; a part without one: 0."""
        out, prev = {n: [0., 0] for n in names}, self.t0
        for name, t, peak in self.marks:
            out[name][0] += t - prev
            out[name][1] = max(out[name][1], peak)
            prev = t
        return {k: tuple(v) for k, v in out.items()}

    def wrap(self, inner, label: str):
        """``inner`` measured as part ``label``, which may hold (and see the peaks of) others."""
        def wrapped(*args, **kwargs):
            self.fold()
            start = rss_mb() - self.base
            self.open.append(start)
            out = inner(*args, **kwargs)
            self.fold()
            self.parts.append(dict(part=label, start_mb=round(start),
                                   peak_mb=round(self.open.pop())))
            return out
        return wrapped


def run_process(cmd, limit_bytes: float, seconds: float, env=None, on_row=None):
    """Run ``cmd``, killed above ``limit_bytes`` of RSS (before the kernel's OOM killer) or after
    ``seconds``; ``on_row`` gets each :data:`ROW` row as it comes. Returns returncode, rows,
    stderr, killed ('rss', 'timeout' or None), rss (the highest seen), note (why it was killed or
    failed: the exit status and stderr's last lines; None where it exited 0)."""
    with tempfile.TemporaryFile('w+') as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        rows = []

        def read():
            for line in proc.stdout:
                if line.startswith(ROW):
                    rows.append(json.loads(line[len(ROW):]))
                    if on_row:
                        on_row(rows[-1])

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        start, rss, killed = time.time(), 0, None
        while proc.poll() is None:
            try:  # its resident pages (none to read once it is gone)
                with open(f'/proc/{proc.pid}/statm') as f:
                    rss = max(rss, int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE'))
            except (OSError, IndexError, ValueError):
                pass
            killed = 'rss' if rss > limit_bytes else (
                'timeout' if time.time() - start > seconds else None)
            if killed:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.05)
        reader.join()
        err.seek(0)
        stderr, code = err.read(), proc.returncode
    oom_killer = ' (the kernel\'s OOM killer?)' if code == -9 else ''
    note = (f'killed ({killed}) at RSS {rss / 2**30:.1f} GiB after {time.time() - start:.0f} s '
            f'(limit {limit_bytes / 2**30:.1f} GiB, {seconds:.0f} s)' if killed else
            f'exit {code}{oom_killer}: ' + ' | '.join(stderr.strip().splitlines()[-3:]) if code
            else None)
    return dict(returncode=code, rows=rows, stderr=stderr, killed=killed, rss=rss, note=note)


def run_fresh(target: str, payload, limit_bytes: float, seconds: float, live: bool = True,
              threads=None, on_row=None) -> dict:
    """``target(payload)`` ('module:function', benchmarks/ importable) in a fresh Python process,
    under :data:`LIVE_MALLOC` if ``live`` (else glibc's defaults): :func:`run_process`'s answer."""
    env = {k: v for k, v in os.environ.items() if k != 'MALLOC_MMAP_THRESHOLD_'}
    env['PYTHONPATH'] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get('PYTHONPATH')) if p)
    if threads:
        env['OMP_NUM_THREADS'] = env['MKL_NUM_THREADS'] = str(threads)
    if live:
        env.update(LIVE_MALLOC)
    code = 'import sys; from xcit_benchmark.fresh_points import child_main; sys.exit(child_main())'
    return run_process([sys.executable, '-c', code, target, json.dumps(payload)], limit_bytes,
                       seconds, env=env, on_row=on_row)


def child_main(argv=None) -> int:
    """The fresh process of :func:`run_fresh`: the target's row (a dict) or rows (an iterable),
    each printed as it comes; an exception is a last row, status 'error' (exit status 1)."""
    target, payload = sys.argv[1:] if argv is None else argv
    module, _, name = target.partition(':')
    try:
        rows = getattr(importlib.import_module(module), name)(json.loads(payload))
        for row in [rows] if isinstance(rows, dict) else rows:
            print(ROW + json.dumps(row), flush=True)
    except Exception as e:  # reported to the parent
        traceback.print_exc()
        print(ROW + json.dumps(dict(status='error', note=f'{type(e).__name__}: {e}'[:300])),
              flush=True)
        return 1
    return 0


def random_segmentor(config: str, device: str = 'cpu'):
    """``mmseg.apis.init_model`` of ``config``, random weights (seed 0, no Pretrained init)."""
    import torch
    from mmengine.config import Config
    from mmseg.apis import init_model
    cfg = Config.fromfile(config)
    cfg.model.backbone.init_cfg = None
    torch.manual_seed(0)
    return init_model(cfg, device=device)


def random_detector(config: str, device: str = 'cpu'):
    """``mmdet.apis.init_detector`` of ``config``, random weights (seed 0, no Pretrained init)."""
    import torch
    from mmdet.apis import init_detector
    from mmengine.config import Config
    cfg = Config.fromfile(config)
    cfg.model.backbone.init_cfg = None
    torch.manual_seed(0)
    return init_detector(cfg, device=device)


def revision() -> str:
    """The checkout's commit, ``+dirty`` if xcit_mm/ differs from it; without git, $REVISION."""
    try:
        commit, dirty = [subprocess.run(['git', '-C', REPO, *cmd], capture_output=True, text=True,
                                        check=True).stdout.strip()
                         for cmd in (['rev-parse', '--short', 'HEAD'],
                                     ['status', '--porcelain', '--', 'xcit_mm'])]
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get('REVISION')
    return commit + ('+dirty' if dirty else '')


def kept_rows(artifact: dict, again) -> tuple:
    """``--update``: the rows of ``artifact`` not measured ``again`` (each with the revision that
    measured it), and the commands and notes of the runs that did."""
    meta = artifact.get('meta', {})
    kept = [r for r in artifact['rows'] if not again(r)]
    for row in kept if meta.get('revision') else []:
        row.setdefault('revision', meta['revision'])
    commands = meta.get('earlier_commands', [])
    notes = meta.get('earlier_notes', [None] * len(commands))  # one per command
    return kept, dict(earlier_commands=commands + [meta.get('command', '?')],
                      earlier_notes=notes + [meta.get('note')])


def cpu_model() -> str:
    return read_cpuinfo()[0] or platform.processor()


def run_metadata() -> dict:
    """Machine, software and load of a run, stored with its results."""
    import torch
    meta = dict(date=time.strftime('%Y-%m-%d %H:%M:%S'), host=platform.node(), cpu=cpu_model(),
                cpu_count=os.cpu_count(), torch=torch.__version__, python=platform.python_version(),
                torch_threads=torch.get_num_threads(), loadavg_1_5_15=os.getloadavg(),
                command=' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
    if torch.cuda.is_available():
        meta['gpu'] = torch.cuda.get_device_name()
    return meta


def package_version(name: str) -> str:
    """The installed version of ``name``, without importing it."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return 'not installed'


def write_artifact(out: str, meta: dict, rows: list, columns=None, key='rows',
                   csv_rows=None) -> list:
    """``out.json`` (``{"meta", key: rows}``) and ``out.csv`` (``columns``, default every key,
    of ``csv_rows``, default ``rows``); returns their paths. A run writes them again after each
    row: a later one may not come."""
    os.makedirs(os.path.dirname(out) or '.', exist_ok=True)
    with open(out + '.json', 'w') as f:
        json.dump({'meta': meta, key: list(rows)}, f, indent=1, default=str)
    csv_rows = rows if csv_rows is None else csv_rows
    with open(out + '.csv', 'w', newline='') as f:
        writer = csv.DictWriter(f, extrasaction='ignore', fieldnames=columns or list(
            dict.fromkeys(k for r in csv_rows for k in r)))
        writer.writeheader()
        writer.writerows(csv_rows)
    return [out + '.csv', out + '.json']


def add_artifact_arguments(parser) -> None:
    """``--threads``, ``--note``, ``--out`` and ``--update``, as a one-artifact benchmark takes
    them (:func:`write_updated`)."""
    parser.add_argument('--threads', type=int, default=None, help="torch's threads")
    parser.add_argument('--note', default='', help='what else ran on the machine')
    parser.add_argument('--out', required=True, help='FILE (FILE.json and FILE.csv)')
    parser.add_argument('--update', action='store_true',
                        help="keep the artifact's rows of the points this run does not measure")


def write_updated(out: str, meta: dict, rows: list, point, update: bool) -> list:
    """:func:`write_artifact`; with ``update``, the rows already at ``out`` whose ``point(row)``
    no new row has stay, and the meta keeps the earlier commands and notes."""
    if update and os.path.exists(out + '.json'):
        with open(out + '.json') as f:
            earlier = json.load(f)
        again = {point(row) for row in rows}
        kept, earlier_runs = kept_rows(earlier, lambda row: point(row) in again)
        rows, meta = kept + rows, dict(meta, **earlier_runs)
    return write_artifact(out, meta, rows)
