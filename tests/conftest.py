"""Shared pytest fixtures.

mmpretrain's XCiT port is the numerical reference. ``import mmpretrain.models`` pulls in modules
that import torchvision (box utils, dataset transforms), which has no CPU build here. The fixture
below installs a TEST-ONLY stand-in for those unused torchvision imports before importing the
port; xcit_mm itself never imports torchvision.
"""
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import os.path as osp
import sys
import types

import pytest

if os.environ.get('PYTEST_XDIST_WORKER'):
    # Two xdist workers share the 2 cores (setup.cfg): one torch / OpenMP thread each, also in
    # the processes the tests start (oversubscribed OpenMP threads wait on each other).
    os.environ['OMP_NUM_THREADS'] = os.environ['MKL_NUM_THREADS'] = '1'
    import torch
    torch.set_num_threads(1)


# mmengine's config work memoized and seaborn imported on first use, here and, through a
# sitecustomize first on their PYTHONPATH, in every Python process the tests start (tools, ranks,
# benchmarks). (process_start imports by name: setup.cfg's pythonpath = tests.)
import process_start  # noqa: E402

process_start.install()
os.environ['PYTHONPATH'] = os.pathsep.join(
    [osp.join(osp.dirname(osp.abspath(__file__)), 'child_site')]
    + [p for p in [os.environ.get('PYTHONPATH')] if p])

# The benchmark library lives beside the scripts that use it (benchmarks/xcit_benchmark).
sys.path.insert(0, osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'benchmarks'))


