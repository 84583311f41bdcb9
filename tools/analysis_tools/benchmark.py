#!/usr/bin/env python
"""Speed, peak-memory and FLOPs benchmark for XCiT backbones and the usual alternatives.

Models (``--models``, see ``--list-models``):

* ``xcit_<arch>_p<8|16>``            ``XCiTBackbone.forward``: trunk + dense adapter (4 maps).
* ``xcit_<arch>_p<8|16>_trunk``      ``XCiTBackbone.forward_trunk``: trunk only (paper layers).
* ``mmpretrain_xcit_<arch>_p<8|16>`` mmpretrain's port of the same trunk
  (``mmpretrain.models.backbones.xcit.XCiT`` with ``cls_attn_layers=0``, ``out_type='featmap'``,
  ``final_norm=False``, ``out_indices`` = the paper layers), i.e. the same work as ``*_trunk``.
* ``resnet50``  mmdet ``ResNet`` depth 50; ``swin_t`` mmdet ``SwinTransformer`` (embed 96, depths
  2,2,6,2, window 7); ``vit_s16`` mmseg ``VisionTransformer`` (DeiT-S: embed 384, depth 12, 6 heads,
  img_size 224, position embedding interpolated to the input size on the fly).
* Suffix ``+cp`` builds the model with ``with_cp=True`` (gradient checkpointing; only changes the
  train-step numbers).

Every model is built untrained, all parameters trainable, drop-path 0, BatchNorm (no SyncBN).

Figures per (model, resolution) point:

* time: median ms/image over ``--repeats`` timed calls after ``--warmup`` calls.  The repeats are
  *interleaved* across models (round r runs every model once, in an order rotated by r), so slow
  drifts of a shared machine hit all models alike; ``--compare`` also reports the median of the
  per-round (paired) time ratios.
* peak memory: measured in a FRESH PROCESS per point.  CPU: growth of the peak resident set
  (``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs``) over the resident
  set after the model build, a 64 px warm-up call (it faults in code pages, creates thread pools),
  the input creation and ``malloc_trim(0)`` (so freed warm-up pages cannot hide reuse); the
  worker runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so that the RSS peak follows the live tensors
  (``--cpu-mem-mode process`` keeps glibc's defaults: the RSS a plain process shows).  CUDA:
  ``torch.cuda.max_memory_allocated()`` growth over ``torch.cuda.memory_allocated()`` at the same
  moment.  So it is the memory the forward (or train
  step, incl. the parameter gradients) needs on top of the weights and the input.
* FLOPs: counted with ``torch.utils.flop_counter.FlopCounterMode`` (aten-level: mm/addmm/bmm,
  convolutions incl. depthwise and transposed, SDPA; matmul/einsum decompose into bmm, so the XCA
  ``q @ k^T`` and ``attn @ v`` products are counted; norms, softmax and element-wise ops are not,
  as in fvcore).  ``gmacs`` = forward multiply-accumulates per image, the unit the XCiT/Swin/DeiT
  papers call "GFLOPs".  ``achieved_gflop_s`` uses 2 FLOPs per MAC of everything executed
  (forward, plus backward and checkpoint recomputation in train mode) and ``matmul_frac`` divides it
  by the rate of a float32 1024x1024 ``torch.mm`` timed as an extra step of every interleaved
  round (so it sees the same machine load as the models).

Examples::

    python tools/benchmark.py                                    # default table, CPU inference
    python tools/benchmark.py --models xcit_s12_p8 --resolutions 384 --compare --repeats 20
    python tools/benchmark.py --mode train --with-cp both --models xcit_s12_p16 --resolutions 1024
    python tools/benchmark.py --goals --threads 1                # the project's goals, PASS/FAIL
    python tools/benchmark.py --flops-report                     # Table 1 check of the trunk FLOPs

This tool never imports torchvision.  mmpretrain's XCiT module is loaded without executing the
``mmpretrain.models`` package ``__init__`` (see :func:`load_mmpretrain_xcit`).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import importlib
import importlib.machinery
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER_MARK = '@@XCIT_BENCHMARK_WORKER@@'

# arch -> (embed dims D, depth, heads); same table as XCiTBackbone / the paper.
XCIT_ARCHS: Dict[str, Tuple[int, int, int]] = {
    'n12': (128, 12, 4), 't12': (192, 12, 4), 't24': (192, 24, 4), 's12': (384, 12, 8),
    's24': (384, 24, 8), 'm24': (512, 24, 8), 'l24': (768, 24, 16)}

# Paper Table 1: ImageNet classifiers (trunk + 2 class-attention layers + norm + head).
PAPER_TABLE1: Dict[str, Dict[str, float]] = {
    'n12': dict(params_m=3.05, gmacs_224_p16=0.56, gmacs_384_p8=6.4),
    't12': dict(params_m=6.72, gmacs_224_p16=1.24, gmacs_384_p8=14.3),
    't24': dict(params_m=12.12, gmacs_224_p16=2.34, gmacs_384_p8=27.3),
    's12': dict(params_m=26.25, gmacs_224_p16=4.81, gmacs_384_p8=55.6),
    's24': dict(params_m=47.67, gmacs_224_p16=9.10, gmacs_384_p8=106.0),
    'm24': dict(params_m=84.40, gmacs_224_p16=16.13, gmacs_384_p8=188.0),
    'l24': dict(params_m=189.10, gmacs_224_p16=35.86, gmacs_384_p8=417.9)}

# Goal thresholds of the project (issue 4); --goals checks exactly these.
GOAL_MEM_SCALING_MAX = 4.6      # XCiT-S12/16 peak inference memory 1024^2 / 512^2
GOAL_MEM_VS_SWIN_MAX = 0.75     # XCiT-S12/16 (backbone+adapter) / Swin-T at 1024^2, batch 1
GOAL_MEM_VS_VIT_MAX = 0.45      # XCiT-S12/16 (backbone+adapter) / ViT-S/16 at 1024^2, batch 1
GOAL_SPEED_VS_PORT_MAX = 0.90   # XCiTBackbone S12/8 trunk / mmpretrain port time at 384^2, fp32
GOAL_MEM_VS_PORT_MAX = 1.10     # ... at <= 1.1x the port's peak memory
GOAL_CP_SAVING_MIN = 0.40       # with_cp cuts the 1024^2 train-step peak by >= 40%

DEFAULT_MODELS = ['xcit_s12_p16', 'xcit_s12_p8', 'resnet50', 'swin_t', 'vit_s16']
DEFAULT_RESOLUTIONS = [224, 384, 512, 768, 1024]
BASELINES = {
    'resnet50': 'mmdet ResNet-50 (4 stages, strides 4-32)',
    'swin_t': 'mmdet SwinTransformer Swin-T (embed 96, depths 2,2,6,2, window 7)',
    'vit_s16': 'mmseg VisionTransformer ViT-S/16 = DeiT-S (embed 384, depth 12, 6 heads)'}
_XCIT_RE = re.compile(r'(?P<port>mmpretrain_)?xcit_(?P<arch>[a-z]\d\d)_p(?P<patch>\d+)'
                      r'(?P<trunk>_trunk)?')

CSV_FIELDS = [
    'model', 'description', 'resolution', 'batch', 'mode', 'precision', 'device', 'threads',
    'with_cp', 'status', 'params_m', 'gmacs', 'gflop_exec', 'ms_per_img', 'ms_p25', 'ms_p75',
    'imgs_per_s', 'achieved_gflop_s', 'matmul_gflop_s', 'matmul_frac', 'peak_mem_mb',
    'mem_base_mb', 'mem_method', 'flops_counter', 'warmup', 'repeats', 'note']


# --------------------------------------------------------------------------------------------
# model zoo
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``--models`` entry.

    Attributes:
        name: Canonical name, including the ``+cp`` suffix.
        family: One of ``xcit``, ``xcit_trunk``, ``mmpretrain_xcit``, ``resnet50``, ``swin_t``,
            ``vit_s16``.
        arch: XCiT arch key (``'s12'`` ...) or None.
        patch: XCiT patch size or None.
        with_cp: Whether the model is built with gradient checkpointing.
    """

    name: str
    family: str
    arch: Optional[str] = None
    patch: Optional[int] = None
    with_cp: bool = False

    @property
    def is_xcit(self) -> bool:
        """bool: Whether this is one of the XCiT variants (ours or mmpretrain's)."""
        return self.family in ('xcit', 'xcit_trunk', 'mmpretrain_xcit')

    @property
    def description(self) -> str:
        """str: Human readable description used in tables and plots."""
        cp = ' +with_cp' if self.with_cp else ''
        if self.family in BASELINES:
            return BASELINES[self.family] + cp
        label = f'XCiT-{self.arch.upper()}/{self.patch}'
        if self.family == 'xcit':
            return f'xcit_mm XCiTBackbone {label} (trunk + adapter){cp}'
        if self.family == 'xcit_trunk':
            return f'xcit_mm XCiTBackbone.forward_trunk {label}{cp}'
        return f'mmpretrain XCiT port {label} (trunk, cls_attn_layers=0){cp}'


