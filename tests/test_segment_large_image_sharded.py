# Copyright (c) xcit_mm contributors. All rights reserved.
"""tools/segment_large_image.py over several processes (``--launcher pytorch`` under torchrun,
``--launcher slurm`` under srun; gloo on the CPU): the ranks stream slabs of one scene and the
first writes the outputs, which a GIS user opens as one raster and one layer, the same as one
process writes. A rank that fails stops the run with one line naming it and leaves no output.

The model and the GeoTIFFs are test_segment_large_image's (a small XCiT Semantic FPN, random
weights; files written by GDAL through rasterio). The expected outputs are the tool's own in one
process, which that file checks against mmseg's ``inference_model``.
"""
import os
import os.path as osp
import subprocess
import sys

import numpy as np
from test_large_image_instances import _geotiff as _detector_geotiff
from test_large_image_instances import _scene as _detector_scene
from test_large_image_instances import tiny as tiny_detector  # noqa: F401
from test_segment_large_image import _corrupt_tile, _geotiff, _image, tiny, tool  # noqa: F401

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TOOL = osp.join(ROOT, 'tools', 'segment_large_image.py')


def _one_thread_env(**more) -> dict:
    """The environment of the tool's processes: one torch thread each, this checkout first."""
    return dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1',
                PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]), **more)


def _torchrun(ranks: int, args, tmp_path, port: int):
    """The tool under torchrun, ``ranks`` processes of one thread each, on this machine."""
    env = _one_thread_env()
    return subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', str(ranks),
         '--master-addr', '127.0.0.1', '--master-port', str(port), TOOL] + list(args)
        + ['--launcher', 'pytorch'], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600)


