"""Check, before anything is built, that the data a config points at is really there.

Without this check a missing COCO / ADE20k / Cityscapes copy surfaces deep inside dataset
construction (for example as ``FileNotFoundError: data/coco/annotations/instances_train2017.json``
raised from a dataloader worker, or as an empty ADE20k dataset that fails on the first iteration),
possibly minutes after start-up on every rank of a multi-GPU job. :func:`check_data` walks the
dataloader and evaluator settings of a config the same way mmengine's ``BaseDataset`` resolves them
and raises one :class:`DatasetNotFoundError` that lists every missing path and says what to
download and where to put it, or how to point the config elsewhere with ``--cfg-options``. A
Cityscapes copy without the ``*_gtFine_labelTrainIds.png`` label maps (made by mmseg's converter,
not part of the download) counts as missing too.

The built-in shapes dataset is created on use by :func:`shapes_world.ensure_shapes_world`.
"""
import os
import os.path as osp
from typing import Iterable, List, Optional, Sequence, Tuple

# Split name -> (dataloader key, evaluator key, loop key that enables it).
_SPLITS = {
    'train': ('train_dataloader', None, 'train_cfg'),
    'val': ('val_dataloader', 'val_evaluator', 'val_cfg'),
    'test': ('test_dataloader', 'test_evaluator', 'test_cfg'),
}

_COCO_HELP = """\
COCO 2017 is needed. Download these three archives from https://cocodataset.org/#download
    http://images.cocodataset.org/zips/train2017.zip
    http://images.cocodataset.org/zips/val2017.zip
    http://images.cocodataset.org/annotations/annotations_trainval2017.zip
and unzip them into {root} so that it contains
    annotations/instances_train2017.json, annotations/instances_val2017.json
    train2017/*.jpg
    val2017/*.jpg
(or link an existing copy there: ln -s /path/to/coco {root})."""

_ADE_HELP = """\
ADE20k (the SceneParsing ADEChallengeData2016 release, 150 classes) is needed. Download
    http://data.csail.mit.edu/places/ADEchallenge/ADEChallengeData2016.zip
and unzip it into {parent} so that {root} contains
    images/training/*.jpg, images/validation/*.jpg
    annotations/training/*.png, annotations/validation/*.png
(or link an existing copy there: ln -s /path/to/ADEChallengeData2016 {root})."""

_CITYSCAPES_HELP = """\
Cityscapes (fine annotations, 19 classes) is needed. Register at
https://www.cityscapes-dataset.com/, download leftImg8bit_trainvaltest.zip and
gtFine_trainvaltest.zip (Downloads page) and unzip both into {root} so that it contains
    leftImg8bit/train/<city>/*_leftImg8bit.png, leftImg8bit/val/<city>/*_leftImg8bit.png
    gtFine/train/<city>/*_gtFine_labelTrainIds.png, gtFine/val/<city>/*_gtFine_labelTrainIds.png
The *_gtFine_labelTrainIds.png label maps are not in the download: make them from the
*_gtFine_polygons.json files with mmseg's tools/dataset_converters/cityscapes.py (needs
cityscapesscripts):
    pip install cityscapesscripts
    python {converter} {root} --nproc 8
(or link an existing copy there: ln -s /path/to/cityscapes {root})."""

_SHAPES_HELP = """\
This config uses the built-in shapes dataset (cfg.shapes_world). tools/train.py and tools/test.py
generate it automatically; to create it by hand run
    python tools/dataset_converters/make_shapes.py --config CONFIG"""


class DatasetNotFoundError(FileNotFoundError):
    """Raised by :func:`check_data` when files a config needs do not exist.

    ``str(error)`` is the full user-facing message. ``error.missing`` keeps the machine-readable
    list of ``(where, kind, path)`` tuples, for callers that want to react to specific paths.
    """

    def __init__(self, message: str, missing: List[Tuple[str, str, str]]):
        super().__init__(message)
        self.missing = missing

    def __str__(self) -> str:  # FileNotFoundError would prefix errno fields otherwise
        return self.args[0]


def _is_remote(path: str) -> bool:
    """Paths such as ``s3://bucket/coco`` live behind a file backend and cannot be checked."""
    return '://' in str(path)


def _join(root: str, path: str) -> str:
    """Join like mmengine's ``BaseDataset._join_prefix``: absolute paths and an empty root win."""
    if not root or osp.isabs(path) or _is_remote(path):
        return path
    return osp.join(root, path)


