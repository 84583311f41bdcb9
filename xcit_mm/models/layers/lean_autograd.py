"""Memory-lean autograd for the XCiT layer and the adapter's 2x upsampling: keep only what is
expensive to recompute, hand-derive the rest (docs/benchmark_whole_model.md); drop-path enters as
a per-sample ``scale`` of gamma."""
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

_NORM_EPS = 1e-12  # as F.normalize: the q / k column norms are clamped from below
_OFFSETS = ((0, 0), (0, 1), (1, 0), (1, 1))  # (di, dj) of a 2x2 stride-2 transposed conv


def xca_sums(q: torch.Tensor, k: torch.Tensor, squared: bool = False) -> Tuple[torch.Tensor, ...]:
    """XCA's only reads of all the tokens, ``(q^T k, q_norm, k_norm)`` of q, k (B, h, N, d): the
    (B, h, d, d) product and the (B, h, d) column norms; ``squared``: the norms squared, which add
    up over the bands of a streamed trunk (and reduce faster over a band's strided columns)."""
    if squared:
        return q.transpose(-2, -1) @ k, (q * q).sum(-2), (k * k).sum(-2)
    return (q.transpose(-2, -1) @ k, torch.linalg.vector_norm(q, dim=-2),
            torch.linalg.vector_norm(k, dim=-2))


