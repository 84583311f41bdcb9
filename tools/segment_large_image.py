"""Segment a gigapixel image at full resolution, with the whole image's context, in bounded
memory: the image is read by windows of rows, the XCiT segmentor streams it
(``LeanEncoderDecoder.stream_labels``), and the labels are written band by band.

    python tools/segment_large_image.py CONFIG CHECKPOINT IMAGE --out LABELS.tif \\
        [--max-memory MB] [--device DEV] [--token-dir DIR] [--bands B [B ...]] \\
        [--scale MIN MAX [MIN MAX ...]] [--rgb-from {first3,gray}] [--scale-16bit [MAX]] \\
        [--cfg-options KEY=VALUE ...]

IMAGE: any raster GDAL reads (GeoTIFF, BigTIFF, COG, JPEG2000, a VRT mosaic, PNG / JPEG with a
world file, ...), or an OME-TIFF or slide TIFF (level 0, through tifffile), read by windows of
rows. Its nodata, alpha and mask bands mark the pixels without data, which get the labels'
nodata. LABELS.tif: a Cloud-Optimized GeoTIFF of class ids (uint8 up to 255 classes, else
uint16) with overviews, the dataset's palette as its colour table and its class names in
LABELS.tif.aux.xml, carrying the input's georeferencing and none of its band metadata, written
under a .partial name and renamed when complete. A problem with the input, the output or the budget
is one line on stderr (exit status 1; 130 when interrupted) and leaves no file behind. See
docs/gigapixel.md.
"""
import argparse
import errno
import math
import os.path as osp
import signal
import sys

_REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)
WRITER_TILE = 512  # the label COG's tiles
WRITER_CACHE_MB = 64  # GDAL's block cache for the writer, beside the reader's


def parse_args(argv=None):
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(
        description='Segment a gigapixel image at full resolution into a tiled label GeoTIFF')
    parser.add_argument('config', help='segmentation config (a LeanEncoderDecoder)')
    parser.add_argument('checkpoint', help='checkpoint file (path or URL)')
    parser.add_argument('image', help='input image: any raster GDAL reads (GeoTIFF, COG, '
                        'JPEG2000, VRT, PNG / JPEG, ...), or an OME-TIFF or slide TIFF')
    parser.add_argument('--out', required=True, help='output label file (.tif)')
    parser.add_argument('--max-memory', type=float, default=None, metavar='MB',
                        help='MB the reader and the segmentation may add; token maps that do not '
                        'fit go to disk')
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


def run(args) -> None:
    """Check the input and output, build the model, stream the labels into the file."""
    import torch
    from tqdm import tqdm

    from xcit_mm.apis.large_image import (LargeImageError, check_output, model_rows,
                                          open_image, write_label_rasters)
    from xcit_mm.apis.utils import read_config
    cfg = read_config(args.config, args.cfg_options)
    mean = (cfg.model.get('data_preprocessor') or {}).get('mean') or [0, 0, 0]
    check_output(args.out)
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise LargeImageError(f'--device {args.device}: no CUDA device here; use --device cpu')
    with open_image(args.image, args.max_memory) as source:
        check_output(args.out, source.files)
        read_rows = model_rows(source, len(mean), args.bands, args.scale, args.rgb_from,
                               args.scale_16bit)
        # GDAL's block cache is one per process: the reader's share and the writer's, both
        # left out of the model's budget with the writer's tile row
        height, width = source.height, source.width
        gdal_cache_mb = math.ceil(source.memory_mb) + WRITER_CACHE_MB
        writer_mb = gdal_cache_mb + WRITER_TILE * width * 2 / 2 ** 20
        budget = None if args.max_memory is None else args.max_memory - writer_mb
        if budget is not None and budget <= 0:
            raise LargeImageError(f'--max-memory {args.max_memory:g} MB does not cover the '
                                  f'reader and the writer ({writer_mb:.0f} MB), let alone the '
                                  'model: raise it')
        from mmengine.runner import load_checkpoint
        from mmseg.apis import init_model

        import xcit_mm  # noqa: F401  (LeanEncoderDecoder, safe checkpoint loading)
        from xcit_mm.models.utils import check_checkpoint
        from xcit_mm.models.utils.memory_budget import MemoryBudgetError
        # mmseg's init_model needs a checkpoint 'meta' (KeyError without one): weights loaded
        # here, the palette read by _palette
        model = init_model(cfg, None, device='cpu')
        checkpoint = load_checkpoint(model, check_checkpoint(args.checkpoint), map_location='cpu')
        meta = checkpoint.get('meta') if isinstance(checkpoint, dict) else None
        model.dataset_meta = (meta or {}).get('dataset_meta')
        model.to(device)
        if not hasattr(model, 'stream_labels'):
            raise LargeImageError(f'{type(model).__name__} cannot stream a large image; set '
                                  "model.type='LeanEncoderDecoder' in the config")
        num_classes = model.decode_head.num_classes
        hw = (height, width)
        bar = tqdm(desc=f'segmenting {osp.basename(args.image)} ({hw[0]} x {hw[1]})',
                   unit='band', disable=None, file=sys.stderr)

        def progress(done, total):
            bar.total, bar.n = total, done
            bar.refresh()

        def label_rows(rows):
            bar.set_postfix_str(f'label rows {rows}/{hw[0]}')

        nodata = None if read_rows.valid_rows is None else (
            lambda start, stop: ~read_rows.valid_rows(start, stop))
        try:
            with torch.no_grad():
                stream = model.stream_labels(read_rows, hw, max_memory=budget,
                                             token_dir=args.token_dir, progress=progress,
                                             valid_rows=read_rows.valid_rows)
                write_label_rasters(
                    args.out, stream, hw, num_classes,
                    palette=_dataset_meta(model, cfg, 'palette', num_classes),
                    class_names=_dataset_meta(model, cfg, 'classes', num_classes),
                    crs=source.crs, transform=source.transform, gcps=source.gcps,
                    nodata_mask=nodata, tile=WRITER_TILE, cache_mb=gdal_cache_mb,
                    on_rows=label_rows)
        except MemoryBudgetError as e:  # the model's share of the budget, told as the user's
            raise LargeImageError(f'{e} (the model\'s share of --max-memory {args.max_memory:g} '
                                  f'MB: the reader and the writer hold {writer_mb:.0f} MB)'
                                  ) from None
        finally:
            bar.close()


def main(argv=None) -> int:
    """Run the tool; a user's error is one line on stderr and a non-zero exit status."""
    args = parse_args(argv)
    from xcit_mm.apis.utils import error_line
    try:
        run(args)
    except KeyboardInterrupt:
        print(f'error: interrupted; no {args.out} written', file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError) as e:  # ours, the engine's (budget, memory)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            e = (f'no space left on the device ({e.filename or "token maps"}); free space or '
                 'choose another --out / --token-dir')
        print(error_line(e), file=sys.stderr)
        return 1
    print(f'labels written: {args.out}')
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # a batch system's SIGTERM cleans up as Ctrl-C does


if __name__ == '__main__':
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
