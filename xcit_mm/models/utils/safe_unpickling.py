"""What ``torch.load(weights_only=True)`` may rebuild beyond tensors once ``xcit_mm`` is imported:
mmengine's message hub (``HistoryBuffer``, plain numpy data) and ``argparse.Namespace`` (official
XCiT files), each through a stand-in that checks what the file gives and runs no code it names."""
import argparse
import pickle

import numpy as np
from mmengine.logging.history_buffer import HistoryBuffer

_PLAIN_KINDS = 'biufcUS'  # bool, int, uint, float, complex, str, bytes
_STATISTICS = ('min', 'max', 'current', 'mean')


def _refuse(what: str) -> pickle.UnpicklingError:
    """The error of every stand-in; :mod:`checkpoint_io` names ``what`` in its message."""
    return pickle.UnpicklingError(
        f'checkpoint asks for {what}, which is not part of an mmengine checkpoint: refused')


def _build_only(cls) -> tuple:
    """An allow-list entry no file can name (``GLOBAL`` names are one line; this one holds a
    newline), for a type that may only receive ``BUILD`` state."""
    return (cls, f'{cls.__module__}.{cls.__qualname__}\n(state only)')


def _plain_dtype(spec, align=False, copy=False, *rest):
    """``numpy.dtype`` for plain kinds only: no object, structured or sub-array dtypes."""
    try:
        dtype = np.dtype(spec, align, copy, *rest)
    except Exception:  # TypeError for anything that is not a dtype spec
        raise _refuse(f'numpy.dtype({spec!r})') from None
    if dtype.kind not in _PLAIN_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise _refuse(f'a numpy array of dtype {dtype!r} (object and structured arrays are not '
                      f'plain data)')
    return dtype


class _NdarrayName:
    """What a file gets for ``numpy.ndarray``: only a token for :func:`_plain_reconstruct`."""

    def __new__(cls, *args, **kwargs):
        raise _refuse('numpy.ndarray(...) (arrays are rebuilt by numpy._reconstruct only)')


_RECONSTRUCT = np.zeros(1).__reduce__()[0]  # numpy's own entry points, from its pickle protocol
_SCALAR = np.float64(1).__reduce__()[0]


def _plain_reconstruct(subtype, shape, dtype_code):
    """numpy's ``_reconstruct`` for a plain ``ndarray``; numpy then fills it from the file."""
    if subtype is not _NdarrayName or not isinstance(shape, tuple) \
            or not all(isinstance(n, int) for n in shape):
        raise _refuse(f'numpy._reconstruct({subtype!r}, {shape!r}, ...)')
    _plain_dtype(dtype_code)
    return _RECONSTRUCT(np.ndarray, shape, dtype_code)


def _plain_scalar(dtype, data=None):
    """numpy's ``scalar`` for a dtype the file built through :func:`_plain_dtype`."""
    if not isinstance(dtype, np.dtype) or not isinstance(data, bytes):
        raise _refuse(f'numpy.scalar({dtype!r}, {type(data).__name__})')
    _plain_dtype(dtype)
    return _SCALAR(dtype, data)


class HistoryBufferState(HistoryBuffer):
    """What a file gets for ``HistoryBuffer``: becomes one once its state is checked as data."""

    def __init__(self, *args, **kwargs):  # a REDUCE would run __init__ on what the file gives
        raise _refuse('HistoryBuffer(...) (it is rebuilt from its state only)')

    def __setstate__(self, state):
        data = ('max_length', '_log_history', '_count_history')
        if not isinstance(state, dict) or not set(data) <= set(state) \
                or not set(state) <= set(data) | {'statistics_methods'}:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise _refuse(f'a HistoryBuffer with state {keys}')
        methods = state.get('statistics_methods', {})
        own = {name: getattr(HistoryBuffer, name) for name in _STATISTICS}
        if not isinstance(methods, dict) or any(own.get(k) is not v for k, v in methods.items()):
            raise _refuse('HistoryBuffer statistics other than min, max, current and mean')
        if not isinstance(state['max_length'], int) or not all(
                isinstance(state[k], np.ndarray) for k in ('_log_history', '_count_history')):
            raise _refuse('a HistoryBuffer whose length or histories are not numbers')
        self.__class__ = HistoryBuffer
        self.__dict__.update((k, state[k]) for k in data)
        self._set_default_statistics()  # mmengine's own four, as HistoryBuffer() registers them


def _statistics_getattr(obj, name):
    """``getattr`` for ``HistoryBuffer.min/max/current/mean`` only (mmengine's statistics)."""
    if obj in (HistoryBuffer, HistoryBufferState) and name in _STATISTICS:
        return getattr(HistoryBuffer, name)
    shown = 'HistoryBuffer' if obj is HistoryBufferState else repr(obj)
    raise _refuse(f'getattr({shown}, {name!r})')


def training_state_entries() -> list:
    """The allow-list, as ``torch.serialization.add_safe_globals`` takes it."""
    entries = [(HistoryBufferState, 'mmengine.logging.history_buffer.HistoryBuffer'),
               (_statistics_getattr, 'builtins.getattr'), argparse.Namespace,
               (_plain_dtype, 'numpy.dtype'), (_NdarrayName, 'numpy.ndarray'),
               _build_only(np.ndarray)]
    # the dtype types whose instances numpy fills from the file (BUILD)
    dtypes = {type(np.dtype(code)) for code in '?bhilqBHILQefdgFDGUS'}
    entries += [_build_only(cls) for cls in sorted(dtypes, key=lambda t: t.__qualname__)]
    for module in ('numpy.core.multiarray', 'numpy._core.multiarray'):
        entries += [(_plain_reconstruct, f'{module}._reconstruct'),
                    (_plain_scalar, f'{module}.scalar')]
    return entries