def parse_model(name: str) -> ModelSpec:
    """Parse a model name of ``--models``.

    Args:
        name: e.g. ``'xcit_s12_p16'``, ``'xcit_s12_p8_trunk'``, ``'mmpretrain_xcit_s12_p8'``,
            ``'swin_t+cp'``.

    Returns:
        ModelSpec: The parsed spec.

    Raises:
        ValueError: For an unknown name or an impossible combination.
    """
    base, with_cp = (name[:-3], True) if name.endswith('+cp') else (name, False)
    if base in BASELINES:
        return ModelSpec(name=name, family=base, with_cp=with_cp)
    m = _XCIT_RE.fullmatch(base)
    if m is None:
        raise ValueError(f'unknown model {name!r}; see --list-models')
    arch, patch = m.group('arch'), int(m.group('patch'))
    if arch not in XCIT_ARCHS:
        raise ValueError(f'unknown XCiT arch {arch!r} in {name!r}; choose from '
                         f'{sorted(XCIT_ARCHS)}')
    if patch not in (8, 16):
        raise ValueError(f'XCiT patch size must be 8 or 16, got {patch} in {name!r}')
    if m.group('port'):
        if m.group('trunk'):
            raise ValueError(f'{name!r}: mmpretrain_xcit_* already is the trunk only; drop _trunk')
        if with_cp:
            raise ValueError(f'{name!r}: mmpretrain\'s XCiT has no with_cp option')
        family = 'mmpretrain_xcit'
    else:
        family = 'xcit_trunk' if m.group('trunk') else 'xcit'
    return ModelSpec(name=name, family=family, arch=arch, patch=patch, with_cp=with_cp)


def paper_out_indices(depth: int) -> Tuple[int, ...]:
    """The paper's dense-prediction layers (0-based) for a trunk of ``depth`` layers."""
    return (3, 5, 7, 11) if depth == 12 else (7, 11, 15, 23)


def _ensure_xcit_mm_importable():
    """Make ``import xcit_mm`` work from a plain checkout (before ``pip install -e .``)."""
    if importlib.util.find_spec('xcit_mm') is None and REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)


def load_mmpretrain_xcit():
    """Import ``mmpretrain.models.backbones.xcit`` without running ``mmpretrain.models``' __init__.

    What fails here: ``import mmpretrain.models`` executes the package ``__init__``, which imports
    all heads; ``heads/cls_head.py`` imports ``mmpretrain.evaluation``, whose
    ``metrics/visual_grounding_eval.py`` does ``import torchvision.ops.boxes`` -- and torchvision
    is not installed (there is no build for this torch).  ``xcit.py`` itself only needs
    mmcv/mmengine, ``mmpretrain.registry``, ``mmpretrain.models.utils`` and ``.base_backbone``,
    none of which touch torchvision.

    So, only inside the benchmark process and only when torchvision is missing, this registers
    *bare* package objects for ``mmpretrain.models`` and ``mmpretrain.models.backbones`` (their real
    directories as ``__path__``, their ``__init__`` NOT executed, marked with
    ``__xcit_benchmark_placeholder__``) and imports the submodule through them.  The placeholders
    stay for the life of this process: mmpretrain's ``MODELS`` registry imports its location
    ``mmpretrain.models`` lazily at its first lookup (``build_norm_layer('LN')``), which must not
    run the real ``__init__`` either; 'LN', 'BN', 'GELU' are then found in mmengine's root
    registry (mmcv registers them there).  Nothing else in the benchmark process imports
    ``mmpretrain.models``.  No torchvision stub is created and xcit_mm is not involved.  Where
    torchvision exists the ordinary import is used.

    Returns:
        module: mmpretrain's ``xcit`` module (``XCiT``, ``ClassAttentionBlock``, ...).

    Raises:
        ImportError: If mmpretrain is not installed.
    """
    name = 'mmpretrain.models.backbones.xcit'
    if importlib.util.find_spec('mmpretrain') is None:
        raise ImportError('mmpretrain is not installed; it is needed for the mmpretrain_xcit_* '
                          'models and the class-attention part of --flops-report')
    if importlib.util.find_spec('torchvision') is not None:
        return importlib.import_module(name)
    # mmdet's optional `from mmpretrain.models.classifiers import ...` (inside try/except) may
    # already have failed half-way: the submodules stay in sys.modules, 'mmpretrain.models' not.
    import mmpretrain  # the top-level package does not import mmpretrain.models
    parent = mmpretrain
    for pkg in ('mmpretrain.models', 'mmpretrain.models.backbones'):
        if pkg not in sys.modules:
            spec = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
            spec.submodule_search_locations = [
                os.path.join(parent.__path__[0], pkg.rpartition('.')[2])]
            module = importlib.util.module_from_spec(spec)
            module.__xcit_benchmark_placeholder__ = True
            sys.modules[pkg] = module
            setattr(parent, pkg.rpartition('.')[2], module)
        parent = sys.modules[pkg]
    return importlib.import_module(name)


def build_model(spec: ModelSpec, device: str = 'cpu') -> Tuple[nn.Module, Callable]:
    """Build one benchmark model.

    Args:
        spec: The parsed model spec.
        device: ``'cpu'`` or ``'cuda'``.

    Returns:
        tuple: ``(module, forward)`` where ``forward(img)`` returns a sequence of tensors.
    """
    cp = spec.with_cp
    if spec.family in ('xcit', 'xcit_trunk'):
        _ensure_xcit_mm_importable()
        import xcit_mm  # noqa: F401  (registers XCiTBackbone in mmengine's root MODELS)
        from mmengine.registry import MODELS
        model = MODELS.build(dict(type='XCiTBackbone', arch=spec.arch, patch_size=spec.patch,
                                  norm_cfg=dict(type='BN'), drop_path_rate=0.0, with_cp=cp))
        forward = model.forward_trunk if spec.family == 'xcit_trunk' else model
    elif spec.family == 'mmpretrain_xcit':
        xcit_mod = load_mmpretrain_xcit()
        dims, depth, heads = XCIT_ARCHS[spec.arch]
        model = xcit_mod.XCiT(
            img_size=224, patch_size=spec.patch, embed_dims=dims, depth=depth, num_heads=heads,
            cls_attn_layers=0, out_type='featmap', out_indices=paper_out_indices(depth),
            final_norm=False, layer_scale_init_value=1.0 if depth == 12 else 1e-5,
            bn_norm_cfg=dict(type='BN'), init_cfg=None)
        forward = model
    elif spec.family in ('resnet50', 'swin_t'):
        import mmdet.models  # noqa: F401  (fills mmdet's MODELS registry)
        from mmdet.registry import MODELS as DET_MODELS
        if spec.family == 'resnet50':
            cfg = dict(type='ResNet', depth=50, num_stages=4, out_indices=(0, 1, 2, 3),
                       frozen_stages=-1, norm_cfg=dict(type='BN', requires_grad=True),
                       norm_eval=False, style='pytorch', with_cp=cp)
        else:
            cfg = dict(type='SwinTransformer', embed_dims=96, depths=(2, 2, 6, 2),
                       num_heads=(3, 6, 12, 24), window_size=7, mlp_ratio=4, qkv_bias=True,
                       drop_path_rate=0.0, patch_norm=True, out_indices=(0, 1, 2, 3),
                       with_cp=cp, convert_weights=False)
        model = DET_MODELS.build(cfg)
        forward = model
    elif spec.family == 'vit_s16':
        import mmseg.models  # noqa: F401  (fills mmseg's MODELS registry)
        from mmseg.registry import MODELS as SEG_MODELS
        model = SEG_MODELS.build(dict(
            type='VisionTransformer', img_size=224, patch_size=16, embed_dims=384, num_layers=12,
            num_heads=6, mlp_ratio=4, out_indices=(2, 5, 8, 11), qkv_bias=True,
            with_cls_token=True, final_norm=False, interpolate_mode='bicubic',
            drop_path_rate=0.0, with_cp=cp))
        forward = model
    else:  # pragma: no cover - parse_model guards this
        raise ValueError(f'unknown model family {spec.family!r}')
    return model.to(device), forward


