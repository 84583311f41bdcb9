"""Segment a gigapixel image at full resolution, with the whole image's context, in bounded
memory: the image is read by windows of rows, the XCiT segmentor streams it
(``LeanEncoderDecoder.stream_labels``), and the labels are written band by band.

    python tools/segment_large_image.py CONFIG CHECKPOINT IMAGE --out LABELS.tif \\
        [--confidence CONFIDENCE.tif] [--vector POLYGONS.gpkg [--min-area A] [--simplify T]] \\
        [--max-memory MB] [--device DEV] [--token-dir DIR] [--bands B [B ...]] \\
        [--scale MIN MAX [MIN MAX ...]] [--rgb-from {first3,gray}] [--scale-16bit [MAX]] \\
        [--include-nodata-tokens] [--cfg-options KEY=VALUE ...]
    python tools/segment_large_image.py DETECTOR_CONFIG CHECKPOINT IMAGE \\
        --out INSTANCES.{gpkg,fgb,geojson,json} [--score-thr T] [input and memory options]
    python tools/segment_large_image.py CONFIG CHECKPOINT 'tiles/*.tif' --out LABELS_DIR [...]
    torchrun --nproc-per-node N tools/segment_large_image.py ... --launcher pytorch

IMAGE: any raster GDAL reads (GeoTIFF, BigTIFF, COG, JPEG2000, a VRT mosaic, PNG / JPEG with a
world file, ...), or an OME-TIFF or slide TIFF (level 0, through tifffile), read by windows of
rows. Its nodata, alpha and mask bands mark the pixels without data, which get the outputs'
nodata. LABELS.tif: a Cloud-Optimized GeoTIFF of class ids (uint8 up to 255 classes, else
uint16) with overviews, the dataset's palette as its colour table and its class names in
LABELS.tif.aux.xml, carrying the input's georeferencing and none of its band metadata.
CONFIDENCE.tif: the top-1 softmax probability as uint8 (0-255) on the same grid. POLYGONS: the
labels as polygons (class id, class name, area) in the input's CRS, merged across the bands.

One pass over the stream feeds every output; none of them is held whole. Each output is written
under a .partial name and renamed when complete: the rasters first, then the polygons; if the
polygons then fail, the tool removes the rasters it has just renamed, so a failed run leaves none
of its outputs. A problem with the input, an output or the budget is one line on stderr (exit
status 1; 130 when interrupted). See docs/gigapixel.md.

With a detector's config (a LeanMaskRCNN: the config's model type decides), the same command
streams its instances (``LeanMaskRCNN.stream_instances``) into --out: polygons of the instances'
masks (fields class_id, class_name, score) in the input's CRS for .gpkg, .fgb or .geojson, or
COCO results (RLE masks, pixel coordinates) for .json; see docs/large_image_tool.md, Detectors.

Many scenes (several files, a folder or a pattern) go into output folders, one file per scene
named after it, those already written skipped. Under a launcher (torchrun, srun) the processes
stream one scene together, each a slab of its rows, the first writing the outputs, or share many
scenes out; see docs/large_image_tool.md and docs/sharded_stream.md.
"""
import argparse
import copy
import errno
import math
import os
import os.path as osp
import signal
import sys

_REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)
MB = 2 ** 20
GEO_INSTALL = 'pip install xcit_mm[geo]'
# What the reader and the outputs hold beside the model, left out of its share of --max-memory
# (MB; _memory_shares adds them up):
WRITER_TILE = 512  # the COGs' tiles: the writer fills one row of tiles (512 rows x W) per raster
WRITER_CACHE_MB = 64  # GDAL's block cache for the writer's tiles and overviews, beyond the reader's
COG_COPY_MB = 50  # GDAL's COG driver copying the tiles into the COG with its overviews
# The polygons (PolygonWriter): up to 16 MB of complete polygons queued between writes, and
# their arrays while written; GDAL's polygons of one slice of a band (a quarter megapixel) as
# Python lists; the open polygons (those reaching the latest band's last row). That is a few
# MB for ordinary labels; labels that change class at most pixels take more, and the open
# polygons are not bounded at all: a class spanning the scene keeps its vertices, and those of
# the holes in it, until its last row.
POLYGONS_MB = 64
# A detector's instances (InstanceWriter): up to 16 MB of features between writes, 16 MB of the
# valid-pixel mask's rows, and the masks of one row of cores over their boxes.
INSTANCES_MB = 64
# Instances scored below this are not written (--score-thr): mmdet's demo / DetInferencer
# threshold. The configs' test_cfg.rcnn.score_thr (0.05) keeps low scores for COCO's AP.
SCORE_THR = 0.3
# The options that apply to one kind of model only.
SEGMENTATION_ONLY = ('--confidence', '--vector', '--min-area', '--simplify')


