# Copyright (c) xcit_mm contributors. All rights reserved.
"""The labels or instances of a scene streamed by several ranks, handed to the rank that writes
the outputs: :class:`SlabFiles` (labels), :class:`CoreRowFiles` (a detector's rows of cores).

A sharded stream (``docs/sharded_stream.md``) gives each rank the labels of its own slab of rows.
The outputs are single files (a COG, whose overviews need every row; polygons merged across row
bands), so one rank, the first, writes them all, from the rows in order: its own slab as it
streams, then each other rank's, read back from a file that rank wrote beside the output. The
writer then sees the same bands of rows as in one process, so the outputs are what one process
writes. The files are raw rows (labels as uint8, or uint16 above 256 classes; the confidence as
uint8 in a second file), removed once read back or when the run fails.

A detector's ranks hand over their rows of cores before the merge (``LeanMaskRCNN.stream_instances``
with a shard): the first rank merges every rank's rows in rank order, as one process merges its
own, so the instances are one process's too.
"""
import os
import os.path as osp
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np

from .errors import LargeImageError
from .writer import as_numpy

# The rows read back at once from a rank's file: about this many bytes of labels.
READ_BACK_BYTES = 16 << 20


def check_folder_shared(out: str, rank: int, world_size: int, gathered) -> None:
    """Refuse, before any work, a run whose first rank cannot see the files the others write
    beside ``out`` (ranks on several machines without a file system they share): the hand-over
    would otherwise fail only once every rank has streamed its share. Every rank leaves a mark
    file there and the first rank looks for them all. ``gathered(value)``: every rank's value in
    rank order (a collective, called twice by every rank)."""
    def mark(r: int) -> str:
        return f'{out}.rank{r}.mark.partial'
    with open(mark(rank), 'w'):
        pass
    try:
        gathered(None)  # every rank has left its mark
        unseen = [r for r in range(world_size) if not osp.exists(mark(r))] if rank == 0 else []
        unseen = gathered(unseen)[0]
    finally:
        os.remove(mark(rank))
    if unseen:
        ranks = ', '.join(map(str, unseen))
        raise LargeImageError(
            f'rank 0 cannot see the files of rank {ranks} beside {out} (no {mark(unseen[0])}): '
            'the ranks hand their rows to the first rank through files beside --out, so on '
            'several machines --out must be in a folder they all share (NFS, Lustre, ...)')


