"""Entry point of a memory worker process: ``python -m xcit_benchmark.worker CFG_JSON``.

Started by :func:`xcit_benchmark.memory.run_memory_worker`; prints
``WORKER_MARK + json(result)`` on stdout (a failure is reported as ``status='error'``).  Kept
apart from :mod:`.memory` so that ``-m`` runs a module nothing else imports.
"""
import json
import sys
import traceback
import warnings


def main(argv=None) -> int:
    """Run :func:`~xcit_benchmark.memory.worker_main` on ``argv[0]`` (JSON)."""
    argv = sys.argv[1:] if argv is None else argv
    # mmcv's ConvModule warns about mmpretrain's LPI conv (bias before a norm): not our concern
    warnings.filterwarnings('ignore', message='Unnecessary conv bias before batch/instance norm')
    from xcit_benchmark.memory import WORKER_MARK, worker_main
    try:
        cfg = json.loads(argv[0])
        if cfg.get('kind') == 'whole_model':  # --whole-model: one config, by part
            from xcit_benchmark.whole_model import worker_main as whole_model_main
            result = whole_model_main(cfg)
        else:
            result = worker_main(cfg)
    except Exception as e:  # reported to the parent, which records status='error'
        traceback.print_exc()
        result = dict(status='error', note=f'{type(e).__name__}: {e}'[:300])
    print(WORKER_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