def parse_args(argv=None):
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(
        description='Segment a gigapixel image at full resolution into a Cloud-Optimized '
        'GeoTIFF of labels, and optionally its confidence and polygons')
    parser.add_argument('config', help='segmentation config (a LeanEncoderDecoder) or '
                        'detection config (a LeanMaskRCNN)')
    parser.add_argument('checkpoint', help='checkpoint file (path or URL)')
    parser.add_argument('image', nargs='+', help='input image: any raster GDAL reads (GeoTIFF, '
                        'COG, JPEG2000, VRT, PNG / JPEG, ...), or an OME-TIFF or slide TIFF. '
                        "Many scenes: several files, a folder or a quoted pattern ('tiles/*.tif'),"
                        ' each into its own outputs in the --out (--confidence, --vector) '
                        'folders, those already written skipped')
    parser.add_argument('--out', required=True, metavar='LABELS.tif',
                        help='output labels: a Cloud-Optimized GeoTIFF of class ids. For a '
                        "detector, its instances: the masks' polygons (.gpkg, .fgb, .geojson) "
                        'or COCO results (.json). Many scenes: a folder (SCENE.tif; a '
                        "detector's SCENE.gpkg)")
    parser.add_argument('--confidence', default=None, metavar='PATH',
                        help='also write the top-1 softmax probability as uint8 (0-255, 0 where '
                        'there is no data) on the labels\' grid, a Cloud-Optimized GeoTIFF')
    parser.add_argument('--vector', default=None, metavar='PATH',
                        help='also write the labels as polygons (fields class_id, class_name, '
                        'area) in the input\'s CRS: .gpkg, .fgb or .geojson')
    parser.add_argument('--min-area', type=float, default=None, metavar='A',
                        help='with --vector: drop polygons smaller than A, in the CRS\'s units '
                        '(square metres for a projected CRS, square degrees for a geographic '
                        'one, pixels without a CRS)')
    parser.add_argument('--simplify', type=float, default=None, metavar='T',
                        help='with --vector: simplify each polygon on its own with tolerance T, '
                        'in the CRS\'s units (metres for a projected CRS, pixels without a '
                        'CRS); neighbours may then overlap or part slightly along shared edges')
    parser.add_argument('--score-thr', type=float, default=None, metavar='T',
                        help=f'detectors only: write the instances scored at least T (default '
                        f'{SCORE_THR}, the threshold of mmdet\'s demo: the config\'s own '
                        'test_cfg.rcnn.score_thr, 0.05, keeps the low scores COCO\'s AP needs, '
                        'which would crowd a map with false detections; 0 writes them all)')
    parser.add_argument('--max-memory', type=float, default=None, metavar='MB',
                        help='MB the reader, the writers and the segmentation may add; token '
                        'maps that do not fit go to disk. With --vector, an object spanning '
                        'many rows is held until its last row, outside this bound')
    parser.add_argument('--device', default='cpu', help='torch device, e.g. cpu or cuda:0')
    parser.add_argument('--token-dir', default=None, metavar='DIR',
                        help='folder for the disk-backed token maps (default: the system temp '
                        'folder)')
    parser.add_argument('--bands', type=int, nargs='+', default=None, metavar='B',
                        help="the input's bands (1-based, as GDAL numbers them) the model takes "
                        'as R, G, B, e.g. --bands 4 3 2')
    parser.add_argument('--scale', type=float, nargs='+', default=None, metavar='MIN MAX',
                        help='scale the bands linearly, MIN to 0 and MAX to 255, clipped: one '
                        'pair for all bands or one per band (e.g. --scale 0 3000 for '
                        'reflectances); needed for pixels other than 8-bit')
    parser.add_argument('--rgb-from', choices=['first3', 'gray'], default=None,
                        help='shortcut for --bands: first3 = bands 1-3 (RGBA, RGB + NIR); '
                        'gray = band 1 as R, G and B')
    parser.add_argument('--scale-16bit', type=float, nargs='?', const=65535.0, default=None,
                        metavar='MAX', help='shortcut for --scale 0 MAX on a 16-bit image '
                        '(MAX default 65535)')
    parser.add_argument('--include-nodata-tokens', action='store_true',
                        help='let the tokens of pixels without data (nodata, alpha, mask) into '
                        "XCA's sums over the whole image (and UperNet's pooling), as segmenting "
                        "the whole image with mmseg's inference_model does. By default they are "
                        'left out, so that the labels of the data do not depend on the size of a '
                        'nodata collar. '
                        'No effect on an image without nodata, alpha or mask')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='one scene streamed by several processes (torchrun '
                        '--nproc-per-node N ... --launcher pytorch, or srun ... --launcher '
                        'slurm): each streams a slab of rows, the first writes the outputs '
                        '(segmentation configs)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                        metavar='KEY=VALUE', help='override config settings, e.g. '
                        'model.test_cfg.mode=stream model.test_cfg.band_mb=64 (bands of 64 MB)')
    return parser.parse_args(argv)


