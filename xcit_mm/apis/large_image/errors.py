# Copyright (c) xcit_mm contributors. All rights reserved.
"""The large-image tool's user errors, and the check of its output path before any work."""
import os.path as osp


class LargeImageError(ValueError):
    """A problem with the user's input or output path, told in one line that names the fix."""


def check_output(out: str) -> None:
    """Fail before any work on an output that cannot be written."""
    folder = osp.dirname(osp.abspath(out))
    if not osp.isdir(folder):
        raise LargeImageError(f'output folder does not exist: {folder}; create it or choose '
                              'another --out')
    if osp.isdir(out):
        raise LargeImageError(f'--out {out} is a folder; give a file name, e.g. {out}/labels.tif')
