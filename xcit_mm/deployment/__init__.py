# Copyright (c) xcit_mm contributors. All rights reserved.
"""ONNX export checked with ONNX Runtime (docs/deployment.md); not imported by ``import xcit_mm``,
and importable without ``onnx`` / ``onnxruntime``."""
from .onnx import (ExportError, build_export_model, check_onnx_runtime, check_shape, export_onnx,
                   onnx_session, run_onnx, verify_onnx)

__all__ = [
    'ExportError', 'build_export_model', 'check_onnx_runtime', 'check_shape', 'export_onnx',
    'onnx_session', 'run_onnx', 'verify_onnx'
]
