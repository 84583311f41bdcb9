# Copyright (c) xcit_mm contributors. All rights reserved.
"""ONNX export of XCiT models (normalised ``image`` in; a segmentor's ``logits`` at the input
size, or a detector's backbone + neck out), checked against PyTorch with ONNX Runtime
(docs/deployment.md)."""
import copy
import importlib
import os
import os.path as osp
import types
import warnings
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.utils import _pair

INSTALL_HINT = ("pip install 'xcit_mm[onnx]' (onnx==1.17.0, onnxruntime==1.20.1) or "
                'bash tools/install.sh')


class ExportError(ValueError):
    """A model or an argument that this exporter cannot handle (one clear message)."""


def check_onnx_runtime(need_runtime: bool = True):
    """``(onnx, onnxruntime or None)``; an :class:`ImportError` naming the install command."""
    try:
        import onnx
    except ImportError as e:
        raise ImportError(f'ONNX export needs the onnx package: {INSTALL_HINT}') from e
    try:
        return onnx, importlib.import_module('onnxruntime') if need_runtime else None
    except ImportError as e:
        raise ImportError(f'--verify needs onnxruntime: {INSTALL_HINT}') from e


class ExportedModel(nn.Module):
    """A segmentor's ``encode_decode`` without the image metas, or a detector's backbone + neck."""

    def __init__(self, model: nn.Module, task: str):
        super().__init__()
        self.model, self.task = model, task

    def forward(self, image: torch.Tensor):
        feats = self.model.extract_feat(image)
        if self.task == 'det':
            return tuple(feats)
        return F.interpolate(self.model.decode_head(feats), size=image.shape[2:], mode='bilinear',
                             align_corners=bool(self.model.decode_head.align_corners))


def build_export_model(config, checkpoint: Optional[str] = None,
                       cfg_options: Optional[dict] = None) -> nn.Module:
    """The module to export for a config (and checkpoint), in eval mode on the CPU, with the
    attributes ``task``, ``output_names`` and ``metadata`` (written into the file)."""
    from mmengine.model import revert_sync_batchnorm
    from mmengine.runner import load_checkpoint

    from xcit_mm.apis import config_task, preprocess_cfg, read_config
    try:
        cfg = read_config(config, cfg_options)
    except (FileNotFoundError, TypeError):
        raise
    except Exception as e:  # a file that is not an mmengine config
        raise ExportError(f'cannot read config {config!r} ({type(e).__name__}: {e}); is it an '
                          'mmdet / mmseg config file?') from e
    if not isinstance(cfg.get('model', None), dict):
        raise ExportError(f'config {config!r} has no model dict')
    task = config_task(cfg)
    model_type = str(cfg.model.get('type', ''))
    if task == 'det':
        if not cfg.model.get('neck'):
            raise ExportError(f'detector {model_type!r} has no neck: ONNX export of a detector '
                              f'covers backbone + neck (e.g. Mask R-CNN\'s FPN)')
        from mmdet.apis import init_detector as init
    else:
        # LeanEncoderDecoder changes only predict(); the exported encode_decode is
        # EncoderDecoder's (a cascade's list of decode heads is refused here)
        if model_type.split('.')[-1] not in ('EncoderDecoder', 'LeanEncoderDecoder'):
            raise ExportError(f'segmentor type {model_type!r} is not supported: ONNX export '
                              'takes an mmseg EncoderDecoder (Semantic FPN, UperNet, ...)')
        from mmseg.apis import init_model as init
    # record=True: init_detector resets the filters to warn "checkpoint is None, use COCO
    # classes" (the class names are taken below)
    with warnings.catch_warnings(record=True):
        model = init(copy.deepcopy(cfg), None, device='cpu')
    model = revert_sync_batchnorm(model).eval()
    meta = {}
    if checkpoint is not None:  # what init_* would do, without mmseg's KeyError for no 'meta'
        meta = load_checkpoint(model, checkpoint, map_location='cpu').get('meta', None) or {}
    wrapper = ExportedModel(model, task)
    if task == 'seg':
        wrapper.output_names = ['logits']
    else:
        with torch.no_grad():
            n_out = len(wrapper(torch.zeros(1, 3, 64, 64)))
        wrapper.output_names = [f'feat{i}' for i in range(n_out)]
    pre = preprocess_cfg(cfg)
    wrapper.metadata = {
        'xcit_mm.task': task,
        'xcit_mm.model': model_type,
        'xcit_mm.input': 'image (B, 3, H, W) float32, normalised: (pixel - mean) / std',
        'xcit_mm.mean': ','.join(f'{v:g}' for v in pre['mean']),
        'xcit_mm.std': ','.join(f'{v:g}' for v in pre['std']),
        'xcit_mm.channel_order': 'RGB' if pre['rgb'] else 'BGR',
        'xcit_mm.outputs': ','.join(wrapper.output_names),
        'xcit_mm.checkpoint_file': osp.basename(checkpoint) if checkpoint else 'random init',
    }
    if task == 'seg':  # the checkpoint's class names, else those of the config's test dataset
        dataset = (cfg.get('test_dataloader', None) or {}).get('dataset', None) or {}
        names = ((meta.get('dataset_meta') or {}).get('classes') or meta.get('CLASSES')
                 or (dataset.get('metainfo', None) or {}).get('classes') or ())
        wrapper.metadata['xcit_mm.classes'] = ','.join(map(str, names))
    return wrapper.eval()


