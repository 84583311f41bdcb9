"""Utilities shared by the package and its tools.

- :mod:`.checkpoint_io`: THE checkpoint reader (safe, one error class, one message per failure).
- :mod:`.data_check`: fail early, with download instructions, when a dataset is missing or a COCO
  annotation file is not one.
- :mod:`.dist_utils`: distributed set-up and teardown, including CPU-only (gloo) machines.
"""
from .checkpoint_io import (CheckpointError, check_checkpoint, check_pretrained,
                            extract_state_dict, find_pretrained, load_checkpoint_file,
                            resolve_auto_resume)
from .data_check import (AnnotationFormatError, DatasetNotFoundError, check_annotation_formats,
                         check_data, coco_annotation_problem, find_missing_data)
from .dist_utils import (CPUDistributedDataParallel, distributed_session, init_cpu_dist,
                         init_distributed, prepare_cpu_distributed_cfg)

__all__ = [
    'AnnotationFormatError', 'CPUDistributedDataParallel', 'CheckpointError',
    'DatasetNotFoundError', 'check_annotation_formats', 'check_checkpoint', 'check_data',
    'check_pretrained', 'coco_annotation_problem', 'distributed_session', 'extract_state_dict',
    'find_missing_data', 'find_pretrained', 'init_cpu_dist', 'init_distributed',
    'load_checkpoint_file', 'prepare_cpu_distributed_cfg', 'resolve_auto_resume'
]