def count_params(model: nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# measurement primitives
# --------------------------------------------------------------------------------------------
def _conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation,
                        transposed, _output_padding, _groups, output_mask, out_shape=None,
                        **kwargs) -> int:
    """FLOPs of ``aten.convolution_backward``, correct for grouped (depthwise) convolutions.

    torch 2.13's built-in formula ignores ``groups`` for the weight gradient and counts a depthwise
    3x3 conv's backward as if it were dense (x C too much).  Each gradient (input, weight) of a
    convolution costs exactly the MACs of its forward, whatever the groups, so this returns the
    forward count times the number of gradients requested in ``output_mask``; for groups=1 it
    equals torch's formula.
    """
    from torch.utils.flop_counter import conv_flop_count
    forward = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs executed by ``fn()`` according to ``torch.utils.flop_counter.FlopCounterMode``.

    2 FLOPs per multiply-accumulate (a ``Linear(16, 8)`` on 4 rows is ``2 * 4 * 16 * 8``); biases,
    norms, softmax and element-wise ops are not counted.  Backward ops are counted when ``fn``
    runs a backward pass (with :func:`_conv_backward_flop` replacing torch's formula that
    overcounts grouped convolutions).

    Args:
        fn: Zero-argument callable to run under the counter.

    Returns:
        int: Total FLOPs.
    """
    from torch.utils.flop_counter import FlopCounterMode
    mapping = {torch.ops.aten.convolution_backward: _conv_backward_flop}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return int(counter.get_total_flops())


def analytic_trunk_macs(arch: str, patch: int, height: int, width: int) -> int:
    """Multiply-accumulates of an XCiT trunk by formula (cross-check of the counter).

    Counts the conv patch embedding, the 1x1 position projection and per layer
    ``N * (12 D^2 + 2 D d_h + 18 D)``: qkv 3D^2, XCA ``q k^T`` and ``A v`` 2 D d_h, proj D^2,
    LPI 2 depthwise 3x3 = 18 D, FFN 8 D^2.  No biases, norms or softmax (as the counter).

    Args:
        arch: XCiT arch key.
        patch: 8 or 16.
        height: Image height.
        width: Image width.

    Returns:
        int: MACs for one image.
    """
    dims, depth, heads = XCIT_ARCHS[arch]
    chans = [3, dims // 8, dims // 4, dims // 2, dims] if patch == 16 else \
        [3, dims // 4, dims // 2, dims]
    h, w, macs = height, width, 0
    for cin, cout in zip(chans[:-1], chans[1:]):
        h, w = math.ceil(h / 2), math.ceil(w / 2)
        macs += h * w * cout * cin * 9
    tokens = h * w
    macs += tokens * 64 * dims
    macs += depth * tokens * (12 * dims * dims + 2 * dims * (dims // heads) + 18 * dims)
    return macs


def autocast_context(device: str, precision: str):
    """Autocast context for ``precision`` ('fp32': none; 'amp': bf16 on CPU, fp16 on CUDA)."""
    if precision == 'fp32':
        return contextlib.nullcontext()
    if precision != 'amp':
        raise ValueError(f'unknown precision {precision!r}')
    dtype = torch.bfloat16 if device == 'cpu' else torch.float16
    return torch.autocast(device_type=device, dtype=dtype)


def make_step(model: nn.Module, forward: Callable, img: torch.Tensor, mode: str, device: str,
              precision: str) -> Callable[[], None]:
    """A zero-argument callable running one inference call or one train step.

    Inference: ``model.eval()`` and the forward under ``torch.no_grad()``.  Train step:
    ``model.train()``, forward, ``loss = sum(out.float().mean())``, backward, gradients dropped
    (``grad = None``, so every step allocates them, as a real step before ``optimizer.step``).

    Args:
        model: The module.
        forward: Its forward callable (``model`` or e.g. ``model.forward_trunk``).
        img: Input batch.
        mode: ``'inference'`` or ``'train'``.
        device: Device type of ``img``.
        precision: ``'fp32'`` or ``'amp'``.

    Returns:
        callable: The step.
    """
    if mode == 'inference':
        model.eval()

        def step():
            with torch.no_grad(), autocast_context(device, precision):
                forward(img)
    elif mode == 'train':
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]

        def step():
            with autocast_context(device, precision):
                outs = forward(img)
                loss = sum(o.float().mean() for o in outs)
            loss.backward()
            for p in params:
                p.grad = None
    else:
        raise ValueError(f'unknown mode {mode!r}')
    return step


def _sync(device: str):
    if device == 'cuda':
        torch.cuda.synchronize()


MATMUL_STEP = '__matmul_fp32_1024__'
MATMUL_SIZE, MATMUL_CALLS = 1024, 4


def make_matmul_step(device: str) -> Callable[[], None]:
    """A step of ``MATMUL_CALLS`` float32 1024x1024 ``torch.mm`` (the reference rate)."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device)

    def step():
        for _ in range(MATMUL_CALLS):
            torch.mm(a, b)
    return step


def matmul_gflops(step_seconds: float) -> float:
    """GFLOP/s of one :func:`make_matmul_step` call that took ``step_seconds``."""
    return 2 * MATMUL_SIZE ** 3 * MATMUL_CALLS / step_seconds / 1e9


def measure_matmul_gflops(device: str, repeats: int = 10) -> float:
    """Rate of a float32 1024x1024 ``torch.mm`` (median over ``repeats`` steps), in GFLOP/s."""
    step = make_matmul_step(device)
    times = time_interleaved({MATMUL_STEP: step}, 1, repeats, device)[MATMUL_STEP]
    return matmul_gflops(statistics.median(times))