def _dataset_meta(model, cfg, key: str, num_classes: int):
    """The checkpoint's ``key`` ('palette' or 'classes'), else the config's test dataset's,
    where it covers every class; else None (grey labels, or classes without names)."""
    value = (getattr(model, 'dataset_meta', None) or {}).get(key)
    if value is None or len(value) < num_classes:
        try:
            from mmseg.registry import DATASETS
            value = DATASETS.get(cfg.test_dataloader.dataset.type).METAINFO.get(key)
        except (AttributeError, KeyError, TypeError):
            return None
    return list(value[:num_classes]) if value is not None and len(value) >= num_classes else None


def _outputs(args) -> dict:
    """The outputs asked for, by option."""
    return {option: path for option, path in (('--out', args.out),
                                              ('--confidence', args.confidence),
                                              ('--vector', args.vector)) if path is not None}


def check_outputs(args, inputs=()) -> None:
    """Fail before any work on options that do not go together, or on an output that cannot be
    written: its folder missing, a folder itself, a file the input reads (``inputs``: also
    through a link or another relative path) or the path of another output."""
    from xcit_mm.apis.large_image import LargeImageError, check_output, check_vector_output
    if args.vector is None:
        for option, value in (('--min-area', args.min_area), ('--simplify', args.simplify)):
            if value:
                raise LargeImageError(f'{option} applies to the polygons: give --vector PATH '
                                      f'too, or drop {option}')
    if args.vector is not None:
        check_vector_output(args.vector)
    taken = [('a file the input reads', path) for path in inputs]
    for option, path in _outputs(args).items():
        check_output(path, option, taken)
        taken.append((f'the path of {option}', path))


def _memory_shares(source, width: int, num_classes: int, args) -> dict:
    """MB of --max-memory that the reader, the raster writer and the polygons hold (the model
    gets the rest), and GDAL's block cache (one per process: the reader's and the writer's)."""
    label_bytes = 1 if num_classes <= 255 else 2  # uint8 labels up to 255 classes, else uint16
    # the row of tiles being filled: the labels', and the confidence's (uint8) when written
    tile_rows = WRITER_TILE * width * (label_bytes + (args.confidence is not None)) / MB
    shares = dict(reader=math.ceil(source.memory_mb),  # its block cache (or tifffile's rows)
                  writer=WRITER_CACHE_MB + COG_COPY_MB + tile_rows,
                  polygons=POLYGONS_MB if args.vector is not None else 0)
    return dict(shares, cache_mb=shares['reader'] + WRITER_CACHE_MB)


def _model_budget(args, shares: dict, writers: str):
    """The model's share of --max-memory (None without one): what is left once the reader and
    ``writers`` hold their ``shares`` (MB), and those shares in words; an error naming the fix
    when nothing is left."""
    from xcit_mm.apis.large_image import LargeImageError
    held_text = ', '.join(f'{k} {v:.0f}' for k, v in shares.items() if v) + ' MB'
    budget = None if args.max_memory is None else args.max_memory - sum(shares.values())
    if budget is not None and budget <= 0:
        raise LargeImageError(f'--max-memory {args.max_memory:g} MB does not cover the reader '
                              f'and {writers} ({held_text}), let alone the model: raise it')
    return budget, held_text