def _leaf_datasets(dataset_cfg) -> Iterable[dict]:
    """Yield the real datasets below wrappers (RepeatDataset, ConcatDataset, ClassBalanced...)."""
    if dataset_cfg is None:
        return
    if isinstance(dataset_cfg, (list, tuple)):
        for item in dataset_cfg:
            yield from _leaf_datasets(item)
        return
    if not isinstance(dataset_cfg, dict):
        return
    if 'datasets' in dataset_cfg:
        yield from _leaf_datasets(dataset_cfg['datasets'])
    elif isinstance(dataset_cfg.get('dataset'), dict):
        yield from _leaf_datasets(dataset_cfg['dataset'])
    else:
        yield dataset_cfg


def _type_name(dataset_cfg: dict) -> str:
    dataset_type = dataset_cfg.get('type')
    return str(getattr(dataset_type, '__name__', dataset_type))


def _label_maps_missing(dataset_cfg: dict, path: str) -> Optional[str]:
    """For Cityscapes, the annotation directory ``path`` (which exists) must hold label maps of the
    dataset's ``seg_map_suffix``: the download has only polygons and colour / id images, the
    ``*_gtFine_labelTrainIds.png`` files come from mmseg's converter. Returns the missing kind."""
    if _type_name(dataset_cfg) != 'CityscapesDataset':
        return None
    suffix = dataset_cfg.get('seg_map_suffix') or '_gtFine_labelTrainIds.png'
    if any(name.endswith(suffix) for _, _, names in os.walk(path) for name in names):
        return None
    return f'no label maps *{suffix} (run the conversion below)'


def _dataset_paths(dataset_cfg: dict) -> List[Tuple[str, str]]:
    """The ``(kind, path)`` pairs a dataset config will read, resolved against ``data_root``."""
    data_root = dataset_cfg.get('data_root') or ''
    paths = []
    ann_file = dataset_cfg.get('ann_file')
    if ann_file:
        paths.append(('annotation file', _join(data_root, ann_file)))
    prefixes = dataset_cfg.get('data_prefix') or {}
    if isinstance(prefixes, dict):
        for key, prefix in prefixes.items():
            if prefix is None:
                continue
            kind = 'annotation directory' if 'seg' in key or 'ann' in key else 'image directory'
            paths.append((kind, _join(data_root, prefix) if prefix else data_root))
    if not paths and data_root:
        paths.append(('data root', data_root))
    return paths


def _evaluator_paths(evaluator_cfg) -> List[Tuple[str, str]]:
    """Annotation files read directly by metrics (e.g. ``CocoMetric.ann_file``)."""
    cfgs = evaluator_cfg if isinstance(evaluator_cfg, (list, tuple)) else [evaluator_cfg]
    paths = []
    for cfg in cfgs:
        if isinstance(cfg, dict) and 'metrics' in cfg:  # Evaluator(metrics=[...])
            paths.extend(_evaluator_paths(cfg['metrics']))
        elif isinstance(cfg, dict) and cfg.get('ann_file'):
            paths.append(('annotation file', cfg['ann_file']))
    return paths


def _split_enabled(cfg, split: str) -> bool:
    """Mirror the Runner: a val/test loop only runs when loader, evaluator and loop cfg exist."""
    loader_key, evaluator_key, loop_key = _SPLITS[split]
    if cfg.get(loader_key) is None or cfg.get(loop_key) is None:
        return False
    return evaluator_key is None or cfg.get(evaluator_key) is not None