class SlabFiles:
    """The slab files of one output (``out``): rank ``rank`` of ``world_size`` writes its
    bands with :meth:`keep`, the first rank notes its own as they pass (:meth:`note`) and reads
    the others' back with :meth:`others`, given what every rank :meth:`told` (its (first, stop)
    pixel rows; the caller gathers them once every rank has kept its own)."""

    def __init__(self, out: str, rank: int, world_size: int, width: int, num_classes: int,
                 confidence: bool):
        self.out, self.rank, self.world_size = out, rank, world_size
        self.width, self.confidence = width, confidence
        self.dtype = np.uint8 if num_classes <= 256 else np.uint16
        self._rows: Optional[Tuple[int, int]] = None

    def path(self, rank: int, kind: str = 'labels') -> str:
        """Rank ``rank``'s file of ``kind`` ('labels' or 'confidence'), beside the output (the
        same disk, removed with the run)."""
        return f'{self.out}.rank{rank}.{kind}.partial'

    def _kinds(self) -> List[Tuple[str, type]]:
        return [('labels', self.dtype)] + [('confidence', np.uint8)] * self.confidence

    def note(self, band) -> None:
        """One band of this rank's, ``(start, stop, ...)``, each following the one before."""
        start, end = band[:2]
        if self._rows is not None and start != self._rows[1]:
            raise RuntimeError(f'SlabFiles: rank {self.rank} gave rows {start}..{end - 1} after '
                               f'rows ending at {self._rows[1] - 1}: bands must follow on')
        self._rows = (start if self._rows is None else self._rows[0], end)

    def told(self) -> Tuple[int, int]:
        """The pixel rows this rank's bands covered (``(0, 0)``: none)."""
        return self._rows or (0, 0)

    def keep(self, bands) -> None:
        """Write this rank's bands, ``(start, stop, labels[, confidence])`` top to bottom, each
        following the one before, to its files."""
        files = [open(self.path(self.rank, kind), 'wb') for kind, _ in self._kinds()]
        try:
            for band in bands:
                self.note(band)
                for f, (_, dtype), rows in zip(files, self._kinds(), band[2:]):
                    f.write(np.ascontiguousarray(as_numpy(rows), dtype).tobytes())
            for f in files:
                f.flush()
                os.fsync(f.fileno())
        finally:
            for f in files:
                f.close()

    def others(self, rows: List[Tuple[int, int]]) -> Iterator[tuple]:
        """The bands of every rank after this one, in rank order, read back from their files
        (``rows``: every rank's kept rows, indexed by rank), each file removed once read."""
        kinds = self._kinds()
        step = max(1, READ_BACK_BYTES // (self.width * np.dtype(self.dtype).itemsize))
        for rank in range(self.rank + 1, self.world_size):
            first, stop = rows[rank]
            files = []
            try:
                for kind, dtype in kinds:
                    path = self.path(rank, kind)
                    expected = (stop - first) * self.width * np.dtype(dtype).itemsize
                    got = osp.getsize(path) if osp.exists(path) else None
                    if got != expected:
                        raise RuntimeError(
                            f'rank {rank}: its {kind} file {path} holds '
                            f'{"no file" if got is None else f"{got} bytes"}, not the {expected} '
                            f'bytes of rows {first}..{stop - 1}')
                    files.append(open(path, 'rb'))
                for start in range(first, stop, step):
                    n = min(step, stop - start)
                    yield (start, start + n) + tuple(
                        np.fromfile(f, dtype, n * self.width).reshape(n, self.width)
                        for f, (_, dtype) in zip(files, kinds))
            finally:
                for f in files:
                    f.close()
            for kind, _ in kinds:
                os.remove(self.path(rank, kind))

    def remove(self) -> None:
        """Remove every rank's file still there (a failed or interrupted run)."""
        for rank in range(self.world_size):
            for kind, _ in self._kinds():
                if osp.lexists(self.path(rank, kind)):
                    os.remove(self.path(rank, kind))


class CoreRowFiles:
    """The rows of cores of one detector output (``out``), not yet merged, handed over as
    :class:`SlabFiles` hands bands over (:meth:`keep`, :meth:`note`, :meth:`told`: how many rows,
    :meth:`others`). Each row is its detections' arrays (boxes, scores, classes, mask logits) and
    the next row's top, saved as ``.npy`` arrays one after another (read without pickle)."""

    FIELDS = ('bboxes', 'scores', 'labels', 'mask_logits')

    def __init__(self, out: str, rank: int, world_size: int):
        self.out, self.rank, self.world_size = out, rank, world_size
        self._count = 0

    def path(self, rank: int) -> str:
        """Rank ``rank``'s file, beside the output (the same disk, removed with the run)."""
        return f'{self.out}.rank{rank}.cores.partial'

    def keep(self, rows: Iterable) -> None:
        """Write this rank's rows of cores (``InstanceData`` with the :attr:`FIELDS` and a
        ``next_top`` in its metainfo), top to bottom."""
        with open(self.path(self.rank), 'wb') as f:
            for row in rows:
                self.note(row)
                next_top = row.metainfo['next_top']
                np.save(f, np.array([-1 if next_top is None else next_top], np.int64))
                for field in self.FIELDS:
                    np.save(f, as_numpy(row.get(field)))
            f.flush()
            os.fsync(f.fileno())

    def note(self, row) -> None:
        """One row of cores of this rank's."""
        self._count += 1

    def told(self) -> int:
        """How many rows of cores this rank gave."""
        return self._count

    def others(self, counts: List[int]) -> Iterator:
        """The rows of every rank after this one, in rank order, read back from their files
        (``counts``: how many each rank kept, indexed by rank), each file removed once read."""
        import torch
        from mmengine.structures import InstanceData
        for rank in range(self.rank + 1, self.world_size):
            path = self.path(rank)
            if not osp.exists(path):
                raise RuntimeError(f'rank {rank}: its rows of cores {path} are not there')
            with open(path, 'rb') as f:
                for _ in range(counts[rank]):
                    next_top = int(np.load(f, allow_pickle=False)[0])
                    row = InstanceData(metainfo=dict(next_top=None if next_top < 0 else next_top))
                    for field in self.FIELDS:
                        setattr(row, field, torch.from_numpy(np.load(f, allow_pickle=False)))
                    yield row
            os.remove(path)

    def remove(self) -> None:
        """Remove every rank's file still there (a failed or interrupted run)."""
        for rank in range(self.world_size):
            if osp.lexists(self.path(rank)):
                os.remove(self.path(rank))
