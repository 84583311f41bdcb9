# Copyright (c) xcit_mm contributors. All rights reserved.
"""Deployment: ONNX export of XCiT segmentors / detector feature extractors, checked against
PyTorch with ONNX Runtime (see docs/deployment.md).

Not imported by ``import xcit_mm``; importing this package needs neither ``onnx`` nor
``onnxruntime`` (they are imported when an export or a verification runs:
``pip install 'xcit_mm[onnx]'`` or ``bash tools/install.sh``).
"""
from .onnx import (ExportError, build_export_model, check_onnx_runtime, export_onnx,
                   onnx_session, other_shape, run_onnx, verify_onnx)

__all__ = [
    'ExportError', 'build_export_model', 'check_onnx_runtime', 'export_onnx', 'onnx_session',
    'other_shape', 'run_onnx', 'verify_onnx'
]
