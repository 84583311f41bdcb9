"""Semantic FPN on a whole image with its large maps made in bands of rows.

XCiT's only operation across the whole image is cross-covariance attention on the stride-16 (or
stride-8) tokens. Everything at a finer stride is row-local: the conv stem, the adapter that makes
the stride-4 level, the FPN's stride-4 lateral and output convs, the head's stride-4 conv and the
x2 bilinear upsamplings into it, the 1x1 classifier. So the network can see the whole image (every
token attends to the statistics of all of them) while its stride-2 and stride-4 maps are made a
band of rows at a time, each band with the rows of context its convs need:

* XCiT's stem (``ConvPatchEmbed`` with ``band_rows``) and stride-4 level
  (``forward_level_rows``), the FPN's level 0 (:class:`~.fpn_data_flow.BottomLevelRows`);
* the head's branch 0 conv on those FPN rows, each other branch run whole up to its last x2
  upsampling (maps at stride 8 and coarser) and upsampled a band at a time (:func:`up2_rows`),
  the branches summed in ``FPNHead.forward``'s order, then ``cls_seg``.

Only the stride-4 logits (C channels) and the maps at stride 8 and coarser are ever whole. The
values equal ``FPNHead.forward(FPN.forward(backbone(x)))`` up to float rounding (a convolution of
another size may sum in another order; ``tests/test_sem_fpn_bands.py``).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from mmseg.models.utils import Upsample, resize
from torch import Tensor

from .fpn_data_flow import (BackboneLevels, BottomLevelRows, RowLocalBackbone, band_rows_for,
                            conv_halo, fpn_upper_levels, neck_bands_bottom_level, row_bands)


def why_not_in_bands(backbone, neck, head) -> Optional[str]:
    """Why this backbone, FPN and ``FPNHead`` cannot run in bands (None if they can): the
    parts :func:`semantic_fpn_in_bands` relies on, as a reason a user can act on."""
    if not isinstance(backbone, RowLocalBackbone):
        return (f'{type(backbone).__name__} cannot make its stride-4 level in bands of rows '
                '(XCiTBackbone can)')
    if not neck_bands_bottom_level(neck):
        return ('the FPN needs a 1x1 lateral conv, a size-keeping stride-1 output conv with BN '
                "or no norm, and upsample_cfg mode='nearest' at level 0")
    if len(head.scale_heads[0]) != 1 or conv_halo(head.scale_heads[0][0]) is None:
        return ("the head's stride-4 branch must be one size-keeping stride-1 conv with BN or "
                'no norm')
    for branch in list(head.scale_heads)[1:]:
        up = branch[-1]
        if not (type(up) is Upsample and up.size is None and up.scale_factor == 2
                and up.mode == 'bilinear' and not up.align_corners):
            return ("each coarser branch of the head must end with a x2 bilinear Upsample, "
                    'align_corners=False')
    return None


def resized_rows(x: Tensor, start: int, stop: int, factor: int, width: int) -> Tensor:
    """Rows ``start:stop`` of ``F.interpolate(x, size=(factor * h, width), mode='bilinear',
    align_corners=False)`` (``x`` of ``h`` rows), from the rows of ``x`` they read and one more
    on each side.

    An output row ``y`` reads source position ``(y + 0.5) / factor - 0.5``; a slice of ``x``
    starting at an input row ``a`` and resized to ``factor`` times its rows maps its own output
    row ``y - factor * a`` to the same position relative to ``a``, with the same ratio (``k / kf``
    rounds as ``1 / f``), so inside the slice every row is the whole resize's, bit for bit. Only
    the slice's outermost output rows differ (clamped at its edges), and they lie outside
    ``start:stop``.
    """
    lo, hi = max(0, start // factor - 1), min(x.shape[2], -(-stop // factor) + 1)
    band = F.interpolate(x[:, :, lo:hi], size=(factor * (hi - lo), width), mode='bilinear',
                         align_corners=False)
    return band[:, :, start - factor * lo:stop - factor * lo]


def up2_rows(x: Tensor, start: int, stop: int) -> Tensor:
    """Rows ``start:stop`` of mmseg's ``Upsample(scale_factor=2, mode='bilinear')`` of ``x``
    (align_corners=False), which resizes to twice the size (:func:`resized_rows`)."""
    return resized_rows(x, start, stop, 2, 2 * x.shape[3])


def semantic_fpn_in_bands(backbone, neck, head, inputs: Tensor, band_mb: float) -> Tensor:
    """``head.forward(neck(backbone(inputs)))`` (logits at stride 4) with the stem and every
    stride-4 map made in bands of about ``band_mb`` MB. The parts must pass
    :func:`why_not_in_bands`; eval mode, no autograd."""
    levels = BackboneLevels(backbone, inputs, band_mb)
    outs, top = fpn_upper_levels(levels, neck)
    outs[1] = neck.fpn_convs[1](top)
    fpn_rows = BottomLevelRows(levels, neck, top)
    height, width = fpn_rows.hw
    # the coarser branches up to their last upsampling: maps at stride 8 and coarser
    coarse = []
    for i in range(1, len(head.scale_heads)):
        x = head.scale_heads[i][:-1](outs[i])
        outs[i] = None
        if (2 * x.shape[2], 2 * x.shape[3]) != (height, width):
            # an image side that is not a multiple of the coarse strides: FPNHead resizes the
            # upsampled branch to the stride-4 size; that resize is made whole, as stock makes it
            x = resize(head.scale_heads[i][-1](x), size=(height, width), mode='bilinear',
                       align_corners=head.align_corners)
            coarse.append((x, False))
        else:
            coarse.append((x, True))
        del x
    halo = conv_halo(head.scale_heads[0][0])
    row_bytes = head.channels * width * inputs.shape[0] * inputs.element_size()
    logits = None
    for start, stop, lo, hi in row_bands(height, band_rows_for(band_mb, row_bytes), halo):
        out = head.scale_heads[0](fpn_rows(lo, hi))[:, :, start - lo:stop - lo]
        for x, upsample_here in coarse:
            out = out + (up2_rows(x, start, stop) if upsample_here else x[:, :, start:stop])
        band = head.cls_seg(out)
        del out
        if logits is None:
            logits = band.new_empty(band.shape[:2] + (height, width))
        logits[:, :, start:stop] = band
        del band
    return logits


def labels_in_row_bands(logits: Tensor, size, crop, band_mb: float) -> Tensor:
    """``resize(logits, size, bilinear)[..., top:H - bottom, left:W - right].argmax(1)`` for one
    image's (1, C, h, w) logits, a band of output rows at a time: the labels (1, H', W') are the
    only full-size tensor. ``crop`` = (top, bottom, left, right); ``size`` = (H, W) with ``H`` a
    multiple of ``h``.

    With an integer row factor every output row of a band is the whole resize's, bit for bit
    (:func:`resized_rows`), and so is its argmax.
    """
    (height, width), h = size, logits.shape[2]
    factor = height // h
    assert factor * h == height, (size, logits.shape)
    top, bottom, left, right = crop
    row_bytes = logits.shape[1] * width * logits.element_size()
    rows = max(factor, band_rows_for(band_mb, row_bytes) // factor * factor)
    labels = torch.empty((1, height - top - bottom, width - left - right), dtype=torch.long,
                         device=logits.device)
    for start in range(top, height - bottom, rows):
        stop = min(height - bottom, start + rows)
        band = resized_rows(logits, start, stop, factor, width)[..., left:width - right]
        labels[:, start - top:stop - top] = band.argmax(dim=1)
        del band
    return labels