def _torchrun_on_machines(ranks_per_machine, args, tmp_path, port: int):
    """The tool as torchrun starts it on several machines (one torchrun a machine, meeting at
    torchrun's c10d rendezvous, each with its own number of processes), here all on this one:
    ranks and local ranks differ, as across machines. Returns the machines' runs."""
    env = _one_thread_env()
    machines = [subprocess.Popen(
        [sys.executable, '-m', 'torch.distributed.run', '--nnodes', str(len(ranks_per_machine)),
         '--nproc-per-node', str(ranks), '--rdzv-backend', 'c10d',
         '--rdzv-endpoint', f'127.0.0.1:{port}', '--rdzv-id', 'scene', TOOL] + list(args)
        + ['--launcher', 'pytorch'], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for ranks in ranks_per_machine]
    runs = []
    for machine in machines:
        stdout, stderr = machine.communicate(timeout=600)
        runs.append(subprocess.CompletedProcess(machine.args, machine.returncode, stdout, stderr))
    return runs


def _srun(ranks: int, args, tmp_path, port: int):
    """The tool as ``srun --ntasks N python tools/segment_large_image.py ... --launcher slurm``
    runs it, with test_reliability's stand-ins for srun and scontrol (no cluster here): each
    task gets slurm's variables, and the tool takes its rank, the world size and the master's
    address from them, as mmengine's slurm launcher does."""
    from test_reliability import _FAKE_SCONTROL, _FAKE_SRUN
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir(exist_ok=True)
    for name, text in (('srun', _FAKE_SRUN.format(python=sys.executable)),
                       ('scontrol', _FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _one_thread_env(MASTER_PORT=str(port), PATH=f'{bin_dir}:{os.environ["PATH"]}',
                          FAKE_SRUN_RECORD=str(tmp_path / 'srun.json'))
    for key in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR'):
        env.pop(key, None)
    return subprocess.run(['srun', '--ntasks', str(ranks), sys.executable, TOOL] + list(args)
                          + ['--launcher', 'slurm'], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def _polygons(path):
    """Each class's polygons, unioned: {class_id: geometry}, and the layer's CRS."""
    import pyogrio
    import shapely
    meta, _, geometry, fields = pyogrio.raw.read(path)
    classes = fields[list(meta['fields']).index('class_id')]
    shapes = shapely.from_wkb(geometry)
    unions = {int(c): shapely.union_all(shapes[classes == c]) for c in np.unique(classes)}
    return unions, meta['crs']


def test_three_ranks_write_what_one_process_writes(tool, tiny, tmp_path):  # noqa: F811
    """A 200 x 300 GeoTIFF with a nodata corner over 3 ranks on two "machines" (two torchruns
    of 2 and 1 processes at one rendezvous; 13 token rows: slabs of 4 and 5 rows, thinner than
    the stream's margin): the labels, confidence and polygons as the tool writes them in one
    process, placed by GDAL over the input; the ranks' files are gone."""
    import rasterio
    config, checkpoint, _ = tiny
    scene = _geotiff(tmp_path / 'scene.tif', _image())
    outputs = dict(one={}, three={})
    for name, outs in outputs.items():
        outs.update(labels=str(tmp_path / f'{name}.tif'),
                    confidence=str(tmp_path / f'{name}_c.tif'),
                    polygons=str(tmp_path / f'{name}.gpkg'))
    args = lambda outs: [config, checkpoint, scene, '--out', outs['labels'],  # noqa: E731
                         '--confidence', outs['confidence'], '--vector', outs['polygons']]
    assert tool.main(args(outputs['one'])) == 0
    runs = _torchrun_on_machines([2, 1], args(outputs['three']), tmp_path, 29631)
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert sum(run.stdout.count('written: ') for run in runs) == 1  # rank 0 writes, says so
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith('three')) == [
        'three.gpkg', 'three.tif', 'three.tif.aux.xml', 'three_c.tif']
    one, three = outputs['one'], outputs['three']
    for kind, agree in (('labels', 0.9999), ('confidence', 0.999)):
        with rasterio.open(one[kind]) as a, rasterio.open(three[kind]) as b, \
                rasterio.open(scene) as src:
            assert (b.transform, b.crs, b.shape) == (src.transform, src.crs, src.shape)
            assert (a.nodata, a.dtypes, a.block_shapes) == (b.nodata, b.dtypes, b.block_shapes)
            expected, got = a.read(1), b.read(1)
            assert (expected == b.nodata).sum() > 0  # the corner without data
            assert np.array_equal(expected == a.nodata, got == b.nodata)
            assert (expected == got).mean() >= agree, kind
            assert len(np.unique(expected)) > 2
    expected, crs = _polygons(one['polygons'])
    got, got_crs = _polygons(three['polygons'])
    assert got_crs == crs and sorted(got) == sorted(expected)
    total = sum(g.area for g in expected.values())
    assert sum(expected[c].symmetric_difference(got[c]).area for c in got) <= 1e-4 * total


def test_two_slurm_tasks_write_the_instances_one_process_writes(tool, tiny_detector, tmp_path):  # noqa: F811,E501
    """Mask R-CNN (test_large_image_instances' tiny detector, cores of 128 px on a 200 x 300
    GeoTIFF with a nodata collar: two rows of cores, one a rank), under srun (``--launcher
    slurm``; the segmentor's runs above use torchrun): the first rank merges every rank's rows
    of cores as one process merges its own and writes the GeoPackage, which holds one process's
    instances (classes, scores, mask polygons) in the input's CRS; no rank file is left."""
    import pyogrio
    import shapely
    config, checkpoint, _ = tiny_detector
    scene = _detector_geotiff(tmp_path / 'scene.tif', _detector_scene()[0])
    one, two = str(tmp_path / 'one.gpkg'), str(tmp_path / 'two.gpkg')
    assert tool.main([config, checkpoint, scene, '--out', one]) == 0
    run = _srun(2, [config, checkpoint, scene, '--out', two], tmp_path, 29655)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count('written: ') == 1
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith('two')) == ['two.gpkg']
    (meta, _, want_geometry, want), (got_meta, _, got_geometry, got) = (
        pyogrio.raw.read(path) for path in (one, two))
    assert got_meta['crs'] == meta['crs'] == 'EPSG:32633'
    fields = list(meta['fields'])
    classes, scores = fields.index('class_id'), fields.index('score')
    assert len(got[classes]) == len(want[classes]) > 3
    assert np.array_equal(got[classes], want[classes])
    assert np.abs(got[scores] - want[scores]).max() < 1e-4
    want_shapes, got_shapes = shapely.from_wkb(want_geometry), shapely.from_wkb(got_geometry)
    differ = shapely.area(shapely.symmetric_difference(want_shapes, got_shapes)).sum()
    assert differ <= 1e-3 * shapely.area(want_shapes).sum()


def test_a_failing_rank_stops_the_run_naming_itself_and_leaves_no_output(tiny, tmp_path):  # noqa: F811,E501
    """A tile only the second rank reads is corrupt (the bottom of a 1280-row scene: the first
    rank's slab and margin end above it): that rank's error is one line naming it, the first
    rank stops too, saying why, and no output nor rank file is left."""
    import tifffile
    config, checkpoint, _ = tiny
    path = str(tmp_path / 'scene.tif')
    img = np.concatenate([_image()] * 7)[:1280]
    tifffile.imwrite(path, img, tile=(64, 64), compression='zlib', photometric='rgb')
    _corrupt_tile(path, index=19 * 5 + 2)  # tile row 19 (rows 1216-1279), tile column 2
    run = _torchrun(2, [config, checkpoint, path, '--out', str(tmp_path / 'labels.tif')],
                    tmp_path, 29641)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.startswith('error: ')]
    assert any(line.startswith('error: rank 1 of 2: ') and 'cannot be read' in line
               for line in lines), run.stderr[-3000:]
    assert 'error: rank 0 of 2: stopped, another rank has stopped (its own error line names ' \
        'it); no output written' in lines  # the first rank read no corrupt tile
    assert os.listdir(tmp_path) == ['scene.tif']


def _scenes(folder, count=4, corrupt=2):
    """``count`` small GeoTIFFs written by GDAL in ``folder``, scene ``corrupt`` with a broken
    tile, and a sidecar that is no scene."""
    folder.mkdir()
    for i in range(count):
        _geotiff(folder / f's{i}.tif', _image(seed=i))
    _corrupt_tile(str(folder / f's{corrupt}.tif'), index=3)
    (folder / 's1.tif.aux.xml').write_text('<PAMDataset/>')
    return str(folder)


def test_many_scenes_go_on_past_a_bad_one_and_a_rerun_skips_the_written(
        tool, tiny, tmp_path, capsys):  # noqa: F811
    """A folder of 4 scenes, one corrupt: 3 label files named after their scenes, each placed by
    GDAL over its scene; a summary naming the bad file and exit status 1. The same scenes as a
    pattern again: the 3 skipped, the bad one failing again."""
    import rasterio
    config, checkpoint, _ = tiny
    scenes, out = _scenes(tmp_path / 'scenes'), tmp_path / 'labels'
    out.mkdir()
    assert tool.main([config, checkpoint, scenes, '--out', str(out)]) == 1
    printed = capsys.readouterr()
    assert 'scenes: 4 (3 written, 0 skipped as done, 1 failed)' in printed.out
    failed = [line for line in printed.out.splitlines() if line.startswith('failed: ')]
    assert len(failed) == 1 and 's2.tif' in failed[0] and 'cannot be read' in failed[0]
    assert 'error: 1 of 4 scenes failed' in printed.err
    assert sorted(os.listdir(out)) == sorted(f's{i}.tif{aux}' for i in (0, 1, 3)
                                             for aux in ('', '.aux.xml'))
    for i in (0, 1, 3):
        with rasterio.open(out / f's{i}.tif') as dst, rasterio.open(f'{scenes}/s{i}.tif') as src:
            assert (dst.transform, dst.crs, dst.shape) == (src.transform, src.crs, src.shape)
    assert tool.main([config, checkpoint, f'{scenes}/s*.tif', '--out', str(out)]) == 1
    assert 'scenes: 4 (0 written, 3 skipped as done, 1 failed)' in capsys.readouterr().out


def test_many_scenes_shared_out_to_two_ranks(tool, tiny, tmp_path):  # noqa: F811
    """The same folder over 2 ranks, one scene already written: each scene whole on one rank,
    the summary once, the bad scene named, exit status non-zero; the labels equal those of one
    process."""
    import rasterio
    config, checkpoint, _ = tiny
    scenes, out = _scenes(tmp_path / 'scenes'), tmp_path / 'labels'
    out.mkdir()
    one = tmp_path / 'one.tif'
    assert tool.main([config, checkpoint, f'{scenes}/s3.tif', '--out', str(one)]) == 0
    (out / 's0.tif').write_bytes(b'written before')  # done: skipped, not read
    run = _torchrun(2, [config, checkpoint, scenes, '--out', str(out)], tmp_path, 29672)
    assert run.returncode != 0
    assert run.stdout.count('scenes: 4 (2 written, 1 skipped as done, 1 failed)') == 1
    assert [line for line in run.stderr.splitlines() if line.startswith('error: ')] == [
        'error: rank 0 of 2: 1 of 4 scenes failed (see the lines above); a rerun skips the '
        'scenes written'], run.stderr[-3000:]
    assert (out / 's0.tif').read_bytes() == b'written before'
    with rasterio.open(out / 's3.tif') as got, rasterio.open(one) as expected:
        assert np.array_equal(got.read(), expected.read())
    assert sorted(os.listdir(out)) == ['s0.tif', 's1.tif', 's1.tif.aux.xml', 's3.tif',
                                       's3.tif.aux.xml']


def test_ranks_that_cannot_see_the_first_ranks_folder_are_refused_before_any_work(tmp_path):
    """On several machines the ranks hand their rows over through files beside --out: where the
    first rank cannot see another rank's files (no shared file system) the run is refused before
    any work, naming the rank and the fix; where it can, nothing is left behind."""
    import pytest

    from xcit_mm.apis.large_image import LargeImageError
    from xcit_mm.apis.large_image.slabs import check_folder_shared
    out = str(tmp_path / 'labels.tif')
    # rank 0 of 3 in a world whose other ranks wrote their marks on machines of their own
    with pytest.raises(LargeImageError, match=r'rank 0 cannot see the files of rank 1, 2 beside '
                       r'.*labels\.tif .*must be in a folder they all share'):
        check_folder_shared(out, 0, 3, lambda value: [value] * 3)
    assert os.listdir(tmp_path) == []
    # rank 1 of 2 stops with the first rank's verdict, whatever it sees itself
    for verdict in ([1], []):
        answers = iter([[None, None], [verdict, []]])
        if verdict:
            with pytest.raises(LargeImageError, match='rank 0 cannot see the files of rank 1 '):
                check_folder_shared(out, 1, 2, lambda value: next(answers))
        else:
            check_folder_shared(out, 1, 2, lambda value: next(answers))
        assert os.listdir(tmp_path) == []
