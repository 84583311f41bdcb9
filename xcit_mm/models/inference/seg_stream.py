"""Semantic FPN and UperNet on a streamed XCiT trunk, and stock ``predict``'s labels, as
:class:`~.row_stream.RowMap` s made a band of rows at a time, each sum and resize where stock
does it (``docs/gigapixel.md``). No map is ever whole: UperNet's pyramid pooling adds its pools up
band by band, and the full-resolution steps run a chunk of classes at a time into a running
argmax (and softmax, for a confidence). The checks that a model's parts allow all this, before
any work, are here too."""
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from mmseg.models.decode_heads import UPerHead
from mmseg.models.utils import Upsample
from torch import Tensor
from torch.nn.modules.utils import _pair

from .fpn_data_flow import fpn_rows, top_down_rows
from .row_stream import (Combine, Crop, LevelByLevelBackbone, Local, NotRowLocal, Resize, RowMap,
                         TensorRows, _graph, measured_bands, module_rows)

# The pyramid pooling's pass over the coarsest level, where no stream gives its band.
POOL_BAND_MB = 64


def _resized(source: RowMap, target: RowMap, align_corners) -> RowMap:
    """``source`` resized bilinearly to ``target``'s size (itself where the sizes agree)."""
    if (source.height, source.width) == (target.height, target.width):
        return source
    return Resize(source, (target.height, target.width), 'bilinear', align_corners)


def _branch_rows(branch, source: RowMap) -> RowMap:
    """One of FPNHead's scale heads (convs and mmseg ``Upsample`` s) as rows."""
    for module in branch:
        if isinstance(module, Upsample):
            size = module.size or [int(side * module.scale_factor)
                                   for side in (source.height, source.width)]
            source = Resize(source, size, module.mode, module.align_corners)
        else:
            source = module_rows(module, source)
    return source


def logits_rows(levels: Sequence[RowMap], neck, head, band_mb: float = POOL_BAND_MB,
                slab=None, valid_cells: Optional[Callable[[int, int], Tensor]] = None) -> RowMap:
    """The head's logits of the backbone's level maps, by rows: Semantic FPN
    (``FPNHead.forward(FPN.forward(levels))``) or UperNet (its pyramid pooling's pass over the
    coarsest level in bands of ``band_mb``; with a ``slab`` of a sharded stream
    (``sharding.Slab``), over the slab's rows, the pools then added up across the ranks; with
    ``valid_cells``, over the coarsest level's cells that hold data only, see
    :class:`PyramidPooling`)."""
    if type(head) is UPerHead:
        return _upernet_rows(levels, head, band_mb, slab, valid_cells)
    outs = fpn_rows(levels, neck)
    output = _branch_rows(head.scale_heads[0], outs[0])
    for i in range(1, len(head.feature_strides)):
        branch = _branch_rows(head.scale_heads[i], outs[i])
        output = Combine(torch.add, output, _resized(branch, output, head.align_corners))
    return Local(head.cls_seg, output)


def _upernet_rows(levels: Sequence[RowMap], head: UPerHead, band_mb: float, slab=None,
                  valid_cells: Optional[Callable[[int, int], Tensor]] = None) -> RowMap:
    """``UPerHead.forward(levels)`` by rows, its ``psp_forward`` included: the pooled maps of
    :class:`PyramidPooling`, each resized to the coarsest level as rows, concatenated with it
    and the bottleneck conv, all by rows."""
    top = levels[-1]
    pooling = PyramidPooling(top, head.psp_modules, band_mb, slab, valid_cells)
    psp = [top] + [Resize(pooled, (top.height, top.width), 'bilinear',
                          head.psp_modules.align_corners) for pooled in pooling.maps]
    lateral = [module_rows(conv, level) for conv, level in zip(head.lateral_convs, levels)]
    lateral.append(module_rows(head.bottleneck, Combine(_cat_channels, *psp)))
    for i in range(len(lateral) - 1, 0, -1):
        lateral[i - 1] = top_down_rows(lateral[i - 1], lateral[i],
                                       dict(mode='bilinear', align_corners=head.align_corners))
    outs = [module_rows(conv, lat) for conv, lat in zip(head.fpn_convs, lateral)] + lateral[-1:]
    outs = [outs[0]] + [_resized(out, outs[0], head.align_corners) for out in outs[1:]]
    return Local(head.cls_seg, module_rows(head.fpn_bottleneck, Combine(_cat_channels, *outs)))


