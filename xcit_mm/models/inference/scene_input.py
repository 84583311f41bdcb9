"""How a scene's pixels enter the stream, for every model that streams one: rows as mmcv reads
them, preprocessed as the model's data preprocessor would preprocess the whole image; which pixels
hold data; and how the stream reports its progress."""
import inspect
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor


def preprocessed_rows(preprocessor, read_rows: Callable[[int, int], 'np.ndarray'],
                      device: torch.device, start: int, stop: int) -> Tensor:
    """Rows ``start..stop-1`` of ``read_rows`` ((b - a, W, C) as mmcv reads them, BGR) as the
    network input (1, C, b - a, W): channels swapped and normalised as ``preprocessor`` (mmseg's
    ``SegDataPreProcessor`` or mmdet's ``DetDataPreprocessor``) does it."""
    rows = torch.from_numpy(np.ascontiguousarray(read_rows(start, stop))).to(device)
    rows = rows.permute(2, 0, 1)[None]
    # mmseg names the flag channel_conversion, mmengine's (and so mmdet's) _channel_conversion
    if getattr(preprocessor, 'channel_conversion',
               getattr(preprocessor, '_channel_conversion', False)):
        rows = rows[:, [2, 1, 0]]
    rows = rows.float()
    if getattr(preprocessor, '_enable_normalize', False):
        return (rows - preprocessor.mean) / preprocessor.std
    return rows


def stage_reporter(progress: Optional[Callable]) -> Callable[[int, int, str], None]:
    """How the stream calls ``progress``: ``progress(done, total, stage=stage)`` if it has a
    ``stage`` parameter (or ``**kwargs``), else ``progress(done, total)``. Two stages, each
    counting its work from 0 to its total: ``'trunk'``, token rows x layers (every layer passes
    over every token row, so the trunk's time goes by them and their rate gives its time left),
    then ``'labels'``, the label rows made. A callable without ``stage`` sees the total change
    once, when the labels start."""
    if progress is None:
        return lambda done, total, stage: None
    try:
        params = inspect.signature(progress).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        params = ()
    if any(p.name == 'stage' or p.kind == p.VAR_KEYWORD for p in params):
        return lambda done, total, stage: progress(done, total, stage=stage)
    return lambda done, total, stage: progress(done, total)


def valid_pixels(valid_rows: Callable[[int, int], 'np.ndarray'], width: int,
                 device: torch.device, start: int, stop: int) -> Tensor:
    """``valid_rows(start, stop)`` checked, as a bool tensor on ``device``."""
    mask = np.asarray(valid_rows(start, stop))
    if mask.shape != (stop - start, width) or mask.dtype != np.bool_:
        raise ValueError(f'valid_rows({start}, {stop}) must give a bool array of shape '
                         f'({stop - start}, {width}), got {mask.dtype} {mask.shape}')
    return torch.from_numpy(np.ascontiguousarray(mask)).to(device)