def xca_mixing(q: torch.Tensor, k: torch.Tensor, temperature: torch.Tensor,
               proj_weight: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``(mixing, attn, cosine, q_norm, k_norm)`` of q, k (B, h, N, d): XCA's attention folded
    into the output projection, ``v @ mixing + bias``."""
    qk, q_norm, k_norm = xca_sums(q, k)
    q_norm, k_norm = q_norm.clamp_min(_NORM_EPS), k_norm.clamp_min(_NORM_EPS)
    mixing, attn, cosine = xca_mixing_of_sums(qk, q_norm, k_norm, temperature, proj_weight)
    return mixing, attn, cosine, q_norm, k_norm


def xca_mixing_of_sums(qk: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                       temperature: torch.Tensor, proj_weight: torch.Tensor):
    """XCA's ``(mixing, attn, cosine)`` from its sums over the tokens (which a streamed trunk
    adds up band by band): ``qk`` = q^T k (B, h, d, d) and the column norms (B, h, d)."""
    B, h, d, _ = qk.shape
    q_norm, k_norm = q_norm.clamp_min(_NORM_EPS), k_norm.clamp_min(_NORM_EPS)
    cosine = qk / (q_norm[..., :, None] * k_norm[..., None, :])
    attn = (cosine * temperature).softmax(dim=-1)  # (B, h, d_out, d_v)
    weight_t = proj_weight.t().reshape(h, d, h * d)  # W^T rows, per head
    mixing = (attn.transpose(-2, -1) @ weight_t).reshape(B, h * d, h * d)
    return mixing, attn, cosine


def split_qk(qk: torch.Tensor, num_heads: int):
    """(B, N, 2C) (q then k, head by head, as XCA's qkv lays them out) -> q, k (B, h, N, d):
    views, no copy."""
    B, N, C2 = qk.shape
    return qk.view(B, N, 2, num_heads, C2 // 2 // num_heads).permute(2, 0, 3, 1, 4).unbind(0)


def split_qkv(qkv: torch.Tensor, num_heads: int):
    """(B, N, 3C) -> q, k (B, h, N, d) and v (B, N, C): views, no copy."""
    C = qkv.shape[-1] // 3
    q, k = split_qk(qkv[..., :2 * C], num_heads)
    return q, k, qkv[..., 2 * C:]


def _coef(gamma: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    return gamma if scale is None else gamma * scale


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _norm_linear(x, ln_weight, ln_bias, weight, bias, eps) -> torch.Tensor:
    return F.linear(torch.native_layer_norm(x, x.shape[-1:], ln_weight, ln_bias, eps)[0], weight,
                    bias)


def _output_grads(grad_out, gamma, scale):
    """The output's gradient made contiguous, that of ``gamma * y`` and that of ``y``."""
    grad_out = grad_out.contiguous()
    grad_scaled = grad_out if scale is None else grad_out * scale
    return grad_out, grad_scaled, grad_scaled * gamma


def _norm_linear_backward(grad_lin, x, ln_weight, ln_bias, lin_weight, eps, grad_residual,
                          needs) -> tuple:
    """Gradients of x, LN weight and bias, linear weight and bias (``needs``: which) of
    ``x + ... linear(LN(x))`` from ``grad_lin``, LN recomputed."""
    C = x.shape[-1]
    normed, mean, rstd = torch.native_layer_norm(x, (C,), ln_weight, ln_bias, eps)
    grad_weight = _flat(grad_lin).t() @ _flat(normed) if needs[3] else None
    grad_bias = _flat(grad_lin).sum(0) if needs[4] else None
    del normed
    grad_x = grad_ln_weight = grad_ln_bias = None
    if needs[0] or needs[1] or needs[2]:
        grad_x, grad_ln_weight, grad_ln_bias = torch.ops.aten.native_layer_norm_backward(
            grad_lin @ lin_weight, x, (C,), mean, rstd, ln_weight, ln_bias, list(needs[:3]))
        if needs[0]:
            grad_x = grad_x + grad_residual
    return grad_x, grad_ln_weight, grad_ln_bias, grad_weight, grad_bias


class _XCAResidual(torch.autograd.Function):
    """``x + coef * (v @ mixing + proj_bias)``, q, k, v from ``qkv(LN(x))``, saving x and qkv."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, qkv_weight, qkv_bias, temperature, proj_weight,
                proj_bias, gamma, scale, num_heads: int, eps: float):
        qkv = _norm_linear(x, ln_weight, ln_bias, qkv_weight, qkv_bias, eps)
        q, k, v = split_qkv(qkv, num_heads)
        mixing, attn, cosine, q_norm, k_norm = xca_mixing(q, k, temperature, proj_weight)
        out = torch.addcmul(x, _coef(gamma, scale), torch.baddbmm(proj_bias, v, mixing))
        ctx.save_for_backward(x, ln_weight, ln_bias, qkv_weight, temperature, proj_weight,
                              proj_bias, gamma, scale, qkv, mixing, attn, cosine, q_norm, k_norm)
        ctx.num_heads, ctx.eps = num_heads, eps
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x, ln_weight, ln_bias, qkv_weight, temperature, proj_weight, proj_bias, gamma, scale,
         qkv, mixing, attn, cosine, q_norm, k_norm) = ctx.saved_tensors
        needs = ctx.needs_input_grad
        B, N, C = x.shape
        h = ctx.num_heads
        d = C // h
        q, k, v = split_qkv(qkv, h)
        grad_out, grad_scaled, grad_y = _output_grads(grad_out, gamma, scale)
        # dy^T v per image: gives the mixing's gradient and, with the mixing, gamma's.
        v_t_grad = torch.bmm(v.transpose(1, 2), grad_scaled)  # (B, C, C)
        grad_gamma = None
        if needs[8]:
            grad_gamma = ((v_t_grad * mixing).sum(1) + proj_bias * grad_scaled.sum(1)).sum(0)
        grad_mixing = (v_t_grad * gamma).view(B, h, d, C)
        del v_t_grad
        grad_proj_bias = grad_y.sum((0, 1)) if needs[7] else None
        grad_v = torch.bmm(grad_y, mixing.transpose(1, 2))  # (B, N, C)
        del grad_y
        # mixing[b, (h, j), :] = sum_i attn[b, h, i, j] W^T[h, i, :]
        weight_t = proj_weight.t().reshape(h, d, C)
        grad_proj_weight = (attn @ grad_mixing).sum(0).reshape(C, C).t() if needs[6] else None
        grad_attn = (grad_mixing @ weight_t.transpose(-2, -1)).transpose(-2, -1)  # (B,h,d,d)
        # softmax, temperature, cosine = S / (|q_i| |k_j|) with S = q^T k
        grad_logits = attn * (grad_attn - (grad_attn * attn).sum(-1, keepdim=True))
        grad_temperature = (grad_logits * cosine).sum((0, 2, 3)).view_as(temperature)
        grad_cosine = grad_logits * temperature
        grad_s = grad_cosine / (q_norm[..., :, None] * k_norm[..., None, :])
        grad_cos_cos = grad_cosine * cosine
        # d|q_i| = -sum_j dA_ij A_ij / |q_i|, and |q| = ||q||_2 gives dq += q d|q| / |q|; a clamped
        # (zero) column has q = 0, so the term vanishes as under autograd.
        q_coef = -grad_cos_cos.sum(-1) / q_norm.square()  # (B, h, d)
        k_coef = -grad_cos_cos.sum(-2) / k_norm.square()
        grad_qkv = qkv.new_empty(B, N, 3, h, d)
        grad_qkv[:, :, 0] = (k @ grad_s.mT + q * q_coef[..., None, :]).transpose(1, 2)
        grad_qkv[:, :, 1] = (q @ grad_s + k * k_coef[..., None, :]).transpose(1, 2)
        grad_qkv[:, :, 2] = grad_v.view(B, N, h, d)
        del grad_v
        grads_norm_qkv = _norm_linear_backward(grad_qkv.view(B, N, 3 * C), x, ln_weight, ln_bias,
                                               qkv_weight, ctx.eps, grad_out, needs[:5])
        return (*grads_norm_qkv, grad_temperature if needs[5] else None, grad_proj_weight,
                grad_proj_bias, grad_gamma, None, None, None)


class _FFNResidual(torch.autograd.Function):
    """``x + coef * fc2(GELU(fc1(LN(x))))``, saving x and the pre-GELU hidden layer."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, gamma,
                scale, eps: float):
        hidden = _norm_linear(x, ln_weight, ln_bias, fc1_weight, fc1_bias, eps)
        y = F.linear(F.gelu(hidden), fc2_weight, fc2_bias)
        out = torch.addcmul(x, _coef(gamma, scale), y)
        ctx.save_for_backward(x, ln_weight, ln_bias, fc1_weight, fc2_weight, fc2_bias, gamma,
                              scale, hidden)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x, ln_weight, ln_bias, fc1_weight, fc2_weight, fc2_bias, gamma, scale,
         hidden) = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_out, grad_scaled, grad_y = _output_grads(grad_out, gamma, scale)
        act = F.gelu(hidden)
        grad_fc2_weight = grad_gamma = None
        if needs[5] or needs[7]:
            # dy^T a: fc2's weight gradient before gamma, and with fc2's weight gamma's gradient
            proj = _flat(grad_scaled).t() @ _flat(act)  # (C, hidden)
            if needs[5]:
                grad_fc2_weight = proj * gamma[:, None]
            if needs[7]:
                grad_gamma = (proj * fc2_weight).sum(1) + fc2_bias * _flat(grad_scaled).sum(0)
            del proj
        del act
        grad_fc2_bias = _flat(grad_y).sum(0) if needs[6] else None
        grad_hidden = torch.ops.aten.gelu_backward(grad_y @ fc2_weight, hidden)
        del grad_y
        grads_norm_fc1 = _norm_linear_backward(grad_hidden, x, ln_weight, ln_bias, fc1_weight,
                                               ctx.eps, grad_out, needs[:5])
        return (*grads_norm_fc1, grad_fc2_weight, grad_fc2_bias, grad_gamma, None, None)


