#!/usr/bin/env python
"""Store a training run's final metrics and wall time as a JSON artifact.

    python tools/train.py configs/shapes/sem_fpn_xcit_shapes_ade.py --work-dir work_dirs/seg
    python tools/analysis_tools/collect_results.py work_dirs/seg \\
        --command "python tools/train.py configs/shapes/sem_fpn_xcit_shapes_ade.py" \\
        --out docs/results/shapes_sem_fpn.json
"""
import argparse
import json
import os
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))
from training_extras.run_results import collect_run_results, cpu_description  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('work_dir', help='the --work-dir of the training run')
    parser.add_argument('--command', required=True, help='the command that made the run')
    parser.add_argument('--out', required=True, help='JSON file to write')
    parser.add_argument('--note', default=None,
                        help='conditions of the run, e.g. other jobs on the machine')
    args = parser.parse_args(argv)
    try:
        results = collect_run_results(args.work_dir)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f'error: {e}\n')
    results.update(command=args.command, machine=cpu_description())
    if args.note:
        results['note'] = args.note
    os.makedirs(osp.dirname(osp.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(results, f, indent=2)
        f.write('\n')
    print(json.dumps(results, indent=2))


if __name__ == '__main__':
    main()
