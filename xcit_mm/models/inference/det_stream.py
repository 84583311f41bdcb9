"""Mask R-CNN over a whole scene on the scene's own features (``LeanMaskRCNN``'s
``mode='stream'``, docs/lean_detection.md): the geometry of the cores, the window of feature rows
their heads read, and the merge of their detections.

The XCiT trunk streams over the whole scene (:mod:`.row_stream`), so every feature map is the
scene's, not a tile's. The scene is cut into *cores*, tiles that do not overlap. Each core's RPN
proposes from the anchors whose centres lie in it (each anchor belongs to one core), and its RoI
heads read the scene's feature maps in a window of rows reaching ``margin`` pixels above and below
the core, over the whole width (or over a band of columns reaching ``margin`` beyond the core
sideways, :func:`column_windows`), so that a box leaving the core is still seen whole, on the
features the whole image would give it.
An object near a core's edge may be proposed by the anchors of both cores: the whole image's
class-wise NMS, applied across the cores (:class:`CoreRowMerge`), keeps it once. Nothing is cut,
so no fragments need merging.

The window holds whole rows of every FPN level (the level maps are made by rows), from
``margin`` above a row of cores to ``margin`` below it; moving down to the next row of cores
keeps the rows both windows share, moved in place, and makes only the new ones. On a scene so
wide that such rows do not fit the memory, each band of core columns gets a window of its own,
made from those columns of the token maps, one band after the other."""
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

from mmcv.ops import batched_nms
from mmengine.structures import InstanceData
from torch import Tensor

from .row_stream import RowMap, _graph, band_rows_for

# Core edges inside the scene lie on multiples of the coarsest FPN stride (P6's, 64 px), so that a
# core starts on a whole cell of every level: its anchors are the scene's anchors, shifted by the
# core's corner, and a window's RoIs sample the features at the scene's positions.
ALIGN = 64