class _StreamProgress:
    """The stream's two stages on one tqdm bar, each counting its own unit from 0 to its total
    (see ``stage_reporter``): the trunk's layers over the token rows, whose rate gives the time
    left of the trunk, then the label rows (a detector's: its cores); the bar starts again at
    each stage so that its rate and time left are of that stage's work."""

    STAGES = {'trunk': ('trunk (token rows x layers)', 'row-layer'), 'labels': ('labels', 'row'),
              'cores': ('cores', 'core')}

    def __init__(self, bar, name: str, last_step: str = 'writing the overviews'):
        self.bar, self.name, self.stage, self.last_step = bar, name, None, last_step

    def __call__(self, done: int, total: int, stage: str) -> None:
        if stage != self.stage:
            self.stage = stage
            description, self.bar.unit = self.STAGES[stage]
            self.bar.set_description_str(f'{self.name}: {description}', refresh=False)
            self.bar.reset(total)
        self.bar.n = done
        self.bar.refresh()

    def writing(self) -> None:
        """The labels are made: the writer makes the overviews (``last_step``)."""
        self.bar.set_description_str(f'{self.name}: {self.last_step}')


def _feed(stream, polygons, valid_rows, masks: dict, progress: _StreamProgress):
    """The stream's bands on to the raster writer, each band's labels given to the polygons
    first; the band's pixels without data read once (``masks``) for both. The stream is closed
    when the writer stops, so that its token maps go at once, not when collected."""
    try:
        for band in stream:
            start, stop, labels = band[:3]
            masks.clear()
            masks[start, stop] = None if valid_rows is None else ~valid_rows(start, stop)
            if polygons is not None:
                polygons.add_band(start, labels, nodata_mask=masks[start, stop])
            yield band
        progress.writing()
    finally:
        stream.close()


def _remove(paths) -> None:
    for path in paths:
        if osp.lexists(path):
            os.remove(path)


def _check_geo_packages(vector: bool, more=()) -> None:
    """The packages of setup.py's ``geo`` extra that the run needs, before any work: rasterio
    reads and writes the rasters, tifffile and imagecodecs read slide and OME-TIFF tiles,
    pyogrio and shapely make the polygons; ``more``: others (a detector's pycocotools)."""
    import importlib
    for name in (['rasterio', 'tifffile', 'imagecodecs'] + ['pyogrio', 'shapely'] * vector
                 + list(more)):
        try:
            importlib.import_module(name)
        except ImportError:
            raise RuntimeError(f'{name} is not installed; {GEO_INSTALL}') from None


def run(args) -> None:
    """Read the config; a detector's instances (:func:`detect`) or a segmentor's labels
    (:func:`segment`), each refusing the options of the other."""
    from xcit_mm.apis.large_image import LargeImageError
    from xcit_mm.apis.utils import config_task, read_config
    from xcit_mm.apis.large_image.scenes import is_many, list_scenes
    cfg = read_config(args.config, args.cfg_options)
    detector = config_task(cfg) == 'det'
    args.many = is_many(args.image)
    if args.many:
        scenes = list_scenes(args.image)
    else:
        args.image = args.image[0]
    if not detector and args.score_thr is not None:
        raise LargeImageError(f'--score-thr applies to detectors; {args.config} is a '
                              f'segmentation config ({cfg.model.type}): drop --score-thr')
    task = detect if detector else segment
    if args.launcher == 'none':
        return run_many(args, cfg, scenes, task) if args.many else task(args, cfg)
    import torch.distributed as dist

    from training_extras.dist_utils import distributed_session, lost_peer_message
    with distributed_session(cfg, args.launcher):
        args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
        try:
            return run_many(args, cfg, scenes, task) if args.many else task(args, cfg)
        except RuntimeError as e:  # gloo's words for a rank gone, told as such in main
            args.peer_lost = lost_peer_message(e) is not None
            raise


