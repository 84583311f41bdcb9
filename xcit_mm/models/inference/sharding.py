"""One image's stream shared out to the ranks of a torch.distributed process group, exactly
(docs/sharded_stream.md): each rank makes a horizontal slab of the image's token rows and the
labels of its slab's pixel rows; together the ranks give the labels one process gives.

Everything in a segmentor on XCiT is row-local but XCA, which reads the whole image only through
its per-head sums, and UperNet's pyramid pooling, which reads it through its pooled sums. So the
ranks exchange only those sums (:meth:`Shard.combine`, one collective per XCA layer and one per
pooling), and each rank makes its slab's rows from the input pixels of the slab and a margin
around it instead of exchanging halo rows: the rows near the margin's outer edge go wrong (LPI
reads zeros past it), but they are never added into the sums nor read by the labels
(:class:`SlabRows` refuses them), and :func:`trunk_rows_read` finds, from the row maps after the
trunk, how many rows the labels read beyond the slab."""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .row_stream import RowMap, TokenMap

EMPTY = (0, 0)  # no rows


class Shard:
    """This process's share of a sharded stream: its rank and the world size of ``group``
    (default: torch.distributed's default group, which ``init_process_group`` made, e.g. under
    ``torchrun``), and the exchanges it took part in.

    ``exchanges``: ``(what, bytes)`` of each :meth:`combine`, the bytes of this rank's own share
    (what it hands to the collective); ``bytes_sent`` their total. An ``all_gather`` by a ring, as
    gloo and NCCL run it, also passes on the other ranks' shares: each rank then sends
    (world size - 1) shares in all."""

    def __init__(self, group=None):
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                'Shard: torch.distributed is not initialised: call '
                "torch.distributed.init_process_group (backend 'gloo' on the CPU, 'nccl' on "
                'GPUs) in every process first, e.g. in a script started by torchrun '
                '--nproc-per-node N, which sets the rank and world size')
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.exchanges: List[Tuple[str, int]] = []

    @property
    def bytes_sent(self) -> int:
        return sum(size for _, size in self.exchanges)

    def token_rows(self, grid_rows: int) -> Tuple[int, int]:
        """This rank's slab ``(first, stop)`` of ``grid_rows`` token rows: the rows shared out as
        evenly as whole rows allow, in rank order (a rank gets none where there are fewer rows
        than ranks; it still takes part in every exchange)."""
        return (self.rank * grid_rows // self.world_size,
                (self.rank + 1) * grid_rows // self.world_size)

    def slab(self, image_rows: int, patch_size: int) -> 'Slab':
        """This rank's :class:`Slab` of an image of ``image_rows`` pixel rows cut into patches of
        ``patch_size``."""
        grid_rows = -(-image_rows // patch_size)
        return Slab(self, image_rows, patch_size, *self.token_rows(grid_rows))

    def combine(self, tensors: Sequence[Tensor], what: str) -> List[Tensor]:
        """The sum over the ranks of each of ``tensors`` (each rank gives its own part, of the
        same shapes): one ``all_gather`` of them all, flattened, then the parts added in rank
        order, in float64, so that every rank gets the same values whatever the timing (an
        ``all_reduce`` adds in an order its algorithm picks). Each result in its tensor's dtype."""
        dtype = torch.float32
        for tensor in tensors:
            dtype = torch.promote_types(dtype, tensor.dtype)
        flat = torch.cat([tensor.reshape(-1).to(dtype) for tensor in tensors])
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        self.dist.all_gather(parts, flat, group=self.group)
        self.exchanges.append((what, flat.numel() * flat.element_size()))
        total = parts[0].double()
        for part in parts[1:]:
            total += part
        out, offset = [], 0
        for tensor in tensors:
            out.append(total[offset:offset + tensor.numel()].view(tensor.shape).to(tensor.dtype))
            offset += tensor.numel()
        return out

    def agree(self, values: Sequence[int], what: str) -> None:
        """Check that every rank was given the same ``values`` (e.g. the image size): a rank that
        streams another image would otherwise add its sums into the others' and hang or give
        wrong labels."""
        mine = torch.tensor([int(v) for v in values], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.dist.all_gather(parts, mine, group=self.group)
        self.exchanges.append(('stream check', mine.numel() * mine.element_size()))
        if any(not torch.equal(part, parts[0]) for part in parts):
            given = '; '.join(f'rank {rank}: {part.tolist()}' for rank, part in enumerate(parts))
            raise ValueError(f'the ranks of a sharded stream were given different {what} '
                             f'({given}): give every rank the same image and model')


@dataclass(frozen=True)
class Slab:
    """A rank's slab of one image: token rows ``first:stop`` of the patch grid, and the pixel
    rows they cover (:attr:`pixel_rows`)."""

    shard: Shard
    image_rows: int
    patch_size: int
    first: int
    stop: int

    @property
    def grid_rows(self) -> int:
        return -(-self.image_rows // self.patch_size)

    @property
    def pixel_rows(self) -> Tuple[int, int]:
        """The image's pixel rows of the slab's token rows: the rank's labels."""
        return (min(self.image_rows, self.first * self.patch_size),
                min(self.image_rows, self.stop * self.patch_size))

    def rows_of(self, height: int) -> Tuple[int, int]:
        """The slab's share of the rows of a map of ``height`` rows over the whole image (e.g.
        the coarsest level, which UperNet pools): the rows whose place in it lies in the slab's
        pixel rows, in proportion. The ranks' shares tile the map."""
        first, stop = self.pixel_rows
        return (-(-first * height // self.image_rows), -(-stop * height // self.image_rows))

    def combine(self, tensors: Sequence[Tensor], what: str) -> List[Tensor]:
        return self.shard.combine(tensors, what)


class SlabRows(RowMap):
    """A whole image's token map (``height`` token rows) of which a rank made only rows
    ``first:first + len(token_map)`` (``token_map``), exactly only ``exact`` (first, stop):
    past them LPI read zeros where the image has rows. Rows are asked for in whole-image
    numbers; a row outside ``exact`` is an error, not a wrong label. Without a ``token_map``,
    a placeholder of the map's size, to work out which rows the maps after the trunk read."""

    def __init__(self, height: int, width: int, token_map: Optional[TokenMap] = None,
                 first: int = 0, exact: Tuple[int, int] = EMPTY):
        super().__init__(height, width)
        self.token_map, self.first, self.exact = token_map, first, exact

    def rows(self, start: int, stop: int) -> Tensor:
        start, stop = self._made(start, stop)
        return self.token_map.rows(start - self.first, stop - self.first)

    def columns(self, start: int, stop: int, first: int, last: int) -> Tensor:
        start, stop = self._made(start, stop)
        return self.token_map.columns(start - self.first, stop - self.first, first, last)

    def _made(self, start: int, stop: int) -> Tuple[int, int]:
        """Rows ``start:stop`` within the map, checked to be rows this rank made exactly."""
        start, stop = max(0, start), min(self.height, stop)
        if self.token_map is None:
            raise RuntimeError('SlabRows: a placeholder has no rows (it sizes the row maps that '
                               'trunk_rows_read walks)')
        if start < self.exact[0] or stop > self.exact[1]:
            raise RuntimeError(f'SlabRows: token rows {start}..{stop - 1} were asked for, but '
                               f'this rank made only rows {self.exact[0]}..{self.exact[1] - 1} '
                               'exactly: the margin given to stream_trunk (read_rows) is too '
                               'small for the maps that read them')
        return start, stop


def rows_read(node: RowMap, start: int, stop: int) -> Dict[int, Tuple[RowMap, int, int]]:
    """``{id(map): (map, first, stop)}``: the rows of every map ``node``'s rows ``start:stop``
    are made from (``node`` included), each map's rows as the span of what all its readers read
    (each ``RowMap.reads``), in an order where a map comes after all its readers."""
    sources, readers, todo = {}, {}, [node]
    while todo:  # the graph, as its maps read each other
        current = todo.pop()
        if id(current) in sources:
            continue
        sources[id(current)] = [source for source, _, _ in current.reads(0, current.height)]
        for source in sources[id(current)]:
            readers[id(source)] = readers.get(id(source), 0) + 1
            todo.append(source)
    need = {id(node): (node, start, stop)}
    ready = [node]
    while ready:
        current = ready.pop()
        span = need.get(id(current))
        if span is not None:
            first, last = max(0, span[1]), min(current.height, span[2])
            if first < last:
                for source, lo, hi in current.reads(first, last):
                    if lo >= hi:
                        continue
                    _, lo0, hi0 = need.get(id(source), (source, lo, hi))
                    need[id(source)] = (source, min(lo, lo0), max(hi, hi0))
        for source in sources[id(current)]:
            readers[id(source)] -= 1
            if readers[id(source)] == 0:
                ready.append(source)
    return {key: span for key, span in need.items() if span[1] < span[2]}


def trunk_rows_read(node: RowMap, start: int, stop: int,
                    trunk: Sequence[RowMap]) -> Tuple[int, int]:
    """The token rows of the ``trunk`` maps (placeholders, e.g. :class:`SlabRows` without a
    map) that rows ``start:stop`` of ``node`` are made from, as one span; ``EMPTY`` if none."""
    spans = [span[1:] for key, span in rows_read(node, start, stop).items()
             if key in {id(m) for m in trunk}]
    if not spans:
        return EMPTY
    return min(lo for lo, _ in spans), max(hi for _, hi in spans)
