"""benchmarks/whole_image_inference.py: its skipping rule, its run loop and artifact, its
children (stock and lean give the same output through the upstream doors), its command line,
and the reports made from an artifact (``--markdown``, ``--plot``).

The children run small XCiTs (2 layers, 32 channels) through ``--config``-style overrides of the
paper configs at 128 px, in this process; one end-to-end run of the script starts one fresh
child. The run loop is driven by a stand-in runner, so the skipping after a large or a killed
point is checked without measuring anything.
"""
import argparse
import csv
import json
import os.path as osp
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, osp.join(ROOT, 'benchmarks'))
import whole_image_inference as wii  # noqa: E402

SMALL_XCIT = 'dict(_delete_=True, embed_dims=32, depth=2, num_heads=4)'  # base: a name
SMALL_CONFIGS = {
    'segmentor': """_base_ = [{base!r}]
model = dict(
    backbone=dict(arch={arch}, out_indices=(0, 0, 1, 1)),
    neck=dict(in_channels=[32] * 4, out_channels=32),
    decode_head=dict(in_channels=[32] * 4, channels=16))
""",
    'detector': """_base_ = [{base!r}]
model = dict(
    backbone=dict(arch={arch}, out_indices=(0, 0, 1, 1)),
    neck=dict(in_channels=[32] * 4, out_channels=32),
    rpn_head=dict(in_channels=32, feat_channels=32),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=32),
        bbox_head=dict(in_channels=32, fc_out_channels=64),
        mask_roi_extractor=dict(out_channels=32),
        mask_head=dict(in_channels=32, conv_out_channels=32)))
"""}


def _small_config(tmp_path, task: str) -> str:
    """A small XCiT in the paper config of ``task`` (same neck, heads, pipeline and doors)."""
    path = tmp_path / f'small_{task}.py'
    base = osp.join(ROOT, wii.CONFIGS[(task, 'xcit')])
    path.write_text(SMALL_CONFIGS[task].format(base=base, arch=SMALL_XCIT))
    return str(path)


def test_skip_reason_extrapolates_by_the_pixels_and_stops_after_a_failure():
    """A point is skipped when the previous size's RSS before the call plus its growth times the
    pixel ratio passes the limit, and after any point that did not finish."""
    assert wii.skip_reason(None, 1024, 20480) is None
    prev = dict(status='ok', size=2048, peak_growth_mb=4000, base_mb=700)
    assert wii.skip_reason(prev, 4096, 20480) is None  # 700 + 4 x 4000 = 16700 MB
    why = wii.skip_reason(prev, 4096, 16000)
    assert why.startswith('not run: extrapolated peak RSS 16.3 GiB') and '4 x growth 4000' in why
    assert wii.extrapolated_mb(prev, 4096) == 16000
    # two sizes up: x16 the pixels
    assert wii.skip_reason(dict(prev, size=1024), 4096, 65000) is None  # 700 + 64000
    assert '16 x growth' in wii.skip_reason(dict(prev, size=1024), 4096, 64000)
    for status in ('killed', 'error', 'skipped'):
        assert wii.skip_reason(dict(status=status, size=4096), 8192, 10**9) == \
            f'not run: {status} at 4096'
        assert wii.extrapolated_mb(dict(status=status, size=4096), 8192) is None


