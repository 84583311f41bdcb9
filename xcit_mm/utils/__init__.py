"""Helpers for the command-line tools (tools/train.py, tools/test.py).

Not imported by ``xcit_mm/__init__.py``: the backbone must stay importable without them, and the
tools import what they need explicitly (``from xcit_mm.utils import ...``).

- :mod:`.data_check`: fail early, with download instructions, when a config's dataset is missing;
  generate the built-in shapes dataset when a config asks for it.
- :mod:`.cpu_dist`: make ``tools/dist_train.sh CONFIG N`` work on machines without a GPU (gloo).
"""
from .cpu_dist import (CPUDistributedDataParallel, init_cpu_dist, init_distributed,
                       prepare_cpu_distributed_cfg)
from .data_check import (DatasetNotFoundError, check_data, ensure_shapes_world,
                         find_missing_data)

__all__ = [
    'CPUDistributedDataParallel', 'init_cpu_dist', 'init_distributed',
    'prepare_cpu_distributed_cfg', 'DatasetNotFoundError', 'check_data', 'ensure_shapes_world',
    'find_missing_data'
]