def run_many(args, cfg, scenes, task) -> None:
    """Each scene into its own outputs (named after it in the output folders), those already
    written skipped; a scene that fails is a line of the summary and the others go on. Under a
    launcher the scenes are shared out to the ranks, each scene whole on one rank; a scene whose
    stream does not fit --max-memory in one process is then streamed by all the ranks together,
    after the others (a failure there stops the run: the ranks' exchanges cannot go on without
    it). The summary, printed by the first rank, ends in an error if any scene failed."""
    import time

    from xcit_mm.apis.large_image import LargeImageError
    from xcit_mm.apis.large_image.scenes import (SceneResult, output_folder, scene_name,
                                                 summary)
    from xcit_mm.apis.utils import error_line
    start, detector = time.time(), task is detect
    folders = {option: output_folder(path, option) for option, path in _outputs(args).items()}
    rank, world_size = getattr(args, 'rank', 0), getattr(args, 'world_size', 1)
    models = []  # built for the first scene that runs

    def scene_args(scene: str, sharded: bool):
        name = scene_name(scene)
        one = copy.copy(args)
        one.image, one.many = scene, False
        one.launcher = args.launcher if sharded else 'none'
        one.out = osp.join(folders['--out'], name + ('.gpkg' if detector else '.tif'))
        one.confidence = args.confidence and osp.join(folders['--confidence'], name + '.tif')
        one.vector = args.vector and osp.join(folders['--vector'], name + '.gpkg')
        return one

    def run_scene(scene: str, sharded: bool = False) -> SceneResult:
        one = scene_args(scene, sharded)
        if all(osp.exists(path) for path in _outputs(one).values()):
            return SceneResult(scene, 'skipped')
        if not models:
            models.append((_build_detector if detector else _build_segmentor)(cfg, args))
        began = time.time()
        try:
            height, width = task(one, cfg, models[0])
        except (OSError, ValueError, RuntimeError) as e:
            over_budget = getattr(e, 'over_budget', False)  # found before any work or exchange
            if sharded and not over_budget:
                raise
            if world_size > 1 and over_budget and not sharded:
                return SceneResult(scene, 'deferred')
            return SceneResult(scene, 'failed', reason=error_line(e)[len('error: '):])
        return SceneResult(scene, 'written', height * width, time.time() - began)

    from tqdm import tqdm
    mine = scenes[rank::world_size]
    where = f' on rank {rank} of {world_size}' if world_size > 1 else ''
    bar = tqdm(mine, desc=f'scenes{where}', unit='scene', disable=None, file=sys.stderr)
    results = [run_scene(scene) for scene in bar]
    if world_size > 1:
        results = [result for part in _gathered(results) for result in part]
    deferred = [r.scene for r in results if r.status == 'deferred']
    results = [r for r in results if r.status != 'deferred']
    results += [run_scene(scene, sharded=True) for scene in deferred]
    order = {scene: i for i, scene in enumerate(scenes)}
    results.sort(key=lambda r: order[r.scene])
    if rank == 0:
        print('\n'.join(summary(results, time.time() - start)))
    failed = sum(r.status == 'failed' for r in results)
    if failed and rank == 0:
        raise LargeImageError(f'{failed} of {len(scenes)} scenes failed (see the lines above); '
                              'a rerun skips the scenes written')


def _build_segmentor(cfg, args):
    """The config's segmentor with the checkpoint's weights (checked, safely loaded) and its
    ``dataset_meta``, on ``--device``, in eval mode."""
    import torch
    from mmengine.runner import load_checkpoint
    from mmseg.apis import init_model

    import xcit_mm  # noqa: F401  (LeanEncoderDecoder, safe checkpoint loading)
    from xcit_mm.models.utils import check_checkpoint
    # mmseg's init_model needs a checkpoint 'meta' (KeyError without one): weights loaded
    # here, the palette and class names read by _dataset_meta
    model = init_model(cfg, None, device='cpu')
    checkpoint = load_checkpoint(model, check_checkpoint(args.checkpoint), map_location='cpu')
    meta = checkpoint.get('meta') if isinstance(checkpoint, dict) else None
    model.dataset_meta = (meta or {}).get('dataset_meta')
    return model.to(torch.device(args.device))


