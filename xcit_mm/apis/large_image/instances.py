# Copyright (c) xcit_mm contributors. All rights reserved.
"""A detector's instances (``LeanMaskRCNN.stream_instances``) written as the stream gives them,
never all held: :class:`InstanceWriter`.

The output's extension decides what is written:

- ``.gpkg``, ``.fgb``, ``.geojson``: one feature per instance, the outline of its mask (GDAL's
  polygonising, ``rasterio.features.shapes``, 4-connected, of the mask pasted over its box) as a
  MultiPolygon (one part for most instances, several where the mask has several parts), or its
  box where the mask is empty; fields ``class_id``, ``class_name`` and ``score``; in the input's
  CRS, placed by its geotransform (an image without one: pixel coordinates, column and row, y
  down, and no CRS, as the segmentation's polygons). Appended to a GeoPackage beside the output
  as each piece of the stream comes, copied to FlatGeobuf or GeoJSON at the end (neither driver
  appends in place), as :class:`~.polygons.PolygonWriter` does.
- ``.json``: COCO's results format, a list of ``{image_id, category_id, bbox [x, y, w, h],
  score, segmentation}``, the segmentation a compressed RLE of the whole image's mask as
  ``pycocotools.mask.encode`` makes it (built here from the box's mask: never a mask of the whole
  image), in pixel coordinates whatever the input's georeferencing. ``category_id`` is the
  model's class index (0-based, the order of ``dataset_meta['classes']``), ``image_id`` 0.

Instances scored below ``score_thr`` are dropped; pixels without data (``valid_rows``) are
removed from each mask. The output is written under a ``.partial`` name, put on disk and renamed
when complete; :meth:`InstanceWriter.abort` (or an exception in the ``with`` block) leaves no
file. ``rasterio``, ``shapely``, ``pyogrio`` and ``pycocotools`` are imported inside the
functions, not by ``import xcit_mm``.
"""
import json
import os
import os.path as osp
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .errors import LargeImageError, check_output, sync_to_disk
from .polygons import (VECTOR_DRIVERS, append_features, copy_layer, queued_columns,
                       raise_if_full, remove_vector_files)
from .writer import as_numpy

# Output formats by file extension: GDAL's OGR driver, or COCO's results JSON.
INSTANCE_FORMATS = dict(VECTOR_DRIVERS, **{'.json': 'COCO'})
_FIELDS = ['class_id', 'class_name', 'score']
_FLUSH_BYTES = 16 << 20  # features queued between writes to the GeoPackage, at most
_VALID_CHUNK_BYTES = 16 << 20  # the rows of the valid-pixel mask read at once
_RLE_PIXELS = 2 ** 32  # pycocotools' RLE counts are 32-bit
IMAGE_ID = 0


def check_instances_output(path: str, option: str = '--out',
                           taken: Sequence[Tuple[str, str]] = ()) -> str:
    """Fail before any work on an instance file that cannot be written; return its format (an
    OGR driver's name, or ``'COCO'``)."""
    fmt = INSTANCE_FORMATS.get(osp.splitext(path)[1].lower())
    if fmt is None:
        raise LargeImageError(f'{option} {path}: unknown format for a detector\'s instances; '
                              'end the name with .gpkg, .fgb, .geojson (polygons, GeoPackage, '
                              'FlatGeobuf, GeoJSON) or .json (COCO results)')
    check_output(path, option, taken)
    return fmt


