"""RoIAlign as a weighted gather: mmcv's ``RoIAlign`` values, faster on CPU (docs/benchmark.md).

Every RoIAlign output cell is a fixed linear combination of feature-map pixels: the average over
the bin's sampling points of their bilinear interpolations, at most 4 pixels per point. So the
whole op is one sparse (cells x pixels) matrix applied to the (pixels x channels) map, which
``F.embedding_bag`` (``mode='sum'`` with per-sample weights) computes over contiguous channel
rows with threads, and whose transpose, the backward, is another ``embedding_bag`` after sorting
the taps by pixel. mmcv's CPU kernels are single-threaded loops over RoIs and channels, and its
backward scatters one value at a time; at the shapes quick-start's sizes they are
the largest part of a Mask R-CNN training step after the backbone (docs/benchmark.md,
"The shapes quick-start").

The sampling points, the border rules (points more than one pixel outside the map count zero,
points within it are clamped to the edge) and the adaptive grid (``sampling_ratio=0``:
``ceil(bin size)`` points per bin side) are mmcv's ``roi_align`` CPU kernel's, so values agree to
float rounding (tests/test_gather_roi_align.py checks outputs and gradients against mmcv). The
map is read through its strides, so channels-last maps work too (mmcv's CPU kernel reads raw
NCHW memory). Off the CPU the module calls mmcv's kernel.
"""
from typing import Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _bag_offsets(sizes: torch.Tensor) -> torch.Tensor:
    """Where each bag starts in the flat list of its members, given the bag sizes."""
    return sizes.cumsum(0) - sizes