def segment(args, cfg, model=None):
    """Check the input and outputs, build the model (unless given), stream the labels into the
    outputs; return the scene's (height, width)."""
    _check_geo_packages(args.vector is not None)
    import torch
    from tqdm import tqdm

    from xcit_mm.apis.large_image import (LargeImageError, PolygonWriter, model_rows,
                                          open_image, write_label_rasters)
    mean = (cfg.model.get('data_preprocessor') or {}).get('mean') or [0, 0, 0]
    check_outputs(args)
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise LargeImageError(f'--device {args.device}: no CUDA device here; use --device cpu')
    with open_image(args.image, args.max_memory) as source:
        check_outputs(args, source.files)
        if args.vector is not None and source.gcps:
            raise LargeImageError(
                f'--vector: {args.image} is placed by ground control points, not by a '
                'geotransform, so the polygons cannot be put in its CRS; warp it first (e.g. '
                'gdalwarp -r near IN OUT.tif) or drop --vector')
        read_rows = model_rows(source, len(mean), args.bands, args.scale, args.rgb_from,
                               args.scale_16bit)
        height, width = hw = source.height, source.width
        shares = _memory_shares(source, width, cfg.model.decode_head.num_classes, args)
        budget, held_text = _model_budget(args, {k: v for k, v in shares.items()
                                                 if k != 'cache_mb'}, 'the writers')
        from xcit_mm.models.utils.memory_budget import MemoryBudgetError
        model = model or _build_segmentor(cfg, args)
        if not hasattr(model, 'stream_labels'):
            raise LargeImageError(f'{type(model).__name__} cannot stream a large image; set '
                                  "model.type='LeanEncoderDecoder' in the config")
        num_classes = model.decode_head.num_classes
        class_names = _dataset_meta(model, cfg, 'classes', num_classes)
        valid_rows = read_rows.valid_rows
        stream_kwargs = dict(max_memory=budget, token_dir=args.token_dir,
                             confidence=args.confidence is not None, valid_rows=valid_rows,
                             mask_xca=not args.include_nodata_tokens)
        slabs = None
        if args.launcher != 'none':
            from xcit_mm.apis.large_image.slabs import SlabFiles
            stream_kwargs['shard'] = shard = _open_shard(args.out)
            slabs = SlabFiles(args.out, shard.rank, shard.world_size, width, num_classes,
                              args.confidence is not None)
            if shard.rank > 0:  # a slab of labels for the first rank, which writes the outputs
                _keep_share(lambda: model.stream_labels(read_rows, hw, **stream_kwargs), slabs)
                return hw
        masks = {}  # the current band's pixels without data, for the writer and the polygons
        rasters = [p for p in (args.out, args.confidence) if p is not None]
        polygons = None
        name = f'{osp.basename(args.image)} ({height} x {width})'
        bar = tqdm(desc=name, disable=None, file=sys.stderr)
        progress = _StreamProgress(bar, name)
        try:
            if args.vector is not None:  # without class names, class_name is the class id
                polygons = PolygonWriter(
                    args.vector, class_names or [str(i) for i in range(num_classes)],
                    crs=source.crs, transform=source.transform,
                    min_area=args.min_area or 0.0, simplify=args.simplify or 0.0, height=height)
            with torch.no_grad():
                stream = model.stream_labels(read_rows, hw, progress=progress, **stream_kwargs)
                if slabs is not None:
                    stream = _with_other_shares(stream, slabs)
                write_label_rasters(
                    args.out, _feed(stream, polygons, valid_rows, masks, progress), hw, num_classes,
                    palette=_dataset_meta(model, cfg, 'palette', num_classes),
                    class_names=class_names, crs=source.crs, transform=source.transform,
                    gcps=source.gcps, confidence_out=args.confidence,
                    nodata_mask=None if valid_rows is None else lambda a, b: masks[a, b],
                    tile=WRITER_TILE, cache_mb=shares['cache_mb'])
            try:  # the rasters are renamed: the polygons last, the rasters removed if they fail
                if polygons is not None:
                    polygons.close()
            except BaseException:
                _remove(rasters + [p + '.aux.xml' for p in rasters])
                raise
        except MemoryBudgetError as e:  # the model's share of the budget, told as the user's
            error = LargeImageError(f'{e} (the model\'s share of --max-memory '
                                    f'{args.max_memory:g} MB: the reader and the writers hold '
                                    f'{held_text})')
            error.over_budget = True  # (several ranks may stream it together)
            raise error from None
        finally:
            if polygons is not None:
                polygons.abort()  # nothing left to do after a close; the partial file otherwise
            if slabs is not None:
                slabs.remove()  # read and removed after a success; left by a failure
            bar.close()
    return hw


def _open_shard(out: str):
    """This rank's share of the scene (``sharding.Shard``), once the ranks have checked that
    they all see one folder beside ``out``: the first rank reads the others' files from it."""
    from xcit_mm.apis.large_image.slabs import check_folder_shared
    from xcit_mm.models.inference.sharding import Shard
    shard = Shard()
    check_folder_shared(out, shard.rank, shard.world_size, _gathered)
    return shard


def _gathered(value) -> list:
    """Every rank's ``value``, in rank order (a collective: it waits for the slowest rank)."""
    import torch.distributed as dist
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _keep_share(make_stream, files) -> None:
    """A rank after the first: its share of the scene (``make_stream()``: a segmentor's bands, a
    detector's rows of cores) into its files (``slabs.SlabFiles``, ``slabs.CoreRowFiles``), then
    what it kept told, once every rank has kept its own; the files removed if it fails."""
    import torch
    try:
        with torch.no_grad():
            stream = make_stream()
            try:
                files.keep(stream)
            finally:
                stream.close()
    except BaseException:
        files.remove()
        raise
    _gathered(files.told())