class InstanceWriter:
    """The instances of a detector's stream, piece by piece, to polygons or COCO results (see the
    module); use as a context manager (an exception leaves no file)::

        with InstanceWriter('instances.gpkg', class_names, (H, W), crs=src.crs,
                            transform=src.transform, score_thr=0.3) as out:
            for instances in model.stream_instances(read_rows, (H, W)):
                out.add(instances)

    ``instances``: mmengine ``InstanceData`` with ``bboxes`` (x1, y1, x2, y2 in the image's
    pixels), ``scores``, ``labels`` and, for a model with masks, ``mask_logits`` (N, side, side),
    pasted as mmdet pastes them (``paste_in_box``, ``mask_threshold``). ``crs``: anything
    rasterio's ``CRS.from_user_input`` takes (None: no CRS); ``transform``: (column, row) to the
    CRS (rasterio's ``Affine`` or its six numbers; None for the identity); used by the polygon
    formats only. ``valid_rows(a, b)``: bool (b - a, W), the pixels of rows a..b-1 holding data;
    the others are removed from each mask. ``count``: the instances written so far.

    What is held beyond one piece of the stream: up to 16 MB of features between writes, and 16
    MB of the valid-pixel mask's rows at a time."""

    def __init__(self, path: str, class_names: Sequence[str], image_hw: Sequence[int],
                 crs=None, transform=None, score_thr: float = 0.0, mask_threshold: float = 0.5,
                 valid_rows: Optional[Callable[[int, int], np.ndarray]] = None,
                 layer: Optional[str] = None):
        self.format = check_instances_output(path)
        if not 0 <= score_thr <= 1:
            raise LargeImageError(f'--score-thr {score_thr:g}: give a score from 0 to 1')
        self.path = path
        self.class_names = [str(name) for name in class_names]
        self.image_hw = tuple(int(v) for v in image_hw)
        self.score_thr = float(score_thr)
        self.mask_threshold = float(mask_threshold)
        self.valid_rows = valid_rows
        self.count = 0
        self._closed = False
        self._file = None
        ext = osp.splitext(path)[1]
        if self.format == 'COCO':
            if self.image_hw[0] * self.image_hw[1] >= _RLE_PIXELS:
                raise LargeImageError(
                    f'{path}: the image has {self.image_hw[0] * self.image_hw[1]} pixels, more '
                    "than COCO's RLE masks count (2^32); write polygons instead (--out "
                    f'{osp.splitext(path)[0]}.gpkg)')
            self._made = self._store = path + '.partial'
            self._remove_temporaries()  # a killed run's leftovers
            self._file = open(self._made, 'w')
            self._file.write('[')
            return
        from rasterio.crs import CRS
        from rasterio.transform import Affine
        self.crs_wkt = CRS.from_user_input(crs).to_wkt() if crs is not None else None
        self.transform = Affine.identity() if transform is None else Affine(*tuple(transform)[:6])
        self.layer = layer or osp.basename(path)[:-len(ext)]
        self._store = path + '.partial.gpkg'  # the features as they come
        self._made = path + '.partial' + ext if self.format != 'GPKG' else self._store
        self._pending = {'wkb': [], 'class_id': [], 'score': []}
        self._pending_bytes = 0
        self._remove_temporaries()
        self._write(append=False)  # the layer, so that a file that cannot be made fails now

    # ---------------------------------------------------------------- instances in

    def add(self, instances) -> None:
        """Write one piece of the stream (any number of instances, each written once)."""
        if self._closed:
            raise RuntimeError('InstanceWriter.add after close')
        scores = as_numpy(instances.scores).astype(np.float64)
        keep = np.flatnonzero(scores >= self.score_thr)
        if not len(keep):
            return
        bboxes = as_numpy(instances.bboxes).astype(np.float64)[keep]
        labels = as_numpy(instances.labels).astype(np.int64)[keep]
        if len(labels) and (labels.min() < 0 or labels.max() >= len(self.class_names)):
            raise ValueError(f'class ids {labels.min()} to {labels.max()}, but '
                             f'{len(self.class_names)} class names')
        masks = self._masks(instances, keep)
        if self.format == 'COCO':
            self._add_coco(bboxes, scores[keep], labels, masks)
        else:
            self._add_polygons(bboxes, scores[keep], labels, masks)
        self.count += len(keep)

    def _masks(self, instances, keep: np.ndarray) -> Optional[List[Tuple[np.ndarray, int, int]]]:
        """Each kept instance's mask over its box, ``(bool (h, w), x0, y0)``, its pixels without
        data removed; None for a model without masks."""
        logits = instances.get('mask_logits', None)
        if logits is None:
            return None
        import torch

        from xcit_mm.models.detectors.box_masks import paste_in_box
        index = torch.as_tensor(keep, dtype=torch.long)
        pasted = paste_in_box(logits[index], instances.bboxes[index], self.image_hw,
                              threshold=self.mask_threshold)
        masks = [(mask.cpu().numpy(), x0, y0) for mask, x0, y0 in pasted]
        if self.valid_rows is not None:
            self._remove_nodata(masks)
        return masks

    def _remove_nodata(self, masks: List[Tuple[np.ndarray, int, int]]) -> None:
        """Pixels without data out of each mask (in place): the valid pixels of the rows the
        boxes span, read once, a few MB of rows at a time (``valid_rows`` gives whole rows)."""
        spans = [(y0, y0 + len(mask)) for mask, _, y0 in masks if mask.size]
        if not spans:
            return
        width = self.image_hw[1]
        top, bottom = min(a for a, _ in spans), max(b for _, b in spans)
        step = max(1, _VALID_CHUNK_BYTES // width)
        for a in range(top, bottom, step):
            b = min(bottom, a + step)
            valid = None
            for mask, x0, y0 in masks:
                r0, r1 = max(a, y0), min(b, y0 + len(mask))
                if r0 >= r1 or not mask.size:
                    continue
                if valid is None:
                    valid = np.asarray(self.valid_rows(a, b), bool)
                    if valid.shape != (b - a, width):
                        raise ValueError(f'valid_rows({a}, {b}) gave shape {valid.shape}, not '
                                         f'({b - a}, {width})')
                mask[r0 - y0:r1 - y0] &= valid[r0 - a:r1 - a, x0:x0 + mask.shape[1]]

    def _add_coco(self, bboxes, scores, labels, masks) -> None:
        from xcit_mm.models.detectors.box_masks import coco_rle
        for i, (box, score, label) in enumerate(zip(bboxes, scores, labels)):
            x1, y1, x2, y2 = (float(v) for v in box)
            if masks is None:  # a box-only model: the box's pixels, as COCO's bbox results
                H, W = self.image_hw
                x0, y0 = min(W, max(0, int(np.floor(x1)))), min(H, max(0, int(np.floor(y1))))
                mask = np.ones((min(H, int(np.ceil(y2))) - y0, min(W, int(np.ceil(x2))) - x0),
                               bool)
            else:
                mask, x0, y0 = masks[i]
            result = dict(image_id=IMAGE_ID, category_id=int(label),
                          bbox=[x1, y1, x2 - x1, y2 - y1], score=float(score),
                          segmentation=coco_rle(mask, x0, y0, self.image_hw))
            try:
                self._file.write((',\n' if self.count or i else '\n') + json.dumps(result))
            except OSError as e:
                raise_if_full(self._made, e, '--out')
                raise
        self._file.flush()

    def _add_polygons(self, bboxes, scores, labels, masks) -> None:
        """Each instance's outline (or box) in the CRS, queued; written past 16 MB and at the
        end of each piece of the stream."""
        import shapely
        geoms = np.empty(len(bboxes), dtype=object)
        for i, box in enumerate(bboxes):
            geom = None
            if masks is not None:
                geom = _outline(*masks[i])
            geoms[i] = geom if geom is not None else shapely.box(*box)
        a, b, c, d, e, f = tuple(self.transform)[:6]
        if (a, b, c, d, e, f) != (1, 0, 0, 0, 1, 0):
            matrix, offset = np.array([[a, b], [d, e]]).T, np.array([c, f])
            geoms = shapely.transform(geoms, lambda xy: xy @ matrix + offset)
        geoms = shapely.multipolygons(shapely.get_parts(geoms),
                                      indices=_part_index(geoms)) if len(geoms) else geoms
        wkb = shapely.to_wkb(geoms)
        self._pending['wkb'].append(wkb)
        self._pending['class_id'].append(labels.astype(np.int32))
        self._pending['score'].append(scores)
        self._pending_bytes += sum(len(w) for w in wkb)
        self._write(append=True)

    def _write(self, append: bool) -> None:
        """Append the queued features to the GeoPackage (``append=False``: create its layer)."""
        wkb, columns = queued_columns(self._pending, self.class_names, 'score')
        if append and not len(wkb):
            return
        append_features(self._store, self.layer, wkb, columns, _FIELDS, 'MultiPolygon',
                        self.crs_wkt, append, '--out')
        self._pending = {'wkb': [], 'class_id': [], 'score': []}
        self._pending_bytes = 0

    # ---------------------------------------------------------------- finishing

    def close(self) -> None:
        """Finish the file and give it its name."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.format == 'COCO':
                try:
                    self._file.write('\n]\n' if self.count else ']\n')
                    self._file.close()
                except OSError as e:
                    raise_if_full(self._made, e, '--out')
                    raise
            else:
                self._write(append=True)
                if self.format != 'GPKG':
                    copy_layer(self._store, self._made, self.layer, self.format,
                               'MultiPolygon', self.crs_wkt, '--out')
            sync_to_disk(self._made)  # on disk before it gets its name
            os.replace(self._made, self.path)
            sync_to_disk(osp.dirname(osp.abspath(self.path)))
        finally:
            self._remove_temporaries()

    def abort(self) -> None:
        """Stop without a file."""
        self._closed = True
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        remove_vector_files(self._store, self._made)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _outline(mask: np.ndarray, x0: int, y0: int):
    """The outline of a box's mask (bool (h, w), top-left pixel (x0, y0)) in the image's pixel
    coordinates, as polygons (a shapely Polygon or MultiPolygon; holes kept); None if empty."""
    import shapely
    from rasterio.features import shapes
    from rasterio.transform import Affine
    if not mask.any():
        return None
    parts = [shapely.geometry.shape(geom) for geom, _ in shapes(
        mask.view(np.uint8), mask=mask, connectivity=4, transform=Affine.translation(x0, y0))]
    geom = parts[0] if len(parts) == 1 else shapely.MultiPolygon(parts)
    if not shapely.is_valid(geom):  # GEOS's make_valid, its polygons kept
        parts = shapely.get_parts(shapely.get_parts(shapely.make_valid(geom)))
        parts = parts[(shapely.get_type_id(parts) == shapely.GeometryType.POLYGON)
                      & ~shapely.is_empty(parts)]
        geom = shapely.MultiPolygon(list(parts)) if len(parts) else None
    return geom


def _part_index(geoms: np.ndarray) -> np.ndarray:
    """The feature of each part of ``geoms`` (``shapely.get_parts``' order)."""
    import shapely
    return np.repeat(np.arange(len(geoms)), shapely.get_num_geometries(geoms))