def test_run_skips_in_size_order_and_writes_the_artifact(tmp_path):
    """The run loop, with a stand-in for the fresh process: sizes in increasing order (lean
    first), no process for a skipped point, the artifact (CSV columns, JSON rows and meta)
    rewritten after each point and complete at the end."""
    growth = {('lean', 1024): 300, ('lean', 2048): 1200, ('lean', 4096): 4800,
              ('stock', 1024): 600, ('stock', 2048): 2000}
    calls = []

    def runner(script, point, limit_bytes, timeout_s):
        assert script == wii.__file__ and limit_bytes == 10 * 2**30 and timeout_s == 99
        calls.append((point['task'], point['path'], point['size']))
        if (point['path'], point['size']) not in growth:
            return dict(status='killed', note='rss: RSS 10.0 GiB after 1 s (limit 10.0 GiB)')
        return dict(status='ok', peak_growth_mb=growth[(point['path'], point['size'])],
                    base_mb=700, time_s=1.5, digest=f"d{point['size']}")

    out = str(tmp_path / 'art')
    args = argparse.Namespace(limit_gb=10.0, timeout=99, out=out, note='test',
                              tasks=['segmentor'], backbones=['xcit'], paths=['stock', 'lean'],
                              sizes=[8192, 1024, 4096, 2048], update=False)
    rows = wii.run(args, dict(wii.CONFIGS), runner=runner)
    assert calls == [('segmentor', p, s) for s in (1024, 2048, 4096) for p in ('lean', 'stock')]
    status = {(r['path'], r['size']): r['status'] for r in rows}
    assert status == {('lean', 1024): 'ok', ('stock', 1024): 'ok', ('lean', 2048): 'ok',
                      ('stock', 2048): 'ok', ('lean', 4096): 'ok', ('stock', 4096): 'killed',
                      ('lean', 8192): 'skipped', ('stock', 8192): 'skipped'}
    lean_8192, stock_8192 = rows[-2:]
    assert lean_8192['extrapolated_mb'] == 4 * 4800 and '19.4 GiB' in lean_8192['note']
    assert stock_8192['note'] == 'not run: killed at 4096' and 'extrapolated_mb' not in stock_8192
    with open(out + '.csv') as f:
        table = list(csv.reader(f))
    assert table[0] == wii.COLUMNS and len(table) == 9
    assert table[1] == ['segmentor', 'xcit', 'lean', '1024', 'ok', '300', '1.5', 'd1024', '']
    with open(out + '.json') as f:
        artifact = json.load(f)
    meta = artifact['meta']
    assert {'cpu', 'threads', 'command', 'torch', 'limit_gb', 'configs'} <= set(meta)
    assert meta['complete'] and meta['note'] == 'test' and meta['torch'][0].isdigit()
    assert meta['stock_equals_lean'] == {f'segmentor:xcit:{s}': True for s in (1024, 2048)}
    assert artifact['rows'] == json.loads(json.dumps(rows))


def test_update_measures_some_points_again_and_keeps_the_others(tmp_path):
    """``--update``: the rows of the artifact at ``--out`` that the run does not measure stay
    (with the command that measured them), the others are replaced or added."""
    out = str(tmp_path / 'art')

    def runner(script, point, limit_bytes, timeout_s):
        return dict(status='ok', peak_growth_mb=point['size'] // 4, base_mb=700, time_s=1.0,
                    digest=point['path'][0])

    def args(**kw):
        return argparse.Namespace(**dict(dict(limit_gb=10.0, timeout=99, out=out, note=None,
                                              tasks=['detector'], backbones=['xcit'],
                                              paths=['stock', 'lean'], sizes=[1024, 2048],
                                              update=False), **kw))

    wii.run(args(), dict(wii.CONFIGS), runner=runner)
    wii.run(args(paths=['bands', 'lean'], sizes=[2048, 4096], update=True), dict(wii.CONFIGS),
            runner=runner)
    with open(out + '.json') as f:
        artifact = json.load(f)
    points = sorted((r['path'], r['size']) for r in artifact['rows'])
    assert points == [('bands', 2048), ('bands', 4096), ('lean', 1024), ('lean', 2048),
                      ('lean', 4096), ('stock', 1024), ('stock', 2048)]
    meta = artifact['meta']
    assert len(meta['earlier_commands']) == 1 and meta['sizes'] == [1024, 2048, 4096]
    assert meta['stock_equals_lean'] == {'detector:xcit:1024': False,
                                         'detector:xcit:2048': False}
    with pytest.raises(SystemExit) as exc:  # nothing to update
        wii.main(['--update', '--out', str(tmp_path / 'none'), '--sizes', '1024'])
    assert exc.value.code == 2