def _cat_channels(*maps: Tensor) -> Tensor:
    return torch.cat(maps, dim=1)


def _adaptive_bins(size: int, bins: int) -> Tensor:
    """(bins, size) 0/1: which of ``size`` rows (or columns) each of torch's adaptive pooling bins
    averages: bin i from floor(i * size / bins) to ceil((i + 1) * size / bins)."""
    member = torch.zeros(bins, size)
    for i in range(bins):
        member[i, i * size // bins:-(-(i + 1) * size // bins)] = 1
    return member


class PyramidPooling:
    """UperNet's pyramid pooling (mmseg's ``PPM``: an adaptive average pool to s x s, then a 1x1
    ConvModule, per scale s) of a map made by rows: on first use, one pass over its rows in
    measured bands adds each band into every pool's sums (in float64, binned as torch bins
    them), so that the map is never whole; the ConvModules then run on the small pooled maps
    as stock runs them. ``maps``: each scale's output as rows.

    With a ``slab`` (``sharding.Slab``), the pass covers the slab's share of the source's rows
    (``slab.rows_of``: the ranks' shares tile the map) and the sums and counts are added up
    across the ranks (``slab.combine``), so that every rank pools the whole map: the pass then
    runs on every rank, which :func:`run_poolings` makes sure of before any rank's labels.

    With ``valid_cells(a, b)`` (a bool (b - a, width) tensor of the source's rows a..b-1), each
    pool averages the cells that hold data only, as XCA's sums leave out the tokens without
    data: a nodata collar then does not pull the pooled context of the data towards what the
    model makes of empty pixels. A bin without any such cell pools to zeros."""

    def __init__(self, source: RowMap, ppm, band_mb: float, slab=None,
                 valid_cells: Optional[Callable[[int, int], Tensor]] = None):
        for branch in ppm:
            if not (isinstance(branch, nn.Sequential)
                    and type(branch[0]) is nn.AdaptiveAvgPool2d):
                raise NotRowLocal(f'{type(ppm).__name__}: a branch that is not an adaptive '
                                  'average pool then modules of the pooled map')
        self.source, self.ppm, self.band_mb, self.slab = source, ppm, band_mb, slab
        self.valid_cells = valid_cells
        self.pass_rows = (0, source.height) if slab is None else slab.rows_of(source.height)
        self.scales = [_pair(branch[0].output_size) for branch in ppm]
        if any(None in scale for scale in self.scales):
            raise NotRowLocal('an adaptive average pool of the input size along one side')
        self._pooled: Optional[List[Tensor]] = None
        self.maps = [_Pooled(self, i, *scale) for i, scale in enumerate(self.scales)]

    @staticmethod
    def held_bytes(scales: Sequence[int], in_channels: int, channels: int, width: int) -> int:
        """What a pass holds beyond its bands: each scale's float64 sums and 0/1 column bins,
        and the pooled maps the ConvModules make (float32)."""
        return sum(8 * in_channels * s * s + 4 * width * s + 4 * channels * s * s
                   for s in scales)

    def pooled(self, index: int) -> Tensor:
        if self._pooled is None:
            self._pooled = self._pool()
        return self._pooled[index]

    def _pool(self) -> List[Tensor]:
        height, width = self.source.height, self.source.width
        rows = [_adaptive_bins(height, s).double() for s, _ in self.scales]
        cols = [_adaptive_bins(width, s) for _, s in self.scales]
        count = len(self.scales)
        sums, counts, dtype = [0.] * count, [0.] * count, None
        first, stop = self.pass_rows
        source = self.source if (first, stop) == (0, height) else Crop(
            self.source, first, 0, stop - first, width)
        for start, stop, band in measured_bands(source, self.band_mb):
            start, stop, dtype = start + first, stop + first, band.dtype
            valid = None
            if self.valid_cells is not None:  # cells without data add nothing, count nothing
                valid = self.valid_cells(start, stop).to(band)
                band = band * valid
            for i, (row_bins, col_bins) in enumerate(zip(rows, cols)):
                # each band row's column-bin sums (float32, as torch's pool adds), then the rows
                by_columns = torch.matmul(band, col_bins.t().to(band)).double()
                band_bins = row_bins[:, start:stop].to(band.device)
                sums[i] = sums[i] + torch.einsum('ir,bcrj->bcij', band_bins, by_columns)
                if valid is not None:
                    counts[i] = counts[i] + band_bins @ (valid @ col_bins.t().to(band)).double()
            del band
        if self.slab is not None:  # a rank whose share has no rows adds zeros
            device = next(self.ppm.parameters()).device
            dtype = dtype or next(self.ppm.parameters()).dtype
            zeros = [torch.zeros(1, self.ppm.in_channels, *scale, dtype=torch.float64,
                                 device=device) for scale in self.scales]
            sums = [z if isinstance(total, float) else total for z, total in zip(zeros, sums)]
            if self.valid_cells is not None:
                sums += [z[0, 0] if isinstance(total, float) else total
                         for z, total in zip(zeros, counts)]
            sums = self.slab.combine(sums, 'pyramid pooling sums')
            sums, counts = sums[:count], sums[count:] or counts
        outs = []
        for branch, total, row_bins, col_bins, cells in zip(self.ppm, sums, rows, cols, counts):
            if self.valid_cells is None:  # every cell of each bin
                cells = row_bins.sum(1)[:, None] * col_bins.double().sum(1)[None]
            cells = cells.to(total.device)
            mean = total / cells.clamp(min=1)  # a bin without data: zeros
            outs.append(branch[1:](mean.to(dtype)))
        return outs


def valid_cells_of(valid_pixels: Callable[[int, int], Tensor], image_hw: Sequence[int],
                   stride: int) -> Callable[[int, int], Tensor]:
    """``valid_cells(a, b)`` of a map of ``stride`` over the image (cells of stride x stride
    pixels, as ``ceil(H / stride)`` rows) from ``valid_pixels(start, stop)`` (a bool
    (stop - start, W) tensor of the image's pixel rows): a cell holds data if any of its pixels
    does, as a token does for XCA's sums."""
    H, W = image_hw
    columns = -(-W // stride)

    def valid_cells(a: int, b: int) -> Tensor:
        pixels = valid_pixels(a * stride, min(H, b * stride))
        padded = pixels.new_zeros(((b - a) * stride, columns * stride))
        padded[:pixels.shape[0], :W] = pixels
        return padded.view(b - a, stride, columns, stride).any(3).any(1)

    return valid_cells


class _Pooled(RowMap):
    """One scale of a :class:`PyramidPooling` as rows (the whole small map made on first use)."""

    def __init__(self, pooling: PyramidPooling, index: int, height: int, width: int):
        super().__init__(height, width)
        self.pooling, self.index = pooling, index

    def reads(self, start: int, stop: int) -> List[Tuple[RowMap, int, int]]:
        """Any of its rows: the pooling pass's rows of the source."""
        return [(self.pooling.source, *self.pooling.pass_rows)]

    def rows(self, start: int, stop: int) -> Tensor:
        return self.pooling.pooled(self.index)[:, :, max(0, start):stop]


def run_poolings(node: RowMap) -> None:
    """Run now every pyramid pooling ``node`` is made from: in a sharded stream each pass ends in
    an exchange every rank must join, also a rank whose labels never read the pooled maps."""
    for current in _graph(node)[0]:
        if isinstance(current, _Pooled):
            current.pooling.pooled(current.index)


def labels_rows(logits: RowMap, head_hw: Sequence[int], crop: Sequence[int],
                out_hw: Sequence[int], head_align_corners: bool,
                align_corners: bool, classes_per_chunk: Optional[int] = None,
                confidence: bool = False) -> RowMap:
    """Stock ``predict``'s labels (1, 1, H, W) by rows: the head's resize to ``head_hw``, the
    padding ``crop`` (left, right, top, bottom), the resize to ``out_hw``, the argmax; the
    full-resolution steps run ``classes_per_chunk`` classes at a time (default: all). With
    ``confidence``, channel 1 holds round(255 x the top-1 softmax probability)."""
    window = ClassWindow(logits)
    x = Resize(window, head_hw, 'bilinear', head_align_corners)
    left, right, top, bottom = crop
    x = Crop(x, top, left, head_hw[0] - top - bottom, head_hw[1] - left - right)
    if (x.height, x.width) != tuple(out_hw):
        x = Resize(x, out_hw, 'bilinear', align_corners)
    return RunningArgmax(x, window, classes_per_chunk, confidence)


class ClassWindow(RowMap):
    """Classes ``c0:c1`` of a map's rows (set by :class:`RunningArgmax` chunk after chunk), laid
    out as the map is (the kernels that resize them give each class the bits of all classes);
    ``num_classes``: the map's, once a band was made."""

    def __init__(self, source: RowMap):
        super().__init__(source.height, source.width)
        self.source, self.window, self.num_classes = source, None, None

    def reads(self, start: int, stop: int) -> List[Tuple[RowMap, int, int]]:
        return [(self.source, start, stop)]

    def rows(self, start: int, stop: int) -> Tensor:
        band = self.source.rows(start, stop)
        self.num_classes = band.shape[1]
        if self.window is None:
            return band
        part = band[:, self.window[0]:self.window[1]]
        if band.is_contiguous(memory_format=torch.channels_last) and not band.is_contiguous():
            part = part.contiguous(memory_format=torch.channels_last)
        return part


class RunningArgmax(Combine):
    """The argmax over classes of ``source`` (made from ``window``'s classes), one chunk of
    classes after another: strictly greater wins, so a tie goes to the lower class and a NaN
    beats a number, as in ``argmax``. With ``confidence``, also the top-1 softmax probability
    (in 0-255 levels), from a running maximum and a running sum of exponentials rescaled to it
    (online softmax). Output: (1, 1 or 2, rows, W) int64. A Combine: its source's rows are
    read once."""

    def __init__(self, source: RowMap, window: ClassWindow, classes_per_chunk: Optional[int],
                 confidence: bool = False):
        super().__init__(None, source)
        self.window, self.confidence = window, confidence
        self.chunk = classes_per_chunk
        self.chain = _maps_between(source, window)

    def _make(self, start: int, stop: int) -> Tensor:
        source, = self.sources
        best = labels = total = None
        c0 = 0
        while c0 == 0 or c0 < self.window.num_classes:
            self.window.window = (c0, c0 + self.chunk) if self.chunk else None
            for m in self.chain:  # the rows they keep are of the chunk before
                m.forget()
            x = source.rows(start, stop)
            values, index = x.max(dim=1, keepdim=True)  # the first maximum of the chunk
            if best is None:
                best, labels = values, index
            else:
                better = (values > best) | (values.isnan() & ~best.isnan())
                labels = torch.where(better, index + c0, labels)
                values = torch.where(better, values, best)
                if self.confidence:  # the running sum rescaled to the new maximum
                    total.mul_(torch.exp(best - values))
                best = values
                del better
            if self.confidence:
                part = torch.exp(x - best).sum(dim=1, keepdim=True)
                total = part if total is None else total.add_(part)
                del part
            del x, values, index
            c0 += self.chunk or self.window.num_classes
        self.window.window = None
        for m in self.chain:
            m.forget()
        if not self.confidence:
            return labels
        # the top class's probability is exp(0) / total; in 0-255 levels, rounded
        return torch.cat([labels, torch.round(255 / total).long()], dim=1)


def _maps_between(node: RowMap, source: RowMap) -> List[RowMap]:
    """The maps on the way from ``source`` up to ``node`` (both included)."""
    chain = [node]
    while chain[-1] is not source:
        chain.append(chain[-1].source)
    return chain


def why_not_by_rows(backbone: LevelByLevelBackbone, neck, head) -> Optional[str]:
    """Why the adapter, neck or head cannot run by rows (None if they can): the graph a streamed
    predict builds, on a small image's placeholder maps (nothing runs)."""
    side, device = 64, next(head.parameters()).device
    placeholder = TensorRows(torch.zeros(1, 1, side, side, device=device))
    levels = [TensorRows(torch.zeros(1, channels, -(-side // stride), -(-side // stride),
                                     device=device))
              for channels, stride in zip(backbone.out_channels, backbone.strides)]
    try:
        for level in range(len(levels)):
            backbone.level_rows(placeholder, level, (side, side))
    except NotRowLocal as error:
        return f'a part of the backbone\'s adapter: {error}'
    try:
        logits_rows(levels, neck, head)
    except NotRowLocal as error:
        return f'a part of the neck or head: {error}'
    return None