def _read_kb(path: str, key: str) -> int:
    """Value in kB of ``key:`` in a /proc file such as ``/proc/self/status``."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'{key} not found in {path}')


def _proc_status_kb(key: str, pid: str = 'self') -> int:
    return _read_kb(f'/proc/{pid}/status', key)


def _release_free_heap():
    """Return free malloc pages to the OS (glibc ``malloc_trim(0)``; no-op elsewhere).

    Called before the memory baseline, so that the measured call cannot silently reuse pages the
    64 px warm-up left resident: every page it touches then shows up as resident-set growth.
    """
    try:
        import ctypes
        ctypes.CDLL('libc.so.6').malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss():
    """Reset VmHWM to the current RSS (Linux >= 4.0); raise if the kernel refuses."""
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')


def time_interleaved(steps: Dict[str, Callable[[], None]], warmup: int, repeats: int,
                     device: str, progress=None) -> Dict[str, List[float]]:
    """Time several steps with interleaved repeats.

    Warm-up: ``warmup`` calls of every step.  Then ``repeats`` rounds; round ``r`` calls every step
    once, in the list order rotated by ``r``.  The garbage collector is off while timing.

    Args:
        steps: Name -> zero-argument callable.
        warmup: Untimed calls per step.
        repeats: Timed rounds.
        device: For CUDA synchronisation around every call.
        progress: Optional tqdm bar, advanced once per call.

    Returns:
        dict: Name -> list of ``repeats`` wall times in seconds, in round order.
    """
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
            _sync(device)
            if progress is not None and name != MATMUL_STEP:
                progress.update()
    times: Dict[str, List[float]] = {name: [] for name in names}
    gc.collect()
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                _sync(device)
                t0 = time.perf_counter()
                steps[name]()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
                if progress is not None and name != MATMUL_STEP:
                    progress.update()
    finally:
        if gc_enabled:
            gc.enable()
    return times


# --------------------------------------------------------------------------------------------
# fresh-process memory worker
# --------------------------------------------------------------------------------------------
def _set_threads(threads: Optional[int]):
    if threads:
        torch.set_num_threads(threads)


def worker_main(cfg: dict) -> dict:
    """Measure the peak memory of one point; runs inside a fresh process (``--_worker``).

    Args:
        cfg: dict with model, resolution, batch, mode, precision, device, threads, mem_iters.

    Returns:
        dict: ``status`` ('ok' | 'oom' | 'error'), ``peak_mem_mb``, ``mem_base_mb``,
        ``mem_method``, ``note``.
    """
    _set_threads(cfg.get('threads'))
    device = cfg['device']
    spec = parse_model(cfg['model'])
    torch.manual_seed(0)
    model, forward = build_model(spec, device)
    tiny = torch.randn(1, 3, 64, 64, device=device)
    make_step(model, forward, tiny, cfg['mode'], device, cfg['precision'])()
    del tiny
    res = cfg['resolution']
    img = torch.randn(cfg['batch'], 3, res, res, device=device)
    step = make_step(model, forward, img, cfg['mode'], device, cfg['precision'])
    gc.collect()
    _release_free_heap()
    try:
        if device == 'cuda':
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            for _ in range(cfg['mem_iters']):
                step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            method = 'cuda max_memory_allocated - memory_allocated before the call(s)'
        else:
            _reset_peak_rss()
            base = _proc_status_kb('VmRSS') * 1024
            for _ in range(cfg['mem_iters']):
                step()
            peak = _proc_status_kb('VmHWM') * 1024
            threshold = os.environ.get('MALLOC_MMAP_THRESHOLD_')
            method = ('fresh process: VmHWM - VmRSS after build, 64px warm-up, input and '
                      'malloc_trim; ' + (f'MALLOC_MMAP_THRESHOLD_={threshold} (live tensors)'
                                         if threshold else 'glibc default malloc (process RSS)'))
    except torch.cuda.OutOfMemoryError as e:
        return dict(status='oom', note=f'CUDA OOM: {str(e).splitlines()[0]}')
    return dict(status='ok', peak_mem_mb=(peak - base) / 2 ** 20, mem_base_mb=base / 2 ** 20,
                mem_method=method, note='')


def run_memory_worker(cfg: dict, limit_bytes: int, timeout_s: float) -> dict:
    """Run :func:`worker_main` in a fresh Python process and return its result.

    The parent polls the child's resident set every 50 ms and kills it above ``limit_bytes``
    (reported as ``status='oom'``), so that a point that does not fit never reaches the kernel's
    OOM killer on a shared machine.

    Args:
        cfg: Worker config (see :func:`worker_main`).
        limit_bytes: RSS above which the child is killed.
        timeout_s: Wall-clock limit of the child.

    Returns:
        dict: The worker's result, or ``status`` 'oom' / 'timeout' / 'error' with a ``note``.
    """
    env = os.environ.copy()
    env['PYTHONPATH'] = os.pathsep.join(p for p in (REPO_ROOT, env.get('PYTHONPATH')) if p)
    if cfg.get('threads'):
        env['OMP_NUM_THREADS'] = env['MKL_NUM_THREADS'] = str(cfg['threads'])
    if cfg.get('cpu_mem_mode', 'live') == 'live':
        # A fixed mmap threshold turns off glibc's dynamic one: every block >= 64 KiB (every
        # tensor that matters) gets its own mapping, unmapped when freed, so the RSS peak follows
        # the live tensors.  With the default, freed blocks stay in the heap and the peak varies
        # +-15% run to run and overstates the need by up to 2x (measured on XCiT-S12/16 @512).
        env['MALLOC_MMAP_THRESHOLD_'] = '65536'
    else:
        env.pop('MALLOC_MMAP_THRESHOLD_', None)
    cmd = [sys.executable, os.path.abspath(__file__), '--_worker', json.dumps(cfg)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO_ROOT)
    start, max_rss = time.time(), 0
    while True:
        try:
            out, err = proc.communicate(timeout=0.05)
            break
        except subprocess.TimeoutExpired:
            try:
                max_rss = max(max_rss, _proc_status_kb('VmRSS', str(proc.pid)) * 1024)
            except (OSError, RuntimeError):
                pass  # the process is exiting
            if max_rss > limit_bytes or time.time() - start > timeout_s:
                proc.kill()
                proc.communicate()
                if max_rss > limit_bytes:
                    return dict(status='oom', note=f'killed at RSS {max_rss / 2**30:.1f} GiB > '
                                f'--mem-limit-gb {limit_bytes / 2**30:.1f}')
                return dict(status='timeout', note=f'memory worker ran > {timeout_s:.0f} s')
    for line in out.splitlines():
        if line.startswith(WORKER_MARK):
            return json.loads(line[len(WORKER_MARK):])
    tail = ' | '.join(err.strip().splitlines()[-3:])
    reason = 'killed by signal 9 (kernel OOM killer?)' if proc.returncode == -9 else \
        f'exit code {proc.returncode}'
    return dict(status='error', note=f'memory worker failed ({reason}): {tail}')


# --------------------------------------------------------------------------------------------
# FLOPs per point
# --------------------------------------------------------------------------------------------
def _count_model_flops(model: nn.Module, forward: Callable, resolution: int,
                       mode: str) -> Tuple[int, int]:
    """(forward FLOPs, executed FLOPs of ``mode``) of one ``resolution`` x ``resolution`` image."""
    img = torch.randn(1, 3, resolution, resolution)
    model.eval()
    with torch.no_grad():
        fwd = count_flops(lambda: forward(img))
    if mode == 'inference':
        return fwd, fwd
    model.train()

    def train_step():
        sum(o.float().mean() for o in forward(img)).backward()
    try:
        return fwd, count_flops(train_step)
    finally:
        for p in model.parameters():
            p.grad = None


def point_flops(spec: ModelSpec, resolution: int, mode: str,
                cache: Optional[Dict[str, Tuple[nn.Module, Callable]]] = None) -> dict:
    """Forward MACs and executed FLOPs for one image of one point.

    Counted without computing: real weights, but the input is a ``FakeTensor``
    (``FakeTensorMode(allow_non_fake_inputs=True)``), so every op only propagates shapes -- any
    size is cheap, and models that query their device (autocast) or call ``.item()`` on real
    buffers still run.  If a model cannot run on fake tensors it is counted with one real image.

    Args:
        spec: The model.
        resolution: Square input side.
        mode: ``'inference'`` or ``'train'``.
        cache: Optional name -> (model, forward) dict of CPU models reused for counting.

    Returns:
        dict: ``gmacs`` (forward, paper "GFLOPs"), ``gflop_exec`` (2 per MAC, incl. backward and
        checkpoint recomputation in train mode), ``params_m``, ``flops_counter``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    cache = {} if cache is None else cache
    if spec.name not in cache:
        torch.manual_seed(0)
        cache[spec.name] = build_model(spec, 'cpu')
    model, forward = cache[spec.name]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            fwd, executed = _count_model_flops(model, forward, resolution, mode)
        counter = 'torch FlopCounterMode, fake tensors'
    except Exception:  # data-dependent control flow: count a real image instead
        fwd, executed = _count_model_flops(model, forward, resolution, mode)
        counter = 'torch FlopCounterMode, real CPU pass'
    return dict(gmacs=fwd / 2e9, gflop_exec=executed / 1e9, params_m=count_params(model) / 1e6,
                flops_counter=counter)


# --------------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------------
@dataclass
class RunOptions:
    """Options shared by all points of one run (see the argparse help)."""

    batch: int = 1
    mode: str = 'inference'
    precision: str = 'fp32'
    device: str = 'cpu'
    threads: Optional[int] = None
    warmup: int = 1
    repeats: int = 5
    mem_iters: int = 2
    cpu_mem_mode: str = 'live'
    mem_limit_bytes: int = 8 * 2 ** 30
    mem_timeout_s: float = 1800.
    do_time: bool = True
    do_mem: bool = True
    do_flops: bool = True
    quiet: bool = False


def _progress(total: int, quiet: bool, desc: str):
    if quiet:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)


def _warn_if_loaded(opts: RunOptions):
    """Warn when other processes compete for the cores this run's threads need."""
    if opts.device != 'cpu' or not opts.do_time:
        return
    try:
        load = os.getloadavg()[0]
    except OSError:
        return
    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    if load + threads > cores + 0.5 and threads > 1:
        print(f'WARNING: load average {load:.1f} on {cores} cores: with {threads} threads the '
              'OpenMP barriers wait for descheduled threads and CPU times are inflated several '
              'fold (and noisy). On a shared machine use --threads 1 for speed comparisons.',
              file=sys.stderr)