def _upsample_traceable(self, x: torch.Tensor) -> torch.Tensor:
    """mmseg ``Upsample.forward`` without ``int()`` of the traced size (a graph constant)."""
    if self.size:
        return F.interpolate(x, self.size, None, self.mode, self.align_corners)
    return F.interpolate(x, scale_factor=self.scale_factor, mode=self.mode,
                         align_corners=self.align_corners, recompute_scale_factor=True)


def _pool_matrix(length: torch.Tensor, bins: int, like: torch.Tensor) -> torch.Tensor:
    """(bins, length) averaging matrix; bin i covers [floor(i L / bins), ceil((i + 1) L / bins)),
    as torch's adaptive average pooling kernel."""
    pos = torch.arange(length, device=like.device)
    i = torch.arange(bins, device=like.device)
    start = torch.div(i * length, bins, rounding_mode='floor')
    end = torch.div((i + 1) * length + bins - 1, bins, rounding_mode='floor')
    mask = ((pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])).to(like.dtype)
    return mask / mask.sum(dim=1, keepdim=True)


def _adaptive_avg_pool_traceable(self, x: torch.Tensor) -> torch.Tensor:
    """``nn.AdaptiveAvgPool2d`` as two matmuls with averaging matrices of the traced size (the
    exporter's own op needs static sizes)."""
    H, W = x.shape[-2:]
    out_h, out_w = (H if o is None else o for o in _pair(self.output_size))
    rows = _pool_matrix(torch.as_tensor(H), int(out_h), x)  # (out_h, H)
    cols = _pool_matrix(torch.as_tensor(W), int(out_w), x)  # (out_w, W)
    return torch.matmul(torch.matmul(rows, x), cols.t())


@contextmanager
def traceable_upstream_modules(model: nn.Module):
    """Inside the block, ``model``'s mmseg ``Upsample`` and ``nn.AdaptiveAvgPool2d`` modules run
    the traceable forwards above."""
    from mmseg.models.utils import Upsample
    patched = [m for m in model.modules() if isinstance(m, (Upsample, nn.AdaptiveAvgPool2d))]
    for module in patched:
        forward = _upsample_traceable if isinstance(module, Upsample) else \
            _adaptive_avg_pool_traceable
        module.forward = types.MethodType(forward, module)
    try:
        yield model
    finally:
        for module in patched:
            del module.forward


def check_shape(shape: Sequence[int], what: str = '--shape') -> Tuple[int, int]:
    if len(shape) != 2 or any(not isinstance(s, int) or s < 32 for s in shape):
        raise ExportError(f'image sides must be >= 32 px (the stride-32 level of the backbone), '
                          f'got {what} {list(shape)}: give two sides H W')
    return int(shape[0]), int(shape[1])