def _axis_taps(start: torch.Tensor, extent: torch.Tensor, bins: int, grid: torch.Tensor,
               size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pixel indices and weights along one axis for every RoI and bin.

    Args:
        start, extent: (R,) RoI start and length in feature-map pixels.
        bins: pooled output size along the axis.
        grid: (R,) sampling points per bin along the axis.
        size: feature-map length along the axis.

    Returns:
        index, weight: (R, bins, 2 S) with S = max(grid): for each sampling point its lower and
        upper neighbour and their linear weights (zero for padding and out-of-map points).
    """
    num_rois = start.shape[0]
    points = int(grid.max()) if num_rois else 0
    bin_size = extent / bins
    k = torch.arange(points, dtype=start.dtype, device=start.device)
    p = torch.arange(bins, dtype=start.dtype, device=start.device)
    grid_f = grid.to(start.dtype)
    # mmcv: start + p * bin_size + (k + 0.5) * bin_size / grid
    pos = (start[:, None, None] + p[None, :, None] * bin_size[:, None, None]
           + (k[None, None, :] + 0.5) * bin_size[:, None, None] / grid_f[:, None, None])
    used = k[None, None, :] < grid_f[:, None, None]
    inside = used & (pos >= -1.0) & (pos <= size)
    pos = pos.clamp(min=0)
    low = pos.floor().clamp(max=size - 1)
    at_edge = low >= size - 1
    frac = torch.where(at_edge, torch.zeros_like(pos), pos - low)
    low_index = low.long()
    high_index = torch.where(at_edge, low_index, low_index + 1)
    index = torch.stack([low_index, high_index], -1).reshape(num_rois, bins, 2 * points)
    weight = (torch.stack([1 - frac, frac], -1) * inside[..., None]).reshape(
        num_rois, bins, 2 * points)
    return index, weight


def roi_align_taps(rois: torch.Tensor, feat_shape: Tuple[int, int, int, int],
                   output_size: Tuple[int, int], spatial_scale: float, sampling_ratio: int,
                   aligned: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sparse RoIAlign matrix as embedding-bag arguments.

    Returns:
        index (nnz,): rows of the (N*H*W, C) pixel table, grouped by output cell;
        weight (nnz,): their weights (bilinear weight / number of sampling points);
        offsets (R*ph*pw,): where each output cell's taps start. Zero-weight taps are dropped.
    """
    N, _, H, W = feat_shape
    ph, pw = output_size
    coords = rois[:, 1:].to(torch.float64 if rois.dtype == torch.float64 else torch.float32)
    offset = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (coords * spatial_scale - offset).unbind(1)
    width, height = x2 - x1, y2 - y1
    if aligned:
        if bool(((width < 0) | (height < 0)).any()):
            raise ValueError('RoIAlign got RoIs with x2 < x1 or y2 < y1; boxes must be '
                             '(batch_index, x1, y1, x2, y2) with x1 <= x2 and y1 <= y2')
    else:  # mmcv: unaligned RoIs are at least one pixel
        width, height = width.clamp(min=1), height.clamp(min=1)
    if sampling_ratio > 0:
        grid_h = grid_w = torch.full_like(height, sampling_ratio, dtype=torch.long)
    else:  # adaptive: ceil(roi size / bins) points per bin side
        grid_h = torch.ceil(height / ph).long()
        grid_w = torch.ceil(width / pw).long()
    index_y, weight_y = _axis_taps(y1, height, ph, grid_h, H)
    index_x, weight_x = _axis_taps(x1, width, pw, grid_w, W)
    count = (grid_h * grid_w).clamp(min=1).to(weight_y.dtype)
    batch = rois[:, 0].long()
    # (R, ph, pw, 2Sy, 2Sx): outer product of the two axes' taps
    index = (batch[:, None, None, None, None] * (H * W)
             + index_y[:, :, None, :, None] * W + index_x[:, None, :, None, :])
    weight = (weight_y[:, :, None, :, None] * weight_x[:, None, :, None, :]
              / count[:, None, None, None, None])
    num_cells = rois.shape[0] * ph * pw
    weight = weight.reshape(num_cells, -1)
    keep = weight != 0
    return index.reshape(num_cells, -1)[keep], weight[keep], _bag_offsets(keep.sum(1))


class _WeightedGather(torch.autograd.Function):
    """``out[m] = sum_j weight[j] * table[index[j]]`` over the taps j of cell m (an embedding
    bag); the backward transposes the bags (sort the taps by table row) and gathers again."""

    @staticmethod
    def forward(ctx, table, index, weight, offsets):
        ctx.save_for_backward(index, weight, offsets)
        ctx.num_rows = table.shape[0]
        return F.embedding_bag(index, table, offsets, mode='sum', per_sample_weights=weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        index, weight, offsets = ctx.saved_tensors
        taps_per_cell = torch.diff(offsets, append=offsets.new_tensor([index.numel()]))
        cell_of_tap = torch.repeat_interleave(
            torch.arange(offsets.numel(), device=index.device), taps_per_cell)
        order = torch.argsort(index, stable=True)  # fixed summation order: deterministic
        row_offsets = _bag_offsets(torch.bincount(index, minlength=ctx.num_rows))
        grad_table = F.embedding_bag(
            cell_of_tap[order], grad_out.contiguous(), row_offsets, mode='sum',
            per_sample_weights=weight[order])
        return grad_table, None, None, None


def gather_roi_align(input: torch.Tensor, rois: torch.Tensor,
                     output_size: Tuple[int, int], spatial_scale: float = 1.0,
                     sampling_ratio: int = 0, aligned: bool = True) -> torch.Tensor:
    """mmcv's ``roi_align(input, rois, output_size, spatial_scale, sampling_ratio, 'avg',
    aligned)`` as a weighted gather; returns (R, C, ph, pw), channels-last in memory."""
    N, C, H, W = input.shape
    ph, pw = output_size
    num_rois = rois.shape[0]
    if num_rois == 0:
        return input.new_zeros(0, C, ph, pw)
    with torch.no_grad():
        index, weight, offsets = roi_align_taps(rois, input.shape, output_size, spatial_scale,
                                                sampling_ratio, aligned)
    table = input.permute(0, 2, 3, 1).reshape(N * H * W, C)  # a view for channels-last input
    out = _WeightedGather.apply(table, index, weight.to(input.dtype), offsets)
    return out.view(num_rois, ph, pw, C).permute(0, 3, 1, 2)


class GatherRoIAlign(nn.Module):
    """Drop-in for ``mmcv.ops.RoIAlign`` (same arguments and values), computed as a weighted
    gather on CPU and by mmcv's kernel elsewhere.

    Args:
        output_size (int | tuple[int, int]): Pooled height and width.
        spatial_scale (float): Feature-map size / image size (1 / stride).
        sampling_ratio (int): Sampling points per bin side; 0: ``ceil(bin size)`` per RoI.
        pool_mode (str): Only ``'avg'`` (what mmdet's RoI heads use).
        aligned (bool): Pixel-centre alignment (shift by -0.5), as in mmcv.
        use_torchvision (bool): Only False (accepted for config compatibility).
    """

    def __init__(self, output_size: Union[int, Tuple[int, int]], spatial_scale: float = 1.0,
                 sampling_ratio: int = 0, pool_mode: str = 'avg', aligned: bool = True,
                 use_torchvision: bool = False):
        super().__init__()
        if pool_mode != 'avg':
            raise ValueError(f"GatherRoIAlign computes pool_mode='avg' only, got {pool_mode!r}; "
                             "use mmcv.ops.RoIAlign (mmdet's SingleRoIExtractor) for 'max'")
        if use_torchvision:
            raise ValueError('GatherRoIAlign does not call torchvision; drop use_torchvision')
        if not isinstance(sampling_ratio, int) or sampling_ratio < 0:
            raise ValueError(f'sampling_ratio must be an int >= 0 (0: adaptive), '
                             f'got {sampling_ratio!r}')
        self.output_size = ((output_size, output_size) if isinstance(output_size, int) else
                            tuple(output_size))
        self.spatial_scale = float(spatial_scale)
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned

    def forward(self, input: torch.Tensor, rois: torch.Tensor) -> torch.Tensor:
        if input.device.type != 'cpu':
            from mmcv.ops import roi_align
            return roi_align(input, rois, self.output_size, self.spatial_scale,
                             self.sampling_ratio, 'avg', self.aligned)
        return gather_roi_align(input, rois, self.output_size, self.spatial_scale,
                                self.sampling_ratio, self.aligned)

    def extra_repr(self) -> str:
        return (f'output_size={self.output_size}, spatial_scale={self.spatial_scale}, '
                f'sampling_ratio={self.sampling_ratio}, aligned={self.aligned}')