def run_points(points: Sequence[Tuple[ModelSpec, int]],
               opts: RunOptions) -> Tuple[List[dict], dict]:
    """Measure a list of (model, resolution) points.

    Per resolution: FLOPs (fake tensors), then one fresh memory-worker process per point, then the
    interleaved timing of every point that fitted, in this process (models built once).

    Args:
        points: (spec, resolution) pairs; each pair once.
        opts: Run options.

    Returns:
        tuple: (records, meta) -- one dict per point (CSV_FIELDS plus ``times_s``) and run metadata.
    """
    if opts.device == 'cuda' and not torch.cuda.is_available():
        raise RuntimeError('--device cuda requested but torch.cuda.is_available() is False')
    _set_threads(opts.threads)
    _warn_if_loaded(opts)
    resolutions = sorted({r for _, r in points})
    n_time_calls = (opts.warmup + opts.repeats) if opts.do_time else 0
    progress = _progress(len(points) * (int(opts.do_mem) + n_time_calls + 1), opts.quiet,
                         f'benchmark ({opts.device}, {opts.mode}, {opts.precision})')
    matmul_before = measure_matmul_gflops(opts.device)
    records: List[dict] = []
    built: Dict[str, Tuple[nn.Module, Callable]] = {}
    flops_models: Dict[str, Tuple[nn.Module, Callable]] = {}
    for res in resolutions:
        specs = [s for s, r in points if r == res]
        recs: Dict[str, dict] = {}
        for spec in specs:
            rec = dict(model=spec.name, description=spec.description, resolution=res,
                       batch=opts.batch, mode=opts.mode, precision=opts.precision,
                       device=opts.device, threads=opts.threads or torch.get_num_threads(),
                       with_cp=spec.with_cp, status='ok', warmup=opts.warmup,
                       repeats=opts.repeats, note='')
            if progress is not None:
                progress.set_postfix_str(f'{spec.name}@{res} flops/memory')
            if opts.do_flops:
                rec.update(point_flops(spec, res, opts.mode, flops_models))
            if progress is not None:
                progress.update()
            if opts.do_mem:
                rec.update(run_memory_worker(dict(
                    model=spec.name, resolution=res, batch=opts.batch, mode=opts.mode,
                    precision=opts.precision, device=opts.device, threads=opts.threads,
                    mem_iters=opts.mem_iters, cpu_mem_mode=opts.cpu_mem_mode),
                    opts.mem_limit_bytes, opts.mem_timeout_s))
                if progress is not None:
                    progress.update()
            recs[spec.name] = rec
        if opts.do_time:
            steps = {}
            img = torch.randn(opts.batch, 3, res, res, device=opts.device)
            for spec in specs:
                if recs[spec.name]['status'] != 'ok':
                    if progress is not None:
                        progress.update(n_time_calls)
                    continue
                if spec.name not in built:
                    torch.manual_seed(0)
                    built[spec.name] = build_model(spec, opts.device)
                model, forward = built[spec.name]
                steps[spec.name] = make_step(model, forward, img, opts.mode, opts.device,
                                             opts.precision)
            if progress is not None:
                progress.set_postfix_str(f'timing {len(steps)} models @{res}')
            if steps:  # the reference matmul rate, interleaved with the models: same load
                steps[MATMUL_STEP] = make_matmul_step(opts.device)
            try:
                times = time_interleaved(steps, opts.warmup, opts.repeats, opts.device,
                                         progress) if steps else {}
            except torch.cuda.OutOfMemoryError as e:
                for name in steps:
                    recs[name].update(status='oom', note=f'CUDA OOM while timing: {e}'[:200])
                times = {}
                torch.cuda.empty_cache()
            mm_times = times.pop(MATMUL_STEP, None)
            for name, ts in times.items():
                recs[name]['matmul_gflop_s'] = matmul_gflops(statistics.median(mm_times))
                per_img = [t / opts.batch for t in ts]
                q = statistics.quantiles(per_img, n=4) if len(per_img) > 1 else per_img * 3
                med = statistics.median(per_img)
                recs[name].update(ms_per_img=med * 1e3, ms_p25=q[0] * 1e3, ms_p75=q[2] * 1e3,
                                  imgs_per_s=1.0 / med, times_s=ts)
            del img, steps
        records.extend(recs[s.name] for s in specs)
    del flops_models
    matmul_after = measure_matmul_gflops(opts.device)
    if progress is not None:
        progress.close()
    matmul = (matmul_before + matmul_after) / 2
    for rec in records:
        rec.setdefault('matmul_gflop_s', matmul)
        if 'ms_per_img' in rec and 'gflop_exec' in rec:
            rec['achieved_gflop_s'] = rec['gflop_exec'] / (rec['ms_per_img'] / 1e3)
            rec['matmul_frac'] = rec['achieved_gflop_s'] / matmul
    meta = run_metadata()
    meta.update(matmul_gflop_s_before=matmul_before, matmul_gflop_s_after=matmul_after,
                options={k: v for k, v in vars(opts).items()})
    return records, meta


def run_metadata() -> dict:
    """Machine, software and load information stored with every result."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    cpu = platform.processor()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next((ln.split(':', 1)[1].strip() for ln in f if ln.startswith('model name')),
                       cpu)
    except OSError:
        pass
    meta = dict(date=time.strftime('%Y-%m-%d %H:%M:%S'), host=platform.node(), cpu=cpu,
                cpu_count=os.cpu_count(), torch=torch.__version__, python=platform.python_version(),
                torch_threads=torch.get_num_threads(), loadavg_1_5_15=load,
                command=' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
    if torch.cuda.is_available():
        meta['gpu'] = torch.cuda.get_device_name()
    return meta


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------
def _fmt(value, digits: int = 1) -> str:
    if value is None or value == '':
        return '-'
    if isinstance(value, float):
        return f'{value:.{digits}f}'
    return str(value)


def print_table(records: Sequence[dict], file=None):
    """Print a human readable table of the records."""
    file = file or sys.stdout
    header = (f'{"model":<28}{"res":>6}{"status":>8}{"ms/img":>10}{"img/s":>9}{"peak MB":>10}'
              f'{"GMACs":>9}{"GFLOP/s":>9}{"%mm":>6}')
    print(header, file=file)
    print('-' * len(header), file=file)
    for r in records:
        frac = r.get('matmul_frac')
        print(f'{r["model"]:<28}{r["resolution"]:>6}{r["status"]:>8}'
              f'{_fmt(r.get("ms_per_img")):>10}{_fmt(r.get("imgs_per_s"), 2):>9}'
              f'{_fmt(r.get("peak_mem_mb")):>10}{_fmt(r.get("gmacs"), 2):>9}'
              f'{_fmt(r.get("achieved_gflop_s")):>9}'
              f'{(f"{100 * frac:.0f}" if frac is not None else "-"):>6}', file=file)
        if r.get('note'):
            print(f'    note: {r["note"]}', file=file)


def write_outputs(records: Sequence[dict], meta: dict, out_dir: str, name: str,
                  plot: bool = True, title: str = '') -> List[str]:
    """Write ``<name>.csv``, ``<name>.json`` and (optionally) ``<name>.png`` under ``out_dir``.

    Returns:
        list: The written paths.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    csv_path = os.path.join(out_dir, f'{name}.csv')
    with open(csv_path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction='ignore')
        writer.writeheader()
        for r in records:
            writer.writerow({k: (round(v, 4) if isinstance(v, float) else v)
                             for k, v in r.items() if k in CSV_FIELDS})
    paths.append(csv_path)
    json_path = os.path.join(out_dir, f'{name}.json')
    with open(json_path, 'w') as f:
        json.dump(dict(meta=meta, records=list(records)), f, indent=1, default=str)
    paths.append(json_path)
    if plot:
        png_path = os.path.join(out_dir, f'{name}.png')
        plot_records(records, png_path, title or _default_title(meta, records))
        paths.append(png_path)
    return paths


def _default_title(meta: dict, records: Sequence[dict]) -> str:
    if not records:
        return ''
    r = records[0]
    load = meta.get('loadavg_1_5_15')
    load_s = f', load {load[0]:.1f}' if load else ''
    return (f'{r["device"]} {r["mode"]} {r["precision"]}, batch {r["batch"]}, '
            f'threads={r["threads"]}{load_s} ({meta.get("date", "")})')


