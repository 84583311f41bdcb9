"""Run a test's memory measurement in a fresh Python process and read back its JSON report."""
import json
import os
import os.path as osp
import subprocess
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def run_fresh(code: str, timeout: float = 600) -> dict:
    """The last stdout line of ``python -c code`` (run from the repository root, this checkout
    first on the path), parsed as JSON. ``MALLOC_MMAP_THRESHOLD_=65536``: malloc returns freed
    memory at once, so the resident set follows the live tensors."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536',
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
