"""The lean models' ``test_cfg`` read into one frozen settings object, checked key by key at
build and after each change, each error naming the fix (a misspelt ``max_memory`` would otherwise
run the image whole, with no budget)."""
import copy
import math
from dataclasses import dataclass, fields
from typing import ClassVar, Dict, Optional, Sequence, Tuple

from ..utils.memory_budget import MemoryModel, read_budget_mb, read_memory_model

# Tiles near COCO's test size (800 x 1333), images the detector knows; the overlap is the largest
# object (network pixels) still seen whole in some tile.
DEFAULT_TILE_SIZE = (1024, 1024)
DEFAULT_TILE_OVERLAP = 256
# How far (network pixels) above and below its core the stream's RoI heads read the scene's
# features (sideways the window's width: the whole width, or this far for windows over bands of
# columns, test_cfg.window_width): an object whose box reaches at most this far
# above or below the core gets the whole image's features (any object up to twice it tall, from
# the core holding its centre); a multiple of the coarsest FPN
# stride, so that windows start on a whole cell of every level. The window of feature rows grows
# with it (cores of 1024 rows and 256 each side: 1536 rows, all levels, the image's width).
DEFAULT_FEATURE_MARGIN = 256
FEATURE_MARGIN_STEP = 64
# The smallest tile side: XCiT needs 32 px to reach its stride-32 level.
MIN_TILE_SIZE = 32
# The window of mode='auto' without test_cfg.crop_size or data_preprocessor.size: mmseg's usual
# training crop; the stride is two thirds of it, as in mmseg's slide configs.
DEFAULT_CROP = (512, 512)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_pair(value, least: int) -> bool:
    return (isinstance(value, (tuple, list)) and len(value) == 2
            and all(_is_int(v) and v >= least for v in value))


@dataclass(frozen=True)
class LeanSettings:
    """The keys both lean models read; each model's subclass adds its own and its modes."""
    MODES: ClassVar[Tuple[str, ...]] = ('whole', )
    DEFAULT_MODE: ClassVar[str] = 'whole'  # when test_cfg has no mode (or mode=None)
    # mode='auto' without max_memory: an error, or (True) the memory the process may use, read
    # at each predict (LeanEncoderDecoder)
    AUTO_BUDGET_FROM_PROCESS: ClassVar[bool] = False
    LEAN_MODES: ClassVar[Tuple[str, ...]] = ()  # modes stock predict has no equivalent of
    READ_BY: ClassVar[Dict[str, Tuple[str, ...]]] = {}  # the modes that read a key (else all)
    OTHER_KEYS: ClassVar[Tuple[str, ...]] = ()  # keys read by the model's parts (rpn, rcnn)
    DOCS: ClassVar[str] = ''
    OWNER: ClassVar[str] = ''  # the model named in messages

    mode: str = 'whole'
    lean: bool = True
    max_memory: Optional[float] = None
    memory_model: Optional[MemoryModel] = None
    band_mb: Optional[float] = None

    @classmethod
    def from_cfg(cls, test_cfg, owner: Optional[str] = None, **context) -> 'LeanSettings':
        """``test_cfg`` checked (``MemoryBudgetError`` for the budget keys, else ``ValueError``);
        ``context``: what the model gives its subclass's reader."""
        cfg, owner = dict(test_cfg or {}), owner or cls.OWNER
        keys = cls.OTHER_KEYS + tuple(f.name for f in fields(cls))
        unknown = sorted(set(cfg) - set(keys))
        if unknown:
            raise ValueError(f'{owner}: unknown test_cfg key(s) {unknown}; the keys are '
                             f'{list(keys)} ({cls.DOCS})')
        mode, lean = cfg.get('mode'), cfg.get('lean', True)
        if mode is None:  # lean=False asks for stock's predict, which has no choice to make
            mode = cls.DEFAULT_MODE if lean is not False else 'whole'
        if mode not in cls.MODES:
            raise ValueError(f'{owner}: test_cfg.mode must be one of {list(cls.MODES)}, got '
                             f'{mode!r}; e.g. --cfg-options model.test_cfg.mode=auto '
                             'model.test_cfg.max_memory=8000')
        if not isinstance(lean, bool):
            raise ValueError(f'{owner}: test_cfg.lean must be True or False, got {lean!r}')
        unread = [k for k in keys
                  if cfg.get(k) is not None and mode not in cls.READ_BY.get(k, (mode, ))]
        if unread:
            modes = cls.READ_BY[unread[0]]
            raise ValueError(
                f'{owner}: test_cfg {[k for k in unread if cls.READ_BY[k] == modes]} only apply '
                f"to {' or '.join(f'mode={m!r}' for m in modes)}, but mode is {mode!r}; set "
                f'test_cfg.mode={modes[-1]!r} or remove them')
        band_mb = cfg.get('band_mb')
        if band_mb is not None and (isinstance(band_mb, bool) or not isinstance(
                band_mb, (int, float)) or not 0 < band_mb < math.inf):
            raise ValueError(f'{owner}: test_cfg.band_mb must be a positive number of MB, e.g. '
                             f'band_mb=64 (or None); got {band_mb!r}')
        if mode in cls.LEAN_MODES and not lean:  # (band_mb: only the lean modes read it)
            raise ValueError(f'{owner}: test_cfg.mode={mode!r} needs the lean predict; it does '
                             'not combine with lean=False (remove one of them)')
        budget = (read_budget_mb(cfg, owner) if cfg.get('max_memory') is not None or (
            mode == 'auto' and not cls.AUTO_BUDGET_FROM_PROCESS) else None)
        return cls(mode, lean, budget, read_memory_model(cfg.get('memory_model'), owner),
                   None if band_mb is None else float(band_mb),
                   **cls._read_own(cfg, mode, owner, **context))

    @classmethod
    def _read_own(cls, cfg: dict, mode: str, owner: str, **context) -> dict:
        return {}


