"""Peak RSS and time of ``tools/segment_large_image.py`` on the inputs of issue 55's memory goals,
one fresh process a run.

    python benchmarks/large_image_tool.py [--config CONFIG] (--size S | --shape H W) \
        [--mosaic N] [--vector .gpkg] [--confidence] [--score-thr T] --budgets none 3000 \
        [--update] --out docs/results/large_image_tool_goals.json

The input, made once in ``--work-dir`` and written tile by tile (never whole): an H x W tiled RGB
BigTIFF, or with ``--mosaic N`` a VRT of N x N tiled GeoTIFFs written by GDAL (through rasterio),
which GDAL reads as one scene; both carry the same pixels and georeferencing. The model: CONFIG
with random weights. Each run is the tool in a fresh process: its exit status, its time and its
peak RSS (``ru_maxrss``); the floor is the same command on a 256² input of the same kind (Python,
torch, mmseg, GDAL and the model), and a row's ``memory_mb`` is its peak above the floor, which is
what ``--max-memory`` bounds.
"""
import argparse
import json
import os
import os.path as osp
import subprocess
import sys
import tempfile
import time
from xml.etree import ElementTree

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path[:0] = [ROOT, osp.join(ROOT, 'benchmarks')]
from training_extras.run_results import cpu_description  # noqa: E402
from xcit_benchmark.fresh_points import (kept_rows, random_detector,  # noqa: E402
                                         random_segmentor, revision, write_artifact)

CONFIG = 'configs/sem_fpn_xcit_s12_p16_80k_ade20k.py'
TOOL = osp.join(ROOT, 'tools/segment_large_image.py')
TILE = 512
FLOOR = 256  # the floor's input: FLOOR² px
# every input: 0.5 m pixels in UTM 33N, the top left corner at (500000, 4000000)
EPSG, ORIGIN, PIXEL = 32633, (500000.0, 4000000.0), 0.5
LOAD_NOTE = ('memory is valid on a loaded machine, the time is not: loadavg (1 min) at the start '
             'and end of the run in load_1min')


def budget_mb(value: str):
    """``--budgets`` item: MB, or ``none`` for no budget (argparse names a bad one)."""
    return None if value == 'none' else float(value)


