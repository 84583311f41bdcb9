# Copyright (c) xcit_mm contributors. All rights reserved.
"""The large-image tool's user errors, the check of its output paths before any work, and the sync
that puts an output on disk before it gets its name."""
import os
import os.path as osp
from typing import Iterable, Tuple


class LargeImageError(ValueError):
    """A problem with the user's input or output path, told in one line that names the fix."""


def check_output(path: str, option: str = '--out',
                 taken: Iterable[Tuple[str, str]] = ()) -> None:
    """Fail before any work on an output that cannot be written: its folder missing, a folder
    itself, or a file already ``taken`` (``(what, path)`` pairs: the files the input reads, the
    other outputs), also when named through a symbolic link, a hard link or another relative
    path, since writing it would overwrite that file."""
    folder = osp.dirname(osp.abspath(path))
    if not osp.isdir(folder):
        raise LargeImageError(f'output folder does not exist: {folder}; create it or choose '
                              f'another {option}')
    if osp.isdir(path):
        raise LargeImageError(f'{option} {path} is a folder; give a file name in it')
    for what, other in taken:
        if osp.realpath(path) == osp.realpath(other) or (
                osp.exists(path) and osp.exists(other) and osp.samefile(path, other)):
            same = '' if osp.abspath(path) == osp.abspath(other) else f' ({other})'
            raise LargeImageError(f'{option} {path} is {what}{same}: it would be overwritten; '
                                  f'choose another {option}')


def sync_to_disk(path: str) -> None:
    """fsync a file (or a folder, for the renames in it), so that a crash after the rename
    cannot leave a complete-looking name over incomplete data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
