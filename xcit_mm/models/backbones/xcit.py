"""XCiT backbone for dense prediction (El-Nouby et al., NeurIPS 2021; docs/backbone.md): a conv
stem, XCiT layers and four layers' features rescaled to strides 4-32 (paper B.2) by ``fpn1``..
``fpn4``, built as the released detectors / segmentors have them so that their files load."""
import math
import warnings
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from mmcv.cnn import ConvModule, build_norm_layer
from mmcv.cnn.bricks import DropPath
from mmengine.model import BaseModule
from mmengine.model.weight_init import trunc_normal_
from mmengine.registry import MODELS
from torch.nn.modules.batchnorm import _BatchNorm

from ..inference.row_stream import (Crop, RowMap, TokenMap, TokenMaps, band_rows_for,
                                    module_rows, row_bands)
from ..layers import (batch_norm_stats_frozen, ffn_residual, recomputed_residual, split_qkv,
                      up2_blockwise, xca_mixing, xca_mixing_of_sums, xca_residual)
from ..utils.ckpt_load import (backbone_load_post_hook, backbone_load_pre_hook,
                               load_backbone_checkpoint)

# Published sizes (paper Table 1). mlp ratio is 4 for all of them.
arch_zoo = {
    'n12': dict(embed_dims=128, depth=12, num_heads=4),
    't12': dict(embed_dims=192, depth=12, num_heads=4),
    't24': dict(embed_dims=192, depth=24, num_heads=4),
    's12': dict(embed_dims=384, depth=12, num_heads=8),
    's24': dict(embed_dims=384, depth=24, num_heads=8),
    'm24': dict(embed_dims=512, depth=24, num_heads=8),
    'l24': dict(embed_dims=768, depth=24, num_heads=16),
}

STRIDES = (4, 8, 16, 32)  # of the adapter's levels; the last is the smallest image side


def _tracing() -> bool:
    """Whether dynamo or an ONNX trace records: then plain tensor code, one graph for every size."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


class FourierPositionEncoding(nn.Module):
    """DETR-style sine/cosine code of any patch grid through a 1x1 conv: no interpolation."""

    def __init__(self, embed_dims: int, hidden_dims: int = 32, temperature: float = 10000.):
        super().__init__()
        self.proj = nn.Conv2d(hidden_dims * 2, embed_dims, kernel_size=1)
        self.hidden_dims = hidden_dims
        self.temperature = temperature

    def _axis_code(self, length: int, device: torch.device) -> torch.Tensor:
        coords = torch.arange(1, length + 1, device=device, dtype=torch.float32)
        coords = coords / (length + 1e-6) * (2 * math.pi)
        dim_t = torch.arange(self.hidden_dims, device=device, dtype=torch.float32)
        exponent = 2 * torch.div(dim_t, 2, rounding_mode='floor') / self.hidden_dims
        dim_t = self.temperature**exponent
        angles = coords[:, None] / dim_t
        return torch.stack([angles[:, 0::2].sin(), angles[:, 1::2].cos()], dim=2).flatten(1)

    def forward(self, grid_hw: Tuple[int, int], start: int = 0,
                stop: Optional[int] = None) -> torch.Tensor:
        """Rows ``start:stop`` of the whole grid's embedding, (rows, W, embed_dims)."""
        H, W = grid_hw
        device = self.proj.weight.device
        codes = torch.broadcast_tensors(self._axis_code(H, device)[start:stop, None, :],
                                        self._axis_code(W, device)[None, :, :])  # (rows, W, hidden)
        # A 1x1 conv is a linear map over channels: apply it to the tokens directly.
        weight = self.proj.weight.flatten(1)
        return F.linear(torch.cat(codes, dim=2).to(weight.dtype), weight, self.proj.bias)