def find_missing_data(cfg, splits: Sequence[str] = ('train', 'val')) -> List[Tuple[str, str, str]]:
    """List the files and directories of ``splits`` that do not exist.

    Args:
        cfg (mmengine.Config | dict): The full config (after ``--cfg-options`` are merged).
        splits (Sequence[str]): Any of ``'train'``, ``'val'``, ``'test'``. Splits whose loop is
            disabled in the config (e.g. ``val_cfg=None``) are skipped, as the Runner skips them.

    Returns:
        list[tuple[str, str, str]]: ``(where, kind, path)`` for every missing path, where ``where``
        is the config key (``'train_dataloader'``, ``'val_evaluator'``...). Remote paths
        (``s3://...``) are not checked. Relative paths are relative to the current directory,
        which is also how mmengine resolves them.
    """
    missing, seen = [], set()
    for split in splits:
        if split not in _SPLITS:
            raise ValueError(f'Unknown split {split!r}; expected one of {sorted(_SPLITS)}')
        if not _split_enabled(cfg, split):
            continue
        loader_key, evaluator_key, _ = _SPLITS[split]
        checks = [(loader_key, kind, path)
                  for dataset in _leaf_datasets(cfg[loader_key].get('dataset'))
                  for kind, path in _dataset_paths(dataset)]
        if evaluator_key is not None:
            checks += [(evaluator_key, kind, path)
                       for kind, path in _evaluator_paths(cfg[evaluator_key])]
        datasets = {path: dataset for dataset in _leaf_datasets(cfg[loader_key].get('dataset'))
                    for _, path in _dataset_paths(dataset)}
        for where, kind, path in checks:
            if _is_remote(path) or path in seen:
                continue
            seen.add(path)
            if not osp.exists(path):
                missing.append((where, kind, path))
            elif kind == 'annotation directory' and path in datasets:
                no_labels = _label_maps_missing(datasets[path], path)
                if no_labels:
                    missing.append((where, no_labels, path))
    return missing


def _dataset_types(cfg, splits: Sequence[str]) -> List[str]:
    types = []
    for split in splits:
        if _split_enabled(cfg, split):
            for dataset in _leaf_datasets(cfg[_SPLITS[split][0]].get('dataset')):
                if _type_name(dataset) not in types:
                    types.append(_type_name(dataset))
    return types


def _first_data_root(cfg, splits: Sequence[str]) -> Optional[str]:
    for split in splits:
        if _split_enabled(cfg, split):
            for dataset in _leaf_datasets(cfg[_SPLITS[split][0]].get('dataset')):
                if dataset.get('data_root'):
                    return dataset['data_root']
    return None


def _override_hint(cfg, splits: Sequence[str], example_root: str) -> str:
    """The ``--cfg-options`` line that moves every checked path of ``splits`` elsewhere."""
    options, root = [], None
    for split in splits:
        if not _split_enabled(cfg, split):
            continue
        loader_key, evaluator_key, _ = _SPLITS[split]
        dataset = cfg[loader_key].get('dataset') or {}
        prefix = f'{loader_key}.dataset'
        while isinstance(dataset, dict) and isinstance(dataset.get('dataset'), dict):
            dataset, prefix = dataset['dataset'], prefix + '.dataset'
        if isinstance(dataset, dict) and dataset.get('data_root'):
            root = root or dataset['data_root']
            options.append(f'{prefix}.data_root={example_root}')
        evaluator = cfg[evaluator_key] if evaluator_key else None
        if isinstance(evaluator, dict) and evaluator.get('ann_file'):
            ann_file = evaluator['ann_file']
            if root and ann_file.startswith(root):
                ann_file = osp.join(example_root, ann_file[len(root):].lstrip('/'))
            else:
                ann_file = '/path/to/' + osp.basename(ann_file)
            options.append(f'{evaluator_key}.ann_file={ann_file}')
    if not options:
        return ''
    return ('To use data stored elsewhere, point the config at it, e.g.\n    --cfg-options ' +
            ' \\\n        '.join(options))


def _cityscapes_converter() -> str:
    """mmseg's Cityscapes converter: the copy pip installs with mmseg, else the repository path."""
    try:
        import mmseg
    except ImportError:
        mmseg = None
    if mmseg is not None:
        path = osp.join(osp.dirname(mmseg.__file__), '.mim', 'tools', 'dataset_converters',
                        'cityscapes.py')
        if osp.isfile(path):
            return path
    return 'mmsegmentation/tools/dataset_converters/cityscapes.py'