def _with_other_shares(stream, files):
    """The first rank's share as it streams, then, once every rank has kept its own, the other
    ranks' read back from their files, so that the writers get the whole scene in order, as from
    one process."""
    try:
        for item in stream:
            files.note(item)
            yield item
    finally:
        stream.close()
    yield from files.others(_gathered(files.told()))


def _detector_meta(model, cfg, num_classes: int):
    """The class names: the checkpoint's ``dataset_meta``, else the config's test dataset's, where
    they cover every class; else the class ids as names."""
    names = (getattr(model, 'dataset_meta', None) or {}).get('classes')
    if names is None or len(names) < num_classes:
        try:
            from mmdet.registry import DATASETS
            names = DATASETS.get(cfg.test_dataloader.dataset.type).METAINFO.get('classes')
        except (AttributeError, KeyError, TypeError):
            names = None
    if names is None or len(names) < num_classes:
        return [str(i) for i in range(num_classes)]
    return [str(name) for name in names[:num_classes]]


def _build_detector(cfg, args):
    """The config's detector with the checkpoint's weights (checked, safely loaded) and its
    ``dataset_meta``, on ``--device``, in eval mode. Built as mmdet's ``init_detector`` builds it,
    without its warnings on stderr (the one-line contract) and without the pretrained weights
    the config's backbone names."""
    import torch
    from mmengine.model.utils import revert_sync_batchnorm
    from mmengine.registry import init_default_scope
    from mmengine.runner import load_checkpoint
    from mmdet.registry import MODELS

    import xcit_mm  # noqa: F401  (LeanMaskRCNN, safe checkpoint loading)
    from xcit_mm.models.utils import check_checkpoint
    init_default_scope(cfg.get('default_scope', 'mmdet') or 'mmdet')
    model_cfg = copy.deepcopy(cfg.model)
    if 'init_cfg' in model_cfg.get('backbone', {}):
        model_cfg.backbone.init_cfg = None  # the checkpoint holds the backbone's weights
    model = revert_sync_batchnorm(MODELS.build(model_cfg))
    loaded = load_checkpoint(model, check_checkpoint(args.checkpoint), map_location='cpu')
    meta = loaded.get('meta') if isinstance(loaded, dict) else None
    model.dataset_meta = {k.lower(): v for k, v in ((meta or {}).get('dataset_meta') or {}).items()}
    model.cfg = cfg
    return model.to(torch.device(args.device)).eval()