def export_onnx(model: nn.Module, out_file: str, shape: Sequence[int], dynamic: bool = False,
                opset: int = 17, batch: int = 1) -> str:
    """Export ``model`` (:func:`build_export_model`) traced at ``batch`` x 3 x ``shape``;
    ``dynamic``: batch, height and width as dynamic axes. Returns ``out_file``."""
    onnx, _ = check_onnx_runtime(need_runtime=False)
    h, w = check_shape(shape)
    names = list(getattr(model, 'output_names', None) or ['output'])
    axes = dict(image={0: 'batch', 2: 'height', 3: 'width'},
                **{n: {0: 'batch', 2: f'{n}_height', 3: f'{n}_width'} for n in names})
    os.makedirs(osp.dirname(osp.abspath(out_file)), exist_ok=True)
    example = torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad(), warnings.catch_warnings(), traceable_upstream_modules(model):
        # the model's size checks read traced sizes as Python values: harmless, but each warns
        warnings.simplefilter('ignore', torch.jit.TracerWarning)
        warnings.filterwarnings('ignore', category=DeprecationWarning)
        warnings.filterwarnings('ignore', message='.*dynamo=False.*')
        torch.onnx.export(model, (example,), out_file, dynamo=False, opset_version=opset,
                          input_names=['image'], output_names=names,
                          dynamic_axes=axes if dynamic else None, do_constant_folding=True)
    proto = onnx.load(out_file)
    onnx.helper.set_model_props(proto, dict(getattr(model, 'metadata', {}),
                                            **{'xcit_mm.export_shape': f'{h}x{w}',
                                               'xcit_mm.dynamic': str(bool(dynamic))}))
    onnx.checker.check_model(proto)
    onnx.save(proto, out_file)
    return out_file


def onnx_session(onnx_file: str, threads: Optional[int] = None):
    """An ONNX Runtime CPU session; ``threads`` intra-op threads (default: torch's count)."""
    _, ort = check_onnx_runtime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(onnx_file, sess_options=options,
                                providers=['CPUExecutionProvider'])


def run_onnx(session, image: torch.Tensor) -> List[torch.Tensor]:
    outs = session.run(None, {session.get_inputs()[0].name: image.numpy()})
    return [torch.from_numpy(o) for o in outs]


def verify_onnx(model: nn.Module, onnx_file: str, shapes: Sequence[Sequence[int]],
                tolerance: float = 1e-4, threads: Optional[int] = None,
                batch: int = 1) -> List[Dict]:
    """The file in ONNX Runtime against ``model`` in PyTorch on a seeded random image, a dict per
    size; ``max_rel`` = max |onnx - torch| / max |torch|, since per-element ratios are meaningless
    where the reference crosses zero."""
    session = onnx_session(onnx_file, threads)
    names = [o.name for o in session.get_outputs()]
    results = []
    model.eval()
    for shape in shapes:
        h, w = check_shape(shape, 'verify size')
        image = torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = model(image)
        ref = [ref] if isinstance(ref, torch.Tensor) else list(ref)
        got = run_onnx(session, image)
        outputs = []
        for name, r, g in zip(names, ref, got):
            same = r.shape == g.shape
            max_abs = (g - r).abs().max().item() if same else float('inf')
            max_rel = max_abs / max(r.abs().max().item(), 1e-12)
            outputs.append(dict(name=name, shape=list(g.shape), max_abs=max_abs, max_rel=max_rel,
                                **({} if same else dict(want_shape=list(r.shape)))))
        ok = len(ref) == len(got) and all(o['max_rel'] <= tolerance for o in outputs)
        results.append(dict(shape=[h, w], outputs=outputs,
                            max_abs=max(o['max_abs'] for o in outputs),
                            max_rel=max(o['max_rel'] for o in outputs), ok=ok))
    return results
