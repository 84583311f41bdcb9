# Copyright (c) xcit_mm contributors. All rights reserved.
"""tools/segment_large_image.py with a detector's config, and its InstanceWriter
(xcit_mm.apis.large_image.instances): the instances written are those of
``LeanMaskRCNN.stream_instances`` on the same pixels above the score threshold, each mask pasted
as ``paste_in_box`` pastes it less the pixels without data, placed over the input as GDAL places
it (polygons burnt back by GDAL; COCO RLE decoded by pycocotools); every bad input is one line
and leaves no file.

The detector is test_lean_detection's tiny Mask R-CNN (XCiT of 2 layers, 32 channels, 10 classes)
with random weights, its class scores spread so that some instances pass the default threshold
and others do not; cores of 128 px on a 200 x 300 image, so the stream gives two rows of cores.
"""
import importlib.util
import json
import os
import os.path as osp

import numpy as np
import pytest
import torch
from recording_bar import recording_bar

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
H, W = 200, 300
COLLAR = 60  # columns without data on the left
CLASSES = [f'class {i}' for i in range(10)]
SCORE_THR = 0.3  # the tool's default


@pytest.fixture(scope='module')
def tool():
    """tools/segment_large_image.py as a module."""
    spec = importlib.util.spec_from_file_location(
        'xcit_mm_tool_segment_large_image_det', osp.join(ROOT, 'tools', 'segment_large_image.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(config path, checkpoint path, model in eval): the paper's Mask R-CNN T12/16 config with
    test_lean_detection's tiny model, test_cfg mode='stream' with cores of 128 px; the
    checkpoint's meta names the classes."""
    from mmengine.config import Config
    from mmdet.registry import MODELS
    from test_lean_detection import _model_cfg
    folder = tmp_path_factory.mktemp('tiny_detector')
    cfg = Config.fromfile(osp.join(ROOT, 'configs', 'mask_rcnn_xcit_t12_p16_3x_coco.py'))
    cfg.model = _model_cfg()
    cfg.model.type = 'LeanMaskRCNN'
    cfg.model.test_cfg.update(mode='stream', tile_size=128, feature_margin=64)
    cfg.model.test_cfg.rcnn.update(score_thr=0.05, max_per_img=20)
    config = str(folder / 'tiny_det.py')
    cfg.dump(config)
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    with torch.no_grad():  # class scores spread about the threshold; masks neither all 0 nor 1
        model.roi_head.bbox_head.fc_cls.weight.normal_(0, 0.25)
        model.roi_head.mask_head.conv_logits.weight.normal_(0, 0.3)
    checkpoint = str(folder / 'tiny_det.pth')
    torch.save({'state_dict': model.state_dict(),
                'meta': {'dataset_meta': {'classes': CLASSES}}}, checkpoint)
    return config, checkpoint, model.eval()


def _scene():
    """RGB pixels with smooth structure and a collar of zeros (no data) on the left; which
    pixels hold data."""
    rs = np.random.RandomState(0)
    yy, xx = np.mgrid[0:H, 0:W]
    img = np.stack([(np.sin(yy / (9 + 4 * c) + xx / (13 + 3 * c)) * 100 + 127
                     + rs.randint(-20, 20, (H, W))) for c in range(3)], axis=2)
    img = np.clip(img, 1, 255).astype(np.uint8)
    img[:, :COLLAR] = 0
    valid = np.ones((H, W), bool)
    valid[:, :COLLAR] = False
    return img, valid


def _affine():
    from affine import Affine
    return Affine(0.5, 0.0, 500000.0, 0.0, -0.5, 4100000.0)


def _geotiff(path, img, **options):
    """A tiled GeoTIFF (UTM 33N, 0.5 m pixels, nodata 0) written by rasterio (GDAL)."""
    import rasterio
    profile = dict(driver='GTiff', height=img.shape[0], width=img.shape[1], count=img.shape[2],
                   dtype='uint8', crs='EPSG:32633', nodata=0, transform=_affine(), tiled=True,
                   blockxsize=64, blockysize=64)
    profile.update(options)
    with rasterio.open(path, 'w', **profile) as dst:
        dst.write(img.transpose(2, 0, 1))
    return str(path)


@pytest.fixture(scope='module')
def reference(tiny):
    """The stream's pieces for the scene as the tool reads it (BGR, the collar without data),
    and every instance's expected mask over the whole image (pasted, less the collar)."""
    from xcit_mm.models.detectors.box_masks import paste_in_box
    img, valid = _scene()
    pieces = list(tiny[2].stream_instances(lambda a, b: np.ascontiguousarray(img[a:b, :, ::-1]),
                                           (H, W), valid_rows=lambda a, b: valid[a:b]))
    masks, pasted_sums = [], []
    for piece in pieces:
        for mask, x0, y0 in paste_in_box(piece.mask_logits, piece.bboxes, (H, W)):
            full = np.zeros((H, W), bool)
            full[y0:y0 + mask.shape[0], x0:x0 + mask.shape[1]] = mask.numpy()
            pasted_sums.append(full.sum())
            masks.append(full & valid)
    flat = dict(bboxes=torch.cat([p.bboxes for p in pieces]).double().numpy(),
                scores=torch.cat([p.scores for p in pieces]).double().numpy(),
                labels=torch.cat([p.labels for p in pieces]).numpy(), masks=np.array(masks))
    assert len(pieces) == 2 and len(flat['scores']) > 10
    # some masks reach into the collar and lose pixels there
    assert (np.array(pasted_sums) > flat['masks'].sum(axis=(1, 2))).any()
    return pieces, flat


def _kept(flat, thr):
    keep = flat['scores'] >= thr
    return {k: v[keep] for k, v in flat.items()}


def _read_polygons(path):
    """(layer info, geometries, fields) as GDAL reads the file."""
    import pyogrio
    import pyogrio.raw
    import shapely
    meta, _, wkb, fields = pyogrio.raw.read(path)
    return pyogrio.read_info(path), shapely.from_wkb(wkb), dict(zip(meta['fields'], fields))


def _check_polygons(path, expected, transform, crs, in_order=True):
    """The file's features are the expected instances, in order (else matched by score: a
    FlatGeobuf's spatial index sorts them): class, name, score, and each outline burnt back by
    GDAL over the image's grid equal to its mask (its box where empty), inside the scene, in
    ``crs``."""
    import shapely
    from rasterio.crs import CRS
    from rasterio.features import rasterize
    info, geoms, fields = _read_polygons(path)
    assert info['geometry_type'] == 'MultiPolygon'
    assert list(info['fields']) == ['class_id', 'class_name', 'score']
    if crs is None:
        assert info['crs'] is None
    else:
        assert CRS.from_user_input(info['crs']) == CRS.from_user_input(crs)
    assert len(geoms) == len(expected['scores']) > 0
    if not in_order:
        assert len(np.unique(expected['scores'])) == len(expected['scores'])
        order = np.argsort(fields['score'])[np.argsort(np.argsort(expected['scores']))]
        geoms, fields = geoms[order], {k: v[order] for k, v in fields.items()}
    np.testing.assert_array_equal(fields['class_id'], expected['labels'])
    assert list(fields['class_name']) == [CLASSES[i] for i in expected['labels']]
    np.testing.assert_array_equal(fields['score'], expected['scores'])
    assert shapely.is_valid(geoms).all()
    assert shapely.covers(shapely.box(*_bounds(transform)), geoms).all()  # inside the scene
    empty = 0
    for geom, mask, box in zip(geoms, expected['masks'], expected['bboxes']):
        if mask.any():
            burnt = rasterize([(geom, 1)], out_shape=(H, W), transform=transform, fill=0,
                              dtype='uint8')
            np.testing.assert_array_equal(burnt.astype(bool), mask)
        else:  # the box, placed by the transform
            empty += 1
            corners = np.array([transform @ (x, y) for x, y in
                                ((box[0], box[1]), (box[2], box[1]), (box[2], box[3]),
                                 (box[0], box[3]))])
            assert shapely.equals(geom, shapely.multipolygons([shapely.polygons(corners)]))
    return empty


def _bounds(transform):
    """(minx, miny, maxx, maxy) of the image's grid in the CRS."""
    corners = np.array([transform @ (x, y) for x in (0, W) for y in (0, H)])
    return (*corners.min(axis=0), *corners.max(axis=0))


# -- the tool --------------------------------------------------------------------------------

def test_geotiff_to_polygons_in_its_crs(tool, tiny, reference, tmp_path, capsys):
    """A UTM GeoTIFF with a nodata collar -> a GeoPackage in its CRS: one MultiPolygon per
    instance the stream gives with a score of at least 0.3 (the default; some are below), in the
    stream's order, each outline exactly its mask less the collar when burnt back by GDAL."""
    config, checkpoint, _ = tiny
    img, _ = _scene()
    scene = _geotiff(tmp_path / 'scene.tif', img)
    out = str(tmp_path / 'instances.gpkg')
    assert tool.main([config, checkpoint, scene, '--out', out]) == 0, capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ['instances.gpkg', 'scene.tif']
    flat = reference[1]
    expected = _kept(flat, SCORE_THR)
    assert 0 < len(expected['scores']) < len(flat['scores'])
    _check_polygons(out, expected, _affine(), 'EPSG:32633')


def test_png_without_georeferencing_to_coco_results(tool, tiny, reference, tmp_path,
                                                    monkeypatch):
    """An RGBA PNG (alpha 0 in the collar, no georeferencing) -> COCO results JSON, every
    instance with --score-thr 0: category, box [x, y, w, h], score, and an RLE that pycocotools
    decodes to the pasted mask less the collar (and that pycocotools' own encoding of that mask
    equals). The progress bar counts the trunk's token rows x layers, then the cores."""
    import pycocotools.mask as mask_utils
    import rasterio
    img, valid = _scene()
    rgba = np.concatenate([img, np.where(valid, 255, 0).astype(np.uint8)[:, :, None]], axis=2)
    png = str(tmp_path / 'slide.png')
    with rasterio.open(png, 'w', driver='PNG', height=H, width=W, count=4, dtype='uint8') as dst:
        dst.write(rgba.transpose(2, 0, 1))
    config, checkpoint, _ = tiny
    out = str(tmp_path / 'instances.json')
    records = []
    monkeypatch.setattr('tqdm.tqdm', recording_bar(records))
    assert tool.main([config, checkpoint, png, '--out', out, '--score-thr', '0']) == 0
    assert not [name for name in os.listdir(tmp_path) if 'partial' in name]
    with open(out) as f:
        results = json.load(f)
    expected = reference[1]
    assert len(results) == len(expected['scores'])
    for result, box, score, label, mask in zip(results, expected['bboxes'], expected['scores'],
                                               expected['labels'], expected['masks']):
        assert result['image_id'] == 0 and result['category_id'] == label
        assert result['score'] == score
        assert result['bbox'] == [box[0], box[1], box[2] - box[0], box[3] - box[1]]
        rle = result['segmentation']
        assert rle['size'] == [H, W]
        np.testing.assert_array_equal(mask_utils.decode(dict(rle, counts=rle['counts'].encode())),
                                      mask.astype(np.uint8))
        assert rle['counts'] == mask_utils.encode(
            np.asfortranarray(mask.astype(np.uint8)))['counts'].decode()

    layers, token_rows = 2, -(-H // 16)  # the tiny model's trunk, 16 px patches
    stages = [(desc, unit, total) for desc, unit, _, total in records if total]
    assert sorted(set(stages), key=stages.index) == [
        ('slide.png (200 x 300): trunk (token rows x layers)', 'row-layer', layers * token_rows),
        ('slide.png (200 x 300): cores', 'core', 6),
        ('slide.png (200 x 300): writing the file', 'core', 6)]


# -- the writer alone ------------------------------------------------------------------------

@pytest.mark.parametrize('ext', ['.fgb', '.geojson'])
def test_formats_that_cannot_append_and_an_image_without_crs(reference, tmp_path, ext):
    """The stream's pieces through InstanceWriter: .fgb and .geojson (made from the GeoPackage at
    the end) hold the same features in the CRS; without a CRS or transform, a .gpkg holds them
    in pixel coordinates (column, row) with no CRS. A rotated transform places them too."""
    from affine import Affine

    from xcit_mm.apis.large_image.instances import InstanceWriter
    pieces, flat = reference
    valid = _scene()[1]
    rotated = _affine() @ Affine.rotation(20)
    for name, crs, transform in ((f'utm{ext}', 'EPSG:32633', rotated),
                                 ('pixels.gpkg', None, None)):
        path = str(tmp_path / name)
        with InstanceWriter(path, CLASSES, (H, W), crs=crs, transform=transform,
                            score_thr=0.2, valid_rows=lambda a, b: valid[a:b]) as writer:
            for piece in pieces:
                writer.add(piece)
        assert writer.count == (flat['scores'] >= 0.2).sum()
        _check_polygons(path, _kept(flat, 0.2), transform or Affine.identity(), crs,
                        in_order=not name.endswith('.fgb'))
    assert sorted(os.listdir(tmp_path)) == sorted([f'utm{ext}', 'pixels.gpkg'])


# -- bad input -------------------------------------------------------------------------------

def _bad_input(kind, tmp_path, monkeypatch):
    """(image, extra arguments, config or None for the detector's, words of the error line)."""
    img, _ = _scene()
    scene = _geotiff(tmp_path / 'scene.tif', img)
    if kind == 'vector_for_a_detector':
        return scene, ['--vector', str(tmp_path / 'labels.gpkg')], None, [
            '--vector applies to segmentation', 'is a detector (LeanMaskRCNN)', 'drop --vector']
    if kind == 'confidence_for_a_detector':
        return scene, ['--confidence', str(tmp_path / 'c.tif')], None, [
            '--confidence applies to segmentation', 'drop --confidence']
    if kind == 'score_thr_for_a_segmentor':
        return scene, ['--score-thr', '0.5'], osp.join(
            ROOT, 'configs', 'sem_fpn_xcit_s12_p16_80k_ade20k.py'), [
            '--score-thr applies to detectors', 'drop --score-thr']
    if kind == 'score_thr_out_of_range':
        return scene, ['--score-thr', '30'], None, ['--score-thr 30', 'from 0 to 1']
    if kind == 'unknown_format':
        return scene, ['--out', str(tmp_path / 'instances.shp')], None, [
            'unknown format', '.gpkg, .fgb, .geojson', '.json (COCO results)']
    if kind == 'out_is_the_input_by_a_link':
        os.symlink(scene, tmp_path / 'link.gpkg')
        return scene, ['--out', str(tmp_path / 'link.gpkg')], None, [
            'is a file the input reads', 'choose another --out']
    if kind == 'polygons_of_a_scene_placed_by_gcps':
        import rasterio
        from rasterio.control import GroundControlPoint
        gcps = [GroundControlPoint(r, c, 500000 + c, 4100000 - r) for r, c in
                ((0, 0), (0, W), (H, 0), (H, W))]
        path = str(tmp_path / 'gcps.tif')
        with rasterio.open(path, 'w', driver='GTiff', height=H, width=W, count=3,
                           dtype='uint8', gcps=gcps, crs='EPSG:32633') as dst:
            dst.write(img.transpose(2, 0, 1))
        return path, [], None, ['placed by ground control points', 'gdalwarp', '.json']
    if kind == 'not_a_streaming_detector':
        return scene, ['--cfg-options', 'model.type=MaskRCNN'], None, [
            'MaskRCNN cannot stream', "model.type='LeanMaskRCNN'"]
    if kind == 'interrupted':  # Ctrl-C as the stream reads, the output begun
        from xcit_mm.apis.large_image import reader

        def interrupt(self, start, stop, bands=None):
            assert any('.partial' in name for name in os.listdir(tmp_path))
            raise KeyboardInterrupt
        monkeypatch.setattr(reader._Source, 'read_rows', interrupt)
        return scene, [], None, ['interrupted']
    if kind == 'writer_fails_midway':  # after the first row of cores was written
        from xcit_mm.apis.large_image import instances
        add = instances.InstanceWriter.add

        def fails(self, piece):
            if self.count:
                assert any('.partial' in name for name in os.listdir(tmp_path))
                raise RuntimeError('Cannot write feature')
            add(self, piece)
            assert self.count
        monkeypatch.setattr(instances.InstanceWriter, 'add', fails)
        return scene, ['--score-thr', '0'], None, ['Cannot write feature']
    raise AssertionError(kind)


@pytest.mark.parametrize('kind', [
    'vector_for_a_detector', 'confidence_for_a_detector', 'score_thr_for_a_segmentor',
    'score_thr_out_of_range', 'unknown_format', 'out_is_the_input_by_a_link',
    'polygons_of_a_scene_placed_by_gcps', 'not_a_streaming_detector', 'interrupted',
    'writer_fails_midway'])
def test_bad_input_is_one_line_and_no_file(tool, tiny, tmp_path, monkeypatch, capsys, kind):
    """One ``error:`` line naming the problem and its fix, a non-zero exit status, no output or
    partial file, the input untouched."""
    config, checkpoint, _ = tiny
    image, extra, other_config, words = _bad_input(kind, tmp_path, monkeypatch)
    out = str(tmp_path / 'instances.gpkg')
    before = {name: osp.getsize(tmp_path / name) for name in os.listdir(tmp_path)}
    status = tool.main([other_config or config, checkpoint, image, '--out', out] + extra)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status != 0 and len(lines) == 1 and lines[0].startswith('error: '), err
    for word in words:
        assert word in lines[0], lines[0]
    assert {name: osp.getsize(tmp_path / name) for name in os.listdir(tmp_path)} == before
