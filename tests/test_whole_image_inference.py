"""benchmarks/peak_memory.py on the CPU: its skipping rule, its run loop, ``--update`` and its
artifact, its children (stock, lean and stream outputs through the upstream doors, the budget and
network paths, the parts), its command line and its reports of the committed artifacts (their
bands rows included: the band paths went into the stream, and no longer run).

The children run small XCiTs (2 layers, 32 channels) in the paper configs' necks, heads and
pipelines, in this process; the run loop is driven by a stand-in runner. One run of the script
(a fresh child process) starts with the module, in the background.
"""
import argparse
import csv
import glob
import json
import os.path as osp
import sys

import pytest

from background import background_once

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, osp.join(ROOT, 'benchmarks'))
import peak_memory as pm  # noqa: E402
from xcit_benchmark.fresh_points import ROW, run_process  # noqa: E402

SMALL = """_base_ = [{base!r}]
model = dict(
    backbone=dict(arch=dict(_delete_=True, embed_dims=32, depth=2, num_heads=4),
                  out_indices=(0, 0, 1, 1)),
    neck=dict(in_channels=[32] * 4, out_channels=32),
"""
SMALL_HEADS = {
    'segmentor': 'decode_head=dict(in_channels=[32] * 4, channels=16))\n',
    # fewer proposals: NMS over 1000 x 80 boxes would be most of the time
    'detector': """rpn_head=dict(in_channels=32, feat_channels=32),
    roi_head=dict(bbox_roi_extractor=dict(out_channels=32),
                  bbox_head=dict(in_channels=32, fc_out_channels=64),
                  mask_roi_extractor=dict(out_channels=32),
                  mask_head=dict(in_channels=32, conv_out_channels=32)),
    test_cfg=dict(rpn=dict(nms_pre=100, max_per_img=50), rcnn=dict(max_per_img=20)))
"""}
RESULTS = osp.join(ROOT, 'docs', 'results')
# one torch thread (the script's run has the other core) and a frozen heap (the measurement's
# gc.collect() calls over a pytest process's heap would be most of the time): conftest.py
pytestmark = pytest.mark.usefixtures('one_torch_thread', 'frozen_heap')


def _write_small(directory, task) -> str:
    path = osp.join(directory, f'small_{task}.py')
    with open(path, 'w') as f:
        f.write(SMALL.format(base=osp.join(ROOT, pm.CONFIGS[(task, 'xcit')]))
                + '    ' + SMALL_HEADS[task])
    return path


@pytest.fixture(scope='module')
def small(tmp_path_factory):
    """The small configs; the detector's also gives every detector its test settings."""
    directory = tmp_path_factory.mktemp('small')
    configs = {task: _write_small(str(directory), task) for task in pm.TASKS}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(pm.CONFIGS, ('detector', 'xcit'), configs['detector'])
        yield configs


@pytest.fixture(scope='module', autouse=True)
def script_run(tmp_path_factory):
    """``peak_memory.py`` end to end from another directory: one point of the small Semantic
    FPN in a fresh child process (once per session), while the other tests run."""
    def cmd(out_dir):
        config = _write_small(str(out_dir), 'segmentor')
        return [sys.executable, osp.join(ROOT, 'benchmarks', 'peak_memory.py'), '--tasks',
                'segmentor', '--backbones', 'xcit', '--paths', 'lean', '--sizes', '64',
                '--config', f'segmentor:xcit={config}', '--out', str(out_dir / 'run'),
                '--limit-gb', '8']
    return background_once(tmp_path_factory, 'peak_memory_script', cmd, timeout=300)


