"""Time the test suite (``python -m pytest tests -q``) and write the per-file times as JSON.

Developer script (as mmdet's ``.dev_scripts``): runs the suite once, exactly as README and CI run
it, and records the wall time, the CPU time of the run (all processes it waited for), the CPU
model, and per test file the summed duration of its tests (from pytest's JUnit XML; with two
xdist workers the sums add up to about twice the wall time).

    python .dev_scripts/suite_time.py --out docs/results/test_suite_time_warm.json
    python .dev_scripts/suite_time.py --cold --out docs/results/test_suite_time_cold.json

``--cold`` gives inductor an empty cache directory, as on a fresh machine (CI): the compile tests
then compile every kernel. ``--repo`` times another checkout of the project (a ``git worktree``
of an earlier commit, first on ``PYTHONPATH``, so its own packages are the ones imported), to
compare two commits on one machine:

    git worktree add /tmp/base BASE_COMMIT
    python .dev_scripts/suite_time.py --cold --repo /tmp/base --out /tmp/base.json

Exit status: pytest's.
"""
import argparse
import collections
import json
import os
import os.path as osp
import platform
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))


def cpu_model() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or 'unknown'


def cpu_flags() -> list:
    """The vector-instruction flags that change CPU timings here (AVX-512, bfloat16, AMX)."""
    wanted = ('avx2', 'avx512f', 'avx512_bf16', 'amx_tile', 'amx_bf16')
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('flags'):
                    present = set(line.split(':', 1)[1].split())
                    return [flag for flag in wanted if flag in present]
    except OSError:
        pass
    return []


def per_file(junit_path: str):
    """({file: summed seconds}, {file: tests}, [(seconds, test id)], outcome counts)."""
    seconds, counts = collections.Counter(), collections.Counter()
    tests, outcomes = [], collections.Counter()
    for case in ET.parse(junit_path).iter('testcase'):
        module = case.get('classname', '').split('.')
        name = next((m for m in module if m.startswith('test_')), module[-1]) + '.py'
        duration = float(case.get('time', 0))
        seconds[name] += duration
        counts[name] += 1
        tests.append((duration, f'{name}::{case.get("name")}'))
        kind = next((child.tag for child in case if child.tag in ('failure', 'error', 'skipped')),
                    'passed')
        outcomes[kind] += 1
    return seconds, counts, sorted(tests, reverse=True), outcomes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', required=True, help='JSON file to write')
    parser.add_argument('--cold', action='store_true',
                        help='run with an empty inductor cache (a fresh machine)')
    parser.add_argument('--repo', default=REPO,
                        help='the checkout whose suite is timed (default: this one)')
    args = parser.parse_args(argv)
    repo = osp.abspath(args.repo)

    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([repo] + [p for p in [env.get('PYTHONPATH')] if p])
    with tempfile.TemporaryDirectory() as tmp:
        if args.cold:
            env['TORCHINDUCTOR_CACHE_DIR'] = osp.join(tmp, 'inductor')
        junit = osp.join(tmp, 'junit.xml')
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        status = subprocess.call([sys.executable, '-m', 'pytest', 'tests', '-q',
                                  f'--junitxml={junit}'], cwd=repo, env=env)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        seconds, counts, tests, outcomes = per_file(junit)

    import torch
    revision = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=repo,
                              capture_output=True, text=True).stdout.strip()
    result = dict(
        command='python -m pytest tests -q', revision=revision,
        inductor_cache='cold (empty directory)' if args.cold else 'as found (warm after a run)',
        cpu=cpu_model(), cpu_flags=cpu_flags(), cores=os.cpu_count(), torch=torch.__version__,
        exit_status=status, outcomes=dict(outcomes), wall_s=round(wall, 1),
        cpu_s=round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1),
        files=[dict(file=name, tests=counts[name], summed_s=round(s, 1))
               for name, s in seconds.most_common()],
        slowest_tests=[dict(test=t, s=round(s, 1)) for s, t in tests[:15]])
    os.makedirs(osp.dirname(osp.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=2)
        f.write('\n')

    print(f'\n{result["command"]}: {int(wall // 60)} min {wall % 60:04.1f} s wall, '
          f'{result["cpu_s"]:.0f} s CPU, {result["cpu"]} ({", ".join(result["cpu_flags"])}), '
          f'{result["cores"]} cores, inductor cache '
          f'{result["inductor_cache"]}; {dict(outcomes)}')
    width = max(len(row['file']) for row in result['files'])
    print(f'{"file":<{width}}  tests  summed s')
    for row in result['files']:
        print(f'{row["file"]:<{width}}  {row["tests"]:5d}  {row["summed_s"]:8.1f}')
    print(f'wrote {args.out}')
    return status


if __name__ == '__main__':
    sys.exit(main())
