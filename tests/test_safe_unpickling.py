"""What ``import xcit_mm`` lets torch's default ``torch.load`` (``weights_only=True``) rebuild.

Exactly mmengine's pure-data training state: real ``HistoryBuffer`` objects and plain numpy
arrays, scalars and dtypes, under numpy 1's and numpy 2's module names. Everything else that a
pickle can carry is refused, by torch's own ``torch.load`` and by our reader, and runs nothing:
object and structured arrays, arrays built directly, a ``HistoryBuffer`` with state or statistics
mmengine never writes, ``getattr`` of anything but its statistics, and code (``os.mkdir``).
Expected values are the objects before saving.
"""
import copyreg
import io
import os
import pickle

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer, MessageHub

import xcit_mm  # noqa: F401  (what the tests are about: the allow-list it installs)
from xcit_mm.models.utils import CheckpointError, load_checkpoint_file


class ForgedBuffer:
    """Pickles as mmengine pickles a ``HistoryBuffer`` (``copyreg.__newobj__``, then ``state``),
    with any state; :func:`_saved` renames its class to ``HistoryBuffer`` in the stream."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        return (copyreg.__newobj__, (ForgedBuffer, ), self.state)


def _global(module: str, name: str) -> bytes:
    return f'c{module}\n{name}\n'.encode()


def _saved(obj, tmp_path, name='file.pth', numpy2=False) -> str:
    """``obj`` saved by ``torch.save`` in torch's legacy format (a plain pickle stream, whose
    GLOBAL opcodes can be renamed in place), optionally with numpy 2's module names."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue().replace(_global(ForgedBuffer.__module__, 'ForgedBuffer'),
                                     _global('mmengine.logging.history_buffer', 'HistoryBuffer'))
    if numpy2:
        assert b'cnumpy.core.multiarray\n' in data, 'no numpy object pickled: nothing to test'
        data = data.replace(b'cnumpy.core.multiarray\n', b'cnumpy._core.multiarray\n')
    path = str(tmp_path / name)
    with open(path, 'wb') as f:
        f.write(data)
    return path


@pytest.mark.parametrize('numpy2', [False, True], ids=['numpy1_names', 'numpy2_names'])
def test_message_hub_opens_with_torchs_default_load(tmp_path, numpy2):
    hub = MessageHub.get_instance(f'safe_unpickling_{numpy2}')
    for loss in (1.0, 0.5, 0.25):
        hub.update_scalar('train/loss', loss)
    hub.update_info('seed_array', np.arange(3, dtype=np.int32))
    hub.update_info('lr', np.float64(0.125))
    path = _saved({'message_hub': hub.state_dict()}, tmp_path, numpy2=numpy2)
    loaded = torch.load(path)['message_hub']
    buffer = loaded['log_scalars']['train/loss']
    assert type(buffer) is HistoryBuffer
    np.testing.assert_array_equal(buffer._log_history, [1.0, 0.5, 0.25])
    assert buffer.mean() == pytest.approx(1.75 / 3) and buffer.current() == 0.25
    assert buffer.statistics('max') == 1.0
    seeds = loaded['runtime_info']['seed_array']
    assert type(seeds) is np.ndarray and seeds.dtype == np.int32
    np.testing.assert_array_equal(seeds, [0, 1, 2])
    assert type(loaded['runtime_info']['lr']) is np.float64
    assert loaded['runtime_info']['lr'] == 0.125
    restored = MessageHub.get_instance(f'safe_unpickling_{numpy2}_restored')
    restored.load_state_dict(loaded)
    assert restored.get_scalar('train/loss').current() == 0.25


class Reduces:
    """Pickles as ``func(*args)`` (then ``state``, if any, is set on the result)."""

    def __init__(self, func, args, state=None):
        self.reduced = (func, args) if state is None else (func, args, state)

    def __reduce__(self):
        return self.reduced


def _buffer_state(**changes):
    state = dict(max_length=10, _log_history=np.ones(2), _count_history=np.ones(2),
                 statistics_methods={'mean': HistoryBuffer.mean})
    state.update(changes)
    return state


REFUSED = {
    'code': (lambda m: Reduces(os.mkdir, (m, )), r'posix\.mkdir'),
    'object_array': (lambda m: np.array([1, 'a'], dtype=object), r'dtype\(.O.\)'),
    'structured_array': (lambda m: np.zeros(2, dtype=[('a', 'f4')]), r"dtype\('V"),
    'direct_ndarray': (lambda m: Reduces(np.ndarray, ((2, ), 'O')), r'numpy\.ndarray\(\.\.\.\)'),
    'buffer_extra_state': (lambda m: ForgedBuffer(_buffer_state(extra=m)),
                           r'HistoryBuffer with state'),
    'buffer_other_statistics': (lambda m: ForgedBuffer(_buffer_state(
        statistics_methods={m: HistoryBuffer.mean})), r'statistics other than'),
    'buffer_constructed': (lambda m: Reduces(HistoryBuffer, ([1.0], [1])),
                           r'HistoryBuffer\(\.\.\.\)'),
    'getattr_other': (lambda m: Reduces(getattr, (HistoryBuffer, '__init__')),
                      r"getattr\(HistoryBuffer, '__init__'\)"),
}


@pytest.mark.parametrize('case', sorted(REFUSED))
def test_anything_else_is_refused_and_runs_nothing(tmp_path, case):
    marker = str(tmp_path / 'ran')
    make, detail = REFUSED[case]
    path = _saved({'meta': {}, 'state_dict': {'w': torch.ones(1)}, 'x': make(marker)},
                  tmp_path)
    with pytest.raises(pickle.UnpicklingError, match=detail):
        torch.load(path)
    with pytest.raises(CheckpointError, match=r'Refusing to load checkpoint .*file\.pth.*it '
                                              r'asks .*' + detail):
        load_checkpoint_file(path)
    assert not os.path.exists(marker)
    assert marker not in HistoryBuffer._statistics_methods  # stock __setstate__ would add it


def test_a_refused_buffer_leaves_the_statistics_registry_alone(tmp_path):
    before = dict(HistoryBuffer._statistics_methods)
    path = _saved({'x': ForgedBuffer(_buffer_state(statistics_methods={
        'mean': HistoryBuffer.max}))}, tmp_path)  # mmengine's method under another name
    with pytest.raises(pickle.UnpicklingError, match='statistics other than'):
        torch.load(path)
    assert HistoryBuffer._statistics_methods == before