def test_why_not_extrapolates_by_the_pixels_and_stops_after_a_failure():
    """Skipped when the previous size's RSS before the call plus its growth times the pixel
    ratio passes the limit, after any point that did not finish, and once the deadline passed;
    a budget point does not depend on the one before."""
    def why(previous, size, limit_mb, path='lean', deadline=float('inf')):
        return pm.why_not(previous, dict(path=path, size=size), deadline, limit_mb)

    assert why(None, 1024, 20480) == {}
    prev = dict(status='ok', size=2048, peak_growth_mb=4000, base_mb=700)
    assert why(prev, 4096, 20480) == {}  # 700 + 4 x 4000 = 16700 MB
    skipped = why(prev, 4096, 16000)
    assert skipped['status'] == 'skipped'
    assert skipped['note'].startswith('not run: extrapolated peak RSS 16.3 GiB')
    assert '4 x growth 4000' in skipped['note'] and skipped['extrapolated_mb'] == 16000
    assert '16 x growth' in why(dict(prev, size=1024), 4096, 64000)['note']
    assert why(prev, 8192, None) == {}  # no limit: only failures stop
    for status in ('killed', 'error', 'skipped', 'oom'):
        assert why(dict(status=status, size=4096), 8192, None) == \
            dict(status='skipped', note=f'not run: {status} at 4096')
        assert why(dict(status=status, size=4096), 8192, None, path='auto') == {}
    assert why(None, 1024, None, deadline=0) == dict(status='skipped',
                                                     note='not run: the budget was spent')


def _args(**kw):
    base = dict(limit_gb=10.0, timeout=99.0, out=None, note=None, tasks=['segmentor'],
                backbones=['xcit'], paths=['stock', 'lean'], sizes=[1024], update=False,
                pipeline='full', device='cpu', budgets=[], warmup=64, repeat_below_s=0.0,
                parts=False, budget_s=float('inf'), grace_s=1.0, log=None)
    return argparse.Namespace(**dict(base, **kw))


def test_run_skips_in_size_order_and_writes_the_artifact(tmp_path):
    """The run loop with a stand-in child: sizes in increasing order (bands, lean, then stock),
    no child for a skipped point, the artifact rewritten after each point and complete at the
    end; budget points last, never skipped."""
    growth = {('lean', 1024): 300, ('lean', 2048): 1200, ('lean', 4096): 4800,
              ('stock', 1024): 600, ('stock', 2048): 2000, ('auto', 4096): 900}
    calls = []

    def runner(group, spec, args, on_row):
        (point,) = group
        calls.append((point['path'], point['size']))
        assert args.limit_gb == 10.0 and spec['device'] == 'cpu'
        if (point['path'], point['size']) not in growth:
            return on_row(dict(point, status='killed', note='rss'))
        on_row(dict(point, status='ok', peak_growth_mb=growth[(point['path'], point['size'])],
                    base_mb=700, time_s=1.5, digest=f"d{point['size']}"))

    out = str(tmp_path / 'art')
    args = _args(out=out, sizes=[8192, 1024, 4096, 2048], paths=['stock', 'lean', 'auto'],
                 budgets=[[4096, 2000]])
    rows = pm.run(args, dict(pm.CONFIGS), runner=runner)
    assert calls == [(p, s) for s in (1024, 2048, 4096) for p in ('lean', 'stock')] + \
        [('auto', 4096)]
    assert [(r['path'], r['size'], r['status']) for r in rows[-3:]] == \
        [('lean', 8192, 'skipped'), ('stock', 8192, 'skipped'), ('auto', 4096, 'ok')]
    assert rows[5]['status'] == 'killed' and rows[-2]['note'] == 'not run: killed at 4096'
    assert rows[-3]['extrapolated_mb'] == 4 * 4800 and '19.4 GiB' in rows[-3]['note']
    assert rows[-1]['max_memory'] == 2000 and all(r['point_wall_s'] >= 0 for r in rows)
    with open(out + '.csv') as f:
        table = list(csv.reader(f))
    assert table[0] == ['task', 'backbone', 'path', 'size', 'max_memory', 'status',
                        'peak_growth_mb', 'time_s', 'digest', 'note']
    assert table[1] == ['segmentor', 'xcit', 'lean', '1024', '', 'ok', '300', '1.5', 'd1024', '']
    with open(out + '.json') as f:
        artifact = json.load(f)
    meta = artifact['meta']
    assert meta['complete'] and meta['device_info']['device'] == 'cpu'
    assert {'cpu', 'threads', 'command', 'torch', 'limit_gb', 'configs'} <= set(meta)
    assert meta['stock_equals_lean'] == {f'segmentor:xcit:{s}': True for s in (1024, 2048)}
    assert artifact['rows'] == json.loads(json.dumps(rows))


