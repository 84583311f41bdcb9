# Copyright (c) xcit_mm contributors. All rights reserved.
"""A deterministic, self-contained "shapes" world for detection and segmentation.

Every image shows a few flat-coloured circles, squares and triangles (3 classes) of varied
size, colour and rotation on a varied background (two-colour gradients, smooth colour noise,
flat colour), with pixel noise and JPEG compression. Objects overlap: they are painted one
after the other and every annotation describes the *visible* part of its object. An object
is only kept when at least ``min_visible`` of it stays visible once all later objects are
painted, so no annotation is a sliver.

The world is written in the real on-disk layouts of the two benchmarks so that the stock
OpenMMLab datasets, transforms and metrics read it unchanged:

* ``task='coco'`` (mmdet ``CocoDataset`` + ``CocoMetric``)::

      root/train/000001.jpg ...            root/val/000001.jpg ...
      root/annotations/instances_train.json
      root/annotations/instances_val.json

  Standard COCO instance json: ``images`` (id, file_name, width, height), ``annotations``
  (id, image_id, category_id, compressed-RLE ``segmentation`` of the visible pixels, tight
  ``bbox`` [x, y, w, h] of those pixels, ``area`` = their count, ``iscrowd`` = 0) and
  ``categories`` 1 circle, 2 square, 3 triangle.

* ``task='ade'`` (mmseg ``BaseSegDataset`` with ADE20k's conventions + ``IoUMetric``)::

      root/images/training/shapes_train_000001.jpg ...
      root/annotations/training/shapes_train_000001.png ...
      root/images/validation/...           root/annotations/validation/...

  Label maps are single-channel uint8 PNGs: 0 = background, 1 = circle, 2 = square,
  3 = triangle. Read with ADE20k's ``reduce_zero_label=True``, mmseg's ``LoadAnnotations`` turns
  them into 255 (ignored), 0, 1, 2; read with ``reduce_zero_label=False`` and a 'background'
  class first (VOC-style, what ``configs/shapes/sem_fpn_xcit_shapes_ade.py`` does), as written.

* ``task='cityscapes'`` (mmseg ``BaseSegDataset`` with Cityscapes' suffixes + ``IoUMetric``), the
  high-resolution world (``image_size=(1024, 2048)`` in ``configs/shapes/``)::

      root/leftImg8bit/train/shapes/shapes_train_000001_leftImg8bit.png ...
      root/gtFine/train/shapes/shapes_train_000001_gtFine_labelTrainIds.png ...
      root/leftImg8bit/val/shapes/...      root/gtFine/val/shapes/...

  Drawn by :func:`draw_hires_image`, made for context: ``objects_per_image`` big shapes of one
  class (``size_range`` e.g. 0.28-0.41 of the height: 500-850 px at 1024 px), each filled with a
  flat grey, on a striped scene whose hues tell the class (:data:`SCENE_HUES`: red circle, green
  square, blue triangle). A window inside a shape sees grey and cannot tell circle from square
  from triangle; a window that sees the scene, or the whole image, can. Label maps as ADE's:
  0 background, 1..3 circle, square, triangle.

Each image is drawn from its own random stream seeded by ``(seed, split, index)``, so the
same arguments always give byte-identical files, and a larger ``num_train`` only appends
images. Training and validation images come from different streams (held out).

Example:
    >>> from shapes_world import generate_shapes
    >>> generate_shapes('data/shapes_coco', task='coco', num_train=800, num_val=100,
    ...                 image_size=160, seed=0)
"""
import colorsys
import json
import logging
import os
import os.path as osp
import shutil
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
from PIL import Image

CLASSES = ('circle', 'square', 'triangle')
PALETTE = [(220, 20, 60), (0, 130, 255), (20, 200, 60)]
# the hue (0-1) of each class's scene in the high-resolution world: red, green, blue
SCENE_HUES = (0.0, 0.33, 0.62)
TASKS = ('coco', 'ade', 'cityscapes')
META_FILE = 'shapes_world.json'
_FORMAT_VERSION = 1
_SPLITS = {'train': 0, 'val': 1}
_ADE_SPLIT_DIRS = {'train': 'training', 'val': 'validation'}
CITYSCAPES_IMG_SUFFIX = '_leftImg8bit.png'
CITYSCAPES_SEG_SUFFIX = '_gtFine_labelTrainIds.png'