def check_data(cfg, splits: Sequence[str] = ('train', 'val'), config_name: str = None) -> None:
    """Raise :class:`DatasetNotFoundError` with download instructions if data is missing.

    The message names every missing path (absolute, so a wrong working directory is obvious),
    explains how to obtain the dataset the config uses (COCO 2017 for ``CocoDataset``, ADE20k
    ``ADEChallengeData2016`` for ``ADE20KDataset``, Cityscapes and its label-map conversion for
    ``CityscapesDataset``, the generator for the built-in shapes data)
    and gives the ``--cfg-options`` overrides that point the config at another location.

    Args:
        cfg (mmengine.Config | dict): The full config (after ``--cfg-options`` are merged).
        splits (Sequence[str]): The splits that will be used: ``('train', 'val')`` for training,
            ``('test',)`` for testing.
        config_name (str, optional): Shown in the message (e.g. the config path).

    Then checks that the COCO-format annotation files are COCO files
    (:func:`check_annotation_formats`).

    Raises:
        DatasetNotFoundError: If any path is missing.
        AnnotationFormatError: If a COCO annotation file is not one.
    """
    missing = find_missing_data(cfg, splits)
    if not missing:
        check_annotation_formats(cfg, splits)
        return
    lines = [f'Dataset not found{" for " + config_name if config_name else ""} '
             f'(working directory: {os.getcwd()}). Missing:']
    for where, kind, path in missing:
        lines.append(f'    {kind}: {osp.abspath(path)}   [{where}]')
    types = _dataset_types(cfg, splits)
    root = _first_data_root(cfg, splits)
    helps = []
    if cfg.get('shapes_world'):
        helps.append(_SHAPES_HELP)
    if 'CocoDataset' in types:
        helps.append(_COCO_HELP.format(root=(root or 'data/coco/').rstrip('/')))
    if 'ADE20KDataset' in types:
        ade_root = (root or 'data/ade/ADEChallengeData2016').rstrip('/')
        helps.append(_ADE_HELP.format(root=ade_root, parent=osp.dirname(ade_root) or '.'))
    if 'CityscapesDataset' in types:
        helps.append(_CITYSCAPES_HELP.format(root=(root or 'data/cityscapes/').rstrip('/'),
                                             converter=_cityscapes_converter()))
    if not helps:
        helps.append(f'Prepare the data of {", ".join(types) or "the dataset"} at the paths above.')
    example = {'CocoDataset': '/path/to/coco/',
               'ADE20KDataset': '/path/to/ADEChallengeData2016',
               'CityscapesDataset': '/path/to/cityscapes/'}.get(
                   types[0] if types else '', '/path/to/data')
    hint = _override_hint(cfg, splits, example)
    message = '\n'.join(lines + helps + ([hint] if hint else []))
    raise DatasetNotFoundError(message, missing)


class AnnotationFormatError(ValueError):
    """Raised by :func:`check_annotation_formats` for an annotation file of the wrong format.

    ``error.path`` is the file, ``error.where`` the config key that points at it.
    """

    def __init__(self, message: str, path: str, where: str):
        super().__init__(message)
        self.path = path
        self.where = where


COCO_KEYS = ('images', 'annotations', 'categories')
_COCO_METRICS = ('CocoMetric', )


def _is_coco_dataset(dataset_type, scope: Optional[str]) -> bool:
    """Whether a dataset type reads COCO-format json (mmdet ``CocoDataset`` or a subclass)."""
    name = getattr(dataset_type, '__name__', dataset_type)
    if not isinstance(name, str):
        return False
    if name == 'CocoDataset':
        return True
    if isinstance(dataset_type, type) or scope == 'mmdet':
        try:
            from mmdet.datasets import CocoDataset
            from mmdet.registry import DATASETS
        except ImportError:
            return False
        cls = dataset_type if isinstance(dataset_type, type) else DATASETS.get(name)
        return isinstance(cls, type) and issubclass(cls, CocoDataset)
    return False


