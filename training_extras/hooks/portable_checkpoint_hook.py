"""Checkpoints that open with ``torch.load(weights_only=True)``: in every upstream door.

mmengine 0.10 pickles its ``MessageHub`` log buffers (``HistoryBuffer`` objects holding NumPy
arrays) into every training checkpoint. torch >= 2.6 loads with ``weights_only=True`` by default
and refuses them, so ``mmdet.apis.init_detector``, ``DetInferencer``, ``mmseg.apis.init_model``,
``MMSegInferencer``, mmdet's / mmseg's ``tools/test.py`` and mmengine's own resume all fail on
them. :class:`PortableCheckpointHook` stores those buffers as plain data (tensors, lists, numbers)
when a checkpoint is saved and rebuilds them when one is loaded for ``--resume``: no torch
allow-list entry is needed, and nothing else in the file changes (``meta.dataset_meta`` included,
so class names and palettes travel with the weights).
"""
from collections import OrderedDict

import numpy as np
import torch
from mmengine.hooks import Hook
from mmengine.logging import HistoryBuffer
from mmengine.registry import HOOKS

_BUFFER = '__history_buffer__'
_ARRAY = '__ndarray__'


def to_plain_data(obj):
    """``obj`` with HistoryBuffers, NumPy arrays and NumPy scalars turned into plain data."""
    if isinstance(obj, HistoryBuffer):
        def floats(values):
            return torch.from_numpy(np.asarray(values, np.float64))

        return {_BUFFER: dict(log_history=floats(obj._log_history),
                              count_history=floats(obj._count_history),
                              max_length=int(obj.max_length))}
    if isinstance(obj, np.ndarray):
        return {_ARRAY: torch.from_numpy(np.ascontiguousarray(obj))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        plain = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            plain[key] = to_plain_data(value)
        return plain
    if isinstance(obj, (list, tuple)):
        items = [to_plain_data(v) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def from_plain_data(obj):
    """Inverse of :func:`to_plain_data`."""
    if isinstance(obj, dict):
        if set(obj) == {_BUFFER}:
            state = obj[_BUFFER]
            return HistoryBuffer(state['log_history'].numpy().tolist(),
                                 state['count_history'].numpy().tolist(), state['max_length'])
        if set(obj) == {_ARRAY}:
            return obj[_ARRAY].numpy()
        restored = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            restored[key] = from_plain_data(value)
        return restored
    if isinstance(obj, list):
        return [from_plain_data(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_plain_data(v) for v in obj)
    return obj


@HOOKS.register_module()
class PortableCheckpointHook(Hook):
    """Save mmengine's message hub as plain data; rebuild it when resuming.

    Runs last on saving (after every hook that adds to the checkpoint) and converts only the
    ``message_hub`` entry, which mmengine reads after all ``after_load_checkpoint`` hooks.
    """

    priority = 'LOWEST'

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        if 'message_hub' in checkpoint:
            checkpoint['message_hub'] = to_plain_data(checkpoint['message_hub'])

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        if 'message_hub' in checkpoint:
            checkpoint['message_hub'] = from_plain_data(checkpoint['message_hub'])