# --------------------------------------------------------------------------------------------
# drawing
# --------------------------------------------------------------------------------------------
def _resize_bilinear(grid: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize a small (h, w, c) float grid to (height, width, c), bilinear, align corners.

    Implemented in numpy so that the result does not depend on an image library's version.
    """
    h, w = grid.shape[:2]
    ys = np.linspace(0, h - 1, height)
    xs = np.linspace(0, w - 1, width)
    y0 = np.floor(ys).astype(int)
    x0 = np.floor(xs).astype(int)
    y1 = np.minimum(y0 + 1, h - 1)
    x1 = np.minimum(x0 + 1, w - 1)
    wy = (ys - y0)[:, None, None]
    wx = (xs - x0)[None, :, None]
    top = grid[y0][:, x0] * (1 - wx) + grid[y0][:, x1] * wx
    bottom = grid[y1][:, x0] * (1 - wx) + grid[y1][:, x1] * wx
    return top * (1 - wy) + bottom * wy


def _random_colour(rng: np.random.Generator) -> np.ndarray:
    """A random RGB colour (float, 0-255)."""
    return rng.uniform(0, 255, size=3)


def _contrasting_colour(rng: np.random.Generator, under: List[np.ndarray], min_contrast: float,
                        max_tries: int) -> Optional[np.ndarray]:
    """The first of ``max_tries`` random colours at least ``min_contrast`` from every colour of
    ``under`` (so that the new object's outline is visible), or None."""
    for _ in range(max_tries):
        cand = _random_colour(rng)
        if min(np.linalg.norm(cand - u) for u in under) >= min_contrast:
            return cand
    return None


def _background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A random background: linear two-colour gradient, smooth colour noise or flat colour."""
    kind = rng.choice(3, p=[0.45, 0.4, 0.15])
    if kind == 0:  # linear gradient in a random direction
        c0, c1 = _random_colour(rng), _random_colour(rng)
        angle = rng.uniform(0, 2 * np.pi)
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
        t = np.cos(angle) * xx / max(width - 1, 1) + np.sin(angle) * yy / max(height - 1, 1)
        t = (t - t.min()) / max(t.max() - t.min(), 1e-6)
        img = c0[None, None] * (1 - t[..., None]) + c1[None, None] * t[..., None]
    elif kind == 1:  # smooth low-frequency colour noise
        cells = int(rng.integers(2, 6))
        grid = rng.uniform(0, 255, size=(cells, cells, 3))
        img = _resize_bilinear(grid, height, width)
    else:  # flat colour
        img = np.broadcast_to(_random_colour(rng), (height, width, 3)).copy()
    return img


def _convex_polygon_mask(vertices: np.ndarray, height: int, width: int) -> np.ndarray:
    """Boolean mask of the pixels whose centres lie inside a convex polygon.

    Args:
        vertices (np.ndarray): (K, 2) polygon vertices (x, y) in pixel units, any orientation.
        height (int): Mask height.
        width (int): Mask width.

    Returns:
        np.ndarray: (height, width) bool mask.
    """
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64) + 0.5
    inside_pos = np.ones((height, width), dtype=bool)
    inside_neg = np.ones((height, width), dtype=bool)
    k = len(vertices)
    for i in range(k):
        x0, y0 = vertices[i]
        x1, y1 = vertices[(i + 1) % k]
        cross = (x1 - x0) * (yy - y0) - (y1 - y0) * (xx - x0)
        inside_pos &= cross >= 0
        inside_neg &= cross <= 0
    return inside_pos | inside_neg


def _shape_mask(label: int, cx: float, cy: float, radius: float, angle: float, height: int,
                width: int) -> np.ndarray:
    """Full (un-occluded) mask of one shape.

    Args:
        label (int): 0 circle, 1 square, 2 triangle.
        cx (float): Centre x in pixels.
        cy (float): Centre y in pixels.
        radius (float): Size parameter: circle radius; the square's half side is 0.85 * radius
            and the triangle's circumradius 1.2 * radius, so the three have similar extents.
        angle (float): Rotation in radians (ignored for circles).
        height (int): Image height.
        width (int): Image width.

    Returns:
        np.ndarray: (height, width) bool mask.
    """
    if label == 0:
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float64) + 0.5
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= radius ** 2
    if label == 1:
        circum = 0.85 * radius * np.sqrt(2.0)
        thetas = angle + np.pi / 4 + np.arange(4) * np.pi / 2
    else:
        circum = 1.2 * radius
        thetas = angle + np.arange(3) * 2 * np.pi / 3
    vertices = np.stack([cx + circum * np.cos(thetas), cy + circum * np.sin(thetas)], axis=1)
    return _convex_polygon_mask(vertices, height, width)


def draw_shapes_image(rng: np.random.Generator,
                      image_size: Union[int, Tuple[int, int]],
                      objects_per_image: Tuple[int, int] = (2, 6),
                      size_range: Tuple[float, float] = (0.08, 0.25),
                      min_visible: float = 0.6,
                      min_contrast: float = 60.0,
                      max_tries: int = 30) -> Tuple[np.ndarray, List[Dict]]:
    """Draw one image of the shapes world.

    Args:
        rng (np.random.Generator): The image's own random stream.
        image_size (int | tuple[int, int]): Side, or (height, width), in pixels.
        objects_per_image (tuple[int, int]): Inclusive range of the number of objects tried.
        size_range (tuple[float, float]): Range of the shape radius as a fraction of the
            shorter image side.
        min_visible (float): A placement is rejected if it leaves an earlier object with less
            than this fraction of its full area visible (or covers it to under 16 pixels).
        min_contrast (float): Minimum RGB distance between an object colour and both the mean
            background colour under it and the colour of every object it overlaps.
        max_tries (int): Placement attempts per object before it is skipped.

    Returns:
        tuple[np.ndarray, list[dict]]: The (H, W, 3) uint8 RGB image and one dict per visible
        object, bottom to top, with ``label`` (0-based class index) and ``mask`` ((H, W) bool,
        visible pixels only).
    """
    height, width = _size_hw(image_size)
    short = min(height, width)
    img = _background(rng, height, width)
    background = img.copy()
    n_obj = int(rng.integers(objects_per_image[0], objects_per_image[1] + 1))
    objects: List[Dict] = []  # dicts with label, visible, area, colour
    for _ in range(n_obj):
        label = int(rng.integers(len(CLASSES)))
        for _ in range(max_tries):
            radius = rng.uniform(*size_range) * short
            margin = 0.9 * radius
            cx = rng.uniform(margin, width - margin)
            cy = rng.uniform(margin, height - margin)
            angle = rng.uniform(0, 2 * np.pi)
            full = _shape_mask(label, cx, cy, radius, angle, height, width)
            if full.sum() < 16:
                continue
            ok = True
            for obj in objects:
                left = obj['visible'] & ~full
                n_left = int(left.sum())
                if n_left < 16 or n_left < min_visible * obj['area']:
                    ok = False
                    break
            if not ok:
                continue
            # contrast against the background under the new shape and against every object
            # it overlaps, so that every visible boundary is visible in the image
            under = [background[full].mean(axis=0)]
            under += [obj['colour'] for obj in objects if (obj['visible'] & full).any()]
            colour = _contrasting_colour(rng, under, min_contrast, max_tries)
            if colour is None:
                continue
            for obj in objects:
                obj['visible'] = obj['visible'] & ~full
            # flat colour with a faint linear shading across the object
            shade = rng.uniform(-20, 20, size=2)
            yy, xx = np.nonzero(full)
            ramp = (shade[0] * (xx - cx) + shade[1] * (yy - cy)) / max(radius, 1.0)
            img[full] = colour[None] + ramp[:, None]
            objects.append(dict(label=label, visible=full, area=int(full.sum()), colour=colour))
            break
    sigma = rng.uniform(0, 12)
    img = img + rng.normal(0, 1, size=img.shape) * sigma
    img = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return img, [dict(label=o['label'], mask=o['visible']) for o in objects]


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------
def _size_hw(image_size: Union[int, Sequence[int]]) -> Tuple[int, int]:
    """Normalise ``image_size`` to (height, width)."""
    if isinstance(image_size, (int, np.integer)):
        height = width = int(image_size)
    else:
        size = tuple(int(s) for s in image_size)
        if len(size) != 2:
            raise ValueError(f'image_size must be an int or (height, width), got {image_size!r}')
        height, width = size
    if height < 32 or width < 32:
        raise ValueError(f'image_size must be at least 32 px per side (the XCiT stride-32 '
                         f'level), got {(height, width)}')
    return height, width


def _image_rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), _SPLITS[split], index]))


def _save_jpg(img: np.ndarray, path: str) -> None:
    Image.fromarray(img).save(path, format='JPEG', quality=92)


def _rle(mask: np.ndarray) -> Dict:
    from pycocotools import mask as mask_utils
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    rle['counts'] = rle['counts'].decode('ascii')
    return rle


def _write_coco_split(root: str, split: str, num: int, size: Tuple[int, int], seed: int,
                      gen_kwargs: Dict, progress) -> Dict:
    img_dir = osp.join(root, split)
    os.makedirs(img_dir, exist_ok=True)
    images, annotations = [], []
    ann_id = 1
    for idx in _iterate(range(num), progress, f'shapes coco {split}'):
        img, objects = draw_shapes_image(_image_rng(seed, split, idx), size, **gen_kwargs)
        file_name = f'{idx + 1:06d}.jpg'
        _save_jpg(img, osp.join(img_dir, file_name))
        images.append(dict(id=idx + 1, file_name=file_name, height=size[0], width=size[1]))
        for obj in objects:
            ys, xs = np.nonzero(obj['mask'])
            x0, y0 = int(xs.min()), int(ys.min())
            w, h = int(xs.max()) - x0 + 1, int(ys.max()) - y0 + 1
            annotations.append(
                dict(id=ann_id, image_id=idx + 1, category_id=obj['label'] + 1,
                     segmentation=_rle(obj['mask']), area=float(obj['mask'].sum()),
                     bbox=[float(x0), float(y0), float(w), float(h)], iscrowd=0))
            ann_id += 1
    coco = dict(
        info=dict(description=f'xcit_mm shapes world ({split})', version=str(_FORMAT_VERSION)),
        licenses=[],
        images=images,
        annotations=annotations,
        categories=[dict(id=i + 1, name=name, supercategory='shape')
                    for i, name in enumerate(CLASSES)])
    ann_file = osp.join(root, 'annotations', f'instances_{split}.json')
    with open(ann_file, 'w') as f:
        json.dump(coco, f, separators=(',', ':'))
    return dict(images=len(images), instances=len(annotations))


def _write_ade_split(root: str, split: str, num: int, size: Tuple[int, int], seed: int,
                     gen_kwargs: Dict, progress) -> Dict:
    sub = _ADE_SPLIT_DIRS[split]
    img_dir = osp.join(root, 'images', sub)
    ann_dir = osp.join(root, 'annotations', sub)
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(ann_dir, exist_ok=True)
    n_obj = 0
    for idx in _iterate(range(num), progress, f'shapes ade {split}'):
        img, objects = draw_shapes_image(_image_rng(seed, split, idx), size, **gen_kwargs)
        label_map = np.zeros(size, dtype=np.uint8)
        for obj in objects:  # visible masks are disjoint
            label_map[obj['mask']] = obj['label'] + 1
        stem = f'shapes_{split}_{idx + 1:06d}'
        _save_jpg(img, osp.join(img_dir, stem + '.jpg'))
        Image.fromarray(label_map).save(osp.join(ann_dir, stem + '.png'))
        n_obj += len(objects)
    return dict(images=num, instances=n_obj)


def _striped_background(rng: np.random.Generator, height: int, width: int,
                        colours: Optional[Sequence[np.ndarray]] = None) -> np.ndarray:
    """A two-colour gradient (``colours``, random if None) with faint stripes (random period and
    angle) over it: locally unlike the flat shapes at any scale, so that shape vs background is
    a local question."""
    c0, c1 = colours if colours is not None else (_random_colour(rng), _random_colour(rng))
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = np.cos(angle) * xx / max(width - 1, 1) + np.sin(angle) * yy / max(height - 1, 1)
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    img = c0[None, None] * (1 - t[..., None]) + c1[None, None] * t[..., None]
    period = rng.uniform(0.015, 0.05) * min(height, width)
    theta = rng.uniform(0, np.pi)
    phase = (np.cos(theta) * xx + np.sin(theta) * yy) * (2 * np.pi / period)
    return img + (rng.uniform(25, 45) * np.sin(phase))[..., None]


def _scene_background(rng: np.random.Generator, label: int, height: int,
                      width: int) -> np.ndarray:
    """The scene of class ``label``: :func:`_striped_background`'s gradient and stripes, with both
    colours drawn from the class's hue family (:data:`SCENE_HUES`, saturated), so any window
    that sees some background knows the class of the objects in the image."""
    hue = SCENE_HUES[label] + rng.uniform(-0.05, 0.05, size=2)
    colours = [np.array(colorsys.hsv_to_rgb(h % 1.0, rng.uniform(0.65, 1.0),
                                            rng.uniform(0.55, 0.95))) * 255 for h in hue]
    return _striped_background(rng, height, width, colours)


def draw_hires_image(rng: np.random.Generator,
                     image_size: Union[int, Tuple[int, int]],
                     objects_per_image: Tuple[int, int] = (1, 1),
                     size_range: Tuple[float, float] = (0.28, 0.41),
                     min_visible: float = 0.6,
                     max_tries: int = 30) -> Tuple[np.ndarray, np.ndarray, int]:
    """Draw one image of the high-resolution ("cityscapes") world, where the class is context:
    big shapes of one class, filled with a flat grey each (a faint shading, no pixel noise), on
    the scene of their class (:func:`_scene_background`). Inside a shape nothing tells the class;
    the scene around it and the outline's geometry do.

    Args and placement rules as :func:`draw_shapes_image` (``size_range``: radius as a fraction
    of the shorter side; it is capped so that the shape fits in the image).

    Returns:
        tuple[np.ndarray, np.ndarray, int]: The (H, W, 3) uint8 RGB image, the (H, W) uint8
        label map (0 background, 1..3 circle, square, triangle) and the number of shapes.
    """
    height, width = _size_hw(image_size)
    short = min(height, width)
    label = int(rng.integers(len(CLASSES)))
    img = _scene_background(rng, label, height, width)
    label_map = np.zeros((height, width), dtype=np.uint8)
    n_obj = int(rng.integers(objects_per_image[0], objects_per_image[1] + 1))
    placed = []  # (visible mask, area)
    for _ in range(n_obj):
        for _ in range(max_tries):
            radius = min(rng.uniform(*size_range) * short, 0.49 * short / 1.2)
            margin = 1.2 * radius  # the square's and the triangle's circumradius
            cx = rng.uniform(margin, width - margin)
            cy = rng.uniform(margin, height - margin)
            full = _shape_mask(label, cx, cy, radius, rng.uniform(0, 2 * np.pi), height, width)
            if any(int((vis & ~full).sum()) < min_visible * area for vis, area in placed):
                continue
            placed = [(vis & ~full, area) for vis, area in placed]
            grey, shade = rng.uniform(40, 215), rng.uniform(-15, 15, size=2)
            yy, xx = np.nonzero(full)
            img[full] = (grey + (shade[0] * (xx - cx) + shade[1] * (yy - cy)) /
                         max(radius, 1.0))[:, None]
            label_map[full] = label + 1
            placed.append((full, int(full.sum())))
            break
    return np.clip(np.rint(img), 0, 255).astype(np.uint8), label_map, len(placed)


def _write_cityscapes_split(root: str, split: str, num: int, size: Tuple[int, int], seed: int,
                            gen_kwargs: Dict, progress) -> Dict:
    img_dir = osp.join(root, 'leftImg8bit', split, 'shapes')
    ann_dir = osp.join(root, 'gtFine', split, 'shapes')
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(ann_dir, exist_ok=True)
    n_obj = 0
    for idx in _iterate(range(num), progress, f'shapes cityscapes {split}'):
        img, label_map, n = draw_hires_image(_image_rng(seed, split, idx), size, **gen_kwargs)
        stem = f'shapes_{split}_{idx + 1:06d}'
        # compress_level 1: several times faster to write than the default, files ~20% larger
        Image.fromarray(img).save(osp.join(img_dir, stem + CITYSCAPES_IMG_SUFFIX),
                                  compress_level=1)
        Image.fromarray(label_map).save(osp.join(ann_dir, stem + CITYSCAPES_SEG_SUFFIX))
        n_obj += n
    return dict(images=num, instances=n_obj)


def _iterate(items: Iterable, progress, desc: str) -> Iterable:
    if not progress:
        return items
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit='img', dynamic_ncols=True)


def generate_shapes(root: str,
                    task: str = 'coco',
                    num_train: int = 800,
                    num_val: int = 100,
                    image_size: Union[int, Tuple[int, int]] = 160,
                    seed: int = 0,
                    objects_per_image: Tuple[int, int] = (2, 6),
                    size_range: Tuple[float, float] = (0.08, 0.25),
                    min_visible: float = 0.6,
                    overwrite: bool = False,
                    progress: bool = False) -> Dict:
    """Generate the shapes world in the real COCO or ADE20k layout.

    Files are written to a temporary sibling directory which is renamed to ``root`` at the
    end, so an interrupted run never leaves a half-written ``root`` behind.

    Args:
        root (str): Output directory.
        task (str): ``'coco'`` (instance detection/segmentation, COCO json) or ``'ade'``
            (semantic segmentation, ADE20k directory layout). Defaults to ``'coco'``.
        num_train (int): Number of training images. Defaults to 800.
        num_val (int): Number of held-out validation images. Defaults to 100.
        image_size (int | tuple[int, int]): Side, or (height, width), in pixels (>= 32).
            Defaults to 160.
        seed (int): World seed; equal arguments give byte-identical files. Defaults to 0.
        objects_per_image (tuple[int, int]): Inclusive range of objects tried per image.
        size_range (tuple[float, float]): Shape radius range, as a fraction of the shorter side.
        min_visible (float): Minimum visible fraction of every annotated object.
        overwrite (bool): Replace an existing ``root``. If False (default) and ``root`` holds a
            world generated with the same arguments, nothing is done; any other existing
            ``root`` raises FileExistsError.
        progress (bool): Show tqdm progress bars. Defaults to False.

    Returns:
        dict: The generation arguments plus per-split ``images`` / ``instances`` counts (also
        written to ``root/shapes_world.json``).

    Raises:
        ValueError: On an unknown task or invalid sizes/counts.
        ShapesWorldExistsError: (a ``FileExistsError``) if ``root`` exists with other contents
            and ``overwrite`` is False.
    """
    args = world_arguments(task=task, num_train=num_train, num_val=num_val,
                           image_size=image_size, seed=seed,
                           objects_per_image=objects_per_image, size_range=size_range,
                           min_visible=min_visible)
    size = tuple(args['image_size'])
    lo, hi = args['objects_per_image']
    smin, smax = args['size_range']

    root = osp.abspath(osp.expanduser(str(root)))
    if osp.exists(root):
        if not overwrite:
            meta = _read_meta(root)
            if _same_world(meta, args):
                return meta
            raise ShapesWorldExistsError(root, args, meta)
    tmp = f'{root}.tmp-{os.getpid()}'
    if osp.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(osp.join(tmp, 'annotations') if task != 'cityscapes' else tmp, exist_ok=True)
    gen_kwargs = dict(objects_per_image=(lo, hi), size_range=(smin, smax),
                      min_visible=float(min_visible))
    writer = dict(coco=_write_coco_split, ade=_write_ade_split,
                  cityscapes=_write_cityscapes_split)[task]
    try:
        summary = dict(args)
        for split, num in (('train', int(num_train)), ('val', int(num_val))):
            summary[split] = writer(tmp, split, num, size, int(seed), gen_kwargs, progress)
        with open(osp.join(tmp, META_FILE), 'w') as f:
            json.dump(summary, f, indent=2)
        if osp.exists(root):  # overwrite=True
            shutil.rmtree(root)
        os.makedirs(osp.dirname(root), exist_ok=True)
        os.replace(tmp, root)
    finally:
        if osp.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return summary


class ShapesWorldExistsError(FileExistsError):
    """``root`` exists but does not hold the shapes world asked for.

    Attributes:
        root (str): The directory.
        wanted (dict): The normalised generation arguments asked for.
        found (dict | None): Those recorded in its ``shapes_world.json``; None if it has none (not
            a generated shapes world).
    """

    def __init__(self, root: str, wanted: Dict, found: Optional[Dict],
                 fix: str = 'remove it or pass overwrite=True'):
        self.root, self.wanted, self.found = root, wanted, found
        super().__init__(self.message(fix))

    def message(self, fix: str) -> str:
        """The error message ending with ``fix`` (e.g. a command-line tool's own flag)."""
        return f'{self.root} already exists and {describe_mismatch(self.found, self.wanted)}; {fix}'


def world_arguments(task: str = 'coco',
                    num_train: int = 800,
                    num_val: int = 100,
                    image_size: Union[int, Tuple[int, int]] = 160,
                    seed: int = 0,
                    objects_per_image: Tuple[int, int] = (2, 6),
                    size_range: Tuple[float, float] = (0.08, 0.25),
                    min_visible: float = 0.6) -> Dict:
    """Check the arguments of :func:`generate_shapes` and return them normalised.

    This is what ``shapes_world.json`` records and what decides whether an existing world is the
    one asked for.

    Raises:
        ValueError: On an unknown task or invalid sizes/counts.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    for name, value in (('num_train', num_train), ('num_val', num_val)):
        if int(value) != value or value < 0:
            raise ValueError(f'{name} must be a non-negative int, got {value!r}')
    size = _size_hw(image_size)
    lo, hi = (int(v) for v in objects_per_image)
    if not 1 <= lo <= hi:
        raise ValueError(f'objects_per_image must be (min, max) with 1 <= min <= max, '
                         f'got {objects_per_image!r}')
    smin, smax = (float(v) for v in size_range)
    if not 0 < smin <= smax <= 0.5:
        raise ValueError(f'size_range must satisfy 0 < min <= max <= 0.5, got {size_range!r}')
    if not 0 < min_visible <= 1:
        raise ValueError(f'min_visible must be in (0, 1], got {min_visible!r}')
    return dict(format_version=_FORMAT_VERSION, task=task, num_train=int(num_train),
                num_val=int(num_val), image_size=list(size), seed=int(seed),
                objects_per_image=[lo, hi], size_range=[smin, smax],
                min_visible=float(min_visible))


def _same_world(meta: Optional[Dict], args: Dict) -> bool:
    return meta is not None and {k: meta.get(k) for k in args} == args


def describe_mismatch(found: Optional[Dict], wanted: Dict) -> str:
    """Say how an existing world (``found``: its recorded arguments, or None) differs from
    ``wanted``, e.g. ``'holds a shapes world generated with num_train=8, num_val=4 (wanted
    num_train=1000, num_val=100)'``."""
    if found is None:
        return f'is not a generated shapes world (it has no {META_FILE})'
    keys = [k for k in wanted if found.get(k) != wanted[k]]
    if not keys:
        return 'holds the shapes world asked for'
    have = ', '.join(f'{k}={found.get(k)!r}' for k in keys)
    want = ', '.join(f'{k}={wanted[k]!r}' for k in keys)
    return f'holds a shapes world generated with {have} (wanted {want})'


def _read_meta(root: str) -> Optional[Dict]:
    path = osp.join(root, META_FILE)
    if not osp.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# looking at it
# --------------------------------------------------------------------------------------------
def load_samples(root: str, split: str = 'val',
                 num: int = 4) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Read back the first ``num`` images of a generated world with per-pixel labels.

    Works for all layouts: COCO masks are decoded with pycocotools, ADE and Cityscapes label
    maps are read as they are.

    Args:
        root (str): A directory written by :func:`generate_shapes`.
        split (str): ``'train'`` or ``'val'``.
        num (int): Number of images.

    Returns:
        list[tuple[np.ndarray, np.ndarray, np.ndarray]]: (RGB uint8 image, uint8 class map
        with 0 = background and 1..3 = circle, square, triangle, int32 instance map with
        0 = background; for ADE, which has no instances, the class map again).
    """
    if split not in _SPLITS:
        raise ValueError(f'split must be one of {tuple(_SPLITS)}, got {split!r}')
    meta = _read_meta(root)
    if meta is None:
        raise FileNotFoundError(f'{root} holds no {META_FILE}: not a generated shapes world')
    out = []
    if meta['task'] == 'coco':
        from pycocotools import mask as mask_utils
        with open(osp.join(root, 'annotations', f'instances_{split}.json')) as f:
            coco = json.load(f)
        by_image: Dict[int, List[Dict]] = {}
        for ann in coco['annotations']:
            by_image.setdefault(ann['image_id'], []).append(ann)
        for info in coco['images'][:num]:
            img = np.asarray(Image.open(osp.join(root, split, info['file_name'])).convert('RGB'))
            label = np.zeros(img.shape[:2], dtype=np.uint8)
            inst = np.zeros(img.shape[:2], dtype=np.int32)
            for ann in by_image.get(info['id'], []):
                m = mask_utils.decode(ann['segmentation']).astype(bool)
                label[m] = ann['category_id']
                inst[m] = ann['id']
            out.append((img, label, inst))
    elif meta['task'] == 'cityscapes':
        img_dir = osp.join(root, 'leftImg8bit', split, 'shapes')
        names = sorted(os.listdir(img_dir))[:num]
        for name in names:
            stem = name[:-len(CITYSCAPES_IMG_SUFFIX)]
            img = np.asarray(Image.open(osp.join(img_dir, name)).convert('RGB'))
            label = np.asarray(Image.open(osp.join(root, 'gtFine', split, 'shapes',
                                                   stem + CITYSCAPES_SEG_SUFFIX)))
            out.append((img, label, label.astype(np.int32)))
    else:
        sub = _ADE_SPLIT_DIRS[split]
        names = sorted(os.listdir(osp.join(root, 'images', sub)))[:num]
        for name in names:
            stem = osp.splitext(name)[0]
            img = np.asarray(Image.open(osp.join(root, 'images', sub, name)).convert('RGB'))
            label = np.asarray(Image.open(osp.join(root, 'annotations', sub, stem + '.png')))
            out.append((img, label, label.astype(np.int32)))
    return out


def make_mosaic(samples: Sequence[Tuple[np.ndarray, np.ndarray, np.ndarray]], path: str,
                columns: int = 4, scale: int = 2) -> np.ndarray:
    """Save a PNG mosaic: each sample's image above its annotation.

    The annotation tile paints every pixel in its class colour (:data:`PALETTE`: circle red,
    square blue, triangle green; background black) and outlines every instance in white.

    Args:
        samples (Sequence[tuple]): (image, class map, instance map) triples as returned by
            :func:`load_samples`.
        path (str): Output PNG path.
        columns (int): Samples per row.
        scale (int): Integer upscaling factor (nearest neighbour).

    Returns:
        np.ndarray: The mosaic (H, W, 3) uint8.
    """
    if not samples:
        raise ValueError('make_mosaic needs at least one sample')
    colours = np.array([(0, 0, 0)] + [list(c) for c in PALETTE], dtype=np.uint8)
    tiles = []
    for img, label, inst in samples:
        ann = colours[label].copy()
        edge = np.zeros(inst.shape, dtype=bool)
        diff_v = inst[:-1] != inst[1:]
        diff_h = inst[:, :-1] != inst[:, 1:]
        edge[:-1] |= diff_v
        edge[1:] |= diff_v
        edge[:, :-1] |= diff_h
        edge[:, 1:] |= diff_h
        ann[edge & (inst > 0)] = 255
        tile = np.concatenate([img, ann], axis=0)
        tiles.append(np.pad(tile, ((2, 2), (2, 2), (0, 0)), constant_values=255))
    h, w = tiles[0].shape[:2]
    rows = (len(tiles) + columns - 1) // columns
    canvas = np.full((rows * h, min(columns, len(tiles)) * w, 3), 255, dtype=np.uint8)
    for i, tile in enumerate(tiles):
        r, c = divmod(i, columns)
        canvas[r * h:(r + 1) * h, c * w:(c + 1) * w] = tile
    if scale > 1:
        canvas = canvas.repeat(scale, axis=0).repeat(scale, axis=1)
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    Image.fromarray(canvas).save(path)
    return canvas


_ROOT_KEYS = ('root', 'data_root', 'out_dir', 'output_dir')
_RUN_ONLY_KEYS = ('overwrite', 'progress')


def _split_world(world: Dict) -> Tuple[Optional[str], Dict]:
    """(root, the other keyword arguments of :func:`generate_shapes`) of a ``shapes_world``."""
    kwargs = dict(world)
    root = None
    for key in _ROOT_KEYS:
        value = kwargs.pop(key, None)
        if value and root is None:
            root = str(value)
    return root, kwargs


class ShapesWorldError(RuntimeError):
    """A config's ``shapes_world`` cannot be provided (``str(error)`` is the user message)."""


def _ensure_here(cfg) -> bool:
    """Rank 0's part of :func:`ensure_shapes_world` (same return value)."""
    from mmengine.logging import print_log
    root, kwargs = _split_world(cfg.get('shapes_world'))
    if root is None:
        raise ShapesWorldError('shapes_world in the config needs a root (the directory to '
                               'generate the data in, the dataloaders\' data_root)')
    try:
        wanted = world_arguments(**{k: v for k, v in kwargs.items() if k not in _RUN_ONLY_KEYS})
    except (TypeError, ValueError) as err:
        raise ShapesWorldError(f'invalid shapes_world in the config: {err}') from err
    path = osp.abspath(osp.expanduser(root))
    overwrite = False
    if osp.isdir(path) and not os.listdir(path):
        overwrite = True  # an empty directory: nothing to lose
    elif osp.exists(path):
        found = _read_meta(path)
        if _same_world(found, wanted):
            return False
        if found is None:  # not ours: never delete it
            raise ShapesWorldError(
                f'shapes_world.root {root} already exists and '
                f'{describe_mismatch(found, wanted)}; move it away, or set shapes_world.root '
                f'and the dataloaders\' data_root to another directory')
        print_log(
            f'shapes_world: {root} {describe_mismatch(found, wanted)}: regenerating it as the '
            f'config asks (it is deterministic; to keep other data, give it another '
            f'shapes_world.root)', logger='current', level=logging.WARNING)
        overwrite = True
    generate_shapes(root, **dict(kwargs, overwrite=overwrite))
    return True


def ensure_shapes_world(cfg, splits: Sequence[str] = ('train', 'val', 'test')) -> bool:
    """Make sure the built-in shapes dataset a config asks for is there, as asked for.

    A config opts in with a ``shapes_world`` dict: the keyword arguments of
    :func:`generate_shapes`, root included (key ``root``, or ``data_root`` / ``out_dir``). The
    root is looked at:

    - missing or empty: the world is generated;
    - holding a world generated with the same arguments (its ``shapes_world.json``): kept;
    - holding a world generated with other arguments (e.g. by an earlier run with
      ``--cfg-options shapes_world.num_train=8``): regenerated as the config asks, with a warning
      in the log saying what differed (the world is deterministic and the config owns it);
    - holding anything else: :class:`ShapesWorldError`, nothing is deleted.

    In a distributed run only global rank 0 looks and writes; the other ranks wait for its
    outcome (the root must be on a file system all ranks share).

    Args:
        cfg (mmengine.Config | dict): The full config.
        splits (Sequence[str]): The splits the tool will read. Both splits are always generated
            together, so this does not change what is done; kept for the tools' call.

    Returns:
        bool: True if data was generated (on this or another rank).

    Raises:
        ShapesWorldError: If the root holds other data, or ``shapes_world`` has no root or
            invalid arguments (on every rank).
    """
    if not cfg.get('shapes_world'):
        return False
    from mmengine.dist import broadcast_object_list, get_rank, is_distributed
    outcome, error = [None], None
    if get_rank() == 0:
        try:
            outcome = [(True, _ensure_here(cfg))]
        except Exception as err:  # the other ranks must hear of any failure, too
            outcome, error = [(False, f'{type(err).__name__}: {err}')], err
    if is_distributed():  # also the barrier: the others wait until rank 0 is done
        broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    ok, value = outcome[0]
    if not ok:
        raise ShapesWorldError(value.split(': ', 1)[1] if value.startswith('ShapesWorldError')
                               else f'rank 0 could not generate the shapes world: {value}')
    return value