def coco_annotation_problem(path: str, full_parse_limit: int = 64 << 20) -> Optional[str]:
    """Why ``path`` is not a COCO annotation file, or None if it looks like one.

    Files up to ``full_parse_limit`` bytes are parsed completely. Larger files (COCO's
    ``instances_train2017.json`` is 448 MB) are checked without parsing, in one streaming pass:
    the first and last non-blank characters must be ``{`` and ``}`` and the keys ``"images"``,
    ``"annotations"`` and ``"categories"`` must occur; this never rejects a valid file.

    Args:
        path (str): The annotation file.
        full_parse_limit (int): Size in bytes up to which the file is parsed with ``json``.

    Returns:
        str | None: A description of the problem (e.g. ``'it is a JSON list'``).
    """
    import json
    size = osp.getsize(path)
    if size == 0:
        return 'the file is empty'
    if size <= full_parse_limit:
        try:
            with open(path, 'rb') as f:
                data = json.loads(f.read())
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            return f'it is not valid JSON ({e})'
        if not isinstance(data, dict):
            return (f'it is a JSON {type(data).__name__.replace("dict", "object")}, not an '
                    f'object')
        missing = [key for key in COCO_KEYS if key not in data]
        if missing:
            return f'it has no {", ".join(repr(k) for k in missing)} (top-level keys: ' \
                   f'{sorted(data)[:10]})'
        wrong = [key for key in COCO_KEYS if not isinstance(data[key], list)]
        if wrong:
            return f'{", ".join(repr(k) for k in wrong)} must be lists'
        return None
    with open(path, 'rb') as f:
        head = f.read(1 << 16).lstrip()
        f.seek(max(0, size - 256))
        tail = f.read().rstrip()
        f.seek(0)
        keys = {key: ('"%s"' % key).encode() for key in COCO_KEYS}
        found, carry = set(), b''
        while len(found) < len(keys):
            chunk = f.read(1 << 24)
            if not chunk:
                break
            window = carry + chunk
            found.update(k for k, token in keys.items() if token in window)
            carry = window[-16:]
    if head[:1] == b'[':
        return 'it is a JSON list, not an object'
    if head[:1] != b'{':
        return f'it is not a JSON object (it starts with {head[:20]!r})'
    if tail[-1:] != b'}':
        return f'it does not end with "}}" (ends with {tail[-20:]!r}): the file is cut short'
    missing = [key for key in COCO_KEYS if key not in found]
    if missing:
        return f'it has no {", ".join(repr(k) for k in missing)}'
    return None


def _coco_annotation_files(cfg, splits: Sequence[str]) -> List[Tuple[str, str, str]]:
    """``(config key, path, config key of ann_file)`` of COCO-format annotation files."""
    scope = cfg.get('default_scope')
    files, seen = [], set()
    for split in splits:
        if not _split_enabled(cfg, split):
            continue
        loader_key, evaluator_key, _ = _SPLITS[split]
        for dataset in _leaf_datasets(cfg[loader_key].get('dataset')):
            if dataset.get('ann_file') and _is_coco_dataset(dataset.get('type'), scope):
                path = _join(dataset.get('data_root') or '', dataset['ann_file'])
                files.append((loader_key, path, 'dataset.ann_file'))
        if evaluator_key is not None:
            evaluators = cfg[evaluator_key]
            evaluators = evaluators if isinstance(evaluators, (list, tuple)) else [evaluators]
            for metric in evaluators:
                if isinstance(metric, dict) and metric.get('ann_file') and \
                        getattr(metric.get('type'), '__name__', metric.get('type')) \
                        in _COCO_METRICS:
                    files.append((evaluator_key, metric['ann_file'], 'ann_file'))
    unique = []
    for where, path, key in files:
        if path not in seen and not _is_remote(path) and osp.isfile(path):
            seen.add(path)
            unique.append((where, path, key))
    return unique


def check_annotation_formats(cfg, splits: Sequence[str] = ('train', 'val'),
                             full_parse_limit: int = 64 << 20) -> None:
    """Raise :class:`AnnotationFormatError` if a COCO annotation file is not a COCO file.

    Checks the ``ann_file`` of every COCO-format dataset (mmdet ``CocoDataset`` and its
    subclasses) and of every ``CocoMetric`` of ``splits``. Without this check, a JSON list or a
    file without ``images`` / ``annotations`` / ``categories`` fails inside pycocotools with an
    ``AssertionError`` or ``KeyError`` that does not name the file.

    Args:
        cfg (mmengine.Config | dict): The full config.
        splits (Sequence[str]): As for :func:`check_data`.
        full_parse_limit (int): See :func:`coco_annotation_problem`.

    Raises:
        AnnotationFormatError: For the first file that is not a COCO annotation file.
    """
    for where, path, key in _coco_annotation_files(cfg, splits):
        problem = coco_annotation_problem(path, full_parse_limit)
        if problem:
            raise AnnotationFormatError(
                f'Annotation file {osp.abspath(path)} [{where}.{key}] is not a COCO annotation '
                f'file: {problem}. The COCO format is a JSON object with "images", '
                f'"annotations" and "categories" lists (like annotations/instances_val2017.json). '
                f'Point {where}.{key} at a COCO file (--cfg-options {where}.{key}=PATH) or '
                f'convert your annotations to the COCO format.', path, f'{where}.{key}')