class _UnusedTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves empty ``torchvision.*`` modules whose attributes are inert placeholders."""

    def find_spec(self, name, path=None, target=None):
        if name == 'torchvision' or name.startswith('torchvision.'):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def __getattr__(attr):
            if attr.startswith('__'):
                raise AttributeError(attr)
            return type(attr, (), {})  # a placeholder class: importable, never used by XCiT

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


@pytest.fixture(scope='session')
def mmpretrain_xcit():
    """``mmpretrain.models.backbones.xcit.XCiT`` (the reference port)."""
    try:
        importlib.import_module('torchvision')
    except ImportError:
        # Serve the stand-in only while mmpretrain is imported, then withdraw it, so that no
        # later test (or mmengine's environment report) mistakes it for a real torchvision.
        finder = _UnusedTorchvision()
        sys.meta_path.append(finder)
        try:
            # all of mmpretrain.models, not only the port: building the port under another
            # default scope (mmdet / mmseg, set by earlier tests) makes mmengine's registry
            # import mmpretrain.models lazily, after the stand-in is gone.
            importlib.import_module('mmpretrain.models')
            return importlib.import_module('mmpretrain.models.backbones.xcit').XCiT
        finally:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n.split('.')[0] == 'torchvision']:
                del sys.modules[name]
    return importlib.import_module('mmpretrain.models.backbones.xcit').XCiT


def _load_tool(relpath):
    """A script (e.g. ``tools/train.py``) as a module (tools/ is not a package), one copy per
    test session.

    Registered in ``sys.modules`` while it executes: dataclasses look their module up there.
    """
    module_name = 'xcit_mm_tool_' + osp.splitext(relpath)[0].replace('/', '_')
    if module_name not in sys.modules:
        path = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), relpath)
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def upstream_tool(package: str, name: str) -> str:
    """mmdet's / mmseg's own ``tools/<name>.py`` as shipped inside the installed package (what
    ``mim train`` / ``mim test`` run)."""
    path = osp.join(osp.dirname(importlib.import_module(package).__file__), '.mim', 'tools',
                    f'{name}.py')
    assert osp.isfile(path), path
    return path


@pytest.fixture(scope='session')
def train_tool():
    """tools/train.py, loaded as a module."""
    return _load_tool('tools/train.py')


@pytest.fixture(scope='session')
def test_tool():
    """tools/test.py, loaded as a module."""
    return _load_tool('tools/test.py')


@pytest.fixture(scope='session')
def demo_tool():
    """demo/image_demo.py, loaded as a module."""
    return _load_tool('demo/image_demo.py')


@pytest.fixture(scope='session')
def xca_tool():
    """tools/analysis_tools/visualize_xca.py, loaded as a module."""
    return _load_tool('tools/analysis_tools/visualize_xca.py')


@pytest.fixture(scope='session')
def bench():
    """benchmarks/benchmark.py, loaded as a module."""
    return _load_tool('benchmarks/benchmark.py')


@pytest.fixture(scope='session')
def roi_align_bench():
    """benchmarks/benchmark_roi_align.py, loaded as a module."""
    return _load_tool('benchmarks/benchmark_roi_align.py')


@pytest.fixture(scope='session')
def onnx_tool():
    """tools/deployment/export_onnx.py, loaded as a module."""
    return _load_tool('tools/deployment/export_onnx.py')


@pytest.fixture(scope='session')
def build_once(tmp_path_factory):
    """``build_once(name, build)``: ``build(folder)`` runs once per test session, on whichever
    xdist worker asks first; the other waits for it and reads the same JSON result. For
    fixtures that train (a checkpoint every door test reads): module-scoped fixtures are built
    on each worker, and again whenever work stealing moves a worker back to the module."""
    import fcntl
    import json
    import shutil
    base = tmp_path_factory.getbasetemp()
    if os.environ.get('PYTEST_XDIST_WORKER'):
        base = base.parent  # the session's folder, shared by its workers

    def run(name, build):
        folder = base / f'once_{name}'
        with open(base / f'once_{name}.lock', 'w') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            result = folder / 'result.json'
            if result.is_file():
                return json.loads(result.read_text())
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            value = build(folder)
            result.write_text(json.dumps(value))
            return value
    return run


def run_as_main(path, *args):
    """A script (mmdet's / mmseg's ``tools/*.py``) run on the CPU in this process as its
    ``__main__`` block runs it, its command line in ``sys.argv``: what the script does, without a
    new interpreter's imports. (Tests of what a process prints as it ends start one.) The
    ``LOCAL_RANK`` the upstream tools set is restored afterwards."""
    import runpy
    with pytest.MonkeyPatch.context() as monkeypatch:
        _cpu_only(monkeypatch)
        monkeypatch.setenv('LOCAL_RANK', '0')
        monkeypatch.setattr(sys, 'argv', [path, *args])
        runpy.run_path(path, run_name='__main__')


def unique_visualizer(name: str) -> str:
    """A ``--cfg-options`` entry giving the run a visualizer of its own: mmengine keys its global
    Visualizer instances by name, and a run in this process would otherwise reuse (and draw with)
    an earlier run's."""
    import time
    return f'visualizer.name=vis_{name}_{time.time_ns()}'


@pytest.fixture
def cpu_only(monkeypatch):
    """The test's CPU code paths (gloo, CPU AMP, CPU DDP) also on a machine with a GPU: torch
    reports no CUDA device in this process (mmengine picks the device from
    ``torch.cuda.is_available()``) nor in the processes it starts (``CUDA_VISIBLE_DEVICES``)."""
    _cpu_only(monkeypatch)


def _cpu_only(monkeypatch):
    import torch
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 0)


@pytest.fixture(scope='module')
def one_torch_thread():
    """One torch thread for a module's in-process work: on a shared 2-core machine two OpenMP
    threads wait for each other's descheduled thread (and a module's background process may
    have the other core)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope='module')
def _unfreeze_at_the_end():
    yield
    gc.unfreeze()


@pytest.fixture
def frozen_heap(_unfreeze_at_the_end):
    """What this process holds before a test is moved out of the garbage collector's sight
    (``gc.freeze``): the benchmark's timing and memory code call ``gc.collect()``, slow over the
    heap of a pytest process that imported torch, mmdet and mmseg; the objects a test creates are
    still collected. Unfrozen after the module."""
    gc.freeze()
    yield


# Modules whose tests run whole trainings / compilations, started first so that the two xdist
# workers (setup.cfg) end together on the many short tests instead of one waiting for the other.
_LONG_RUNNING_MODULES = ('test_compile', 'test_shapes', 'test_reliability', 'test_checkpoint_doors',
                         'test_released_models')


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = item.module.__name__.rsplit('.', 1)[-1] if item.module else ''
        return (_LONG_RUNNING_MODULES.index(name) if name in _LONG_RUNNING_MODULES
                else len(_LONG_RUNNING_MODULES))
    items.sort(key=rank)  # stable: file order within each group


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """The heap the session built (torch, mmdet, mmseg, trained models) moved out of the garbage
    collector's sight before pytest's closing collections and the interpreter's exit: they scan
    only what is left after this instead of the whole heap of a worker."""
    gc.collect()
    gc.freeze()