class ConvPatchEmbed(nn.Module):
    """LeViT-style stem: log2(patch_size) 3x3 stride-2 convs with BN, GELU between them."""

    def __init__(self, in_channels: int, embed_dims: int, patch_size: int, norm_cfg: dict):
        super().__init__()
        num_convs = int(math.log2(patch_size))
        widths = [in_channels] + [embed_dims // 2**i for i in range(num_convs - 1, -1, -1)]
        self.proj = nn.Sequential(*[
            ConvModule(
                widths[i], widths[i + 1], 3, stride=2, padding=1, norm_cfg=norm_cfg,
                act_cfg=dict(type='GELU') if i < num_convs - 1 else None)
            for i in range(num_convs)
        ])
        self.patch_size = 2**num_convs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens of ``x`` zero-padded at the bottom and right to a multiple of the patch."""
        H, W = x.shape[-2:]
        # round up with floor division, not ``-H % p``: a modulo of symbolic sizes makes
        # torch 2.13's inductor fail at the second image size (docs/deployment.md)
        p = self.patch_size
        pad_h, pad_w = (H + p - 1) // p * p - H, (W + p - 1) // p * p - W
        if _tracing() or pad_h or pad_w:  # traced: always (a zero pad is a no-op), no branch
            x = F.pad(x, (0, pad_w, 0, pad_h))
        # faster channels-last on CPU, and the (B, N, D) token view of the output is free
        return self.proj(x.contiguous(memory_format=torch.channels_last))


class XCAProbe(nn.Module):
    """Where :meth:`XCiTBackbone.capture_xca`'s hooks read ``(q, k, attn, grid_hw)``."""

    def forward(self, q, k, attn, grid_hw):
        return attn


class XCA(nn.Module):
    """Cross-covariance attention between channels, folded into the output projection. Float32
    even under autocast: bf16 would lose the small normalised entries."""

    def __init__(self, embed_dims: int, num_heads: int):
        super().__init__()
        if embed_dims % num_heads:
            raise ValueError(f'embed_dims={embed_dims} must be divisible by num_heads={num_heads}')
        self.num_heads = num_heads
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))
        self.qkv = nn.Linear(embed_dims, embed_dims * 3)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.probe = XCAProbe()

    def forward(self, x: torch.Tensor, grid_hw: Tuple[int, int]) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv(x), self.num_heads)  # views, no copy
        autocast = torch.is_autocast_enabled(x.device.type)
        with torch.autocast(x.device.type, enabled=False) if autocast else nullcontext():
            dtype = torch.promote_types(q.dtype, torch.float32)  # fp16/bf16 -> fp32, fp64 stays
            q, k = q.to(dtype), k.to(dtype)
            # mixing: the (B, C, C) matrix that maps v to the projected output
            mixing, attn, _, q_norm, k_norm = xca_mixing(q, k, self.temperature.to(dtype),
                                                         self.proj.weight.to(dtype))
            if self.probe._forward_hooks:  # only materialise normalised q/k for a listener
                self.probe((q / q_norm[..., None, :]).transpose(-2, -1),
                           (k / k_norm[..., None, :]).transpose(-2, -1), attn, grid_hw)
        return torch.baddbmm(self.proj.bias.to(v.dtype), v, mixing.to(v.dtype))


class LPI(nn.Module):
    """Local patch interaction: depthwise 3x3 conv, GELU, BN, depthwise 3x3 conv."""

    def __init__(self, embed_dims: int, norm_cfg: dict):
        super().__init__()
        self.conv1 = nn.Conv2d(embed_dims, embed_dims, 3, padding=1, groups=embed_dims)
        self.act = nn.GELU()
        self.bn = build_norm_layer(norm_cfg, embed_dims)[1]
        self.conv2 = nn.Conv2d(embed_dims, embed_dims, 3, padding=1, groups=embed_dims)

    def forward(self, x: torch.Tensor, grid_hw: Tuple[int, int]) -> torch.Tensor:
        B, N, C = x.shape
        x = x.reshape(B, *grid_hw, C).permute(0, 3, 1, 2)
        x = self.conv2(self.bn(self.act(self.conv1(x))))
        return x.permute(0, 2, 3, 1).reshape(B, N, C)