def pixels(top: int, left: int, rows: int, cols: int, height: int, width: int):
    """The input's RGB pixels in a window: gradients, diagonal stripes and noise, each pixel a
    function of its place alone, so that the mosaic's pieces hold the BigTIFF's pixels."""
    import numpy as np
    yy, xx = np.mgrid[top:top + rows, left:left + cols].astype(np.int64)
    noise = ((yy * 1103515245 + xx * 12345) >> 7) % 32
    base = np.stack([xx * 255 // width, yy * 255 // height, ((xx + yy) // 64) % 256], axis=-1)
    return ((base + noise[..., None]) % 256).astype(np.uint8)


def make_tiff(path: str, height: int, width: int) -> None:
    """A tiled, georeferenced RGB BigTIFF written tile by tile (edge tiles padded)."""
    import numpy as np
    import tifffile

    def tiles():
        for top in range(0, height, TILE):
            for left in range(0, width, TILE):
                tile = np.zeros((TILE, TILE, 3), np.uint8)
                block = pixels(top, left, min(TILE, height - top), min(TILE, width - left),
                               height, width)
                tile[:block.shape[0], :block.shape[1]] = block
                yield tile

    geo = [(33550, 'd', 3, (PIXEL, PIXEL, 0.0), False),
           (33922, 'd', 6, (0.0, 0.0, 0.0) + ORIGIN + (0.0,), False),
           (34735, 'H', 16, (1, 1, 0, 3, 1024, 0, 1, 1, 1025, 0, 1, 1, 3072, 0, 1, EPSG), False)]
    with tifffile.TiffWriter(path + '.partial', bigtiff=True) as tif:
        tif.write(tiles(), shape=(height, width, 3), dtype='uint8', tile=(TILE, TILE),
                  photometric='rgb', compression='zlib', extratags=geo)
    os.replace(path + '.partial', path)


def make_mosaic(path: str, height: int, width: int, n: int) -> None:
    """``path`` (.vrt): N x N tiled GeoTIFFs written by GDAL window by window, and the VRT that
    places each of them in one scene."""
    import rasterio
    from rasterio.transform import from_origin
    from rasterio.windows import Window
    rows, cols = height // n, width // n
    block = min(TILE, rows, cols)
    if height % n or width % n or block % 16:
        raise SystemExit(f'--mosaic {n}: the pieces of {height} x {width} must be whole and '
                         'a multiple of 16 px; choose another size or N')
    crs = rasterio.crs.CRS.from_epsg(EPSG)
    scene = ElementTree.Element('VRTDataset', rasterXSize=str(width), rasterYSize=str(height))
    ElementTree.SubElement(scene, 'SRS').text = crs.to_wkt()
    ElementTree.SubElement(scene, 'GeoTransform').text = ', '.join(
        map(str, from_origin(*ORIGIN, PIXEL, PIXEL).to_gdal()))
    bands = [ElementTree.SubElement(scene, 'VRTRasterBand', dataType='Byte', band=str(b))
             for b in (1, 2, 3)]
    for band, colour in zip(bands, ('Red', 'Green', 'Blue')):
        ElementTree.SubElement(band, 'ColorInterp').text = colour
    for top in range(0, height, rows):
        for left in range(0, width, cols):
            piece = f'{osp.splitext(osp.basename(path))[0]}_{top}_{left}.tif'
            profile = dict(driver='GTiff', height=rows, width=cols, count=3, dtype='uint8',
                           crs=crs, tiled=True, blockxsize=block, blockysize=block,
                           compress='deflate', photometric='RGB', BIGTIFF='IF_SAFER',
                           transform=from_origin(ORIGIN[0] + left * PIXEL,
                                                 ORIGIN[1] - top * PIXEL, PIXEL, PIXEL))
            with rasterio.open(osp.join(osp.dirname(path), piece), 'w', **profile) as dst:
                for y in range(0, rows, block):
                    for x in range(0, cols, block):
                        h, w = min(block, rows - y), min(block, cols - x)
                        window = pixels(top + y, left + x, h, w, height, width)
                        dst.write(window.transpose(2, 0, 1), window=Window(x, y, w, h))
            for b, band in enumerate(bands, 1):
                source = ElementTree.SubElement(band, 'SimpleSource')
                ElementTree.SubElement(source, 'SourceFilename', relativeToVRT='1').text = piece
                ElementTree.SubElement(source, 'SourceBand').text = str(b)
                ElementTree.SubElement(source, 'SrcRect', xOff='0', yOff='0', xSize=str(cols),
                                       ySize=str(rows))
                ElementTree.SubElement(source, 'DstRect', xOff=str(left), yOff=str(top),
                                       xSize=str(cols), ySize=str(rows))
    ElementTree.ElementTree(scene).write(path + '.partial')
    os.replace(path + '.partial', path)


def make_input(work_dir: str, height: int, width: int, mosaic) -> str:
    """The input of ``height`` x ``width`` px (a VRT of ``mosaic`` x ``mosaic`` GeoTIFFs, or one
    BigTIFF), made if missing."""
    name = f'input_{height}x{width}' + (f'_mosaic{mosaic}.vrt' if mosaic else '.tif')
    path = osp.join(work_dir, name)
    if not osp.exists(path):
        make_mosaic(path, height, width, mosaic) if mosaic else make_tiff(path, height, width)
    return path


def input_bytes(image: str) -> int:
    """The bytes of the files GDAL reads for ``image`` (a VRT's pieces with it)."""
    import rasterio
    with rasterio.open(image) as src:
        return sum(osp.getsize(f) for f in src.files)


def tool_flags() -> str:
    """The tool's ``-h``: which options it has today."""
    return subprocess.run([sys.executable, TOOL, '-h'], capture_output=True, text=True).stdout


def run_tool(cmd: list, work_dir: str, threads=None) -> dict:
    """``cmd`` in a fresh process (``threads``: torch's threads, else its default): its exit
    status, wall time, peak RSS (its own ``ru_maxrss``, from ``wait4``) and output, and the load
    of the machine around it."""
    env = dict(os.environ, **({} if threads is None else dict(
        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))))
    load = [round(os.getloadavg()[0], 1)]
    with tempfile.TemporaryFile('w+', dir=work_dir) as err:
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.time() - start
        err.seek(0)
        output = err.read()
    load.append(round(os.getloadavg()[0], 1))
    lines = [line for line in output.splitlines()  # the tool's, not the libraries' warnings
             if line.strip() and not line[0].isspace() and 'Warning' not in line]
    return dict(returncode=os.waitstatus_to_exitcode(status), wall_s=round(wall, 1),
                peak_rss_mb=round(usage.ru_maxrss / 1024), load_1min=load,
                plan=[line for line in lines if 'max_memory=' in line],  # the stream's choice
                output_tail=lines[-3:])


def placed_as_input(image: str, labels: str):
    """Whether GDAL reads the labels on the input's grid: the same size, CRS and transform."""
    import rasterio
    if not osp.exists(labels):
        return None
    with rasterio.open(image) as src, rasterio.open(labels) as dst:
        return (src.shape, src.crs, src.transform) == (dst.shape, dst.crs, dst.transform)


def instances_in_scene(image: str, instances: str):
    """(instances, whether their CRS is the input's and every one lies within its bounds), as
    pyogrio and rasterio read them."""
    import pyogrio
    import rasterio
    from rasterio.crs import CRS
    if not osp.exists(instances):
        return None
    info = pyogrio.read_info(instances)
    with rasterio.open(image) as src:
        bounds, crs = src.bounds, src.crs
    inside = True
    if info['features']:
        box = pyogrio.read_bounds(instances)[1]
        x0, y0, x1, y1 = box[0].min(), box[1].min(), box[2].max(), box[3].max()
        inside = (x0 >= bounds.left and y0 >= bounds.bottom and x1 <= bounds.right
                  and y1 <= bounds.top)
    return dict(features=int(info['features']), crs=CRS.from_user_input(info['crs']) == crs,
                inside=bool(inside))


def point(row: dict) -> tuple:
    """What a row measured (rows of the first version of this script: their defaults)."""
    size = row.get('size')
    return (row.get('config', osp.basename(CONFIG)), row.get('height', size),
            row.get('width', size), row.get('mosaic'), row.get('vector'),
            bool(row.get('confidence')), row.get('score_thr'), row['max_memory'])


def earlier_rows(path: str, again: set, command: str) -> tuple:
    """``--update``: the artifact's rows of the points not measured ``again`` and the earlier
    commands, read as the artifact is now (runs may overlap: another may have written since this
    one began; this one's own earlier write is not an earlier command)."""
    if not osp.exists(path):
        return [], {}
    with open(path) as f:
        artifact = json.load(f)
    kept, earlier = kept_rows(artifact, lambda r: point(r) in again)
    if artifact['meta'].get('command') == command:
        earlier = {key: value[:-1] for key, value in earlier.items()}
    return kept, earlier


def measure(args, image: str, checkpoint: str, budget, name: str) -> dict:
    """One run of the tool on ``image`` with the options of ``args``; its outputs are named
    ``name`` in the work directory."""
    out = osp.join(args.work_dir, name)
    token_dir = osp.join(args.work_dir, 'tokens', name)  # its own: runs may overlap
    os.makedirs(token_dir, exist_ok=True)
    suffix = '.gpkg' if args.detector else '.tif'  # a detector's instances, a segmentor's labels
    cmd = [sys.executable, TOOL, osp.join(ROOT, args.config), checkpoint, image,
           '--out', out + suffix, '--token-dir', token_dir]
    outputs = [out + suffix]
    if args.confidence:
        outputs.append(out + '_confidence.tif')
        cmd += ['--confidence', outputs[-1]]
    if args.vector:
        outputs.append(out + args.vector)
        cmd += ['--vector', outputs[-1]]
    if budget is not None:
        cmd += ['--max-memory', str(budget)]
    if args.score_thr is not None:  # the model's own threshold too, else it keeps fewer
        cmd += ['--score-thr', str(args.score_thr),
                '--cfg-options', f'model.test_cfg.rcnn.score_thr={args.score_thr}']
    for path in outputs:  # a failed run must not show an earlier run's outputs
        if osp.exists(path):
            os.remove(path)
    row = run_tool(cmd, args.work_dir, args.threads)
    placed = (instances_in_scene(image, outputs[0]) if args.detector
              else placed_as_input(image, outputs[0]))
    return dict(row, output_bytes=[osp.getsize(p) if osp.exists(p) else None for p in outputs],
                placed_as_input=placed,
                token_dir_left=sorted(os.listdir(token_dir)), command=' '.join(cmd[1:]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--config', default=CONFIG, help='a LeanEncoderDecoder or LeanMaskRCNN config '
                   '(repo-relative): labels, or instances (.gpkg)')
    shape = p.add_mutually_exclusive_group()
    shape.add_argument('--size', type=int, default=16384, help='a square input of SIZE² px')
    shape.add_argument('--shape', type=int, nargs=2, metavar=('H', 'W'), help='an H x W input')
    p.add_argument('--mosaic', type=int, default=None, metavar='N',
                   help='the input as a VRT of N x N GeoTIFFs read as one scene')
    p.add_argument('--vector', default=None, metavar='SUFFIX',
                   help="also the tool's polygons, e.g. .gpkg")
    p.add_argument('--confidence', action='store_true', help="also the tool's confidence")
    p.add_argument('--score-thr', type=float, default=None, metavar='T',
                   help="a detector's --score-thr and its config's rcnn.score_thr (default: "
                   "the tool's and the config's); random weights score no instance above the "
                   'defaults, 0 writes every detection')
    p.add_argument('--budgets', nargs='+', type=budget_mb, default=[None, 3000.0],
                   help="--max-memory of each run ('none': no budget)")
    p.add_argument('--threads', type=int, default=None,
                   help="torch's threads in the tool (default: torch's own, the cores)")
    p.add_argument('--note', default=LOAD_NOTE, help="each row's note")
    p.add_argument('--work-dir', default='/tmp/large_image_tool')
    p.add_argument('--out', required=True, help='FILE.json (and FILE.csv), rows added as they come')
    p.add_argument('--update', action='store_true',
                   help="keep the artifact's rows of the other points (config, input, options, "
                   'budget)')
    args = p.parse_args(argv)
    height, width = args.shape or (args.size, args.size)
    flags = tool_flags()
    for option, wanted in (('--vector', args.vector), ('--confidence', args.confidence)):
        if wanted and option not in flags:
            p.error(f'{option}: the tool has no {option} yet ({TOOL} -h)')
    os.makedirs(args.work_dir, exist_ok=True)
    config = osp.basename(args.config)
    checkpoint = osp.join(args.work_dir, osp.splitext(config)[0] + '_random.pth')
    from mmengine.config import Config
    args.detector = Config.fromfile(osp.join(ROOT, args.config)).model.type == 'LeanMaskRCNN'
    if args.score_thr is not None and not args.detector:
        p.error('--score-thr: a detector config only (the tool refuses it for segmentation)')
    if not osp.exists(checkpoint):  # the tool takes the config's palette and class names
        import torch
        build = random_detector if args.detector else random_segmentor
        torch.save(dict(state_dict=build(osp.join(ROOT, args.config)).state_dict()), checkpoint)
    code = revision()  # the code the runs import, before the tree changes under them
    image = make_input(args.work_dir, height, width, args.mosaic)
    floor_image = make_input(args.work_dir, FLOOR, FLOOR, args.mosaic)
    options = [f'mosaic{args.mosaic}'] * bool(args.mosaic) + ['confidence'] * args.confidence
    options += [f'vector-{args.vector.lstrip(".")}'] if args.vector else []
    options += [f'score{args.score_thr:g}'] if args.score_thr is not None else []
    tag = '_'.join([osp.splitext(config)[0]] + options)
    floor = measure(args, floor_image, checkpoint, None, f'labels_{tag}_{FLOOR}')
    if floor['returncode']:
        raise SystemExit(f'the floor run failed: {floor}')
    described = dict(config=config, height=height, width=width, mosaic=args.mosaic,
                     vector=args.vector, confidence=args.confidence,
                     **({} if args.score_thr is None else dict(score_thr=args.score_thr)),
                     input=(f'VRT of {args.mosaic} x {args.mosaic} GeoTIFFs' if args.mosaic
                            else 'tiled BigTIFF'))
    again = {point(dict(described, max_memory=budget)) for budget in args.budgets}
    argv = sys.argv[1:] if argv is None else argv
    command = ' '.join(['benchmarks/large_image_tool.py'] + argv)
    rows, out = [], osp.splitext(args.out)[0]  # .json (and .csv)
    for budget in args.budgets:
        row = measure(args, image, checkpoint, budget, f'labels_{tag}_{height}x{width}_{budget}')
        row = dict(described, max_memory=budget, image_bytes=input_bytes(image),
                   revision=code, threads=args.threads or os.cpu_count(),
                   floor_peak_rss_mb=floor['peak_rss_mb'], floor_wall_s=floor['wall_s'],
                   memory_mb=row['peak_rss_mb'] - floor['peak_rss_mb'], **row, note=args.note)
        print(json.dumps(row), flush=True)
        rows.append(row)
        kept, earlier = earlier_rows(out + '.json', again, command) if args.update else ([], {})
        write_artifact(out, dict(
            command=command, **earlier, cpu=cpu_description(), threads=os.cpu_count(),
            floor_note=f'floor_peak_rss_mb: the same command on a {FLOOR}² input of the same '
            'kind (Python, torch, mmseg, GDAL and the model); memory_mb: peak_rss_mb above it'),
            kept + rows)


if __name__ == '__main__':
    main()