def plot_records(records: Sequence[dict], path: str, title: str = ''):
    """Plot ms/image and peak memory vs resolution (log-log), one line per model."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    models = list(dict.fromkeys(r['model'] for r in records))
    for key, ax, label in (('ms_per_img', axes[0], 'time per image [ms]'),
                           ('peak_mem_mb', axes[1], 'peak memory growth [MB]')):
        for model in models:
            pts = sorted((r['resolution'], r[key]) for r in records
                         if r['model'] == model and r.get(key) is not None and r[key] > 0)
            failed = sorted(r['resolution'] for r in records
                            if r['model'] == model and r['status'] != 'ok')
            if not pts:
                continue
            suffix = f' ({", ".join(map(str, failed))}: OOM/failed)' if failed else ''
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o', label=model + suffix)
        ax.set_xscale('log', base=2)
        ax.set_yscale('log')
        resolutions = sorted({r['resolution'] for r in records})
        ax.set_xticks(resolutions)
        ax.set_xticklabels([str(r) for r in resolutions])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel('input side [px] (square input)')
        ax.set_ylabel(label)
        ax.grid(True, which='both', alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, 'not measured', ha='center', va='center', transform=ax.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# compare / goals / flops report
# --------------------------------------------------------------------------------------------
def _median_paired_ratio(a: dict, b: dict) -> Optional[float]:
    ta, tb = a.get('times_s'), b.get('times_s')
    if not ta or not tb or len(ta) != len(tb):
        return None
    return statistics.median(x / y for x, y in zip(ta, tb))


def ratio_rows(records: Sequence[dict], pairs: Sequence[Tuple[str, str]]) -> List[dict]:
    """Time and memory ratios A/B per resolution for the given (A, B) model-name pairs."""
    index = {(r['model'], r['resolution']): r for r in records}
    rows = []
    for a_name, b_name in pairs:
        for res in sorted({r['resolution'] for r in records}):
            a, b = index.get((a_name, res)), index.get((b_name, res))
            if a is None or b is None:
                continue
            row = dict(a=a_name, b=b_name, resolution=res)
            if a.get('ms_per_img') and b.get('ms_per_img'):
                row['time_ratio'] = a['ms_per_img'] / b['ms_per_img']
                row['paired_time_ratio'] = _median_paired_ratio(a, b)
            if a.get('peak_mem_mb') and b.get('peak_mem_mb'):
                row['mem_ratio'] = a['peak_mem_mb'] / b['peak_mem_mb']
            row.update(a_ms=a.get('ms_per_img'), b_ms=b.get('ms_per_img'),
                       a_mb=a.get('peak_mem_mb'), b_mb=b.get('peak_mem_mb'))
            rows.append(row)
    return rows


def print_ratios(rows: Sequence[dict], file=None):
    """Print the rows of :func:`ratio_rows`."""
    file = file or sys.stdout
    header = (f'{"A":<26}{"B":<26}{"res":>6}{"A ms":>9}{"B ms":>9}{"t A/B":>7}{"paired":>8}'
              f'{"A MB":>9}{"B MB":>9}{"mem A/B":>8}')
    print(header, file=file)
    print('-' * len(header), file=file)
    for r in rows:
        print(f'{r["a"]:<26}{r["b"]:<26}{r["resolution"]:>6}{_fmt(r.get("a_ms")):>9}'
              f'{_fmt(r.get("b_ms")):>9}{_fmt(r.get("time_ratio"), 3):>7}'
              f'{_fmt(r.get("paired_time_ratio"), 3):>8}{_fmt(r.get("a_mb")):>9}'
              f'{_fmt(r.get("b_mb")):>9}{_fmt(r.get("mem_ratio"), 3):>8}', file=file)
    print('t A/B = ratio of the median times; paired = median of the per-round ratios of the '
          'interleaved repeats (more robust to machine noise).', file=file)


def compare_pairs(specs: Sequence[ModelSpec]) -> Tuple[List[ModelSpec], List[Tuple[str, str]]]:
    """``--compare``: for every XCiT model, XCiTBackbone.forward_trunk vs mmpretrain's trunk."""
    out, pairs = [], []
    for spec in specs:
        if spec.family not in ('xcit', 'xcit_trunk'):
            continue
        ours = parse_model(f'xcit_{spec.arch}_p{spec.patch}_trunk')
        port = parse_model(f'mmpretrain_xcit_{spec.arch}_p{spec.patch}')
        for s in (ours, port):
            if s not in out:
                out.append(s)
        pairs.append((ours.name, port.name))
    if not pairs:
        raise ValueError('--compare needs at least one xcit_* model in --models')
    return out, pairs


def check_same_trunk(arch: str, patch: int, resolution: int = 64) -> str:
    """Load the port's weights into XCiTBackbone and compare the trunk outputs (eval mode).

    Uses XCiTBackbone's ``init_cfg=dict(type='Pretrained')`` loader on an mmpretrain-layout file
    (``{'state_dict': {'backbone.' + key: tensor}}``).  Shows that ``--compare`` times the same
    computation.

    Returns:
        str: A one-line verdict (max abs difference, or why it could not be checked).
    """
    try:
        torch.manual_seed(0)
        port, _ = build_model(parse_model(f'mmpretrain_xcit_{arch}_p{patch}'))
        with torch.no_grad():  # non-trivial BatchNorm statistics
            for m in port.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.1, 0.1)
                    m.running_var.uniform_(0.5, 1.5)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, 'port.pth')
            torch.save({'state_dict': {'backbone.' + k: v for k, v in
                                       port.state_dict().items()}}, path)
            _ensure_xcit_mm_importable()
            import xcit_mm  # noqa: F401
            from mmengine.registry import MODELS
            ours = MODELS.build(dict(type='XCiTBackbone', arch=arch, patch_size=patch,
                                     norm_cfg=dict(type='BN'),
                                     init_cfg=dict(type='Pretrained', checkpoint=path)))
            ours.init_weights()
        port.eval()
        ours.eval()
        img = torch.randn(1, 3, resolution, resolution)
        with torch.no_grad():
            a, b = ours.forward_trunk(img), port(img)
        diff = max((x - y).abs().max().item() for x, y in zip(a, b))
        scale = max(y.abs().max().item() for y in b)
        return (f'same trunk check XCiT-{arch.upper()}/{patch}: port weights loaded into '
                f'XCiTBackbone, max |diff| of the {len(a)} trunk maps = {diff:.2e} '
                f'(max |value| {scale:.2e})')
    except Exception as e:  # report, do not abort the benchmark
        return f'same trunk check XCiT-{arch.upper()}/{patch} not possible: ' \
               f'{type(e).__name__}: {e}'


def _verdict(ok: Optional[bool]) -> str:
    return 'PASS' if ok else ('FAIL' if ok is not None else 'N/A')


def run_goals(opts: RunOptions) -> Tuple[List[dict], List[dict], dict]:
    """Measure the project's goals side by side (batch 1, fp32, ``opts.device``).

    1. XCiT-S12/16 (backbone+adapter) peak inference memory 1024^2 / 512^2 <= 4.6.
    2. At 1024^2: XCiT-S12/16 backbone+adapter <= 0.75x Swin-T's and <= 0.45x ViT-S/16's peak.
    3. XCiTBackbone S12/8 trunk vs mmpretrain's port at 384^2: median time ratio <= 0.9 (the
       paired per-round ratio is printed too) at <= 1.1x its peak memory.
    4. XCiT-S12/16 train step at 1024^2: with_cp cuts the peak memory by >= 40%.

    Returns:
        tuple: (goal rows, all point records, meta).
    """
    base = RunOptions(**{**vars(opts), 'batch': 1, 'precision': 'fp32', 'mode': 'inference'})
    mem_only = RunOptions(**{**vars(base), 'do_time': False})
    xs, swin, vit = (parse_model(n) for n in ('xcit_s12_p16', 'swin_t', 'vit_s16'))
    ours8, port8 = parse_model('xcit_s12_p8_trunk'), parse_model('mmpretrain_xcit_s12_p8')
    xs_cp = parse_model('xcit_s12_p16+cp')
    records: List[dict] = []
    print('[goals 1+2] peak inference memory, fresh process per point', file=sys.stderr)
    recs, meta = run_points([(xs, 512), (xs, 1024), (swin, 1024), (vit, 1024)], mem_only)
    records += recs
    print('[goals 3] XCiTBackbone S12/8 trunk vs mmpretrain port at 384, interleaved repeats',
          file=sys.stderr)
    recs, _ = run_points([(ours8, 384), (port8, 384)], base)
    records += recs
    print('[goals 4] train step at 1024 with and without with_cp', file=sys.stderr)
    recs, _ = run_points([(xs, 1024), (xs_cp, 1024)],
                         RunOptions(**{**vars(mem_only), 'mode': 'train'}))
    records += recs

    def get(name, res, mode, key):
        for r in records:
            if (r['model'], r['resolution'], r['mode']) == (name, res, mode):
                return r.get(key)
        return None

    def ratio(a, b):
        return a / b if a and b else None

    goals = []
    m512, m1024 = (get('xcit_s12_p16', r, 'inference', 'peak_mem_mb') for r in (512, 1024))
    value = ratio(m1024, m512)
    goals.append(dict(goal='XCiT-S12/16 peak inference memory 1024^2 / 512^2',
                      target=f'<= {GOAL_MEM_SCALING_MAX}', value=value,
                      detail=f'{_fmt(m1024)} MB / {_fmt(m512)} MB',
                      ok=None if value is None else value <= GOAL_MEM_SCALING_MAX))
    for other, limit, label in (('swin_t', GOAL_MEM_VS_SWIN_MAX, 'Swin-T'),
                                ('vit_s16', GOAL_MEM_VS_VIT_MAX, 'ViT-S/16')):
        mo = get(other, 1024, 'inference', 'peak_mem_mb')
        value = ratio(m1024, mo)
        goals.append(dict(goal=f'1024^2 peak memory XCiT-S12/16 backbone+adapter / {label}',
                          target=f'<= {limit}', value=value,
                          detail=f'{_fmt(m1024)} MB / {_fmt(mo)} MB',
                          ok=None if value is None else value <= limit))
    rows = ratio_rows(records, [(ours8.name, port8.name)])
    row = rows[0] if rows else {}
    value = row.get('time_ratio')
    goals.append(dict(goal='384^2 time XCiTBackbone S12/8 trunk / mmpretrain port',
                      target=f'<= {GOAL_SPEED_VS_PORT_MAX}', value=value,
                      detail=f'{_fmt(row.get("a_ms"))} ms / {_fmt(row.get("b_ms"))} ms, paired '
                             f'median ratio {_fmt(row.get("paired_time_ratio"), 3)}, '
                             f'{opts.repeats} interleaved repeats',
                      ok=None if value is None else value <= GOAL_SPEED_VS_PORT_MAX))
    value = row.get('mem_ratio')
    goals.append(dict(goal='384^2 peak memory XCiTBackbone S12/8 trunk / mmpretrain port',
                      target=f'<= {GOAL_MEM_VS_PORT_MAX}', value=value,
                      detail=f'{_fmt(row.get("a_mb"))} MB / {_fmt(row.get("b_mb"))} MB',
                      ok=None if value is None else value <= GOAL_MEM_VS_PORT_MAX))
    plain = get('xcit_s12_p16', 1024, 'train', 'peak_mem_mb')
    ckpt = get('xcit_s12_p16+cp', 1024, 'train', 'peak_mem_mb')
    value = 1 - ckpt / plain if plain and ckpt else None
    goals.append(dict(goal='1024^2 train-step peak memory saved by with_cp (S12/16)',
                      target=f'>= {GOAL_CP_SAVING_MIN:.0%}', value=value,
                      detail=f'{_fmt(ckpt)} MB with_cp vs {_fmt(plain)} MB without',
                      ok=None if value is None else value >= GOAL_CP_SAVING_MIN))
    return goals, records, meta