def core_edges(length: int, tile: int) -> List[Tuple[int, int]]:
    """(start, stop) of the cores along one axis: they cover ``[0, length)`` without overlap,
    ``tile`` long (rounded down to a multiple of :data:`ALIGN`, at least one), the last one
    whatever remains; the whole axis if it fits a tile."""
    step = max(ALIGN, tile // ALIGN * ALIGN)
    edges = list(range(0, length, step))[1:]
    if edges and length - edges[-1] < ALIGN // 2:  # a sliver joins the core before it
        edges.pop()
    edges = [0] + edges + [length]
    return list(zip(edges[:-1], edges[1:]))


def cells(start: int, stop: int, stride: int, size: int) -> Tuple[int, int]:
    """The cells ``[a, b)`` of a level of ``stride`` (``size`` cells) under pixels
    ``[start, stop)``: those whose anchor centre (``cell x stride``) lies in them."""
    return min(size, -(-start // stride)), min(size, -(-stop // stride))


class CoreRowMerge:
    """The cores' detections, one row of cores at a time, through the class-wise NMS that the
    whole image's RoI head applies to all of them (``nms_cfg``, mmcv's ``batched_nms``): one object
    proposed by the anchors of two cores is kept once, the better scored.

    A detection is released once no later core can hold its duplicate: when its box ends more
    than ``reach`` pixels above the next row of cores (a later core's boxes reach at most that far
    above it on the features of its window). The others wait for the next row."""

    def __init__(self, nms_cfg, reach: int):
        self.nms_cfg, self.reach = nms_cfg, reach
        self.pending: Optional[InstanceData] = None

    def add_row(self, dets: InstanceData, next_top: Optional[int]) -> InstanceData:
        """A row of cores' detections in; those now final out (all of them after the last row,
        ``next_top=None``), best scored first."""
        both = dets if self.pending is None else InstanceData.cat([self.pending, dets])
        self.pending = None
        if len(both) > 1:
            _, keep = batched_nms(both.bboxes, both.scores, both.labels, self.nms_cfg)
            both = both[keep]
        if next_top is None:
            return both
        later = both.bboxes[:, 3] > next_top - self.reach
        self.pending = both[later]
        return both[~later]


class FeatureWindow:
    """Rows ``[top, bottom)`` (network pixels) of every level of ``levels`` (row maps of strides
    ``strides``), their whole width, held as tensors; :meth:`move` slides it down the scene,
    making the new rows in bands of about ``band_mb`` of the finest level. ``left``: the scene's
    pixel column where the maps start (a multiple of :data:`ALIGN`), for a window over a band of
    columns (:func:`column_windows`); 0 for maps of the whole width.

    Each level's rows live in one buffer that the window keeps while it moves: the rows two
    windows share are moved to the buffer's front in place, so the window never holds a second
    copy of them (the scene's windows after the first are no taller than it, see
    :func:`window_rows`)."""

    def __init__(self, levels: Sequence[RowMap], strides: Sequence[int], band_mb: float,
                 left: int = 0):
        self.levels, self.strides, self.band_mb = list(levels), list(strides), band_mb
        self.left = left
        self.top = self.bottom = 0
        self.held: List[Tensor] = [None] * len(self.levels)  # views of the buffers, NCHW
        self.buffers: List[Tensor] = [None] * len(self.levels)  # flat, one per level
        self.first: List[int] = [0] * len(self.levels)  # each level's first row held

    def move(self, top: int, bottom: int) -> None:
        """Hold pixel rows ``[top, bottom)`` (``top`` not above the current top): the rows held
        already are kept, the others made band by band, every level's rows of a band together
        (they share the maps of the top-down path), each written into the window's tensor as
        it comes."""
        spans = [cells(top, bottom, s, level.height)
                 for s, level in zip(self.strides, self.levels)]
        kept = [None] * len(self.levels)
        cursors = [a + self._keep_shared(i, a, b, kept) for i, (a, b) in enumerate(spans)]
        pixel = min(c * s for c, s in zip(cursors, self.strides))
        while True:
            for i, (level, s) in enumerate(zip(self.levels, self.strides)):
                a, b = spans[i]
                stop = min(b, -(-pixel // s))
                if stop <= cursors[i]:
                    continue
                rows = level.rows(cursors[i], stop)
                if self.held[i] is None:  # a new buffer, filled as the bands come
                    shape = rows.shape[:2] + (b - a, rows.shape[3])
                    self.buffers[i] = rows.new_empty(math.prod(shape))
                    self.held[i] = self.buffers[i].view(shape)
                    if kept[i] is not None:
                        self.held[i][:, :, :kept[i].shape[2]] = kept[i]
                        kept[i] = None
                self.held[i][:, :, cursors[i] - a:stop - a] = rows
                del rows
                cursors[i] = stop
            if all(c >= b for c, (_, b) in zip(cursors, spans)):
                break
            pixel += self._band_pixels()
        self.first = [a for a, _ in spans]
        self.top, self.bottom = top, bottom

    def _keep_shared(self, i: int, a: int, b: int, kept: List[Optional[Tensor]]) -> int:
        """Make level ``i`` ready to hold its cells ``[a, b)`` and return how many of them, from
        ``a`` on, it holds already. Where they fit the buffer's place for the rows held now, they
        are moved to its front in place, one (image, channel) plane after another in order: a
        plane's new place ends before the old place of every later plane (the new window is no
        taller), so no plane is overwritten before it has moved; each move copies the plane's
        rows aside first, as its old and new places may overlap. A taller window puts them aside
        in ``kept`` and gets a new buffer at its first band."""
        old, first, buffer = self.held[i], self.first[i], self.buffers[i]
        self.held[i] = None
        if old is None:
            return 0
        held_rows = old.shape[2]
        keep = min(b, first + held_rows) - a if first <= a < first + held_rows else 0
        if b - a > held_rows:
            if keep:
                kept[i] = old[:, :, a - first:a - first + keep].clone()
            self.buffers[i] = None
            return keep
        planes, width, rows = old.shape[0] * old.shape[1], old.shape[3], b - a
        for p in range(planes if keep else 0):
            source = (p * held_rows + a - first) * width
            buffer[p * rows * width:(p * rows + keep) * width] = \
                buffer[source:source + keep * width].clone()
        self.held[i] = buffer[:planes * rows * width].view(old.shape[0], old.shape[1], rows,
                                                           width)
        return keep

    def _band_pixels(self) -> int:
        """Pixel rows of the next band: one row of the finest level until a band has been made
        (a row of a very wide scene may cost more than a band), then as many as keep the finest
        level's rows in every map it is made from near ``band_mb`` (one row at least). A coarser
        level makes its next row once the band reaches into it."""
        row_bytes = self.row_bytes()
        rows = band_rows_for(self.band_mb, row_bytes) if row_bytes else 1
        return rows * self.strides[0]

    def row_bytes(self) -> int:
        """The bytes of one row of the finest level in every map it is made from (each map's
        rows counted in proportion to its height), as measured on the last band; 0 before."""
        finest = self.levels[0]
        maps, _ = _graph(finest)
        return int(sum(m.row_bytes * m.height / finest.height for m in maps))

    def crop(self, level: int, rows: Tuple[int, int], cols: Tuple[int, int]) -> Tensor:
        """Cells ``rows`` x ``cols`` (the scene's) of ``level``, clipped to the window, a view."""
        held, first = self.held[level], self.first[level]
        r0, r1 = max(rows[0], first), min(rows[1], first + held.shape[2])
        c = self.left // self.strides[level]
        return held[:, :, r0 - first:r1 - first, max(0, cols[0] - c):max(0, cols[1] - c)]

    def cells_hw(self, level: int) -> Tuple[int, int]:
        """The rows and columns of ``level`` on the scene up to the window's right edge."""
        return (self.levels[level].height,
                self.left // self.strides[level] + self.levels[level].width)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers if t is not None)


class ColumnWindow(NamedTuple):
    """Windows over a band of the scene's columns (:func:`column_windows`): the core columns
    they serve (indices), and the pixel columns ``[left, right)`` of the maps they are made
    from."""
    cores: range
    left: int
    right: int


def column_windows(core_cols: Sequence[Tuple[int, int]], cores_per_window: Optional[int],
                   margin: int, width: int) -> List[ColumnWindow]:
    """The scene's core columns in groups of ``cores_per_window`` (None: one group, the whole
    width), each group's windows made from the maps' columns ``margin`` beyond its cores and
    :data:`ALIGN` more (``margin`` a multiple of it), clipped to the scene.

    The features a core's heads read (its cells and ``margin`` each side) are then the whole
    scene's: the FPN reads at most a cell of its coarsest level (P6, :data:`ALIGN` px) beyond
    them, which the extra :data:`ALIGN` columns hold; its convs' zero padding at the band's
    inner edges falls beyond that. The maps of a band start on a cell of every level."""
    count = len(core_cols)
    step = count if cores_per_window is None else max(1, min(count, cores_per_window))
    if step == count:
        return [ColumnWindow(range(count), 0, width)]
    reach = margin + ALIGN
    return [ColumnWindow(range(i, min(count, i + step)), max(0, core_cols[i][0] - reach),
                         min(width, core_cols[min(count, i + step) - 1][1] + reach))
            for i in range(0, count, step)]


def window_rows(core_rows: Tuple[int, int], margin: int, height: int,
                rows: int = 0) -> Tuple[int, int]:
    """The pixel rows of a window ``margin`` beyond a row of cores (``margin`` a multiple of
    :data:`ALIGN`, so that the window starts on a cell of every level), at least ``rows`` tall
    where the scene allows: the stream asks for the height of its tallest window, so that the
    first window is as tall as the later ones and :class:`FeatureWindow` moves them all in one
    buffer."""
    top = max(0, core_rows[0] - margin)
    return top, min(height, max(core_rows[1] + margin, top + rows))


def window_mb(width: int, rows: int, channels: int, strides: Sequence[int],
              element_size: int = 4) -> float:
    """MB of a window of ``rows`` pixel rows of levels of ``channels`` channels at ``strides``."""
    return sum(channels * math.ceil(rows / s) * math.ceil(width / s) * element_size
               for s in strides) / 2**20
