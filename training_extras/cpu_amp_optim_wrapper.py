"""Mixed-precision training on machines without a GPU (bfloat16 autocast on the CPU).

mmengine's ``AmpOptimWrapper`` asserts that a GPU (or NPU / MLU / MUSA) is present: it is built
around ``torch.cuda.amp.GradScaler``. On the CPU, torch's autocast supports bfloat16, which has
float32's exponent range and so needs no loss scaling. :class:`CPUAmpOptimWrapper` is therefore
the plain ``OptimWrapper`` (same gradient clipping, accumulation and state dict) plus
``torch.autocast('cpu', dtype=torch.bfloat16)`` during the training forward pass.

Where autocast applies: by default on the feature extractor only, the model's ``backbone`` and
``neck`` (nearly all of the FLOPs), whose outputs are cast back to float32. The task heads run in
float32 because mmcv's CPU kernels (``nms`` in the RPN, ``RoIAlign`` in the RoI heads) only
implement float32 and fail on bfloat16 inputs (``expected scalar type Float but found
BFloat16``); on a GPU, mmcv's CUDA kernels accept half precision, which is why
``AmpOptimWrapper`` can autocast the whole model. ``autocast_modules=None`` autocasts the whole
forward pass, as ``AmpOptimWrapper`` does (fine for models without mmcv ops, e.g. mmseg's).

``tools/train.py --amp`` selects this wrapper automatically when ``torch.cuda.is_available()`` is
False (and ``AmpOptimWrapper`` otherwise). In a config::

    optim_wrapper = dict(type='CPUAmpOptimWrapper', optimizer=...)

XCiT's cross-covariance attention computes its L2 normalisation and softmax in float32 under
autocast (see ``xcit_mm.models.backbones.xcit``), so the channel-attention maps keep full precision.

Speed: bfloat16 is only fast on CPUs with native bfloat16 arithmetic (x86 ``avx512_bf16`` or AMX
``amx_bf16``; Arm ``bf16``). Elsewhere oneDNN emulates it and ``--amp`` trains several times slower
than float32 (docs/training_extras.md). :func:`cpu_has_native_bf16` detects this and
``tools/train.py`` warns once (:func:`warn_if_cpu_bf16_is_slow`).
"""
import logging
import os
from contextlib import contextmanager
from typing import List, Optional, Sequence, Union

import torch
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS
from mmengine.runner.amp import autocast

from .cpu_info import read_cpuinfo

CPU_AMP_TYPE = 'CPUAmpOptimWrapper'


def _to_float32(data):
    """Cast the floating-point tensors of a (nested) module output to float32."""
    if isinstance(data, torch.Tensor):
        return data.float() if data.is_floating_point() and data.dtype != torch.float32 else data
    if isinstance(data, (list, tuple)):
        cast = [_to_float32(item) for item in data]
        return type(data)(cast) if not hasattr(data, '_fields') else type(data)(*cast)
    if isinstance(data, dict):
        return type(data)((key, _to_float32(value)) for key, value in data.items())
    return data