def print_goals(goals: Sequence[dict], file=None):
    """Print the PASS/FAIL table of :func:`run_goals`."""
    file = file or sys.stdout
    for g in goals:
        print(f'{_verdict(g["ok"]):<5} {g["goal"]:<62} {_fmt(g["value"], 3):>7} '
              f'(target {g["target"]}) {g["detail"]}', file=file)


def flops_report() -> List[dict]:
    """FLOPs of every XCiT arch vs paper Table 1 (224/p16 and 384/p8).

    What is counted (``FlopCounterMode``, MACs = FLOPs / 2, the paper's "GFLOPs"):

    * ``trunk``: ``XCiTBackbone.forward_trunk`` (conv patch embed, position projection, all XCiT
      layers incl. the XCA products; no adapter).
    * ``cls_part``: what the ImageNet classifier adds on top of the trunk, built from mmpretrain's
      modules: 2 ``ClassAttentionBlock`` on the N+1 tokens, LayerNorm, ``Linear(D, 1000)``.
    * ``classifier = trunk + cls_part`` is compared with the paper (<= 5% required).
    * ``port_classifier``: mmpretrain's full ``XCiT`` classifier (cls_attn_layers=2, final norm) +
      head, counted in one go, as an independent check; ``analytic``: formula of the trunk.

    Returns:
        list: One row per (arch, setting).
    """
    xcit_mod = load_mmpretrain_xcit()
    rows = []
    for arch, (dims, depth, heads) in XCIT_ARCHS.items():
        eta = 1.0 if depth == 12 else 1e-5
        for res, patch, key in ((224, 16, 'gmacs_224_p16'), (384, 8, 'gmacs_384_p8')):
            trunk_info = point_flops(parse_model(f'xcit_{arch}_p{patch}_trunk'), res, 'inference')
            tokens = math.ceil(res / patch) ** 2
            with torch.device('meta'):
                cls_part = nn.ModuleList(
                    [xcit_mod.ClassAttentionBlock(dim=dims, num_heads=heads, qkv_bias=True,
                                                  layer_scale_init_value=eta)
                     for _ in range(2)] + [nn.LayerNorm(dims), nn.Linear(dims, 1000)])
                tok = torch.randn(1, tokens + 1, dims)

            def run_cls():
                x = tok
                for blk in cls_part[:2]:
                    x = blk(x)
                return cls_part[3](cls_part[2](x)[:, 0])
            with torch.no_grad():
                cls_macs = count_flops(run_cls) / 2
            with torch.device('meta'):
                port = xcit_mod.XCiT(img_size=res, patch_size=patch, embed_dims=dims, depth=depth,
                                     num_heads=heads, cls_attn_layers=2, out_type='cls_token',
                                     layer_scale_init_value=eta, init_cfg=None)
                head = nn.Linear(dims, 1000)
                img = torch.randn(1, 3, res, res)
            port.eval()
            with torch.no_grad():
                port_macs = count_flops(lambda: head(port(img)[-1])) / 2
            trunk = trunk_info['gmacs']
            classifier = trunk + cls_macs / 1e9
            paper = PAPER_TABLE1[arch][key]
            rows.append(dict(
                arch=arch, setting=f'{res}/p{patch}', trunk_gmacs=trunk,
                analytic_trunk_gmacs=analytic_trunk_macs(arch, patch, res, res) / 1e9,
                cls_part_gmacs=cls_macs / 1e9, classifier_gmacs=classifier,
                port_classifier_gmacs=port_macs / 1e9, paper_gmacs=paper,
                rel_diff=classifier / paper - 1, ok=abs(classifier / paper - 1) <= 0.05,
                classifier_params_m=(count_params(port) + count_params(head)) / 1e6,
                paper_params_m=PAPER_TABLE1[arch]['params_m'],
                backbone_params_m=trunk_info['params_m']))
    return rows