def test_update_measures_some_points_again_and_keeps_the_others(tmp_path):
    """``--update``: the rows at ``--out`` that the run does not measure stay (with the command
    that measured them), the others are replaced or added."""
    out = str(tmp_path / 'art')

    def runner(group, spec, args, on_row):
        for p in group:
            on_row(dict(p, status='ok', peak_growth_mb=p['size'] // 4, base_mb=7, time_s=1.0,
                        digest=p['path'][0]))

    pm.run(_args(out=out, tasks=['detector'], sizes=[1024, 2048]), pm.CONFIGS, runner)
    pm.run(_args(out=out, tasks=['detector'], paths=['stream', 'lean'], sizes=[2048, 4096],
                 update=True), pm.CONFIGS, runner)
    with open(out + '.json') as f:
        artifact = json.load(f)
    assert sorted((r['path'], r['size']) for r in artifact['rows']) == [
        ('lean', 1024), ('lean', 2048), ('lean', 4096), ('stock', 1024), ('stock', 2048),
        ('stream', 2048), ('stream', 4096)]
    meta = artifact['meta']
    assert len(meta['earlier_commands']) == 1 and meta['sizes'] == [1024, 2048, 4096]
    assert meta['stock_equals_lean'] == {'detector:xcit:1024': False,
                                         'detector:xcit:2048': False}


def test_a_child_that_raises_reports_the_point_it_stopped_at(monkeypatch):
    """A child that raised (its exception row, exit 1, as fresh_points.child_main reports it):
    the point it stopped at an 'error' with the stderr's last lines, the series' next skipped."""
    def fresh(target, payload, limit_bytes, seconds, on_row):
        assert target == 'peak_memory:child' and payload['points'] == points
        reported = [dict(payload['points'][0], status='ok'),
                    dict(status='error', note='OSError: boom')]
        child = (f'import json, sys; [print({ROW!r} + json.dumps(r)) for r in {reported!r}]; '
                 'sys.exit("Traceback\\nOSError: boom")')  # exit status 1, stderr's lines
        return run_process([sys.executable, '-c', child], 2**34, 60, on_row=on_row)

    rows, points = [], [dict(task='segmentor', backbone='xcit', path='lean', size=s)
                        for s in (64, 128, 256)]
    monkeypatch.setattr(pm, 'run_fresh', fresh)
    pm.run_child(points, dict(deadline=float('inf')), _args(), rows.append)
    assert [r['status'] for r in rows] == ['ok', 'error', 'skipped'], rows
    assert rows[1]['size'] == 128 and rows[1]['note'] == 'exit 1: Traceback | OSError: boom'
    assert rows[2]['note'] == 'not run: error at 128'