def _token_keys(cfg: dict, owner: str) -> dict:
    """The stream's ``token_maps`` (where the trunk's token maps live) and ``token_dir``."""
    if cfg.get('token_maps') not in (None, 'memory', 'disk'):
        raise ValueError(f"{owner}: test_cfg.token_maps must be 'memory' or 'disk', got "
                         f"{cfg['token_maps']!r}")
    return dict(token_maps=cfg.get('token_maps'), token_dir=cfg.get('token_dir'))


@dataclass(frozen=True)
class DetectorSettings(LeanSettings):
    """``LeanMaskRCNN``'s top-level ``test_cfg`` keys (next to ``rpn`` and ``rcnn``)."""
    MODES: ClassVar = ('whole', 'tiles', 'auto', 'stream')
    LEAN_MODES: ClassVar = ('tiles', 'auto', 'stream')
    READ_BY: ClassVar = dict(tile_size=('tiles', 'auto', 'stream'), tile_overlap=('tiles', 'auto'),
                             feature_margin=('stream', 'auto'), token_maps=('stream', 'auto'),
                             token_dir=('stream', 'auto'), max_memory=('auto', ),
                             memory_model=('auto', ), mask_format=('tiles', 'auto', 'stream'),
                             band_mb=('stream', 'auto'),  # the stream's bands (once also whole's)
                             window_width=('stream', 'auto'))
    OTHER_KEYS: ClassVar = ('rpn', 'rcnn')
    DOCS: ClassVar = 'docs/lean_detection.md'
    OWNER: ClassVar = 'LeanMaskRCNN'

    tile_size: Tuple[int, int] = DEFAULT_TILE_SIZE
    tile_overlap: int = DEFAULT_TILE_OVERLAP
    feature_margin: int = DEFAULT_FEATURE_MARGIN
    token_maps: Optional[str] = None
    token_dir: Optional[str] = None
    mask_format: str = 'bitmap'
    window_width: Optional[int] = None

    def cores_per_window(self) -> Optional[int]:
        """The stream's core columns per window: ``window_width`` in whole cores, at least one;
        None (the whole width) without it."""
        if self.window_width is None:
            return None
        return max(1, self.window_width // self.tile_size[1])

    @classmethod
    def _read_own(cls, cfg: dict, mode: str, owner: str) -> dict:
        size = cfg.get('tile_size')
        size = DEFAULT_TILE_SIZE if size is None else size
        pair = (size, size) if _is_int(size) else size
        if not _is_pair(pair, MIN_TILE_SIZE):
            raise ValueError(
                f'{owner}: test_cfg.tile_size must be an int or an (h, w) pair of ints, each at '
                f'least {MIN_TILE_SIZE} (network-scale pixels), e.g. tile_size=1024 or '
                f'tile_size=(1024, 1536); got {size!r}')
        overlap = cfg.get('tile_overlap')
        overlap = DEFAULT_TILE_OVERLAP if overlap is None else overlap
        if not (_is_int(overlap) and 0 <= overlap and (mode == 'stream' or overlap < min(pair))):
            raise ValueError(
                f'{owner}: test_cfg.tile_overlap must be an int of network-scale pixels, at '
                f'least 0 and less than the smaller tile side {min(pair)} (tile_size='
                f'{tuple(pair)}); make it larger than the largest object to be seen whole in one '
                f'tile; got {overlap!r}')
        margin = cfg.get('feature_margin')
        margin = DEFAULT_FEATURE_MARGIN if margin is None else margin
        if not (_is_int(margin) and margin >= 0 and margin % FEATURE_MARGIN_STEP == 0):
            raise ValueError(
                f'{owner}: test_cfg.feature_margin must be an int of network-scale pixels, a '
                f'multiple of {FEATURE_MARGIN_STEP} (the coarsest FPN stride), at least 0: how '
                'far above and below its tile the RoI heads read the scene\'s features; objects up '
                f'to twice it tall are detected as on the whole image, e.g. feature_margin=256; '
                f'got {margin!r}')
        width = cfg.get('window_width')
        if width is not None and not (_is_int(width) and width > 0):
            raise ValueError(
                f'{owner}: test_cfg.window_width must be an int of network-scale pixels (or None, '
                'the whole width): how wide a band of cores the stream\'s window of features '
                'serves, rounded down to whole cores (tile_size), at least one; narrower windows '
                f'hold less memory on wide scenes, e.g. window_width=4096; got {width!r}')
        return dict(tile_size=(int(pair[0]), int(pair[1])), tile_overlap=int(overlap),
                    feature_margin=margin, mask_format=_mask_format(cfg, owner),
                    window_width=width, **_token_keys(cfg, owner))


def _mask_format(cfg: dict, owner: str) -> str:
    """``mask_format``: 'bitmap', stock's (N, H, W) bool masks, or 'rle', each mask a COCO RLE
    made from its box alone (binary masks only: a negative ``rcnn.mask_thr_binary`` asks for
    soft masks)."""
    fmt = cfg.get('mask_format')
    fmt = 'bitmap' if fmt is None else fmt
    if fmt not in ('bitmap', 'rle'):
        raise ValueError(f"{owner}: test_cfg.mask_format must be 'bitmap' (stock's (N, H, W) "
                         "masks) or 'rle' (a COCO RLE per instance, as CocoMetric takes it), got "
                         f'{fmt!r}')
    threshold = (cfg.get('rcnn') or {}).get('mask_thr_binary', 0.5)
    if fmt == 'rle' and threshold < 0:
        raise ValueError(f"{owner}: test_cfg.mask_format='rle' encodes binary masks, but "
                         f'test_cfg.rcnn.mask_thr_binary={threshold} asks for soft (uint8) '
                         "masks; set mask_thr_binary >= 0 or mask_format='bitmap'")
    return fmt


@dataclass(frozen=True)
class SegmentorSettings(LeanSettings):
    """``LeanEncoderDecoder``'s ``test_cfg`` keys (``docs/lean_segmentation.md``).

    Without a mode it chooses ('auto'), within the memory the process may use unless
    ``max_memory`` says otherwise: an image runs whole (stock's labels, bit for bit) wherever it
    fits, and a large one streams instead of failing for want of memory hours in. An explicit
    mode='whole' is stock's whole path, with no planning."""
    MODES: ClassVar = ('whole', 'slide', 'auto', 'stream')
    DEFAULT_MODE: ClassVar = 'auto'
    AUTO_BUDGET_FROM_PROCESS: ClassVar = True
    LEAN_MODES: ClassVar = ('auto', 'stream')
    READ_BY: ClassVar = dict(max_memory=('auto', 'stream'), memory_model=('auto', ),
                             band_mb=('stream', 'auto'), token_maps=('stream', 'auto'),
                             token_dir=('stream', 'auto'))
    DOCS: ClassVar = 'docs/lean_segmentation.md'
    OWNER: ClassVar = 'LeanEncoderDecoder'

    mode: str = 'auto'
    keep_seg_logits: bool = False
    lean_chunk_mb: float = 256
    crop_size: Tuple[int, int] = DEFAULT_CROP  # mode 'slide' needs both; else auto's default
    stride: Tuple[int, int] = (341, 341)
    token_maps: Optional[str] = None
    token_dir: Optional[str] = None

    @classmethod
    def _read_own(cls, cfg: dict, mode: str, owner: str,
                  default_crop: Optional[Sequence[int]] = None) -> dict:
        """``default_crop``: the data preprocessor's ``size``, auto's window if given."""
        crop, stride = cfg.get('crop_size'), cfg.get('stride')
        if mode != 'slide' and crop is None:  # auto's window; stock's slide needs both keys
            crop = default_crop or DEFAULT_CROP
        if mode != 'slide' and stride is None and _is_pair(crop, 1):
            stride = tuple(c * 2 // 3 for c in crop)
        for key, value in (('crop_size', crop), ('stride', stride)):
            if not _is_pair(value, 1):
                raise ValueError(
                    f"{owner}: test_cfg mode='slide' needs {key}=(h, w), two positive ints, "
                    f'e.g. crop_size=(512, 512), stride=(341, 341); got {value!r}')
        if any(s > c for s, c in zip(stride, crop)):
            raise ValueError(f'{owner}: test_cfg.stride {tuple(stride)} is larger than '
                             f'crop_size {tuple(crop)}: the windows would leave gaps')
        return dict(keep_seg_logits=cfg.get('keep_seg_logits', False),
                    lean_chunk_mb=cfg.get('lean_chunk_mb', 256), crop_size=tuple(crop),
                    stride=tuple(stride), **_token_keys(cfg, owner))


class LeanSettingsMixin:
    """``test_settings``: ``test_cfg`` read by ``SETTINGS.from_cfg``, again only when it changed."""
    SETTINGS = LeanSettings
    LEAN_PATHS: Tuple[str, ...] = ()  # the parts of predict that ``why_not`` answers for

    def _check_lean_path(self, path: str) -> None:
        """Refuse a lean path the model does not have (a typo would otherwise read as allowed)."""
        if path not in self.LEAN_PATHS:
            raise ValueError(f"{type(self).__name__}: unknown lean path {path!r}; known: "
                             f"{', '.join(self.LEAN_PATHS)}")

    def _settings_context(self) -> dict:
        return {}

    @property
    def test_settings(self) -> LeanSettings:
        read = getattr(self, '_read_test_cfg', None)  # (the test_cfg read, its settings)
        if read is None or read[0] != self.test_cfg:
            settings = self.SETTINGS.from_cfg(self.test_cfg, type(self).__name__,
                                              **self._settings_context())
            self._read_test_cfg = read = (copy.deepcopy(self.test_cfg), settings)
        return read[1]