def print_flops_report(rows: Sequence[dict], file=None):
    """Print :func:`flops_report` rows."""
    file = file or sys.stdout
    header = (f'{"arch":<5}{"setting":>9}{"trunk":>9}{"analytic":>9}{"+cls":>7}{"= clsfr":>9}'
              f'{"port":>9}{"paper":>8}{"diff":>8}{"":>6}{"params":>8}{"paper":>8}')
    print('GMACs per image (= paper "GFLOPs"); trunk = XCiTBackbone.forward_trunk, '
          '+cls = 2 class-attention layers + norm + head (mmpretrain modules)', file=file)
    print(header, file=file)
    print('-' * len(header), file=file)
    for r in rows:
        print(f'{r["arch"]:<5}{r["setting"]:>9}{r["trunk_gmacs"]:>9.3f}'
              f'{r["analytic_trunk_gmacs"]:>9.3f}{r["cls_part_gmacs"]:>7.3f}'
              f'{r["classifier_gmacs"]:>9.3f}{r["port_classifier_gmacs"]:>9.3f}'
              f'{r["paper_gmacs"]:>8.2f}{100 * r["rel_diff"]:>7.1f}%{_verdict(r["ok"]):>6}'
              f'{r["classifier_params_m"]:>8.2f}{r["paper_params_m"]:>8.2f}', file=file)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line of the tool."""
    p = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        epilog=__doc__.split('\n\n', 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs='+', default=DEFAULT_MODELS, metavar='NAME',
                   help='models to measure (default: %(default)s); see --list-models')
    p.add_argument('--resolutions', nargs='+', type=int, default=DEFAULT_RESOLUTIONS,
                   metavar='PX', help='square input sides (default: %(default)s); add 2048 where '
                   'it fits: a point whose memory worker exceeds --mem-limit-gb is reported as '
                   'OOM and not timed')
    p.add_argument('--batch-size', type=int, default=1, help='images per call (default: 1)')
    p.add_argument('--mode', choices=['inference', 'train'], default='inference',
                   help='inference: eval() + no_grad forward; train: train() forward + backward '
                   'of sum(out.mean()) with fresh gradients (default: inference)')
    p.add_argument('--precision', choices=['fp32', 'amp'], default='fp32',
                   help='fp32, or amp = torch.autocast with bf16 on CPU / fp16 on CUDA')
    p.add_argument('--device', choices=['cpu', 'cuda'], default='cpu', help='(default: cpu)')
    p.add_argument('--threads', type=int, default=None,
                   help='torch.set_num_threads (and OMP/MKL threads of the memory workers); '
                   'default: torch\'s default')
    p.add_argument('--warmup', type=int, default=None,
                   help='untimed calls per model and resolution (default 1; --goals 2)')
    p.add_argument('--repeats', type=int, default=None,
                   help='timed interleaved rounds; the median is reported (default 5; '
                   '--goals 10). Run-to-run noise of a shared CPU is ~10%%: use >= 10 for '
                   'decisions')
    p.add_argument('--with-cp', choices=['off', 'on', 'both'], default='off',
                   help='gradient checkpointing for models that support it (all but the '
                   'mmpretrain port); both = each model with and without (the +cp suffix on a '
                   'model name does the same for one model)')
    p.add_argument('--mem-iters', type=int, default=2,
                   help='calls in each fresh memory process after the baseline (default: 2)')
    p.add_argument('--cpu-mem-mode', choices=['live', 'process'], default='live',
                   help='CPU peak memory: live = the memory workers run with '
                   'MALLOC_MMAP_THRESHOLD_=65536, so the RSS peak follows the live tensors '
                   '(reproducible to <1%%, comparable to CUDA max_memory_allocated); process = '
                   'glibc defaults, the RSS a plain process shows, incl. freed heap blocks glibc '
                   'keeps (up to 2x more, +-15%% run to run). Default: live')
    p.add_argument('--mem-limit-gb', type=float, default=None,
                   help='kill a memory worker above this RSS and report OOM (default: 80%% of '
                   'MemAvailable at start)')
    p.add_argument('--mem-timeout', type=float, default=1800., help='seconds per memory worker')
    p.add_argument('--no-time', action='store_true', help='skip the timing (memory/FLOPs only)')
    p.add_argument('--no-mem', action='store_true', help='skip the fresh-process memory workers')
    p.add_argument('--no-flops', action='store_true', help='skip FLOP counting')
    p.add_argument('--compare', action='store_true',
                   help='for every xcit_* model: XCiTBackbone.forward_trunk vs mmpretrain\'s port '
                   'of the same trunk (cls_attn_layers=0; same out_indices), interleaved; prints '
                   'median time ratio, paired ratio and memory ratio; also loads the port\'s '
                   'weights into XCiTBackbone and reports the max output difference')
    p.add_argument('--goals', action='store_true',
                   help='run exactly the project\'s goal checks (batch 1, fp32) and print '
                   'PASS/FAIL with the measured numbers')
    p.add_argument('--fail-on-goal-miss', action='store_true',
                   help='with --goals: exit with status 3 if a goal fails')
    p.add_argument('--flops-report', action='store_true',
                   help='GMACs of every XCiT arch at 224/p16 and 384/p8 vs paper Table 1 (no '
                   'device, no compute)')
    p.add_argument('--out-dir', default='work_dirs/benchmark',
                   help='where CSV/JSON/PNG go (default: %(default)s)')
    p.add_argument('--name', default=None,
                   help='file name stem (default: benchmark / compare / goals / flops)')
    p.add_argument('--no-plot', action='store_true', help='no PNG')
    p.add_argument('--quiet', action='store_true', help='no progress bar')
    p.add_argument('--list-models', action='store_true', help='list model names and exit')
    p.add_argument('--replot', metavar='JSON', default=None,
                   help='only redraw the PNG of an earlier run from its JSON (written next to it)')
    p.add_argument('--_worker', default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ('batch_size', 'repeats', 'mem_iters'):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f'--{name.replace("_", "-")} must be >= 1')
    if args.warmup is not None and args.warmup < 0:
        p.error('--warmup must be >= 0')
    if any(r < 32 for r in args.resolutions):
        p.error('--resolutions must be >= 32 (the stride-32 level of the dense backbones)')
    if args.no_time and args.no_mem and args.no_flops and not (args.flops_report or args.goals):
        p.error('nothing to measure: --no-time, --no-mem and --no-flops all given')
    return args


def list_models() -> str:
    """The model names ``--models`` accepts, as text."""
    archs = '|'.join(XCIT_ARCHS)
    lines = [f'xcit_<{archs}>_p<8|16>           XCiTBackbone (trunk + adapter)',
             f'xcit_<{archs}>_p<8|16>_trunk     XCiTBackbone.forward_trunk',
             f'mmpretrain_xcit_<{archs}>_p<8|16> mmpretrain XCiT port, trunk only']
    lines += [f'{k:<32}{v}' for k, v in BASELINES.items()]
    lines.append('any name + "+cp": built with with_cp=True (not for mmpretrain_xcit_*)')
    return '\n'.join(lines)


def _mem_available_bytes() -> int:
    try:
        return _read_kb('/proc/meminfo', 'MemAvailable') * 1024
    except (OSError, RuntimeError):
        return 8 * 2 ** 30


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    # mmcv's ConvModule warns about mmpretrain's LPI conv (bias before a norm): not our concern
    warnings.filterwarnings('ignore', message='Unnecessary conv bias before batch/instance norm')
    if args._worker is not None:
        try:
            result = worker_main(json.loads(args._worker))
        except Exception as e:  # reported to the parent, which records status='error'
            traceback.print_exc()
            result = dict(status='error', note=f'{type(e).__name__}: {e}'[:300])
        print(WORKER_MARK + json.dumps(result), flush=True)
        return 0
    if args.list_models:
        print(list_models())
        return 0
    if args.replot:
        with open(args.replot) as f:
            data = json.load(f)
        png = os.path.splitext(args.replot)[0] + '.png'
        plot_records(data['records'], png, _default_title(data['meta'], data['records']))
        print(f'wrote {png}')
        return 0
    limit = args.mem_limit_gb * 2 ** 30 if args.mem_limit_gb else 0.8 * _mem_available_bytes()
    opts = RunOptions(batch=args.batch_size, mode=args.mode, precision=args.precision,
                      device=args.device, threads=args.threads,
                      warmup=args.warmup if args.warmup is not None else (2 if args.goals else 1),
                      repeats=args.repeats or (10 if args.goals else 5), mem_iters=args.mem_iters,
                      cpu_mem_mode=args.cpu_mem_mode,
                      mem_limit_bytes=int(limit), mem_timeout_s=args.mem_timeout,
                      do_time=not args.no_time, do_mem=not args.no_mem,
                      do_flops=not args.no_flops, quiet=args.quiet)
    _set_threads(args.threads)

    if args.flops_report:
        rows = flops_report()
        print_flops_report(rows)
        name = args.name or 'flops'
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, f'{name}.csv'), 'w', newline='') as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        with open(os.path.join(args.out_dir, f'{name}.json'), 'w') as f:
            json.dump(dict(meta=run_metadata(), rows=rows), f, indent=1)
        print(f'wrote {args.out_dir}/{name}.csv and .json')
        return 0 if all(r['ok'] for r in rows) else 3

    if args.goals:
        goals, records, meta = run_goals(opts)
        print_table(records)
        print()
        print_goals(goals)
        meta['goals'] = goals
        paths = write_outputs(records, meta, args.out_dir, args.name or 'goals', plot=False)
        print('wrote ' + ', '.join(paths))
        failed = any(g['ok'] is not True for g in goals)
        return 3 if failed and args.fail_on_goal_miss else 0

    specs = [parse_model(n) for n in args.models]
    pairs: List[Tuple[str, str]] = []
    if args.compare:
        specs, pairs = compare_pairs(specs)
    if args.with_cp != 'off':
        expanded = []
        for s in specs:
            cp_spec = s if s.with_cp or s.family == 'mmpretrain_xcit' else parse_model(
                s.name + '+cp')
            if args.with_cp == 'both' and s != cp_spec:
                expanded.append(s)
                pairs.append((cp_spec.name, s.name))
            expanded.append(cp_spec)
        specs = list(dict.fromkeys(expanded))
    if len(set(specs)) != len(specs):
        specs = list(dict.fromkeys(specs))
    checks = []
    if args.compare:
        checks = [check_same_trunk(s.arch, s.patch) for s in specs
                  if s.family == 'xcit_trunk' and not s.with_cp]
    records, meta = run_points([(s, r) for r in args.resolutions for s in specs], opts)
    print_table(records)
    if pairs:
        rows = ratio_rows(records, pairs)
        print()
        print_ratios(rows)
        meta['ratios'] = rows
    for line in checks:
        print(line)
    meta['checks'] = checks
    paths = write_outputs(records, meta, args.out_dir,
                          args.name or ('compare' if args.compare else 'benchmark'),
                          plot=not args.no_plot)
    print('wrote ' + ', '.join(paths))
    return 0


if __name__ == '__main__':
    sys.exit(main())