def xca_residual(x: torch.Tensor, norm: nn.LayerNorm, attn: nn.Module, gamma: torch.Tensor,
                 scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``x + scale * gamma * attn(norm(x))`` by :class:`_XCAResidual`."""
    return _XCAResidual.apply(x, norm.weight, norm.bias, attn.qkv.weight, attn.qkv.bias,
                              attn.temperature, attn.proj.weight, attn.proj.bias, gamma, scale,
                              attn.num_heads, norm.eps)


def ffn_residual(x: torch.Tensor, norm: nn.LayerNorm, ffn: nn.Module, gamma: torch.Tensor,
                 scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``x + scale * gamma * ffn(norm(x))`` by :class:`_FFNResidual`."""
    return _FFNResidual.apply(x, norm.weight, norm.bias, ffn.fc1.weight, ffn.fc1.bias,
                              ffn.fc2.weight, ffn.fc2.bias, gamma, scale, norm.eps)


@contextmanager
def batch_norm_stats_frozen(*modules: nn.Module):
    """Batch norms in ``modules`` keep their running statistics: a re-run forward updates once."""
    norms = [m for module in modules for m in module.modules()
             if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (momentum, count) in zip(norms, saved):
                m.momentum = momentum
                m.num_batches_tracked.copy_(count)


def recomputed_residual(x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor],
                        modules: Sequence[nn.Module], gamma: torch.Tensor,
                        scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``x + scale * gamma * branch(x)`` (cheap ops only) keeping only ``x``: the backward re-runs
    it, the batch norms in ``modules`` updated once."""
    return checkpoint(lambda x, gamma, scale: torch.addcmul(x, _coef(gamma, scale), branch(x)),
                      x, gamma, scale, use_reentrant=False, preserve_rng_state=False,
                      context_fn=lambda: (nullcontext(), batch_norm_stats_frozen(*modules)))


def _row_blocks(x: torch.Tensor, channels: int) -> Iterator[Tuple[int, int]]:
    """``(top, bottom)`` of blocks of input rows: cache-sized on the CPU, the whole map elsewhere
    (fewer launches)."""
    B, _, H, W = x.shape
    rows = H if x.device.type != 'cpu' else max(1, min(H, (1 << 19) // max(1, B * W * channels)))
    return ((top, min(H, top + rows)) for top in range(0, H, rows))


def _up2_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 memory_format: torch.memory_format) -> torch.Tensor:
    B, C, H, W = x.shape
    out_channels = weight.shape[1]
    tokens = x.permute(0, 2, 3, 1)  # (B, H, W, C), a view for channels-last x
    out = torch.empty(B, out_channels, 2 * H, 2 * W, dtype=x.dtype, device=x.device,
                      memory_format=memory_format)
    grid = out.view(B, out_channels, H, 2, W, 2)  # splitting dims: a view in either layout
    bias = bias if bias is not None else x.new_zeros(out_channels)
    for top, bottom in _row_blocks(x, out_channels):
        block = tokens[:, top:bottom].reshape(-1, C)
        for di, dj in _OFFSETS:
            y = torch.addmm(bias, block, weight[:, :, di, dj])
            grid[:, :, top:bottom, di, :, dj] = y.view(B, -1, W, out_channels).permute(0, 3, 1, 2)
    return out


class _Up2Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, memory_format):
        ctx.save_for_backward(x, weight)
        return _up2_forward(x, weight, bias, memory_format)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        B, C, H, W = x.shape
        out_channels = weight.shape[1]
        grid = grad_out.view(B, out_channels, H, 2, W, 2)  # any layout: read block by block
        tokens = x.permute(0, 2, 3, 1)
        grad_tokens = x.new_empty(B, H, W, C) if needs[0] else None
        grad_weight = x.new_zeros(2, 2, C, out_channels) if needs[1] else None
        for top, bottom in _row_blocks(x, out_channels):
            block = tokens[:, top:bottom].reshape(-1, C) if needs[1] else None
            grad_block = None
            for di, dj in _OFFSETS:
                g = grid[:, :, top:bottom, di, :, dj].permute(0, 2, 3, 1).reshape(-1, out_channels)
                if needs[0]:
                    w = weight[:, :, di, dj].t()
                    grad_block = g @ w if grad_block is None else grad_block.addmm_(g, w)
                if needs[1]:
                    grad_weight[di, dj].addmm_(block.t(), g)
            if needs[0]:
                grad_tokens[:, top:bottom] = grad_block.view(B, -1, W, C)
        grad_x = grad_tokens.permute(0, 3, 1, 2) if needs[0] else None  # channels-last
        grad_weight = grad_weight.permute(2, 3, 0, 1) if needs[1] else None
        grad_bias = grad_out.sum((0, 2, 3)) if needs[2] else None  # False for a None bias
        return grad_x, grad_weight, grad_bias, None


def up2_blockwise(conv: nn.ConvTranspose2d, x: torch.Tensor,
                  memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """``conv`` (kernel 2, stride 2) of a channels-last map written into ``memory_format``, one
    matmul per kernel offset and block of input rows: little more memory than the output, where
    conv + ``.contiguous()`` needs two. Under autocast, plain autograd of the same forward."""
    if torch.is_autocast_enabled(x.device.type):
        return _up2_forward(x, conv.weight, conv.bias, memory_format)
    return _Up2Blockwise.apply(x, conv.weight, conv.bias, memory_format)