@pytest.mark.parametrize('task', wii.TASKS)
def test_children_stock_and_lean_give_the_same_output_at_full_resolution(task, tmp_path,
                                                                         monkeypatch):
    """The child of each path on a small XCiT in the paper config of ``task``, at 128 px through
    the upstream door: it runs at the image size, stock and lean outputs have equal digests, the
    detector keeps exactly 100 detections, and the figures are there."""
    import xcit_mm.models.segmentors.lean_encoder_decoder as lean_segmentor
    banded = []  # the segmentor's network in bands of rows: counted
    real = lean_segmentor.semantic_fpn_in_bands
    monkeypatch.setattr(lean_segmentor, 'semantic_fpn_in_bands',
                        lambda *a: banded.append(a[-1]) or real(*a))
    config = _small_config(tmp_path, task)
    results = {}
    for path in [p for p in wii.PATHS if p != 'bands' or (task, 'xcit') in wii.BANDED]:
        point = dict(task=task, backbone='xcit', path=path, size=128, config=config)
        results[path] = out = wii.child(point)
        assert out['status'] == 'ok' and out['type'] == wii.MODEL_TYPES[(task, path)]
        assert out['peak_growth_mb'] >= 0 and out['time_s'] >= 0 and out['base_mb'] > 0
    stock, lean = results['stock'], results['lean']
    assert stock['digest'] == lean['digest'] and len(lean['digest']) == 16
    if task == 'segmentor':
        assert lean['out_shape'] == [1, 128, 128] and stock['labels_sum'] == lean['labels_sum']
        bands = results['bands']  # equal up to float rounding: the labels nearly so
        assert banded[-1] == wii.BAND_MB and bands['out_shape'] == lean['out_shape']
        assert abs(bands['labels_sum'] - lean['labels_sum']) <= 0.01 * lean['labels_sum']
    else:
        assert lean['out_shape'] == [100, 128, 128] and lean['num_dets'] == 100
        assert stock['mask_pixels'] == lean['mask_pixels']
        bands = results['bands']  # equal up to float rounding: the masks' pixels nearly so
        assert bands['num_dets'] == 100 and bands['out_shape'] == lean['out_shape']
        assert abs(bands['mask_pixels'] - lean['mask_pixels']) <= 0.01 * lean['mask_pixels']


def test_script_runs_a_point_in_a_fresh_process_and_writes_the_artifact(tmp_path, monkeypatch):
    """The command line end to end (``main``, here): one point of a small Semantic FPN
    (``--config`` override) in a fresh process started from another directory, the CSV columns
    and the JSON's row and meta."""
    out = str(tmp_path / 'run')
    config = _small_config(tmp_path, 'segmentor')
    monkeypatch.chdir(tmp_path)
    wii.main(['--tasks', 'segmentor', '--backbones', 'xcit', '--paths', 'lean', '--sizes', '64',
              '--config', f'segmentor:xcit={config}', '--out', out, '--limit-gb', '8'])
    with open(out + '.csv') as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == wii.COLUMNS and len(table) == 1
    row = table[0]
    assert (row['task'], row['backbone'], row['path'], row['size'], row['status']) == \
        ('segmentor', 'xcit', 'lean', '64', 'ok')
    assert int(row['peak_growth_mb']) > 0 and float(row['time_s']) >= 0 and len(row['digest']) == 16
    with open(out + '.json') as f:
        artifact = json.load(f)
    assert artifact['rows'][0]['config'] == config and artifact['rows'][0]['out_shape'] == \
        [1, 64, 64]
    assert artifact['meta']['complete'] and artifact['meta']['limit_gb'] == 8.0


