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
from ..inference.sharding import EMPTY, Shard, SlabRows
from ..layers import (batch_norm_stats_frozen, ffn_residual, recomputed_residual, split_qk,
                      split_qkv, up2_blockwise, xca_mixing, xca_mixing_of_sums, xca_residual,
                      xca_sums)
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


def _autocast_off(x: torch.Tensor):
    """A context where autocast does not touch ``x``'s device (a no-op when it is off)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return nullcontext()


def _sums_dtype(x: torch.Tensor) -> torch.dtype:
    """XCA's sums and mixing: float32 from fp16 / bf16, float64 kept."""
    return torch.promote_types(x.dtype, torch.float32)


class XCA(nn.Module):
    """Cross-covariance attention between channels, folded into the output projection.

    XCA reads the tokens as a whole only through its sums over them (``xca_sums``: q^T k and the
    column norms of q and k); from those, the mixing (``xca_mixing_of_sums``) is the (C, C) matrix
    that takes each token's v to its output. The whole forward and the streamed trunk (which adds
    the sums band by band, :meth:`sums`, :meth:`mixing`) share these pieces and
    :meth:`project`. Sums and mixing are float32 even under autocast: bf16 would lose the small
    normalised entries, and fp16 sums overflow past 65504."""

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
        with _autocast_off(x):
            dtype = _sums_dtype(q)
            q, k = q.to(dtype), k.to(dtype)
            mixing, attn, _, q_norm, k_norm = xca_mixing(q, k, self.temperature.to(dtype),
                                                         self.proj.weight.to(dtype))
            if self.probe._forward_hooks:  # only materialise normalised q/k for a listener
                self.probe((q / q_norm[..., None, :]).transpose(-2, -1),
                           (k / k_norm[..., None, :]).transpose(-2, -1), attn, grid_hw)
        return self.project(v, mixing)

    def sums(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """XCA's sums over the tokens ``x`` (B, N, C), as the layer's norm gives them:
        ``(q^T k, |q|^2, |k|^2)`` with the column norms squared, so that the sums of the bands of
        a map add up to the map's. Only q and k are projected (v is not needed yet)."""
        C = x.shape[-1]
        q, k = split_qk(F.linear(x, self.qkv.weight[:2 * C], self.qkv.bias[:2 * C]),
                        self.num_heads)
        with _autocast_off(x):
            dtype = _sums_dtype(q)
            return xca_sums(q.to(dtype), k.to(dtype), squared=True)

    def mixing(self, qk: torch.Tensor, q_sq: torch.Tensor, k_sq: torch.Tensor) -> torch.Tensor:
        """The (B, C, C) mixing from :meth:`sums` over all the tokens, in float32 (or float64)."""
        dtype = _sums_dtype(qk)
        with _autocast_off(qk):
            return xca_mixing_of_sums(qk.to(dtype), q_sq.to(dtype).sqrt(), k_sq.to(dtype).sqrt(),
                                      self.temperature.to(dtype), self.proj.weight.to(dtype))[0]

    def values(self, x: torch.Tensor) -> torch.Tensor:
        """v of the tokens ``x`` (B, N, C) alone: a band's attention needs no q or k."""
        C = x.shape[-1]
        return F.linear(x, self.qkv.weight[2 * C:], self.qkv.bias[2 * C:])

    def project(self, v: torch.Tensor, mixing: torch.Tensor) -> torch.Tensor:
        """The attention's output ``v @ mixing + bias``, in v's dtype."""
        return torch.baddbmm(self.proj.bias.to(v.dtype), v, mixing.to(v.dtype))


class LPI(nn.Module):
    """Local patch interaction: depthwise 3x3 conv, GELU, BN, depthwise 3x3 conv. Each token reads
    the tokens up to 2 rows and columns away (``LPI.reach``)."""

    reach = 2

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
    """Pre-norm XCA, LPI (norm3, gamma3) and FFN (norm2, gamma2) residuals, the released order.

    One definition serves the whole forward and the streamed trunk: :meth:`forward` (outside
    eager training) and :meth:`forward_streamed` both call :meth:`_attention_residual` and
    :meth:`_local_residuals`, and XCA's sums and mixing come from the same pieces (:class:`XCA`).
    Eager training takes the memory-lean autograd functions of ``xcit_mm.models.layers``."""

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
        return self._local_residuals(self._attention_residual(x, grid_hw), grid_hw)

    def _attention_residual(self, x: torch.Tensor, grid_hw: Optional[Tuple[int, int]] = None,
                            mixing: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x + gamma1 * XCA(norm1(x))`` of the whole map x (B, N, C), or of a band of its rows
        given the ``mixing`` of the whole map's sums."""
        y = self.norm1(x)
        if mixing is None:
            return self._residual(x, self.gamma1, self.attn(y, grid_hw))
        return self._residual(x, self.gamma1, self.attn.project(self.attn.values(y), mixing))

    def _local_residuals(self, x: torch.Tensor, grid_hw: Tuple[int, int],
                         rows: Optional[Tuple[int, int]] = None,
                         in_place: bool = False) -> torch.Tensor:
        """The LPI (norm3, gamma3) then FFN (norm2, gamma2) residuals of the token rows ``rows``
        (first, stop) of x (B, N, C), a map of ``grid_hw`` tokens: all of them by default; the
        other rows are context that LPI's convs read.

        ``in_place`` (inference only: x is the caller's to overwrite) adds the residuals into x
        and activates the FFN's hidden layer in place, so that a band of the stream holds no
        second copy of its tokens or of its largest map; the values are the same."""
        lpi = self.lpi(self.norm3(x), grid_hw)
        if rows is not None:
            W = grid_hw[1]
            x, lpi = x[:, rows[0] * W:rows[1] * W], lpi[:, rows[0] * W:rows[1] * W]
        if not in_place:
            x = self._residual(x, self.gamma3, lpi)
            return self._residual(x, self.gamma2, self.ffn(self.norm2(x)))
        x = x.addcmul_(self.gamma3, lpi)
        del lpi
        return x.addcmul_(self.gamma2, self._ffn_in_place(self.norm2(x)))

    def _ffn_in_place(self, x: torch.Tensor) -> torch.Tensor:
        """``self.ffn(x)`` with fc1's output (the hidden layer, 4 x the tokens) activated in place
        rather than copied; an activation other than GELU runs as the module does."""
        act = self.ffn.act
        if type(act) is not nn.GELU:
            return self.ffn(x)
        hidden = self.ffn.fc1(x)
        torch.ops.aten.gelu_(hidden, approximate=act.approximate)
        return self.ffn.fc2(hidden)

    def xca_sums(self, tokens: torch.Tensor, valid: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """XCA's sums (:meth:`XCA.sums`) over ``tokens`` (n, C), rows of this layer's input,
        leaving out those where the bool ``valid`` (n, ) is False."""
        if valid is not None:
            tokens = tokens[valid]
        return self.attn.sums(self.norm1(tokens)[None])

    @torch.no_grad()
    def forward_streamed(self, x: TokenMap, band_rows: int, sums: Sequence[torch.Tensor],
                         then: Sequence[Callable[[int, torch.Tensor], None]] = ()) -> None:
        """:meth:`forward` on the token map ``x`` (H, W, C) in place, given XCA's ``sums`` over the
        whole map (:meth:`xca_sums` of its bands, added), in one pass over bands of rows: each
        band's attention residual, then its LPI and FFN residuals. LPI reads the rows up to
        ``LPI.reach`` away as attention leaves them: those above are kept from the band before,
        those below (not yet written) get their attention residual with this band and again with
        the next. Each band of finished rows goes to every ``then(start, rows)`` before it leaves
        memory (the next layer's sums, a copy of the map), so that no pass reads the map again."""
        H, W, C = x.shape
        mixing = self.attn.mixing(*sums)
        reach = self.lpi.reach
        above = None  # the rows above the band as the attention left them
        # one buffer for them the whole layer: a copy made anew each band would sit among the
        # bands' freed memory and keep the allocator from reusing it
        kept_above = torch.empty((reach, W, C), device=x.device)
        for start, stop, lo, hi in row_bands(H, max(reach, band_rows), reach):
            rows = self._attention_residual(x.read(start, hi).reshape(1, -1, C), mixing=mixing)
            rows = rows.view(-1, W, C)
            block = rows if above is None else torch.cat([above, rows])
            if stop < H:
                above = kept_above.copy_(rows[stop - start - reach:stop - start])
            del rows
            out = self._local_residuals(block.view(1, -1, C), (hi - lo, W),
                                        (start - lo, stop - lo), in_place=True).view(-1, W, C)
            del block
            x.write(start, out)
            for consumer in then:
                consumer(start, out)
            del out


def _write_within(token_map: TokenMap, offset: int, start: int, rows: torch.Tensor) -> None:
    """Write the rows ``start:start + len(rows)`` of a layer's map into ``token_map``, which
    holds only that map's rows ``offset:offset + token_map.height``; the others are not kept."""
    a, b = max(start, offset), min(start + len(rows), offset + token_map.height)
    if a < b:
        token_map.write(a - offset, rows[a - start:b - start])


class _StreamedSums:
    """One layer's XCA sums over a token map, added band by band as its rows are made, leaving
    out the tokens that ``valid`` (the ``owned`` rows, grid columns; or None) marks False.

    The map's rows are the image's token rows from ``first`` on; only those in ``owned``
    (first, stop, whole-image rows) are added: a rank of a sharded stream adds its slab's rows
    and none of its margin's, so that the ranks' sums add up to the image's."""

    def __init__(self, layer: XCiTLayer, valid: Optional[torch.Tensor], first: int = 0,
                 owned: Tuple[int, int] = (0, None)):
        self.layer, self.valid, self.total = layer, valid, None
        self.first, self.owned = first, owned

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Add the rows ``start:start + len(rows)`` of the layer's input, (rows, W, C)."""
        start += self.first
        lo, hi = self.owned
        a, b = max(start, lo), start + len(rows) if hi is None else min(start + len(rows), hi)
        if a >= b:
            return
        if (a, b) != (start, start + len(rows)):
            rows = rows[a - start:b - start]
        valid = None if self.valid is None else self.valid[a - lo:b - lo].flatten()
        band = self.layer.xca_sums(rows.reshape(-1, rows.shape[-1]), valid)
        self.total = band if self.total is None else tuple(
            total.add_(part) for total, part in zip(self.total, band))

    def combined(self, shard: Optional[Shard]) -> Tuple[torch.Tensor, ...]:
        """The sums over the whole image: this process's, or added up over ``shard``'s ranks
        (a rank that owns no token row gives zeros)."""
        if shard is None:
            return self.total
        total = self.total
        if total is None:
            weight = self.layer.norm1.weight
            total = self.layer.xca_sums(weight.new_zeros(0, weight.shape[0]))
        return tuple(shard.combine(total, 'XCA sums'))


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


def _position_frame(valid: Optional[torch.Tensor],
                    grid: Tuple[int, int]) -> Tuple[int, int, int, int]:
    """(top, left, height, width) of the token grid a streamed trunk's position code is made for:
    the bounding box of the ``valid`` tokens, so that a scene's code does not depend on its
    collar; the whole grid without a mask or without any valid token."""
    if valid is None:
        return (0, 0) + tuple(grid)
    return _frame_of(valid.any(1), valid.any(0), grid)


def _sharded_position_frame(valid: Optional[torch.Tensor], owned: Tuple[int, int],
                            grid: Tuple[int, int], shard: Shard) -> Tuple[int, int, int, int]:
    """:func:`_position_frame` of the whole image from each rank's ``valid`` tokens of its
    ``owned`` rows: which rows and columns hold a valid token, added up over the ranks."""
    if valid is None:
        return (0, 0) + tuple(grid)
    rows, cols = torch.zeros(grid[0]), torch.zeros(grid[1])
    rows[owned[0]:owned[1]] = valid.any(1).float().cpu()
    if len(valid):
        cols += valid.any(0).float().cpu()
    rows, cols = shard.combine([rows, cols], 'valid token rows and columns')
    return _frame_of(rows > 0, cols > 0, grid)


def _frame_of(rows_any: torch.Tensor, cols_any: torch.Tensor,
              grid: Tuple[int, int]) -> Tuple[int, int, int, int]:
    """:func:`_position_frame` of the grid rows and columns that hold a valid token."""
    if not bool(rows_any.any()):
        return (0, 0) + tuple(grid)
    rows = rows_any.nonzero()[:, 0]
    cols = cols_any.nonzero()[:, 0]
    top, left = int(rows[0]), int(cols[0])
    return top, left, int(rows[-1]) + 1 - top, int(cols[-1]) + 1 - left


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
                     progress: Callable[[], None] = lambda: None,
                     valid_pixels: Optional[Callable[[int, int], torch.Tensor]] = None,
                     shard: Optional[Shard] = None, read_rows: Tuple[int, int] = EMPTY
                     ) -> List[RowMap]:
        """:meth:`forward_trunk` of one image read by ``read_pixels(a, b)`` (pixel rows) as token
        maps in ``maps``: the layers update one map in place, copied at the ``out_indices``.

        Each layer reads its map once: XCA's sums are added up from the rows the stem or the
        layer before has just made, while they are still in memory.

        ``valid_pixels(a, b)``, if given, is a bool tensor (b - a, W) of the image's valid pixels
        (True) in pixel rows a..b-1, read band by band before the stem. A token whose p x p patch
        holds no valid pixel (a nodata collar, outside a mask) is left out of every layer's XCA
        sums and still gets its output. The position code is then that of the valid tokens'
        bounding box (collar tokens take its nearest edge's code), so that the valid part of a
        scene gets the code it would have alone. Tokens far from the collar then get what the
        valid part cropped alone gives, up to the small change of the sums made by the tokens
        near the collar: those still differ, because the stem reads pixels up to one token above
        and left of its own, and each layer's LPI reads the tokens 2 rows and columns away, so
        collar pixels reach valid tokens within 1 + 2 x (layers) tokens of the collar (the crop
        reads zeros there instead). Exact alignment needs the valid part's bounding box on the
        patch grid.

        With a ``shard`` (:class:`~xcit_mm.models.inference.sharding.Shard`), this process is one
        rank of a sharded stream of the image: it adds up XCA's sums over its slab of token rows
        (``shard.token_rows``) and the ranks add theirs up (one exchange per layer), and it makes
        its slab and the rows ``read_rows`` (first, stop: whole-image token rows the caller will
        read, e.g. for the labels of the slab's pixel rows) from the image's pixels of those
        rows and a margin of :meth:`stream_margin` rows each side (:meth:`streamed_rows`): LPI
        reads zeros past the margin, which spoils ``LPI.reach`` more rows inside it with each
        layer, so that with this margin all the rows asked for come out exact (the copies at
        the ``out_indices`` hold only the slab and ``read_rows``: :meth:`kept_rows`). It returns
        :class:`~xcit_mm.models.inference.sharding.SlabRows` (whole-image row numbers) that
        refuse rows outside them. The position code, and with ``valid_pixels`` (read for the
        slab's rows only) its frame, are the whole image's."""
        if self.training:
            raise RuntimeError('XCiTBackbone.stream_trunk is for inference: call .eval() first')
        H, W = image_hw
        p, D = self.patch_size, self.embed_dims
        grid = self._token_grid(image_hw)
        # the largest stem map: D / (p / 2) channels at stride 2, p / 2 of its rows per token row
        stem_rows = band_rows_for(band_mb, 4 * (D * 2 // p) * (grid[1] * p // 2) * (p // 2))
        device = self.pos_embed.proj.weight.device
        last = max(self.out_indices)
        layers = self.layers[:last + 1]
        if shard is None:
            owned = kept_rows = (first, stop_all) = (0, grid[0])
        else:
            shard.agree((H, W, p, D, len(layers), valid_pixels is not None),
                        'image sizes, models or masks (height, width, patch, dims, layers, mask)')
            owned = shard.token_rows(grid[0])
            first, stop_all = self.streamed_rows(grid[0], owned, read_rows)
            kept_rows = self.kept_rows(owned, read_rows)
        valid = (None if valid_pixels is None else self._valid_tokens(
            valid_pixels, image_hw, stem_rows, owned).to(device))
        frame = (_position_frame(valid, grid) if shard is None else
                 _sharded_position_frame(valid, owned, grid, shard))
        x = maps.new((stop_all - first, grid[1], D))
        sums = _StreamedSums(layers[0], valid, first, owned)
        for start, stop, _, _ in row_bands(stop_all - first, stem_rows):
            start, stop = start + first, stop + first  # whole-image token rows
            lo = max(0, start - 1) * p  # a token row reads p - 1 pixel rows above its own
            tokens = self.patch_embed(read_pixels(lo, min(H, stop * p)))[0, :, start - lo // p:]
            tokens = tokens.permute(1, 2, 0) + self._position_rows(frame, grid, start, stop)
            x.write(start - first, tokens)
            sums.add(start - first, tokens)
            del tokens
        band_rows = band_rows_for(band_mb, self._hidden_row_bytes(grid[1]), at_least=2)
        kept = {}
        for i, layer in enumerate(layers):
            then = []
            if i in self.out_indices and i != last:  # a copy of the rows read after the trunk
                kept[i] = maps.new((kept_rows[1] - kept_rows[0], ) + x.shape[1:])
                then.append(partial(_write_within, kept[i], kept_rows[0] - first))
            following = _StreamedSums(layers[i + 1], valid, first, owned) if i < last else None
            if following is not None:
                then.append(following.add)
            layer.forward_streamed(x, band_rows, sums.combined(shard), then)
            sums = following
            progress()
        kept[last] = x
        if shard is None:
            return [kept[i] for i in self.out_indices]
        reach = self.layers[0].lpi.reach
        slabs = []
        for i in self.out_indices:
            lo, hi = (first, stop_all) if i == last else kept_rows  # the rows the map holds
            exact = (first + reach * (i + 1) if first > 0 else 0,
                     stop_all - reach * (i + 1) if stop_all < grid[0] else grid[0])
            slabs.append(SlabRows(grid[0], grid[1], kept[i], lo,
                                  (max(lo, exact[0]), min(hi, exact[1]))))
        return slabs

    @property
    def stream_margin(self) -> int:
        """The token rows a slab of a sharded stream is made with each side of the rows it needs
        exactly: each layer's LPI (two 3x3 convs) spoils ``LPI.reach`` rows inside an edge where
        the image goes on. (The stem reads the pixels of the row above, read with the margin.)"""
        return self.layers[0].lpi.reach * (max(self.out_indices) + 1)

    def streamed_rows(self, grid_rows: int, owned: Tuple[int, int],
                      read_rows: Tuple[int, int] = EMPTY) -> Tuple[int, int]:
        """The token rows (first, stop) a rank of a sharded stream makes: its :meth:`kept_rows`
        with :attr:`stream_margin` rows each side (none where it owns and reads no row)."""
        lo, hi = self.kept_rows(owned, read_rows)
        if lo == hi:
            return lo, lo
        margin = self.stream_margin
        return max(0, lo - margin), min(grid_rows, hi + margin)

    def rank_token_rows(self, grid_rows: int, owned: Tuple[int, int],
                        read_rows: Tuple[int, int] = EMPTY) -> Tuple[int, int]:
        """How many token rows a rank's maps hold, as :meth:`token_maps_mb` takes them: the map
        the layers update (:meth:`streamed_rows`) and each copy (:meth:`kept_rows`)."""
        first, stop = self.streamed_rows(grid_rows, owned, read_rows)
        lo, hi = self.kept_rows(owned, read_rows)
        return stop - first, hi - lo

    @staticmethod
    def kept_rows(owned: Tuple[int, int],
                  read_rows: Tuple[int, int] = EMPTY) -> Tuple[int, int]:
        """The token rows (first, stop) a rank of a sharded stream keeps of the maps at the
        ``out_indices`` but the last: its slab ``owned`` and the rows ``read_rows`` read after
        the trunk, as one span. Only the map the layers update holds the margin, which the
        layers alone read."""
        spans = [span for span in (owned, read_rows) if span[0] < span[1]]
        if not spans:
            return owned[0], owned[0]
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)

    def _token_grid(self, image_hw: Tuple[int, int]) -> Tuple[int, int]:
        """The patch grid (token rows, token columns) of an image: its sides rounded up."""
        p = self.patch_size
        return tuple((side + p - 1) // p for side in image_hw)

    def _hidden_row_bytes(self, grid_width: int) -> int:
        """The bytes of one token row of the FFN's hidden layer (4 D floats a token), a band's
        largest map in :meth:`stream_trunk`, which sizes its bands by it."""
        return 4 * 4 * self.embed_dims * grid_width

    def trunk_band_mb(self, image_hw: Tuple[int, int], band_mb: float,
                      token_rows: Optional[int] = None) -> float:
        """The MB of the FFN's hidden layer that a band of :meth:`stream_trunk` holds when asked
        for ``band_mb``: whole token rows, at least two, at most the map's (``token_rows`` rows,
        by default the image's), so that a small image's band is the image."""
        grid = self._token_grid(image_hw)
        row_bytes = self._hidden_row_bytes(grid[1])
        rows = min(grid[0] if token_rows is None else token_rows,
                   band_rows_for(band_mb, row_bytes, at_least=2))
        return rows * row_bytes / 2**20

    def token_maps_mb(self, image_hw: Tuple[int, int], token_rows: Optional[int] = None,
                      kept_rows: Optional[int] = None) -> Tuple[int, float]:
        """How many token maps :meth:`stream_trunk` keeps for an image of ``image_hw`` (the
        copies the adapter reads, and the map the layers update), and their MB together: the
        map the layers update of ``token_rows`` rows (a rank's :meth:`streamed_rows`), the
        copies of ``kept_rows`` (a rank's :meth:`kept_rows`); by default all the grid's."""
        grid = self._token_grid(image_hw)
        rows = grid[0] if token_rows is None else token_rows
        copy_rows = rows if kept_rows is None else kept_rows
        copies = len(set(self.out_indices) - {max(self.out_indices)})
        row_mb = 4 * self.embed_dims * grid[1] / 2**20
        return copies + 1, (rows + copies * copy_rows) * row_mb

    def _valid_tokens(self, valid_pixels: Callable[[int, int], torch.Tensor],
                      image_hw: Tuple[int, int], band_rows: int,
                      rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """(grid rows, grid columns) bool: the tokens whose patch holds a valid pixel, from
        ``valid_pixels`` read by bands of ``band_rows`` token rows (the padding to the patch
        grid is not valid); only the token rows ``rows`` (first, stop) if given."""
        H, W = image_hw
        p = self.patch_size
        grid = self._token_grid(image_hw)
        first, last = (0, grid[0]) if rows is None else rows
        valid = torch.empty((last - first, grid[1]), dtype=torch.bool)
        for start, stop, _, _ in row_bands(last - first, band_rows):
            start, stop = start + first, stop + first
            a, b = start * p, min(H, stop * p)
            band = valid_pixels(a, b)
            if (not isinstance(band, torch.Tensor) or band.dtype != torch.bool
                    or tuple(band.shape) != (b - a, W)):
                got = (f'{band.dtype} tensor of shape {tuple(band.shape)}'
                       if isinstance(band, torch.Tensor) else type(band).__name__)
                raise ValueError(f'valid_pixels({a}, {b}) must give a bool tensor of shape '
                                 f'({b - a}, {W}) (pixel rows {a}..{b - 1}, True where the '
                                 f'pixel is valid); got a {got}')
            padded = torch.zeros((stop - start) * p, grid[1] * p, dtype=torch.bool)
            padded[:b - a, :W] = band.cpu()
            valid[start - first:stop - first] = padded.view(stop - start, p, grid[1],
                                                            p).any(3).any(1)
        return valid

    def _position_rows(self, frame: Tuple[int, int, int, int], grid: Tuple[int, int],
                       start: int, stop: int) -> torch.Tensor:
        """The position code of token rows ``start:stop`` (rows, W, D) on the grid ``frame`` =
        (top, left, height, width): tokens outside it take the code of its nearest edge."""
        top, left, height, width = frame
        if frame == (0, 0) + tuple(grid):
            return self.pos_embed(grid, start, stop)
        rows = (torch.arange(start, stop) - top).clamp(0, height - 1)
        cols = (torch.arange(grid[1]) - left).clamp(0, width - 1)
        first = int(rows[0])
        code = self.pos_embed((height, width), first, int(rows[-1]) + 1)
        return code[(rows - first).to(code.device)][:, cols.to(code.device)]

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
