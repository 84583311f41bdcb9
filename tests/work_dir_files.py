"""Files the tests read back: what mmengine writes into a tool's work dir (the metrics of a test
run, the run's log) and the digests of a generated tree."""
import glob
import hashlib
import json
import os.path as osp


def evaluation_metrics(work_dir) -> dict:
    """The metrics dict tools/test.py wrote (mmengine dumps it to <work_dir>/<time>/<time>.json),
    without the timings."""
    files = glob.glob(osp.join(str(work_dir), '*', '*.json'))
    assert len(files) == 1, files
    with open(files[0]) as f:
        return {k: v for k, v in json.load(f).items() if k not in ('data_time', 'time')}


def newest_run_log(work_dir) -> str:
    """The text of the newest run's log in ``work_dir`` (mmengine writes <time>/<time>.log)."""
    with open(sorted(glob.glob(osp.join(str(work_dir), '*', '*.log')))[-1]) as f:
        return f.read()


def file_digests(root) -> dict:
    """{relative path: sha1} of every file below root."""
    out = {}
    for path in sorted(glob.glob(osp.join(str(root), '**', '*'), recursive=True)):
        if osp.isfile(path):
            with open(path, 'rb') as f:
                out[osp.relpath(path, str(root))] = hashlib.sha1(f.read()).hexdigest()
    return out


def load_as_plain_torch(path) -> dict:
    """``torch.load(path)`` with torch's own ``weights_only`` allow-list, as a process that never
    imported xcit_mm reads the file (``import xcit_mm`` adds mmengine's training state to the
    allow-list of the process)."""
    import torch
    added = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    finally:
        torch.serialization.add_safe_globals(added)