@pytest.mark.parametrize('argv, message', [
    (['--sizes', '1000'], 'multiple of 32'),
    (['--sizes', '32'], 'at least 64'),
    (['--sizes', '1024', '1024'], 'each size once'),
    (['--limit-gb', '0'], 'must be positive'),
    (['--tasks', 'classifier'], 'invalid choice'),
    (['--config', 'segmentor:resnet=x.py'], 'TASK:BACKBONE=PATH'),
    (['--config', 'segmentor:xcit=/no/such/config.py'], 'no such config file'),
    (['--config', 'detector:swin=mmpose::x.py'], 'no such config file'),
    (['--markdown', '/no/such.json'], 'cannot read'),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys, monkeypatch):
    """Every bad argument stops before any point runs, with exit status 2 and a message."""
    monkeypatch.setattr(wii, 'run', lambda *args, **kwargs: pytest.fail('points would run'))
    with pytest.raises(SystemExit) as exc:
        wii.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _artifact(tmp_path) -> str:
    """A small artifact with every status, written as the script writes it."""
    def row(task, backbone, path, size, status, growth=None, seconds=None, **extra):
        return dict(task=task, backbone=backbone, path=path, size=size, status=status,
                    peak_growth_mb=growth, time_s=seconds, **extra)
    rows = [row('segmentor', 'xcit', 'lean', 1024, 'ok', 586, 6.3, digest='a'),
            row('segmentor', 'xcit', 'stock', 1024, 'ok', 1232, 6.5, digest='a'),
            row('segmentor', 'xcit', 'lean', 2048, 'ok', 2100, 25.2, digest='b'),
            row('segmentor', 'xcit', 'stock', 2048, 'killed', note='rss'),
            row('segmentor', 'vit', 'lean', 1024, 'ok', 829, 22.0, digest='c'),
            row('segmentor', 'vit', 'lean', 2048, 'skipped', extrapolated_mb=13264),
            row('detector', 'swin', 'stock', 1024, 'ok', 700, 12.0, digest='d'),
            row('detector', 'swin', 'lean', 1024, 'ok', 650, 11.0, digest='e'),
            row('detector', 'swin', 'lean', 2048, 'error', note='exit 1'),
            row('detector', 'xcit', 'lean', 1024, 'ok', 600, 10.0, digest='f'),
            row('detector', 'xcit', 'bands', 1024, 'ok', 400, 11.0, digest='g'),
            row('detector', 'xcit', 'lean', 2048, 'ok', 1200, 20.0, digest='h'),
            row('detector', 'xcit', 'bands', 2048, 'ok', 700, 21.0, digest='h')]
    path = tmp_path / 'art.json'
    path.write_text(json.dumps(dict(meta=dict(cpu='CPU X', threads=2, torch='2.x', limit_gb=20.0,
                                              complete=True), rows=rows)))
    return str(path)


def test_markdown_prints_the_tables_of_an_artifact(tmp_path, capsys):
    """``--markdown JSON``: a table per task, a row per size, a column per (backbone, path)
    that ran, each status readable, and which stock / lean outputs agree."""
    wii.main(['--markdown', _artifact(tmp_path)])
    text = capsys.readouterr().out
    assert ('| image | XCiT-S12/16 stock | XCiT-S12/16 lean | ViT-S/16 lean |\n'
            '|---|---:|---:|---:|\n'
            '| 1024² | +1232 MB, 6.5 s | +586 MB, 6.3 s | +829 MB, 22 s |\n'
            '| 2048² | killed | +2100 MB, 25 s | skipped (>= +13264 MB) |\n') in text
    # the detector table: XCiT lean, bands, Swin-T stock, lean
    assert '| 2048² | +1200 MB, 20 s | +700 MB, 21 s |  | error |' in text
    assert 'Stock and lean outputs equal (digest): XCiT-S12/16 1024².' in text
    assert 'equal (digest): none; **different**: Swin-T 1024².' in text
    assert ('| image | XCiT-S12/16 lean | XCiT-S12/16 bands | Swin-T stock | Swin-T lean |\n'
            '|---|---:|---:|---:|---:|\n| 1024² | +600 MB, 10 s | +400 MB, 11 s |') in text
    assert ('Bands (`band_mb`) and lean: XCiT-S12/16 1024² differ (float rounding), '
            'XCiT-S12/16 2048² equal.') in text
    assert text.rstrip().endswith('CPU X, 2 threads, torch 2.x, limit 20.0 GiB RSS.')
    with pytest.raises(SystemExit) as exc:  # one report at a time
        wii.main(['--markdown', str(tmp_path / 'art.json'), '--plot', 'x'])
    assert exc.value.code == 2


def test_plot_writes_a_png(tmp_path):
    """``--plot JSON --png PATH`` writes a PNG image of a readable size."""
    png = tmp_path / 'plot.png'
    wii.main(['--plot', _artifact(tmp_path), '--png', str(png)])
    data = png.read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n'
    width, height = int.from_bytes(data[16:20], 'big'), int.from_bytes(data[20:24], 'big')
    assert 800 <= width <= 1200 and 600 <= height <= 1000
    bad = tmp_path / 'bad.json'
    bad.write_text(json.dumps(dict(meta={}, rows=[dict(task='segmentor')])))
    with pytest.raises(SystemExit) as exc:
        wii.main(['--plot', str(bad), '--png', str(png)])
    assert exc.value.code == 2


def test_tiled_accuracy_script_names_its_variants_and_rejects_bad_tiles(capsys):
    """``benchmarks/tiled_detection_accuracy.py``: whole first, bands only when asked, a tiles
    variant per SIZE:OVERLAP; a malformed or impossible tile is a usage error."""
    import tiled_detection_accuracy as tda
    assert tda.variants(None, [(128, 96)]) == [
        ('whole', {}), ('tiles 128/96', dict(mode='tiles', tile_size=128, tile_overlap=96))]
    assert tda.variants(64.0, [])[1] == ('bands', dict(band_mb=64.0))
    for bad in ('96', '96:96', 'a:1'):
        with pytest.raises(SystemExit) as exc:
            tda.main(['configs/shapes/mask_rcnn_xcit_shapes_coco.py', 'x.pth', '--tiles', bad])
        assert exc.value.code == 2
        assert 'expected SIZE:OVERLAP' in capsys.readouterr().err
