"""Segment a gigapixel image at full resolution, with the whole image's context, in bounded
memory: the image is read by windows of rows, the XCiT segmentor streams it
(``LeanEncoderDecoder.stream_labels``), and the labels are written band by band.

    python tools/segment_large_image.py CONFIG CHECKPOINT IMAGE --out LABELS.tif \\
        [--max-memory MB] [--device DEV] [--token-dir DIR] [--rgb-from {first3,gray}] \\
        [--scale-16bit [MAX]]

IMAGE: a TIFF (tiled or striped, BigTIFF, OME-TIFF, GeoTIFF; deflate, LZW, JPEG, ... tiles),
read tile by tile, or any file mmcv reads (PNG, JPEG: read whole). LABELS.tif: a tiled, deflate
BigTIFF of class ids (uint8 up to 255 classes, else uint16) with the dataset's palette as its
colour map and the input's georeferencing, written as LABELS.tif.partial and renamed when
complete. A problem with the input, the output or the budget is one line on stderr (exit status
1; 130 when interrupted) and leaves no file behind. See docs/gigapixel.md.
"""
import argparse
import errno
import os.path as osp
import signal
import sys

_REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Segment a gigapixel image at full resolution into a tiled label GeoTIFF')
    parser.add_argument('config', help='segmentation config (a LeanEncoderDecoder)')
    parser.add_argument('checkpoint', help='checkpoint file (path or URL)')
    parser.add_argument('image', help='input image: TIFF / BigTIFF / OME-TIFF / GeoTIFF, or any '
                        'file mmcv reads')
    parser.add_argument('--out', required=True, help='output label file (.tif)')
    parser.add_argument('--max-memory', type=float, default=None, metavar='MB',
                        help='MB the segmentation may add; token maps that do not fit go to disk')
    parser.add_argument('--device', default='cpu', help='torch device, e.g. cpu or cuda:0')
    parser.add_argument('--token-dir', default=None, metavar='DIR',
                        help='folder for the disk-backed token maps (default: the system temp '
                        'folder)')
    parser.add_argument('--rgb-from', choices=['first3', 'gray'], default=None,
                        help='make 3 bands from other inputs: first3 = bands 1-3 of a 4+ band '
                        'image (RGBA, RGB + NIR); gray = band 1 of a 1- or 2-band image as R, G, '
                        'B')
    parser.add_argument('--scale-16bit', type=float, nargs='?', const=65535.0, default=None,
                        metavar='MAX', help='read a 16-bit image as 8-bit: value MAX (default '
                        '65535) becomes 255, linearly, clipped')
    return parser.parse_args(argv)


def _palette(model, cfg, num_classes):
    """The checkpoint's palette, else the config's test dataset's, where it covers every class;
    else None (a grey label file)."""
    palette = (getattr(model, 'dataset_meta', None) or {}).get('palette')
    if palette is None or len(palette) < num_classes:
        try:
            from mmseg.registry import DATASETS
            palette = DATASETS.get(cfg.test_dataloader.dataset.type).METAINFO.get('palette')
        except (AttributeError, KeyError, TypeError):
            return None
    return palette if palette is not None and len(palette) >= num_classes else None


def run(args) -> None:
    """Check the input and output, build the model, stream the labels into the file."""
    import torch
    from tqdm import tqdm

    from xcit_mm.apis.large_image import (LargeImageError, check_output, model_rows,
                                          nodata_rows, open_image, write_labels)
    from xcit_mm.apis.utils import read_config
    cfg = read_config(args.config)
    mean = (cfg.model.get('data_preprocessor') or {}).get('mean') or [0, 0, 0]
    check_output(args.out)
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise LargeImageError(f'--device {args.device}: no CUDA device here; use --device cpu')
    with open_image(args.image) as source:
        read_rows = model_rows(source, len(mean), args.rgb_from, args.scale_16bit)
        from mmengine.runner import load_checkpoint
        from mmseg.apis import init_model

        import xcit_mm  # noqa: F401  (LeanEncoderDecoder, safe checkpoint loading)
        from xcit_mm.models.utils import check_checkpoint
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
        hw = (source.height, source.width)
        bar = tqdm(desc=f'segmenting {osp.basename(args.image)} ({hw[0]} x {hw[1]})',
                   unit='band', disable=None, file=sys.stderr)

        def progress(done, total):
            bar.total, bar.n = total, done
            bar.refresh()

        def label_rows(rows):
            bar.set_postfix_str(f'label rows {rows}/{hw[0]}')

        try:
            with torch.no_grad():
                stream = model.stream_labels(read_rows, hw, max_memory=args.max_memory,
                                             token_dir=args.token_dir, progress=progress)
                write_labels(args.out, stream, hw, num_classes,
                             _palette(model, cfg, num_classes), source.geotags,
                             nodata_rows(source), on_rows=label_rows)
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