@OPTIM_WRAPPERS.register_module()
class CPUAmpOptimWrapper(OptimWrapper):
    """``OptimWrapper`` whose training forward pass runs under CPU bfloat16 autocast.

    Registered in mmengine's root ``OPTIM_WRAPPERS``, so mmdet's and mmseg's scopes find it.

    Args:
        dtype (str | torch.dtype): Autocast dtype; only ``'bfloat16'`` (the only dtype CPU
            autocast supports) is accepted.
        autocast_modules (Sequence[str] | None): Names of the model's sub-modules that run under
            autocast (their outputs are cast back to float32); missing names are skipped, but at
            least one must exist. ``None``: the whole forward pass. Defaults to
            ``('backbone', 'neck')``.
        loss_scale: Accepted for config compatibility with ``AmpOptimWrapper`` and ignored:
            bfloat16 does not underflow where float16 does, so no loss scaling is needed.
        **kwargs: Passed to ``OptimWrapper`` (``optimizer``, ``clip_grad``,
            ``accumulative_counts``).

    Raises:
        ValueError: If ``dtype`` is not bfloat16, or (at the first training step) none of
            ``autocast_modules`` exists in the model.
    """

    def __init__(self,
                 dtype: Union[str, torch.dtype] = 'bfloat16',
                 autocast_modules: Optional[Sequence[str]] = ('backbone', 'neck'),
                 loss_scale=None,
                 **kwargs):
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if dtype is not torch.bfloat16:
            raise ValueError(f'{CPU_AMP_TYPE}: CPU autocast only supports bfloat16, got '
                             f'dtype={dtype!r}. Use dtype="bfloat16" (or train on a GPU with '
                             f'AmpOptimWrapper for float16).')
        super().__init__(**kwargs)
        self.cast_dtype = dtype
        self.autocast_modules = None if autocast_modules is None else tuple(autocast_modules)
        self._active = False
        self._hooked: Optional[int] = None  # id() of the model whose sub-modules carry hooks
        self._contexts: List = []

    def _install_hooks(self, model: torch.nn.Module) -> None:
        module = model.module if is_model_wrapper(model) else model
        if self._hooked == id(module):
            return
        targets = [getattr(module, name) for name in self.autocast_modules
                   if isinstance(getattr(module, name, None), torch.nn.Module)]
        if not targets:
            raise ValueError(
                f'{CPU_AMP_TYPE}: the model ({type(module).__name__}) has none of the '
                f'sub-modules autocast_modules={self.autocast_modules}; name the ones to run in '
                f'bfloat16, or set optim_wrapper.autocast_modules=None for the whole model.')
        for target in targets:
            target.register_forward_pre_hook(self._enter)
            target.register_forward_hook(self._exit, always_call=True)
        self._hooked = id(module)

    def _enter(self, module, args) -> None:
        if self._active:
            context = autocast(device_type='cpu', dtype=self.cast_dtype)
            context.__enter__()
            self._contexts.append(context)
        else:
            self._contexts.append(None)

    def _exit(self, module, args, output):
        context = self._contexts.pop() if self._contexts else None
        if context is None:
            return output
        context.__exit__(None, None, None)
        return _to_float32(output)

    @contextmanager
    def optim_context(self, model: torch.nn.Module):
        """Gradient-accumulation context of ``OptimWrapper`` plus CPU bfloat16 autocast."""
        if self.autocast_modules is None:
            with super().optim_context(model), autocast(device_type='cpu',
                                                        dtype=self.cast_dtype):
                yield
            return
        self._install_hooks(model)
        self._active = True
        try:
            with super().optim_context(model):
                yield
        finally:
            self._active = False


def amp_optim_wrapper_type() -> str:
    """The optim wrapper ``--amp`` should use here: ``AmpOptimWrapper`` on GPUs, else ours."""
    return 'AmpOptimWrapper' if torch.cuda.is_available() else CPU_AMP_TYPE


# /proc/cpuinfo flags of native bfloat16 arithmetic: x86 AVX512-BF16 and AMX-BF16 (flags line),
# Arm BF16 (features line).
BF16_CPU_FLAGS = ('avx512_bf16', 'amx_bf16', 'bf16')


def cpu_has_native_bf16(cpuinfo: str = '/proc/cpuinfo') -> Optional[bool]:
    """Whether this CPU computes bfloat16 natively (``avx512_bf16`` / ``amx_bf16``; Arm ``bf16``).

    Without it, CPU bfloat16 autocast is emulated and slower than float32 (see the module
    docstring for measurements).

    Args:
        cpuinfo (str): The file listing the CPU flags (Linux).

    Returns:
        bool | None: None when it cannot be told (no such file, e.g. not Linux).
    """
    flags = read_cpuinfo(cpuinfo)[1]
    return None if flags is None else any(flag in BF16_CPU_FLAGS for flag in flags)


SLOW_BF16_MESSAGE = (
    'CPU bfloat16 autocast (--amp without a GPU) on a CPU without native bfloat16 arithmetic (no '
    'avx512_bf16 / amx_bf16 in /proc/cpuinfo): bfloat16 is emulated there and training is several '
    'times slower than in float32. Train in float32 here: drop --amp.')

_warned_slow_bf16 = False


def warn_if_cpu_bf16_is_slow() -> bool:
    """Log :data:`SLOW_BF16_MESSAGE` as a warning, once per process, if the CPU lacks native
    bfloat16 (:func:`cpu_has_native_bf16` is False; nothing when it cannot be told).

    Only global rank 0 (``RANK`` / ``SLURM_PROCID`` / ``OMPI_COMM_WORLD_RANK``, 0 when unset) logs.

    Returns:
        bool: True if the warning was logged by this call.
    """
    global _warned_slow_bf16
    if _warned_slow_bf16 or cpu_has_native_bf16() is not False:
        return False
    for key in ('RANK', 'SLURM_PROCID', 'OMPI_COMM_WORLD_RANK'):
        if key in os.environ:
            if os.environ[key] != '0':
                return False
            break
    _warned_slow_bf16 = True
    print_log(SLOW_BF16_MESSAGE, logger='current', level=logging.WARNING)
    return True