@pytest.mark.parametrize('argv, message', [
    (['--sizes', '1000'], 'multiple of 32'),
    (['--sizes', '32'], 'at least 64'),
    (['--sizes', '1024', '1024'], 'each size once'),
    (['--limit-gb', '0'], 'must be positive'),
    (['--tasks', 'classifier'], 'invalid choice'),
    (['--paths', 'auto'], 'needs --budgets'),
    (['--paths', 'auto', '--budgets', '8192'], 'SIZE:MB'),
    (['--paths', 'auto', '--budgets', 'a:b'], 'SIZE:MB'),
    (['--pipeline', 'network'], 'segmentor only'),
    (['--config', 'segmentor:resnet=x.py'], 'TASK:BACKBONE=PATH'),
    (['--config', 'segmentor:xcit=/no/such/config.py'], 'config not found'),
    (['--config', 'detector:swin=mmpose::x.py'], 'the prefix must be mmdet:: or mmseg::'),
    (['--update', '--out', '/no/such/artifact'], '--update needs --out'),
    (['--paths', 'lean', 'bands'], "--paths bands: both models' band paths went into the stream "
                                   "(test_cfg.mode='stream', band_mb its band size): run --paths "
                                   'stream'),
    (['--report', '/no/such.json'], 'cannot read'),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys, monkeypatch):
    """Every bad argument stops before any point runs, with exit status 2 and a message."""
    monkeypatch.setattr(pm, 'run', lambda *args, **kwargs: pytest.fail('points would run'))
    with pytest.raises(SystemExit) as exc:
        pm.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _child(points, **spec):
    """The rows a child reports for ``points`` (one series), run in this process."""
    spec = dict(dict(device='cpu', warmup=64, deadline=float('inf')), points=points, **spec)
    return [json.loads(json.dumps(row)) for row in pm.child(spec)]  # as the parent reads them


@pytest.mark.parametrize('task', pm.TASKS)
def test_stock_lean_and_stream_give_the_same_output_through_the_doors(task, small):
    """Each path's child on the small model at 96 px through the upstream door: the network ran
    at the image size, stock and lean outputs have equal digests, the stream's nearly equal ones
    (one core: the whole image, up to rounding); the detector keeps exactly its ``max_per_img``
    detections, and ``--parts`` gives the peak of each of its parts, none above the call's."""
    rows = {}
    near = 'stream'
    for path in ('stock', 'lean', near):
        (rows[path],) = _child([dict(task=task, backbone='xcit', path=path, size=96,
                                     config=small[task])], parts=path == 'lean')
        assert rows[path]['status'] == 'ok', rows[path]
        assert rows[path]['peak_growth_mb'] >= 0 and rows[path]['base_mb'] > 0
    stock, lean, stream = rows['stock'], rows['lean'], rows[near]
    assert (stock['type'], lean['type']) == (
        ('EncoderDecoder', 'LeanEncoderDecoder') if task == 'segmentor'
        else ('MaskRCNN', 'LeanMaskRCNN'))
    assert stock['digest'] == lean['digest'] and stream['out_shape'] == lean['out_shape']
    if task == 'segmentor':
        assert lean['out_shape'] == [1, 96, 96] and stock['labels_sum'] == lean['labels_sum']
        assert abs(stream['labels_sum'] - lean['labels_sum']) <= 0.01 * lean['labels_sum']
    else:
        assert lean['out_shape'] == [20, 96, 96] and lean['num_dets'] == 20
        assert abs(stream['mask_pixels'] - lean['mask_pixels']) <= 0.01 * lean['mask_pixels']
        parts = {p['part']: p for p in lean['parts']}
        assert {'lean_features', 'lean_rpn', 'lean_roi', 'mask_paste'} <= set(parts)
        assert max(p['peak_mb'] for p in parts.values()) <= lean['peak_growth_mb']


def test_a_series_stops_after_a_failure_but_budget_points_do_not(small, monkeypatch):
    """One child, one model, its points in order (CUDA's series): after a failed size the larger
    ones are not run; budget points run whatever the one before did; past the deadline nothing
    starts."""
    monkeypatch.setattr(pm, 'measure_point', lambda model, infer, point, spec: dict(
        status='error' if point['size'] == 128 else 'ok', peak_growth_mb=1, base_mb=1))
    point = dict(task='segmentor', backbone='xcit', path='lean', config=small['segmentor'])
    auto = dict(point, path='auto', size=128)
    rows = _child([dict(point, size=s) for s in (64, 128, 256)]
                  + [dict(auto, max_memory=1), dict(auto, max_memory=2)])
    assert [(r['status'], r.get('note')) for r in rows] == [
        ('ok', None), ('error', None), ('skipped', 'not run: error at 128'), ('error', None),
        ('error', None)]
    rows = _child([dict(point, size=64, config='no model is built')], deadline=0)
    assert rows[0]['note'] == 'not run: the budget was spent'
    args = pm.make_parser().parse_args(['--device', 'cuda', '--backbones', 'xcit', 'uper'])
    args.budgets = [[4096, 100]]
    args.paths = ['stock', 'lean', 'auto']
    groups = pm.groups(pm.plan(args, pm.CONFIGS), 'cuda')
    assert [(g[0]['task'], g[0]['backbone'], g[0]['path'], len(g)) for g in groups] == [
        ('segmentor', 'xcit', 'lean', 4), ('segmentor', 'xcit', 'stock', 4),
        ('segmentor', 'xcit', 'auto', 1), ('segmentor', 'uper', 'lean', 4),
        ('segmentor', 'uper', 'stock', 4), ('detector', 'xcit', 'lean', 4),
        ('detector', 'xcit', 'stock', 4), ('detector', 'xcit', 'auto', 1)]
    assert all(p['device'] == 'cuda' for g in groups for p in g)


def test_budget_points_report_the_plan_and_its_estimate(small, tmp_path, monkeypatch):
    """``auto``: each point runs the plan its budget allows (the whole image within a large
    one, the stream within a small one) and reports it with its estimate, the peak of ``predict``
    (the input exists before it), the estimate's error and the line (given here: no
    calibration); a detector as a segmentor."""
    line = 'model = dict(test_cfg=dict(memory_model=dict(base_mb=10, mb_per_mpix=100)))'
    configs = {}
    for task in pm.TASKS:
        configs[task] = tmp_path / f'line_{task}.py'
        configs[task].write_text(f'_base_ = [{small[task]!r}]\n{line}')
    monkeypatch.setitem(pm.CONFIGS, ('detector', 'xcit'), str(configs['detector']))
    point = dict(task='segmentor', backbone='xcit', path='auto', size=768,
                 config=str(configs['segmentor']))
    whole, slide = _child([dict(point, max_memory=1000), dict(point, max_memory=400)])
    # within the small budget the stream runs (its bands shrunk to fit: its estimate follows
    # the budget), before windows
    assert (whole['plan'], slide['plan']) == ('whole', 'stream'), (whole, slide)
    # whole is admitted by its bound, which measures nothing at this size and is never below
    # the estimate the full plans measure
    assert whole['estimates'] == {'whole': whole['estimate_mb']}
    assert whole['estimates']['whole'] >= slide['estimates']['whole'] > 400
    (det,) = _child([dict(point, task='detector', size=128, config=str(configs['detector']),
                          max_memory=10**5)])
    assert det['plan'] == 'whole' and det['num_dets'] == 20, det
    for row in (whole, slide, det):
        assert row['status'] == 'ok' and row['memory_model'] == [10, 100]
        assert 0 < row['predict_peak_growth_mb'] <= row['peak_growth_mb']
        assert row['error_pct'] == pytest.approx(  # both MB figures rounded: +-1 MB
            100 * (row['predict_peak_growth_mb'] / row['estimate_mb'] - 1),
            abs=100 / row['estimate_mb'] + 0.1)
        assert row['within_budget'] is (row['predict_peak_growth_mb'] <= row['max_memory'])


def test_network_and_paper_pipelines(small):
    """``--pipeline network``: the segmentor's network alone, lean and stock logits equal;
    ``paper`` keeps the config's test Resize."""
    point = dict(task='segmentor', backbone='xcit', size=64, config=small['segmentor'],
                 pipeline='network')
    (lean,) = _child([dict(point, path='lean')])
    (stock,) = _child([dict(point, path='stock')])
    assert lean['digest'] == stock['digest'] and lean['out_shape'] == [1, 150, 16, 16]
    cfg = pm.build_cfg(dict(point, pipeline='paper', path='lean'))
    assert any(t['type'] == 'Resize' for t in cfg.test_pipeline)


def test_each_path_builds_the_model_the_cpu_page_names():
    """The CPU page's table names each path's model; its bands rows (report only) name the
    ``band_mb`` they were measured with and say that the path went into the stream, which no
    longer takes band_mb with mode='whole'; the stream paths keep their token maps in memory or
    on disk (``test_cfg.token_maps``); the detector's tiles path is ``mode='tiles'``."""
    with open(osp.join(ROOT, 'docs', 'benchmark_high_resolution.md')) as f:
        table = {line.split('|')[1].strip(): line.split('|')[2:4] for line in f
                 if line.startswith('| stock / lean |') or line.startswith('| bands |')}
    for column, task in enumerate(pm.TASKS):
        point = dict(task=task, backbone='xcit', size=64, config=pm.CONFIGS[(task, 'xcit')])
        types = [pm.build_cfg(dict(point, path=p)).model.type for p in ('stock', 'lean')]
        assert ' / '.join(f'`{t}`' for t in types) == table['stock / lean'][column].strip()
        assert f"`{types[1]}`, `test_cfg.band_mb=64`" in table['bands'][column]
        assert 'went into the stream' in table['bands'][column]
        assert 'bands' not in pm.TEST_CFGS and 'bands' in pm.REPORT_ONLY
    for path, maps in (('stream', 'memory'), ('stream-disk', 'disk')):
        test_cfg = pm.build_cfg(dict(point, task='segmentor', path=path,
                                     config=pm.CONFIGS[('segmentor', 'xcit')])).model.test_cfg
        assert (test_cfg.mode, test_cfg.token_maps) == ('stream', maps)
    tiles = pm.build_cfg(dict(point, task='detector', path='tiles', mask_format='rle',
                              config=pm.CONFIGS[('detector', 'xcit')])).model
    assert (tiles.type, tiles.test_cfg.mode, tiles.test_cfg.mask_format) == (
        'LeanMaskRCNN', 'tiles', 'rle')


def _artifact(tmp_path) -> str:
    """A small artifact with every status, as the script writes it."""
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
            row('detector', 'xcit', 'bands', 2048, 'ok', 700, 21.0, digest='h'),
            row('detector', 'xcit', 'auto', 2048, 'ok', 800, 9.5, max_memory=1000, plan='tiles',
                estimate_mb=900)]
    path = tmp_path / 'art.json'
    path.write_text(json.dumps(dict(meta=dict(cpu='CPU X', threads=2, torch='2.x', limit_gb=20.0,
                                              complete=True), rows=rows)))
    return str(path)