def detect(args, cfg, model=None):
    """A detector's instances (``LeanMaskRCNN.stream_instances``) into ``--out``: the same input
    as the labels (bands, scaling, nodata, memory), an :class:`InstanceWriter` as output; the
    model built unless given. Returns the scene's (height, width)."""
    from xcit_mm.apis.large_image import LargeImageError
    from xcit_mm.apis.large_image.instances import InstanceWriter, check_instances_output
    given = dict(zip(SEGMENTATION_ONLY, (args.confidence, args.vector, args.min_area,
                                         args.simplify)))
    for option, value in given.items():
        if value is not None:
            raise LargeImageError(
                f'{option} applies to segmentation; {args.config} is a detector '
                f'({cfg.model.type}), whose instances go to --out (.gpkg, .fgb, .geojson or '
                f'.json): drop {option}')
    score_thr = SCORE_THR if args.score_thr is None else args.score_thr
    if not 0 <= score_thr <= 1:
        raise LargeImageError(f'--score-thr {score_thr:g}: give a score from 0 to 1')
    fmt = check_instances_output(args.out)
    _check_geo_packages(fmt != 'COCO', ['pycocotools'] if fmt == 'COCO' else [])
    import torch
    from tqdm import tqdm

    from xcit_mm.apis.large_image import model_rows, open_image
    mean = (cfg.model.get('data_preprocessor') or {}).get('mean') or [0, 0, 0]
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise LargeImageError(f'--device {args.device}: no CUDA device here; use --device cpu')
    with open_image(args.image, args.max_memory) as source:
        check_instances_output(args.out, '--out', [('a file the input reads', path)
                                                   for path in source.files])
        if fmt != 'COCO' and source.gcps and source.transform is None:
            raise LargeImageError(
                f'--out {args.out}: {args.image} is placed by ground control points, not by a '
                'geotransform, so the polygons cannot be put in its CRS; warp it first (e.g. '
                'gdalwarp -r near IN OUT.tif) or write COCO results in pixels (--out NAME.json)')
        read_rows = model_rows(source, len(mean), args.bands, args.scale, args.rgb_from,
                               args.scale_16bit)
        height, width = hw = source.height, source.width
        budget, held_text = _model_budget(
            args, dict(reader=math.ceil(source.memory_mb), instances=INSTANCES_MB), 'the writer')
        from xcit_mm.models.utils.memory_budget import MemoryBudgetError
        model = model or _build_detector(cfg, args)
        if not hasattr(model, 'stream_instances'):
            raise LargeImageError(f'{type(model).__name__} cannot stream a large image; set '
                                  "model.type='LeanMaskRCNN' in the config")
        num_classes = model.roi_head.bbox_head.num_classes
        rcnn_cfg = (model.test_cfg or {}).get('rcnn') or {}
        valid_rows = read_rows.valid_rows
        # the tokens of pixels without data left out of XCA's sums unless asked for; the masks
        # lose those pixels either way
        stream_kwargs = dict(max_memory=budget, token_dir=args.token_dir,
                             valid_rows=None if args.include_nodata_tokens else valid_rows)
        rows_files = None
        if args.launcher != 'none':
            from xcit_mm.apis.large_image.slabs import CoreRowFiles
            stream_kwargs['shard'] = shard = _open_shard(args.out)
            rows_files = CoreRowFiles(args.out, shard.rank, shard.world_size)
            if shard.rank > 0:  # its rows of cores for the first rank, which merges and writes
                _keep_share(lambda: model.stream_instances(read_rows, hw, **stream_kwargs),
                            rows_files)
                return hw
        name = f'{osp.basename(args.image)} ({height} x {width})'
        bar = tqdm(desc=name, disable=None, file=sys.stderr)
        progress = _StreamProgress(bar, name, last_step='writing the file')
        writer = None
        try:
            writer = InstanceWriter(args.out, _detector_meta(model, cfg, num_classes), hw,
                                    crs=source.crs, transform=source.transform,
                                    score_thr=score_thr,
                                    mask_threshold=rcnn_cfg.get('mask_thr_binary', 0.5),
                                    valid_rows=valid_rows)
            with torch.no_grad():
                stream = model.stream_instances(read_rows, hw, progress=progress,
                                                **stream_kwargs)
                try:
                    instances = stream if rows_files is None else model.merge_core_rows(
                        _with_other_shares(stream, rows_files))
                    for part in instances:
                        writer.add(part)
                finally:
                    stream.close()  # its token maps go at once, not when collected
            progress.writing()
            writer.close()
        except MemoryBudgetError as e:  # the model's share of the budget, told as the user's
            error = LargeImageError(f'{e} (the model\'s share of --max-memory '
                                    f'{args.max_memory:g} MB: the reader and the writer hold '
                                    f'{held_text})')
            error.over_budget = True  # (several ranks may stream it together)
            raise error from None
        finally:
            if writer is not None:
                writer.abort()  # nothing left to do after a close; the partial file otherwise
            if rows_files is not None:
                rows_files.remove()  # read and removed after a success; left by a failure
            bar.close()
    return hw


def main(argv=None) -> int:
    """Run the tool; a user's error is one line on stderr and a non-zero exit status."""
    args = parse_args(argv)
    from xcit_mm.apis.utils import error_line
    try:
        run(args)
    except KeyboardInterrupt:
        print('error: interrupted; no output written', file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError) as e:  # ours, the engine's (budget, memory)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            e = (f'no space left on the device ({e.filename or "token maps"}); free space or '
                 'choose another --out / --token-dir')
        line = error_line(e)
        if getattr(args, 'world_size', 1) > 1:  # which process of a sharded run failed
            rank = f'rank {args.rank} of {args.world_size}'
            if getattr(args, 'peer_lost', False):  # the failure is another rank's
                line = (f'error: {rank}: stopped, another rank has stopped (its own error line '
                        'names it); no output written')
            else:
                line = line.replace('error: ', f'error: {rank}: ', 1)
        print(line, file=sys.stderr)
        return 1
    if getattr(args, 'rank', 0) == 0 and not getattr(args, 'many', False):  # else a summary
        print('written: ' + ', '.join(_outputs(args).values()))
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # a batch system's SIGTERM cleans up as Ctrl-C does


if __name__ == '__main__':
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