class XCiTLayer(nn.Module):
    """Pre-norm XCA, LPI (norm3, gamma3) and FFN (norm2, gamma2) residuals, the released order."""

    def __init__(self, embed_dims: int, num_heads: int, mlp_ratio: float, drop_path: float,
                 layer_scale_init_value: float, norm_cfg: dict):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dims, eps=1e-6)
        self.attn = XCA(embed_dims, num_heads)
        self.norm3 = nn.LayerNorm(embed_dims, eps=1e-6)
        self.lpi = LPI(embed_dims, norm_cfg)
        self.norm2 = nn.LayerNorm(embed_dims, eps=1e-6)
        hidden = int(embed_dims * mlp_ratio)
        self.ffn = nn.Sequential(OrderedDict(fc1=nn.Linear(embed_dims, hidden), act=nn.GELU(),
                                             fc2=nn.Linear(hidden, embed_dims)))
        self.gamma1 = nn.Parameter(layer_scale_init_value * torch.ones(embed_dims))
        self.gamma3 = nn.Parameter(layer_scale_init_value * torch.ones(embed_dims))
        self.gamma2 = nn.Parameter(layer_scale_init_value * torch.ones(embed_dims))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def _drop_scale(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Per-sample drop-path factor (B, 1, 1), or None: the draw of ``drop_path(gamma * y)``."""
        if not (isinstance(self.drop_path, DropPath) and self.training):
            return None
        return self.drop_path(x.new_ones(x.shape[0], 1, 1))

    def _residual(self, x: torch.Tensor, gamma: torch.Tensor, branch: torch.Tensor):
        if isinstance(self.drop_path, DropPath) and self.training:
            return x + self.drop_path(gamma * branch)
        return torch.addcmul(x, gamma, branch)  # x + gamma * branch in one pass

    def forward(self, x: torch.Tensor, grid_hw: Tuple[int, int]) -> torch.Tensor:
        # eager training: the memory-lean autograd functions; otherwise the module code
        if (torch.is_grad_enabled() and not _tracing() and not self.attn.probe._forward_hooks
                and not torch.is_autocast_enabled(x.device.type)):
            x = xca_residual(x, self.norm1, self.attn, self.gamma1, self._drop_scale(x))
            x = recomputed_residual(x, lambda t: self.lpi(self.norm3(t), grid_hw),
                                    (self.norm3, self.lpi), self.gamma3, self._drop_scale(x))
            return ffn_residual(x, self.norm2, self.ffn, self.gamma2, self._drop_scale(x))
        x = self._residual(x, self.gamma1, self.attn(self.norm1(x), grid_hw))
        x = self._residual(x, self.gamma3, self.lpi(self.norm3(x), grid_hw))
        return self._residual(x, self.gamma2, self.ffn(self.norm2(x)))

    @torch.no_grad()
    def forward_streamed(self, x: TokenMap, band_rows: int) -> None:
        """:meth:`forward` on the token map ``x`` in place, by bands of rows, in three passes: XCA's
        sums, each band's attention, then LPI (its context above as attention left it) and FFN."""
        H, W, C = x.shape
        attn, h = self.attn, self.attn.num_heads
        w_qk, w_v = attn.qkv.weight.split([2 * C, C])
        b_qk, b_v = attn.qkv.bias.split([2 * C, C])
        qk = q_sq = k_sq = 0
        for start, stop, _, _ in row_bands(H, band_rows):
            y = self.norm1(x.read(start, stop).reshape(-1, C))
            q, k = F.linear(y, w_qk, b_qk).float().view(-1, 2, h, C // h).permute(1, 2, 0, 3)
            qk = qk + q.transpose(1, 2) @ k  # q, k: (h, n, d)
            q_sq, k_sq = q_sq + (q * q).sum(1), k_sq + (k * k).sum(1)
            del y, q, k
        mixing, _, _ = xca_mixing_of_sums(qk[None], q_sq.sqrt()[None], k_sq.sqrt()[None],
                                          attn.temperature.float(), attn.proj.weight.float())
        mixing = mixing[0].to(w_v.dtype)
        for start, stop, _, _ in row_bands(H, band_rows):
            tokens = x.read(start, stop).reshape(-1, C)
            v = F.linear(self.norm1(tokens), w_v, b_v)
            out = torch.addcmul(tokens, self.gamma1, torch.addmm(attn.proj.bias, v, mixing))
            x.write(start, out.view(stop - start, W, C))
            del tokens, v, out
        above = None  # the rows above the band as the attention left them
        for start, stop, lo, hi in row_bands(H, max(2, band_rows), 2):
            tokens = x.read(start, hi)
            block = tokens if above is None else torch.cat([above, tokens])
            above = tokens[stop - start - 2:stop - start].clone()
            lpi = self.lpi(self.norm3(block.reshape(1, -1, C)), (hi - lo, W))
            out = torch.addcmul(tokens[:stop - start].reshape(-1, C), self.gamma3,
                                lpi[0, (start - lo) * W:(stop - lo) * W])
            del lpi, block, tokens
            out = torch.addcmul(out, self.gamma2, self.ffn(self.norm2(out)))
            x.write(start, out.view(stop - start, W, C))
            del out


def _build_adapter(embed_dims: int, patch_size: int, norm_cfg: dict) -> List[nn.Module]:
    """Modules taking the trunk maps to strides 4-32, in ``nn.Sequential`` exactly where the
    official code has one, so that the released files' names load."""

    up2 = partial(nn.ConvTranspose2d, embed_dims, embed_dims, kernel_size=2, stride=2)

    def pool(k):  # ceil_mode: a ceil(H/p) grid pools to ceil(H/s), so any image size works
        return nn.MaxPool2d(kernel_size=k, stride=k, ceil_mode=True)

    if patch_size == 16:
        return [nn.Sequential(up2(), build_norm_layer(norm_cfg, embed_dims)[1], nn.GELU(), up2()),
                nn.Sequential(up2()), nn.Identity(), pool(2)]
    return [nn.Sequential(up2()), nn.Identity(), nn.Sequential(pool(2)), nn.Sequential(pool(4))]


def _up2_traceable(conv: nn.ConvTranspose2d, x: torch.Tensor,
                   layout: torch.memory_format) -> torch.Tensor:
    """``conv`` (kernel 2, stride 2) of a channels-last map as one matmul for compilers and
    exporters, oriented by ``layout`` so that the interleaving copy reads contiguous rows."""
    B, C, H, W = x.shape
    out_channels = conv.out_channels
    weight = conv.weight.permute(0, 2, 3, 1).reshape(C, 4 * out_channels)  # (di, dj, o) columns
    tokens = x.permute(0, 2, 3, 1).reshape(B * H * W, C)  # a view of the channels-last map
    # both to (B, o, i, di, j, dj), i.e. (B, o, 2i + di, 2j + dj) once reshaped
    if layout == torch.channels_last:
        y = torch.mm(tokens, weight).view(B, H, W, 2, 2, out_channels).permute(0, 5, 1, 3, 2, 4)
    else:  # one mm, no batched matmul (whose backward copies the expanded weight's gradient)
        y = torch.mm(weight.t(), tokens.t()).view(2, 2, out_channels, B, H, W)
        y = y.permute(3, 2, 4, 0, 5, 1)
    if conv.bias is not None:
        y = y + conv.bias.view(out_channels, 1, 1, 1, 1)
    return y.reshape(B, out_channels, 2 * H, 2 * W)


@MODELS.register_module()
class XCiTBackbone(BaseModule):
    """XCiT trunk with the multi-scale adapter, for mmdet and mmseg; options in docs/backbone.md.
    ``pretrained`` (deprecated) becomes ``init_cfg``; mmseg's ResNet weights are an error."""

    def __init__(self,
                 arch: Union[str, dict] = 's12',
                 patch_size: int = 16,
                 in_channels: int = 3,
                 out_indices: Optional[Sequence[int]] = None,
                 drop_path_rate: float = 0.,
                 layer_scale_init_value: Optional[float] = None,
                 mlp_ratio: float = 4.,
                 norm_cfg: dict = dict(type='BN', requires_grad=True),
                 frozen_stages: int = -1,
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 out_channels_last: bool = False,
                 init_cfg: Optional[dict] = None,
                 pretrained: Optional[str] = None):
        super().__init__(init_cfg=self._pretrained_init_cfg(pretrained, init_cfg))
        arch = self._parse_arch(arch)
        self.embed_dims = arch['embed_dims']
        self.num_layers = arch['depth']
        self.num_heads = arch['num_heads']
        mlp_ratio = arch.get('mlp_ratio', mlp_ratio)
        if patch_size not in (8, 16):
            raise ValueError(f'patch_size must be 8 or 16 (the published XCiT models), '
                             f'got {patch_size!r}')
        if self.embed_dims % 8:
            raise ValueError(f'embed_dims must be divisible by 8 for the conv stem, '
                             f'got {self.embed_dims}')
        if not isinstance(in_channels, int) or in_channels < 1:
            raise ValueError(f'in_channels must be a positive int, got {in_channels!r}')
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_indices = self._parse_out_indices(out_indices)
        if not -1 <= frozen_stages <= self.num_layers:
            raise ValueError(f'frozen_stages must be in [-1, {self.num_layers}] (-1: none, '
                             f'0: embeddings, k: embeddings + first k layers), got {frozen_stages}')
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.with_cp = with_cp
        self.out_channels_last = out_channels_last
        if layer_scale_init_value is None:
            layer_scale_init_value = 1.0 if self.num_layers <= 12 else 1e-5

        self.patch_embed = ConvPatchEmbed(in_channels, self.embed_dims, patch_size, norm_cfg)
        self.pos_embed = FourierPositionEncoding(self.embed_dims)
        self.layers = nn.ModuleList([
            XCiTLayer(self.embed_dims, self.num_heads, mlp_ratio, drop_path_rate,
                      layer_scale_init_value, norm_cfg) for _ in range(self.num_layers)
        ])
        self.fpn1, self.fpn2, self.fpn3, self.fpn4 = _build_adapter(
            self.embed_dims, patch_size, norm_cfg)
        # channels-last inputs give channels-last weight gradients: channels-last weights keep
        # DDP's gradient buckets free of stride-mismatch copies
        for module in [self.patch_embed] + self.adapters:
            module.to(memory_format=torch.channels_last)
        # .to() keeps the NCHW strides of (D, 1, 3, 3) weights (contiguous in both formats)
        for layer in self.layers:
            for conv in (layer.lpi.conv1, layer.lpi.conv2):
                conv.weight.data = torch.empty_like(
                    conv.weight, memory_format=torch.channels_last).copy_(conv.weight.data)
        self.out_channels = [self.embed_dims] * len(STRIDES)
        self.strides = STRIDES
        self._freeze_stages()
        # every loader converts published layouts and fails on a file that does not fit
        self.last_load_report: Optional[dict] = None
        self.register_load_state_dict_pre_hook(backbone_load_pre_hook)
        self.register_load_state_dict_post_hook(backbone_load_post_hook)

    @staticmethod
    def _pretrained_init_cfg(pretrained: Optional[str], init_cfg: Optional[dict]):
        if pretrained is None:
            return init_cfg
        fix = ('set model.pretrained=None and give XCiT weights with '
               'model.backbone.init_cfg=dict(type=\'Pretrained\', checkpoint=PATH_OR_URL)')
        if not isinstance(pretrained, str) or init_cfg is not None or \
                pretrained.startswith(('open-mmlab://', 'torchvision://', 'mmcls://')):
            raise ValueError(
                f'XCiTBackbone got pretrained={pretrained!r}' +
                (f' and init_cfg={init_cfg!r}' if init_cfg is not None else '') +
                ': mmseg\'s EncoderDecoder passes model.pretrained to the backbone, and mmseg\'s '
                'model bases set it to the ImageNet weights of their ResNet. Fix: ' + fix)
        warnings.warn(f'XCiTBackbone: pretrained is deprecated, as in mmseg\'s backbones; '
                      f'using init_cfg=dict(type=\'Pretrained\', checkpoint={pretrained!r})')
        return dict(type='Pretrained', checkpoint=pretrained)

    @staticmethod
    def _parse_arch(arch: Union[str, dict]) -> dict:
        if isinstance(arch, str):
            key = arch.lower().replace('xcit_', '').replace('xcit-', '')
            if key not in arch_zoo:
                raise ValueError(f'Unknown XCiT arch {arch!r}: choose one of '
                                 f'{sorted(arch_zoo)} or pass a dict with embed_dims, depth, '
                                 f'num_heads')
            return dict(arch_zoo[key])
        if isinstance(arch, dict):
            missing = {'embed_dims', 'depth', 'num_heads'} - set(arch)
            if missing:
                raise ValueError(f'A custom arch dict needs the keys {sorted(missing)}; got '
                                 f'{arch}')
            return dict(arch)
        raise TypeError(f'arch must be a str or a dict, got {type(arch).__name__}')

    def _parse_out_indices(self, out_indices) -> Tuple[int, ...]:
        if out_indices is None:  # layers depth/3, depth/2, 2*depth/3 and depth (1-based)
            d = self.num_layers
            return (d // 3 - 1, d // 2 - 1, 2 * d // 3 - 1, d - 1)
        out_indices = tuple(out_indices)
        if len(out_indices) != len(STRIDES):
            raise ValueError(f'out_indices needs exactly {len(STRIDES)} layer indices, one per '
                             f'output stride {STRIDES}; got {out_indices}')
        return tuple(self._layer_index(i, f'out_indices {out_indices}') for i in out_indices)

    def _layer_index(self, index: int, what: str) -> int:
        if not -self.num_layers <= index < self.num_layers:
            raise ValueError(f'{what}: layer {index} is out of range for a {self.num_layers}-layer '
                             f'model (valid: 0..{self.num_layers - 1} or negative from the end)')
        return index % self.num_layers

    @property
    def adapters(self) -> List[nn.Module]:
        return [self.fpn1, self.fpn2, self.fpn3, self.fpn4]

    def init_weights(self):
        for m in self.modules():  # every Linear here has a bias
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        init_cfg = self.init_cfg
        if isinstance(init_cfg, dict) and init_cfg.get('type') == 'Pretrained':
            if 'checkpoint' not in init_cfg:
                raise ValueError("init_cfg type 'Pretrained' needs a 'checkpoint' path or URL")
            load_backbone_checkpoint(
                self, init_cfg['checkpoint'], prefix=init_cfg.get('prefix'),
                weights_only=init_cfg.get('weights_only', True))
        elif init_cfg is not None:
            super().init_weights()
        self._is_init = True

    def _freeze_stages(self):
        # layers past the last output never run: no gradient would ever reach them
        frozen = list(self.layers[max(self.out_indices) + 1:])
        if self.frozen_stages >= 0:
            frozen += [self.patch_embed, self.pos_embed] + list(self.layers[:self.frozen_stages])
        for module in frozen:
            module.eval().requires_grad_(False)

    def train(self, mode: bool = True):
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, (_BatchNorm, nn.LayerNorm, nn.GroupNorm)):
                    m.eval()
        return self

    def _check_input(self, x: torch.Tensor):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f'XCiTBackbone expects a (B, C, H, W) image tensor, got {shape}')
        B, C, H, W = x.shape
        if B == 0:
            raise ValueError('XCiTBackbone got an empty batch (0 images): check the data '
                             'pipeline / sampler, which produced no image for this step')
        if C != self.in_channels:
            raise ValueError(f'XCiTBackbone was built for in_channels={self.in_channels} but the '
                             f'image has {C} channels: set in_channels={C} or fix the data '
                             f'preprocessor (e.g. bgr_to_rgb / grayscale conversion)')
        if min(H, W) < STRIDES[-1]:
            raise ValueError(f'Image of {H}x{W} px is too small for XCiTBackbone: each side '
                             f'must be at least {STRIDES[-1]} px to reach the stride-{STRIDES[-1]} '
                             'level; resize or pad the input (e.g. Pad size_divisor=32)')

    def forward_trunk(self, x: torch.Tensor) -> List[torch.Tensor]:
        """Trunk maps at ``out_indices``, (B, D, ceil(H/p), ceil(W/p)) channels-last views."""
        self._check_input(x)
        x = self.patch_embed(x)
        B, D, *grid_hw = x.shape
        x = (x.permute(0, 2, 3, 1) + self.pos_embed(grid_hw)).flatten(1, 2)  # (B, N, D)
        taps = {}
        for i, layer in enumerate(self.layers[:max(self.out_indices) + 1]):
            if self.with_cp and x.requires_grad:
                # the re-run in the backward leaves the LPI's BN statistics alone: updated once
                # (dynamo takes no context_fn)
                frozen_bn = {} if _tracing() else dict(context_fn=lambda layer=layer: (
                    nullcontext(), batch_norm_stats_frozen(layer)))
                x = cp.checkpoint(layer, x, grid_hw, use_reentrant=False, **frozen_bn)
            else:
                x = layer(x, grid_hw)
            if i in self.out_indices:
                taps[i] = x.reshape(B, *grid_hw, D).permute(0, 3, 1, 2)  # channels-last view
        return [taps[i] for i in self.out_indices]

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """4 maps at strides 4/8/16/32, each ceil(H/s) x ceil(W/s)."""
        return tuple(self.forward_level(feat, level, x.shape[-2:])  # after the trunk checks x
                     for level, feat in enumerate(self.forward_trunk(x)))

    def forward_level(self, feat: torch.Tensor, level: int,
                      image_hw: Tuple[int, int]) -> torch.Tensor:
        """Adapter output of one level, NCHW by default (mmcv's CPU ``RoIAlign`` reads raw NCHW
        memory); a final 2x upsampling writes straight into that layout."""
        layout = torch.channels_last if self.out_channels_last else torch.contiguous_format
        tracing = _tracing()
        adapter = self.adapters[level]
        *body, last = adapter if isinstance(adapter, nn.Sequential) else [adapter]
        for module in body:  # p16's inner upsampling feeds a BN: the module's own forward
            feat = module(feat)
        up2 = _up2_traceable if tracing else up2_blockwise
        out = up2(last, feat, layout) if isinstance(last, nn.ConvTranspose2d) else last(feat)
        h, w = self._level_hw(level, image_hw)
        out = out[..., :h, :w]  # the input was padded to the patch size
        if tracing:  # lay out unconditionally: no guard on the padding
            return torch.clone(out, memory_format=layout)
        return out.contiguous(memory_format=layout)  # no copy if already in the layout

    @torch.no_grad()
    def stream_trunk(self, read_pixels: Callable[[int, int], torch.Tensor],
                     image_hw: Tuple[int, int], maps: TokenMaps, band_mb: float,
                     progress: Callable[[], None] = lambda: None) -> List[TokenMap]:
        """:meth:`forward_trunk` of one image read by ``read_pixels(a, b)`` (pixel rows) as token
        maps in ``maps``: the layers update one map in place, copied at the ``out_indices``."""
        if self.training:
            raise RuntimeError('XCiTBackbone.stream_trunk is for inference: call .eval() first')
        H, W = image_hw
        p, D = self.patch_size, self.embed_dims
        grid = ((H + p - 1) // p, (W + p - 1) // p)
        x = maps.new(grid + (D, ))
        # the largest stem map: D / (p / 2) channels at stride 2, p / 2 of its rows per token row
        stem_row = 4 * (D * 2 // p) * (grid[1] * p // 2) * (p // 2)
        for start, stop, _, _ in row_bands(grid[0], band_rows_for(band_mb, stem_row)):
            lo = max(0, start - 1) * p  # a token row reads p - 1 pixel rows above its own
            tokens = self.patch_embed(read_pixels(lo, min(H, stop * p)))[0, :, start - lo // p:]
            x.write(start, tokens.permute(1, 2, 0) + self.pos_embed(grid, start, stop))
            del tokens
        # the FFN's hidden layer, 4 D floats a token, is a band's largest map
        band_rows = band_rows_for(band_mb, 4 * 4 * D * grid[1], at_least=2)
        last, kept = max(self.out_indices), {}
        for i, layer in enumerate(self.layers[:last + 1]):
            layer.forward_streamed(x, band_rows)
            if i in self.out_indices and i != last:
                kept[i] = maps.new(x.shape)
                for start, stop, _, _ in row_bands(grid[0], band_rows):
                    kept[i].write(start, x.read(start, stop))
            progress()
        kept[last] = x
        return [kept[i] for i in self.out_indices]

    def level_rows(self, trunk_map: RowMap, level: int, image_hw: Tuple[int, int]) -> RowMap:
        """:meth:`forward_level` by rows (the adapter is row-local)."""
        return Crop(module_rows(self.adapters[level], trunk_map), 0, 0,
                    *self._level_hw(level, image_hw))

    def _level_hw(self, level: int, image_hw: Tuple[int, int]) -> Tuple[int, int]:
        stride = self.strides[level]
        return tuple((n + stride - 1) // stride for n in image_hw)

    @contextmanager
    def capture_xca(self, layers: Optional[Sequence[int]] = None):
        """Yield ``{layer: dict(q, k, attn, grid)}`` of the last pass in the block, detached."""
        layers = range(self.num_layers) if layers is None else layers
        records: Dict[int, dict] = {}
        handles = []
        for index in layers:
            index = self._layer_index(index, 'capture_xca')

            def hook(module, inputs, output, index=index):
                q, k, attn, grid_hw = inputs
                records[index] = dict(q=q.detach(), k=k.detach(), attn=attn.detach(),
                                      grid=tuple(grid_hw))

            handles.append(self.layers[index].attn.probe.register_forward_hook(hook))
        try:
            yield records
        finally:
            for handle in handles:
                handle.remove()
