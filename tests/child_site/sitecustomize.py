"""Run at start-up by every Python process the tests start (conftest puts this folder first on
PYTHONPATH): ``process_start`` as in the test process, then the ``sitecustomize`` this one
shadows, if the environment has one."""
import importlib.machinery
import importlib.util
import os.path as osp
import sys

_HERE = osp.dirname(osp.abspath(__file__))
_start = importlib.util.spec_from_file_location('_xcit_tests_process_start',
                                                osp.join(osp.dirname(_HERE), 'process_start.py'))
_module = importlib.util.module_from_spec(_start)
_start.loader.exec_module(_module)
_module.install()

_shadowed = importlib.machinery.PathFinder.find_spec(
    'sitecustomize', [p for p in sys.path if osp.abspath(p or '.') != _HERE])
if _shadowed is not None:
    _shadowed.loader.exec_module(importlib.util.module_from_spec(_shadowed))
