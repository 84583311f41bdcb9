# Copyright (c) xcit_mm contributors. All rights reserved.
"""Many scenes in one run of ``tools/segment_large_image.py``: which files IMAGE names, where each
scene's outputs go, which are already done, and the summary at the end.

IMAGE may be several files, a folder (its rasters, not its subfolders) or a pattern such as
``'tiles/*.tif'``; the outputs then go into folders, one file per scene named after it. An output
is written under a temporary name and renamed when complete, so a scene whose outputs all exist
is done, and a rerun skips it."""
import glob
import os
import os.path as osp
from typing import Dict, List, NamedTuple, Optional, Sequence

from .errors import LargeImageError

# Files a folder's listing takes as scenes: rasters GDAL or tifffile reads (not their sidecars:
# .aux.xml, .ovr, world files, .msk).
SCENE_SUFFIXES = ('.tif', '.tiff', '.btf', '.vrt', '.jp2', '.j2k', '.png', '.jpg', '.jpeg', '.img',
                  '.ntf', '.svs', '.ndpi', '.scn', '.bif', '.hdr', '.dem', '.nc')


def is_many(images: Sequence[str]) -> bool:
    """Whether IMAGE names many scenes: several paths, a folder or a pattern."""
    return len(images) > 1 or osp.isdir(images[0]) or glob.has_magic(images[0])


def list_scenes(images: Sequence[str]) -> List[str]:
    """The scenes IMAGE names, in order: files as given, each folder's rasters and each pattern's
    matches sorted by name. Nothing found, or one name for two scenes' outputs, is an error."""
    scenes = []
    for image in images:
        if osp.isdir(image):
            found = sorted(osp.join(image, name) for name in os.listdir(image)
                           if name.lower().endswith(SCENE_SUFFIXES)
                           and osp.isfile(osp.join(image, name)))
            what = f'the folder {image} holds no raster ({", ".join(SCENE_SUFFIXES[:6])}, ...)'
        elif glob.has_magic(image):
            found = sorted(path for path in glob.glob(image) if osp.isfile(path))
            what = f'no file matches {image}'
        else:
            found, what = [image], ''
        if not found:
            raise LargeImageError(f'IMAGE: {what}')
        scenes += found
    names: Dict[str, str] = {}
    for scene in scenes:
        name = scene_name(scene)
        if name in names and osp.realpath(names[name]) != osp.realpath(scene):
            raise LargeImageError(f'IMAGE: {names[name]} and {scene} would write the same '
                                  f'outputs ({name}.*); rename one or run them apart')
        names[name] = scene
    return list(dict.fromkeys(scenes))


def scene_name(scene: str) -> str:
    """The scene's outputs' name: its file name without the extension (``a.ome.tif``: ``a``)."""
    name = osp.basename(scene)
    for suffix in ('.ome.tiff', '.ome.tif'):
        if name.lower().endswith(suffix):
            return name[:-len(suffix)]
    return osp.splitext(name)[0]


def output_folder(path: Optional[str], option: str) -> Optional[str]:
    """A many-scenes run's ``option`` value: an existing folder (or None when not asked for)."""
    if path is not None and not osp.isdir(path):
        raise LargeImageError(f'{option} {path}: with many scenes, {option} is a folder that '
                              'exists (each scene\'s output is named after it); create it')
    return path


class SceneResult(NamedTuple):
    """What became of one scene: ``status`` 'written', 'skipped' (its outputs were there) or
    'failed' (``reason``: its one-line error); its pixels and seconds where it ran."""
    scene: str
    status: str
    pixels: int = 0
    seconds: float = 0.0
    reason: str = ''


def summary(results: Sequence[SceneResult], seconds: float) -> List[str]:
    """The lines printed at the end of a many-scenes run: the counts, the pixels and the time,
    then each failed scene with its reason."""
    by = {status: [r for r in results if r.status == status]
          for status in ('written', 'skipped', 'failed')}
    pixels = sum(r.pixels for r in by['written'])
    lines = [f'scenes: {len(results)} ({len(by["written"])} written, {len(by["skipped"])} '
             f'skipped as done, {len(by["failed"])} failed); {pixels / 1e6:.1f} Mpx written in '
             f'{seconds:.0f} s']
    lines += [f'failed: {r.reason}' if r.reason.startswith(r.scene) else
              f'failed: {r.scene}: {r.reason}' for r in by['failed']]
    return lines