def test_a_detector_takes_the_xcit_detectors_test_settings_at_the_image_size(tmp_path):
    """Every detector series runs XCiT Mask R-CNN's ``test_cfg`` with ``score_thr=0`` (the same
    RoI work for every backbone), its test Resize at scale factor 1 (the image's own size)."""
    from mmengine.config import Config
    config = tmp_path / 'other_detector.py'
    config.write_text(f"_base_ = {osp.join(ROOT, pm.CONFIGS[('detector', 'vit')])!r}\n"
                      "model = dict(test_cfg=dict(rcnn=dict(max_per_img=7, score_thr=0.5)))\n")
    cfg = pm.build_cfg(dict(task='detector', backbone='vit', path='lean', config=str(config)))
    xcit = Config.fromfile(osp.join(ROOT, pm.CONFIGS[('detector', 'xcit')])).model.test_cfg
    xcit.rcnn.score_thr = 0.0  # (the small fixture's config while it is active)
    assert cfg.model.test_cfg == xcit and xcit.rcnn.max_per_img != 7
    (resize,) = [t for t in cfg.test_dataloader.dataset.pipeline if t['type'] == 'Resize']
    assert resize['scale_factor'] == 1.0 and 'scale' not in resize


def test_report_prints_the_tables_and_draws_the_plot(tmp_path, capsys):
    """``--report JSON``: a table per task, a row per size, a column per (backbone, path) that
    ran, each status readable, which outputs agree, the budget points; and a PNG."""
    png = tmp_path / 'plot.png'
    pm.main(['--report', _artifact(tmp_path), '--png', str(png)])
    text = capsys.readouterr().out
    assert ('| image | XCiT-S12/16 stock | XCiT-S12/16 lean | ViT-S/16 lean |\n'
            '|---|---:|---:|---:|\n'
            '| 1024² | +1232 MB, 6.5 s | +586 MB, 6.3 s | +829 MB, 22 s |\n'
            '| 2048² | killed | +2100 MB, 25 s | skipped (>= +13264 MB) |\n') in text
    assert '| 2048² | +1200 MB, 20 s | +700 MB, 21 s |  | error |' in text
    assert 'Stock and lean outputs equal (digest): XCiT-S12/16 1024².' in text
    assert 'equal (digest): none; **different**: Swin-T 1024².' in text
    assert ('Bands (`band_mb`) and lean: XCiT-S12/16 1024² differ (float rounding), '
            'XCiT-S12/16 2048² equal.') in text
    assert '| 2048² | 1000 | tiles | 900 | 800 |  | 9.5 |' in text
    assert text.rstrip().endswith('CPU X, 2 threads, torch 2.x, limit 20.0 GiB RSS.')
    data = png.read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n'
    width, height = int.from_bytes(data[16:20], 'big'), int.from_bytes(data[20:24], 'big')
    assert 800 <= width <= 1200 and 600 <= height <= 1000
    bad = tmp_path / 'bad.json'
    bad.write_text(json.dumps(dict(meta={}, rows=[dict(task='segmentor')])))
    with pytest.raises(SystemExit) as exc:
        pm.main(['--report', str(bad)])
    assert exc.value.code == 2


