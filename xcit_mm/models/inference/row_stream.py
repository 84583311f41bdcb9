"""Whole-image inference a band of rows at a time (docs/gigapixel.md): the trunk streams layer by
layer over :class:`TokenMap` s, every later map is a :class:`RowMap` made on demand from the rows
of its inputs. Torch only, no task package."""
import copy
import errno
import os
import re
import shutil
import tempfile
from typing import (Callable, Iterator, List, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.utils import _pair

MB = 2**20
# The first band of a stream, before any row's bytes are measured: one row, as a row of a very
# wide image may cost more than a band.
FIRST_BAND_ROWS = 1
# The largest integer factor a Resize makes by the call on the band's source rows (see Resize).
MAX_CALL_FACTOR = 16
# File systems whose files live in memory, which a budget of the process's memory does not see.
MEMORY_FILE_SYSTEMS = ('tmpfs', 'ramfs')


def row_bands(height: int, band_rows: int, halo: int = 0) -> Iterator[Tuple[int, int, int, int]]:
    """``(start, stop, lo, hi)``: each band's rows, then with ``halo`` rows of context each side."""
    for start in range(0, height, band_rows):
        stop = min(height, start + band_rows)
        yield start, stop, max(0, start - halo), min(height, stop + halo)


def band_rows_for(band_mb: float, row_bytes: int, at_least: int = 1) -> int:
    """The rows of a band of about ``band_mb`` MB, ``row_bytes`` bytes a row."""
    return max(at_least, int(band_mb * MB) // max(1, row_bytes))


# ---------------------------------------------------------------------------- row maps
class RowMap:
    """Rows of a (B, C, height, width) map on demand (:meth:`_make`). Bands move down the image: a
    map read again keeps its rows from ``LOOKBACK`` rows above the last request and makes only
    new ones; one read once a row (:func:`stream_rows` decides) keeps none, holding no wide band,
    but the few rows past the request a ``_make`` may give for free (they come with the rows
    asked for), which the next band then takes."""

    LOOKBACK = 2  # the consumers' halos differ by less; a request above it makes its rows again
    keeps = True

    def __init__(self, height: int, width: int):
        self.height, self.width = height, width
        self._rows: Optional[Tensor] = None
        self._first = self.row_bytes = 0  # bytes of one of its rows, once one is made

    def rows(self, start: int, stop: int) -> Tensor:
        start, stop = max(0, start), min(self.height, stop)
        kept, first = self._rows, self._first
        last = first + (kept.shape[2] if kept is not None else 0)
        if kept is None or not first <= start <= last:  # nothing made can be reused
            kept, first = self._make(start, stop), start
        elif stop > last:
            keep_from = max(first, start - self.LOOKBACK)
            kept = torch.cat([kept[:, :, keep_from - first:], self._make(last, stop)], dim=2)
            first = keep_from
        self.row_bytes = kept[:, :, :1].numel() * kept.element_size()
        if self.keeps:
            keep_from = max(first, start - self.LOOKBACK)
            self._rows, self._first = kept[:, :, keep_from - first:], keep_from
        elif first + kept.shape[2] > stop:  # rows made ahead (see Resize) only, out of the band
            self._rows, self._first = kept[:, :, stop - first:].clone(), stop
        else:
            self._rows = None
        return kept[:, :, start - first:stop - first]

    def columns(self, start: int, stop: int, first: int, last: int) -> Tensor:
        """Rows ``start:stop`` of columns ``first:last`` only (a map read from disk reads no
        other column, see :class:`TokenMap`)."""
        return self.rows(start, stop)[..., first:last]

    def forget(self) -> None:
        """Drop the rows kept: the next request makes its rows again (its inputs changed)."""
        self._rows = None

    def reads(self, start: int, stop: int) -> List[Tuple['RowMap', int, int]]:
        """``(source, first, stop)``: the rows of each source that rows ``start:stop`` are made
        from (none for a map that is given, not made), so that a slab of the image can know
        which rows of the token maps it needs before any is made (``sharding.rows_read``)."""
        return []

    def _make(self, start: int, stop: int) -> Tensor:
        raise NotImplementedError


# ---------------------------------------------------------------------------- token maps
class TokenMap(RowMap):
    """An (H, W, C) float32 token map read and written by bands of rows, its rows a (1, C, H, W)
    channels-last map; in memory or in a file unlinked at once (gone with the process)."""

    def __init__(self, shape: Sequence[int], device: torch.device, folder: Optional[str] = None):
        # row_bytes: 0 in memory (its rows are views), a row's bytes once read from disk
        super().__init__(*shape[:2])
        self.shape = tuple(shape)
        self.device = torch.device(device)
        self.file_row_bytes = 4 * self.shape[1] * self.shape[2]
        self.data = self.fd = None
        if folder is None:
            self.data = torch.empty(self.shape, device=self.device)
            return
        self.fd, path = tempfile.mkstemp(dir=folder, suffix='.tokens')
        os.unlink(path)
        self.folder = folder

    def read(self, start: int, stop: int) -> Tensor:
        """Rows ``start:stop``: a view in memory, a fresh tensor from disk."""
        if self.data is not None:
            return self.data[start:stop]
        out = torch.empty((stop - start, ) + self.shape[1:])
        self._read_into(out, start * self.file_row_bytes)
        return out.to(self.device)

    def rows(self, start: int, stop: int) -> Tensor:
        if self.data is None:  # rows from disk are new memory a band must count, as made rows
            self.row_bytes = self.file_row_bytes
        return self.read(max(0, start), min(self.height, stop)).permute(2, 0, 1)[None]

    def columns(self, start: int, stop: int, first: int, last: int) -> Tensor:
        start, stop = max(0, start), min(self.height, stop)
        if self.data is not None:
            return self.data[start:stop, first:last].permute(2, 0, 1)[None]
        out = torch.empty((stop - start, last - first, self.shape[2]))
        token_bytes = 4 * self.shape[2]
        self.row_bytes = (last - first) * token_bytes
        for row in range(start, stop):  # each row's span of columns, one read
            self._read_into(out[row - start], row * self.file_row_bytes + first * token_bytes)
        return out.to(self.device).permute(2, 0, 1)[None]

    def _read_into(self, out: Tensor, offset: int) -> None:
        """Fill ``out`` with the file's bytes from ``offset`` (zeros where never written)."""
        view = memoryview(out.numpy()).cast('B')
        while len(view):
            done = os.preadv(self.fd, [view], offset)
            if done == 0:  # rows never written read as zeros (the file is sparse)
                view[:] = bytes(len(view))
                break
            view, offset = view[done:], offset + done

    def write(self, start: int, tokens: Tensor) -> None:
        if self.data is not None:
            self.data[start:start + tokens.shape[0]].copy_(tokens)
            return
        array = tokens.detach().to('cpu', torch.float32).contiguous().numpy()
        view, offset = memoryview(array).cast('B'), start * self.file_row_bytes
        try:
            while len(view):
                done = os.pwrite(self.fd, view, offset)
                view, offset = view[done:], offset + done
        except OSError as error:
            if error.errno == errno.ENOSPC:
                size = self.file_row_bytes * self.shape[0] / MB
                raise OSError(errno.ENOSPC, f'no space left in {self.folder} for the token maps '
                              f'({size:.0f} MB each): free space there or set token_dir '
                              '(test_cfg.token_dir / --token-dir) to a folder on a larger disk'
                              ) from None
            raise

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.data = None


class TokenMaps:
    """The token maps of one image, in memory or in a temporary folder under ``folder`` removed on
    any exit (error and Ctrl-C included)."""

    def __init__(self, device: torch.device, folder: Optional[str] = None):
        self.device, self.parent, self.folder = device, folder, None
        self.maps: List[TokenMap] = []

    def __enter__(self) -> 'TokenMaps':
        if self.parent is not None:
            _check_is_folder(self.parent)
            self.folder = tempfile.mkdtemp(prefix='xcit_tokens_', dir=self.parent)
        return self

    def new(self, shape: Sequence[int]) -> TokenMap:
        self.maps.append(TokenMap(shape, self.device, self.folder))
        return self.maps[-1]

    def __exit__(self, *exc) -> None:
        for token_map in self.maps:
            token_map.close()
        self.maps = []
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


TOKEN_DIR_FIX = 'set test_cfg.token_dir / --token-dir to'


def _check_is_folder(folder: str) -> None:
    if not os.path.isdir(folder):
        raise ValueError(f'token_dir {folder!r} is not a folder: {TOKEN_DIR_FIX} an existing, '
                         'writable folder for the token maps')


def _read_mounts() -> Optional[str]:
    """The kernel's table of mounted file systems (Linux), None where there is none."""
    try:
        with open('/proc/mounts') as f:
            return f.read()
    except OSError:
        return None


def file_system_type(path: str) -> Optional[str]:
    """The type (``ext4``, ``tmpfs``, ...) of the file system holding ``path``: that of the
    deepest mount point above it in ``/proc/mounts``; None where the table cannot be read."""
    mounts = _read_mounts()
    if mounts is None:
        return None
    path = os.path.realpath(path)
    best, best_type = '', None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        # the table writes a space, tab, newline or backslash in a path as an octal escape
        point = re.sub(r'\\([0-7]{3})', lambda m: chr(int(m.group(1), 8)), fields[1])
        inside = path == point or path.startswith(point.rstrip('/') + '/')
        if inside and len(point) >= len(best):  # a later mount over the same point wins
            best, best_type = point, fields[2]
    return best_type


def check_token_folder(folder: str, need_bytes: int, memory_counted: bool = False) -> None:
    """Refuse, before any work, a folder the token maps cannot go to: not a folder; a file system
    in memory (tmpfs, the usual temporary folder on many systems: memory a budget of the
    process does not see) unless the caller's budget counts the maps as memory; too little free
    space for ``need_bytes`` (a full disk would otherwise show up hours into a run)."""
    _check_is_folder(folder)
    need_mb = need_bytes / MB
    fs_type = file_system_type(folder)
    if fs_type in MEMORY_FILE_SYSTEMS and not memory_counted:
        raise ValueError(f'token_dir {folder!r} is on a {fs_type} (memory, which the memory '
                         f'budget does not see): {TOKEN_DIR_FIX} a folder on a disk with '
                         f'{need_mb:.0f} MB free for the token maps')
    stat = os.statvfs(folder)
    free_mb = stat.f_bavail * stat.f_frsize / MB
    if free_mb < need_mb:
        raise ValueError(f'token_dir {folder!r} has {free_mb:.0f} MB free but the token maps '
                         f'need {need_mb:.0f} MB: {TOKEN_DIR_FIX} a folder with room for them '
                         'or free space there')


class TensorRows(RowMap):
    """A map that exists whole (a small, coarse one)."""

    def __init__(self, tensor: Tensor):
        super().__init__(*tensor.shape[2:])
        self.tensor = tensor

    def rows(self, start: int, stop: int) -> Tensor:
        return self.tensor[:, :, max(0, start):stop]


class Local(RowMap):
    """``fn`` of its source's rows, output row ``r`` reading from input row ``r * num // den`` with
    ``halo`` rows of context each side (beyond the map, ``fn``'s zero padding): size-keeping, a
    2x2 stride-2 transposed conv (``den=2``) or a max pool of kernel = stride k (``num=k``)."""

    def __init__(self, fn: Callable[[Tensor], Tensor], source: RowMap, halo: int = 0,
                 num: int = 1, den: int = 1):
        super().__init__(-(-source.height * den // num), -(-source.width * den // num))
        self.fn, self.source, self.halo, self.num, self.den = fn, source, halo, num, den

    def _span(self, start: int, stop: int) -> Tuple[int, int]:
        return (max(0, start * self.num // self.den - self.halo),
                min(self.source.height, -(-stop * self.num // self.den) + self.halo))

    def reads(self, start: int, stop: int) -> List[Tuple[RowMap, int, int]]:
        return [(self.source, *self._span(start, stop))]

    def _make(self, start: int, stop: int) -> Tensor:
        lo, hi = self._span(start, stop)
        first = lo * self.den // self.num
        return self.fn(self.source.rows(lo, hi))[:, :, start - first:stop - first]


class RowConv(Local):
    """A size-keeping stride-1 conv (bare or in a ``ConvModule``) by rows, computing only the rows
    asked for: ``conv`` runs unpadded along the rows on them and ``halo`` rows of context each
    side, with zero rows added where those fall beyond the map (stock's padding there). A conv
    left to pad would make ``2 x halo`` rows more a call, which are cut away: three times the work
    where bands are one row of a wide map."""

    def __init__(self, conv: nn.Module, source: RowMap, halo: int):
        super().__init__(_without_row_padding(conv), source, halo)

    def _make(self, start: int, stop: int) -> Tensor:
        lo, hi = self._span(start, stop)
        band = self.source.rows(lo, hi)
        top, bottom = self.halo - (start - lo), stop + self.halo - hi
        if top or bottom:  # the map's edges: stock's zero padding
            band = F.pad(band, (0, 0, top, bottom))
        return self.fn(band)


def _without_row_padding(module: nn.Module) -> nn.Module:
    """A shallow copy of a conv, or of a ``ConvModule`` around one, that pads columns as it does
    but no rows, sharing its parameters and its other modules."""
    conv = getattr(module, 'conv', module)
    unpadded = copy.copy(conv)
    unpadded.padding = (0, _pair(conv.padding)[1])
    if conv is module:
        return unpadded
    outer = copy.copy(module)
    outer._modules = copy.copy(module._modules)
    outer._modules['conv'] = unpadded
    return outer


class Combine(RowMap):
    """``fn`` of the same rows of several maps of one size (a sum, a concatenation)."""

    def __init__(self, fn: Callable[..., Tensor], *sources: RowMap):
        super().__init__(sources[0].height, sources[0].width)
        self.fn, self.sources = fn, sources

    def reads(self, start: int, stop: int) -> List[Tuple[RowMap, int, int]]:
        return [(source, start, stop) for source in self.sources]

    def _make(self, start: int, stop: int) -> Tensor:
        return self.fn(*(source.rows(start, stop) for source in self.sources))


class Resize(RowMap):
    """``F.interpolate(source, size, mode, align_corners)`` by rows, equal to the call: an integer
    factor by the call on the band's source rows and one more each side, else by the call's own
    source rows (nearest) or their blend with its weights (bilinear)."""

    def __init__(self, source: RowMap, size: Sequence[int], mode: str = 'bilinear',
                 align_corners: Optional[bool] = None, interpolate_kwargs: Optional[dict] = None):
        super().__init__(*size)
        if mode not in ('nearest', 'bilinear'):
            raise ValueError(f'Resize rows: mode {mode!r} is not nearest or bilinear')
        self.source, self.mode = source, mode
        self.align_corners = bool(align_corners) if mode == 'bilinear' else None
        h_in, h_out = source.height, self.height
        # an integer factor, the call's own scale (1 / factor), no corner alignment; a large one
        # (a pooled map of a few rows made as tall as a level) blends instead, as the call
        # would make 2 x factor rows of context with each band
        self.factor = h_out // h_in if (h_out % h_in == 0 and not self.align_corners and (
            h_out // h_in <= MAX_CALL_FACTOR) and (
            mode == 'bilinear' or 'scale_factor' not in (interpolate_kwargs or {}))) else 0
        if mode == 'nearest':  # the call's own source rows and columns
            kwargs = dict(interpolate_kwargs or {}, mode='nearest')
            self.row_of = nearest_index(h_in, h_out, 0, kwargs)
            self.col_of = nearest_index(source.width, self.width, 1, kwargs)
            return
        y = torch.arange(h_out, dtype=torch.float32)
        if self.align_corners:
            scale = (h_in - 1) / (h_out - 1) if h_out > 1 else 0.
            src = torch.tensor(scale, dtype=torch.float32) * y
        else:
            scale = torch.tensor(h_in, dtype=torch.float32) / h_out
            src = (scale * (y + 0.5) - 0.5).clamp_min(0)
        self.row_of = src.long().clamp_max(h_in - 1)
        self.next_of = (self.row_of + 1).clamp_max(h_in - 1)
        self.weight = (src - self.row_of).view(1, 1, -1, 1)

    def _span(self, start: int, stop: int) -> Tuple[int, int]:
        """The source rows that rows ``start:stop`` are made from."""
        f = self.factor
        if f:
            return max(0, start // f - 1), min(self.source.height, -(-stop // f) + 1)
        last = self.row_of if self.mode == 'nearest' else self.next_of
        return int(self.row_of[start]), int(last[stop - 1]) + 1

    def reads(self, start: int, stop: int) -> List[Tuple[RowMap, int, int]]:
        return [(self.source, *self._span(start, stop))]

    def _make(self, start: int, stop: int) -> Tensor:
        f = self.factor
        first, last = self._span(start, stop)
        if f:
            band = F.interpolate(self.source.rows(first, last),
                                 size=(f * (last - first), self.width),
                                 mode=self.mode, align_corners=self.align_corners)
            # every row before the band's last source row is the whole call's: those past stop
            # (up to f - 1) come along for the next band, which would make them again
            end = self.height if last == self.source.height else f * (last - 1)
            return band[:, :, start - f * first:end - f * first]
        if self.mode == 'nearest':
            band = self.source.rows(first, last)
            band = band.index_select(2, (self.row_of[start:stop] - first).to(band.device))
            return band.index_select(3, self.col_of.to(band.device))
        band = F.interpolate(self.source.rows(first, last), size=(last - first, self.width),
                             mode='bilinear', align_corners=self.align_corners)
        device = band.device
        w1 = self.weight[:, :, start:stop].to(device, band.dtype)
        upper = band.index_select(2, (self.row_of[start:stop] - first).to(device))
        lower = band.index_select(2, (self.next_of[start:stop] - first).to(device))
        return upper * (1 - w1) + lower * w1


def nearest_index(n_in: int, n_out: int, axis: int, kwargs: dict) -> Tensor:
    """Source index of each output row (``axis`` 0) or column (1) of nearest ``F.interpolate``:
    the call on a column of indices (each axis is resized alone, so a row of them resizes alike)."""
    line = torch.arange(n_in, dtype=torch.float64).view(1, 1, n_in, 1)
    if 'scale_factor' in kwargs:
        kwargs = dict(kwargs, scale_factor=(_pair(kwargs['scale_factor'])[axis], 1.))
    else:
        kwargs = dict(kwargs, size=(n_out, 1))
    index = F.interpolate(line, **kwargs).flatten().long()
    assert index.numel() == n_out, (index.shape, n_out)
    return index


class Crop(RowMap):
    """Rows ``top:top + height`` and columns ``left:left + width`` of a map."""

    def __init__(self, source: RowMap, top: int, left: int, height: int, width: int):
        super().__init__(height, width)
        self.source, self.top, self.left = source, top, left

    def reads(self, start: int, stop: int) -> List[Tuple[RowMap, int, int]]:
        return [(self.source, self.top + max(0, start), self.top + min(self.height, stop))]

    def rows(self, start: int, stop: int) -> Tensor:
        return self.source.columns(*self.reads(start, stop)[0][1:], self.left,
                                   self.left + self.width)


# ---------------------------------------------------------------------------- modules as rows
def conv_halo(module) -> Optional[int]:
    """The rows of context each side a size-keeping stride-1 ``nn.Conv2d`` needs, bare or in a
    ``ConvModule`` with no norm or a BatchNorm (per pixel in eval mode); else None."""
    conv = getattr(module, 'conv', module)
    if getattr(module, 'with_norm', False) and not isinstance(
            getattr(module, module.norm_name), _BatchNorm):
        return None
    if (type(conv) is not nn.Conv2d or conv.padding_mode != 'zeros'
            or isinstance(conv.padding, str)):
        return None
    (kh, _), (sh, _), (ph, _), (dh, _) = (conv.kernel_size, conv.stride, conv.padding,
                                          conv.dilation)
    return ph if sh == 1 and 2 * ph == dh * (kh - 1) else None


class NotRowLocal(ValueError):
    """A module that cannot run a band of rows at a time; the message says which and why."""


def module_rows(module: nn.Module, source: RowMap) -> RowMap:
    """``module`` of ``source`` as a :class:`RowMap`, or :class:`NotRowLocal` saying why not."""
    if isinstance(module, nn.Sequential):
        for link in module:
            source = module_rows(link, source)
        return source
    if isinstance(module, nn.Identity):
        return source
    if isinstance(module, (nn.GELU, nn.ReLU, nn.Dropout, nn.Dropout2d, _BatchNorm)):  # per pixel
        return Local(module, source)
    halo = conv_halo(module)
    if halo is not None:
        return RowConv(module, source, halo) if halo else Local(module, source)
    norm = getattr(module, 'norm_name', None) and getattr(module, module.norm_name)
    if norm is not None and not isinstance(norm, _BatchNorm):
        raise NotRowLocal(f'{type(module).__name__}: its {type(norm).__name__} normalises over '
                          'the whole map, so a band of rows cannot be made alone (BatchNorm, '
                          'per pixel in eval mode, can)')
    if (type(module) is nn.ConvTranspose2d and _pair(module.kernel_size) == (2, 2)
            and _pair(module.stride) == (2, 2) and _pair(module.padding) == (0, 0)
            and _pair(module.output_padding) == (0, 0)):
        return Local(module, source, num=1, den=2)
    if (type(module) is nn.MaxPool2d and _pair(module.kernel_size) == _pair(module.stride)
            and _pair(module.padding) == (0, 0) and _pair(module.dilation) == (1, 1)):
        return Local(module, source, num=_pair(module.stride)[0])
    raise NotRowLocal(f'{type(module).__name__} cannot run a band of rows at a time (a '
                      'size-keeping stride-1 conv with BN or no norm, a per-pixel module, a 2x2 '
                      'stride-2 transposed conv or a max pool of kernel = stride can)')


def _graph(node: RowMap) -> Tuple[List[RowMap], dict]:
    """Every map ``node`` is made from, itself included (each once), and each one's consumers."""
    maps, consumers, todo = {}, {}, [node]
    while todo:
        current = todo.pop()
        if id(current) in maps:
            continue
        maps[id(current)] = current
        for source in getattr(current, 'sources', None) or [getattr(current, 'source', None)]:
            if isinstance(source, RowMap):
                consumers.setdefault(id(source), []).append(current)
                todo.append(source)
    return list(maps.values()), consumers


def _read_once(node: RowMap, consumers: dict) -> bool:
    """Whether each row of ``node`` is read once: by the stream, or by one consumer of just the
    rows it makes (a sum, a per-pixel function, a crop passing them on to such a consumer)."""
    users = consumers.get(id(node), [])
    if len(users) != 1:
        return not users
    user = users[0]
    if isinstance(user, Crop):
        return _read_once(user, consumers)
    return isinstance(user, Combine) or isinstance(user, Local) and user.halo == 0 and (
        user.num == user.den == 1)


def stream_rows(node: RowMap, band_mb: float, first_rows: int = FIRST_BAND_ROWS
                ) -> Iterator[Tuple[int, int, Tensor]]:
    """``(start, stop, rows)`` of ``node`` band by band: after ``first_rows`` rows, bands whose
    rows in every map, as measured on the band before, come near ``band_mb`` (one row at
    least)."""
    maps, consumers = _graph(node)
    for current in maps:
        current.keeps = not _read_once(current, consumers)
    return measured_bands(node, band_mb, first_rows)


def measured_bands(node: RowMap, band_mb: float, first_rows: int = FIRST_BAND_ROWS
                   ) -> Iterator[Tuple[int, int, Tensor]]:
    """:func:`stream_rows`' bands of a map whose readers are already set up (a second pass over a
    map of the stream, e.g. to pool it whole)."""
    maps, _ = _graph(node)
    start, rows = 0, first_rows
    while start < node.height:
        stop = min(node.height, start + rows)
        band = node.rows(start, stop)
        per_row = band[:, :, :1].numel() * band.element_size() + sum(
            m.row_bytes * m.height / node.height for m in maps)
        yield start, stop, band
        del band
        start, rows = stop, band_rows_for(band_mb, int(per_row))


def materialize(node: RowMap, band_mb: float) -> Tensor:
    """The whole map of ``node``, made band by band into one tensor."""
    out = None
    for start, stop, band in stream_rows(node, band_mb):
        if out is None:
            out = band.new_empty(band.shape[:2] + (node.height, node.width))
        out[:, :, start:stop] = band
    return out


@runtime_checkable
class LevelByLevelBackbone(Protocol):
    """A backbone that makes its trunk maps once (whole or streamed into token maps), then each
    level on demand, whole or by rows (``XCiTBackbone``); any other runs whole, as stock does."""

    def forward_trunk(self, x: Tensor) -> List[Tensor]:
        ...

    def forward_level(self, feat: Tensor, level: int, image_hw: Tuple[int, int]) -> Tensor:
        ...

    def level_rows(self, trunk_map: RowMap, level: int, image_hw: Tuple[int, int]) -> RowMap:
        ...

    def stream_trunk(self, read_pixels: Callable[[int, int], Tensor], image_hw: Tuple[int, int],
                     maps: TokenMaps, band_mb: float, progress: Callable[[], None] = None,
                     valid_pixels: Optional[Callable[[int, int], Tensor]] = None
                     ) -> List[TokenMap]:
        ...


# ---------------------------------------------------------------------------- norms
NORMS = (nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm, _InstanceNorm)
# Where the stream runs a backbone's modules on bands of image rows (the XCiT parts by name): the
# conv stem, each layer's LPI and the adapter; a norm there must be per pixel.
ROW_PARTS = re.compile(r'(patch_embed|layers\.\d+\.lpi|fpn\d)(\.|$)')
NORM_FIX = ("build the backbone with norm_cfg=dict(type='BN') or dict(type='SyncBN') (per pixel "
            'in eval mode)')


def why_not_norms(backbone: nn.Module) -> Optional[str]:
    """A norm the stream would apply to each band alone (None if there is none): in the parts that
    run on bands of rows, any norm but a BatchNorm with running statistics, which alone is per
    pixel in eval mode (a GroupNorm, a LayerNorm, an InstanceNorm would normalise each band over
    its own rows, and give other labels or fail after the whole trunk has run)."""
    for name, module in backbone.named_modules():
        if not ROW_PARTS.match(name):
            continue
        if isinstance(module, _BatchNorm):
            if module.running_mean is None:
                return (f'backbone.{name} is a {type(module).__name__} without running '
                        'statistics (track_running_stats=False): it would normalise each band by '
                        f'its own statistics; {NORM_FIX}')
        elif isinstance(module, NORMS) or 'Norm' in type(module).__name__:
            return (f'backbone.{name} is a {type(module).__name__}: it would normalise each band '
                    f'over its own rows, not over the whole image; {NORM_FIX}')
    return None
