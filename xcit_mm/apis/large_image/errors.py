# Copyright (c) xcit_mm contributors. All rights reserved.
"""The large-image tool's user errors, and the check of its output path before any work."""
import os.path as osp
from typing import Iterable


class LargeImageError(ValueError):
    """A problem with the user's input or output path, told in one line that names the fix."""


def check_output(out: str, inputs: Iterable[str] = ()) -> None:
    """Fail before any work on an output that cannot be written, or that is one of the files
    read (``inputs``: the image, a VRT's sources, its world or .aux.xml file), also when named
    through a symbolic link, a hard link or another relative path."""
    folder = osp.dirname(osp.abspath(out))
    if not osp.isdir(folder):
        raise LargeImageError(f'output folder does not exist: {folder}; create it or choose '
                              'another --out')
    if osp.isdir(out):
        raise LargeImageError(f'--out {out} is a folder; give a file name, e.g. {out}/labels.tif')
    for path in inputs:
        if osp.realpath(out) == osp.realpath(path) or (
                osp.exists(out) and osp.exists(path) and osp.samefile(out, path)):
            same = '' if osp.abspath(out) == osp.abspath(path) else f' ({path})'
            raise LargeImageError(f'--out {out} is a file the input reads{same}: it would be '
                                  'overwritten; choose another --out')