def test_both_reports_plot_on_log_log_axes_with_a_tick_at_each_size():
    """report.log_log_axes, which peak_memory's and benchmark.py's plots share: both axes
    logarithmic, a labelled tick at each measured size, plain numbers on the y axis."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from xcit_benchmark.report import log_log_axes
    fig, ax = plt.subplots()
    ax.plot([512, 2048], [0.3, 40])
    log_log_axes(ax, [512, 1024, 2048], 'time (s)', 'a title')
    fig.canvas.draw()
    assert (ax.get_xscale(), ax.get_yscale()) == ('log', 'log')
    assert list(ax.get_xticks()) == [512, 1024, 2048]
    assert [t.get_text() for t in ax.get_xticklabels()] == ['512²', '1024²', '2048²']
    assert ax.get_xlim() == pytest.approx((512 / 1.25, 2048 * 1.25))
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert {'0.5', '1', '2', '5', '10', '20'} <= set(labels)
    assert (ax.get_ylabel(), ax.get_title()) == ('time (s)', 'a title')
    plt.close(fig)


def test_committed_artifacts_are_the_scripts_and_the_cpu_page_quotes_its_tables(tmp_path,
                                                                                capsys):
    """Every peak-memory artifact under docs/results is one of this script (its rows, the
    CSV's columns, a command of it, a report); the high-resolution page quotes the report of
    its artifact."""
    names = sorted(osp.basename(p)[:-5] for p in glob.glob(osp.join(RESULTS, '*.json'))
                   if osp.basename(p).startswith(('whole_image', 'lean_', 'memory_budget')))
    assert len(names) == 10
    reports = {}
    for name in names:
        artifact = pm.load_artifact(osp.join(RESULTS, name + '.json'))
        meta = artifact['meta']
        for command in meta.get('earlier_commands', []) + [meta['command']]:
            assert command.startswith('python benchmarks/peak_memory.py '), name
        with open(osp.join(RESULTS, name + '.csv')) as f:
            table = list(csv.DictReader(f))
        assert list(table[0]) == [c for c in pm.COLUMNS if c == 'note' or any(
            c in r for r in artifact['rows'])], name
        assert [r['peak_growth_mb'] for r in table] == [
            str(r.get('peak_growth_mb', '')) for r in artifact['rows']], name
        pm.main(['--report', osp.join(RESULTS, name + '.json'), '--png', str(tmp_path / 'p.png')])
        reports[name] = capsys.readouterr().out
    with open(osp.join(ROOT, 'docs', 'benchmark_high_resolution.md')) as f:
        assert reports['whole_image_inference'] in f.read()


def test_tiled_accuracy_script_names_its_variants_and_rejects_bad_tiles(capsys):
    """``benchmarks/tiled_detection_accuracy.py``: whole first, a stream variant per SIZE:MARGIN
    (``--band-mb`` its bands; it had a bands variant of the whole path, which went into the
    stream), a tiles variant per SIZE:OVERLAP; a malformed or impossible tile, or --band-mb
    without a stream, is a usage error."""
    import tiled_detection_accuracy as tda
    assert tda.variants(None, [(128, 96)]) == [
        ('whole', {}), ('tiles 128/96', dict(mode='tiles', tile_size=128, tile_overlap=96))]
    assert tda.variants(64.0, [], [(128, 64)]) == [
        ('whole', {}),
        ('stream 128/64', dict(mode='stream', tile_size=128, feature_margin=64, band_mb=64.0))]
    with pytest.raises(SystemExit) as exc:
        tda.main(['configs/shapes/mask_rcnn_xcit_shapes_coco.py', 'x.pth', '--band-mb', '64'])
    assert exc.value.code == 2
    assert "--band-mb sets the stream's bands" in capsys.readouterr().err
    for bad in ('96', '96:96', 'a:1'):
        with pytest.raises(SystemExit) as exc:
            tda.main(['configs/shapes/mask_rcnn_xcit_shapes_coco.py', 'x.pth', '--tiles', bad])
        assert exc.value.code == 2
        assert 'expected SIZE:OVERLAP' in capsys.readouterr().err


def test_script_runs_a_point_in_a_fresh_process_and_writes_the_artifact(script_run):
    status, out_dir = script_run()
    assert status == 0, (out_dir / 'stderr.txt').read_text()[-3000:]
    config = osp.join(str(out_dir), 'small_segmentor.py')
    with open(out_dir / 'run.csv') as f:
        (row,) = list(csv.DictReader(f))
    assert list(row) == ['task', 'backbone', 'path', 'size', 'status', 'peak_growth_mb',
                         'time_s', 'cpu_s', 'digest', 'note']
    assert (row['task'], row['backbone'], row['path'], row['size'], row['status']) == \
        ('segmentor', 'xcit', 'lean', '64', 'ok')
    assert int(row['peak_growth_mb']) > 0 and len(row['digest']) == 16
    assert 0 < float(row['cpu_s']) < 10 * float(row['time_s']) + 1  # the call's CPU seconds
    with open(out_dir / 'run.json') as f:
        artifact = json.load(f)
    (row,) = artifact['rows']
    assert row['config'] == config and row['out_shape'] == [1, 64, 64] and row['base_mb'] > 0
    meta = artifact['meta']
    assert meta['complete'] and meta['limit_gb'] == 8.0 and meta['device_info']['device'] == 'cpu'


def test_tiled_accuracy_larger_than_scores_the_large_objects_alone(tmp_path):
    """``--larger-than PX`` (``larger_objects_ap``): AP over the objects whose box is wider or
    taller than PX, the others ignore regions: with the large object found and the small one
    missed, AP 1 (it would be about 0.5 if the small one counted); no large object is an
    error."""
    import numpy as np
    import pycocotools.mask as mask_util
    import tiled_detection_accuracy as tda
    boxes = {1: [10, 10, 80, 60], 2: [120, 120, 20, 20]}  # a large object, a small one

    def square(box):
        x, y, w, h = box
        grid = np.zeros((200, 200), np.uint8, order='F')
        grid[y:y + h, x:x + w] = 1
        rle = mask_util.encode(grid)
        rle['counts'] = rle['counts'].decode()
        return rle

    truth = dict(images=[dict(id=1, width=200, height=200, file_name='a.jpg')],
                 categories=[dict(id=1, name='shape')],
                 annotations=[dict(id=i, image_id=1, category_id=1, bbox=box, iscrowd=0,
                                   area=box[2] * box[3], segmentation=square(box))
                              for i, box in boxes.items()])
    ann_file = tmp_path / 'truth.json'
    ann_file.write_text(json.dumps(truth))
    prefix = str(tmp_path / 'dets')
    dets = [dict(image_id=1, category_id=1, bbox=boxes[1], score=0.6)]
    with open(prefix + '.bbox.json', 'w') as f:
        json.dump(dets, f)
    with open(prefix + '.segm.json', 'w') as f:
        json.dump([dict(d, segmentation=square(d['bbox'])) for d in dets], f)
    row = tda.larger_objects_ap(str(ann_file), prefix, 64)
    assert row['larger_64/objects'] == 1
    for kind in ('bbox', 'segm'):
        assert row[f'larger_64/{kind}_mAP'] == 1.0 and row[f'larger_64/{kind}_mAP_50'] == 1.0
    with pytest.raises(SystemExit, match='no object of .* is larger than that'):
        tda.larger_objects_ap(str(ann_file), prefix, 100)
