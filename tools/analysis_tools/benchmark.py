"""Time and peak memory of XCiT against other backbones, or of a whole config, on this machine.

A thin entry to the benchmark harness in ``benchmarks/`` (``benchmarks/benchmark.py --help``
lists every option; docs/benchmark.md explains the method)::

    python tools/analysis_tools/benchmark.py --models xcit_s12_p16 swin_t --resolutions 512 1024
    python tools/analysis_tools/benchmark.py --whole-model CONFIG --mode inference --shape 1024 1024

FLOPs of a config: mmdet's own ``tools/analysis_tools/get_flops.py CONFIG`` (``import xcit_mm``
gives mmengine's counter XCA's matrix products).
"""
import os.path as osp
import runpy
import sys

HARNESS = osp.join(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))), 'benchmarks',
                   'benchmark.py')

if __name__ == '__main__':
    sys.argv[0] = HARNESS
    sys.path.insert(0, osp.dirname(HARNESS))  # the harness imports its library from beside it
    runpy.run_path(HARNESS, run_name='__main__')
