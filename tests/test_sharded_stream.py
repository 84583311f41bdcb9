"""The stream of one image sharded over torch.distributed ranks (``sharding.Shard``), on CPU
processes (gloo), against one process.

Each world size (2 and 3 ranks) is spawned once; every rank runs the world's cases (2 ranks all
of them, 3 ranks those whose splits need 3) and Mask R-CNN's stream, saves what it made, and the
tests compare it with what one process makes of the same image (``stream_labels`` without a
shard, the whole forward's trunk and logits; one process's instances). Models: Semantic FPN and
UperNet, p16 and p8, with LayerNorms, layer scales, temperatures and BN statistics randomised.
Heights split unevenly over the ranks, slabs are thinner than the margin, and a rank of one case
owns no row.
The ranks add their sums in another order than one process adds its bands, so values agree up to
float rounding: measured here below 2e-6 on maps of order 1 (tolerance 1e-4, as
tests/test_stream.py); the labels are equal on every case.
"""
import copy
import datetime
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from mmengine.config import ConfigDict
from mmengine.structures import InstanceData
from mmengine.registry import init_default_scope
from mmseg.models.data_preprocessor import SegDataPreProcessor
from mmseg.registry import MODELS

import xcit_mm  # noqa: F401  (registers XCiTBackbone and LeanEncoderDecoder)
from test_lean_detection import _pair
from test_lean_segmentation import BACKBONE, SEM_FPN, UPERNET, spread_statistics_and_logits
from xcit_mm.models.inference.row_stream import (Crop, Local, TensorRows, TokenMaps, materialize,
                                                 module_rows)
from xcit_mm.models.inference.seg_stream import logits_rows, run_poolings
from xcit_mm.models.inference.sharding import Shard, SlabRows, rows_read, trunk_rows_read

TOLERANCE = dict(rtol=1e-4, atol=1e-4)
HEADS = dict(sem_fpn=SEM_FPN, upernet=UPERNET)
MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]
BAND_MB = 0.02  # many bands in every map
# (heads, patch size, image (H, W), a nodata collar above this pixel row and left of this
# column, or None). 13, 25, 3, 2 and 40 token rows: uneven over 2 and 3 ranks; 3 rows give
# slabs of one row, thinner than the margin; 2 rows leave rank 0 of 3 without one; 40 rows are
# more than a slab, its margin and the rows its labels read; the collar leaves rank 0 of 3
# without a valid token, so that its position frame comes from the others', and UperNet's
# pooling counts the cells with data across the ranks.
CASES = [(heads, patch, (200, 96), None) for heads in HEADS for patch in (16, 8)] + [
    ('upernet', 16, (45, 64), None), ('sem_fpn', 16, (32, 64), None),
    ('upernet', 16, (32, 64), None), ('sem_fpn', 16, (640, 48), None),
    ('upernet', 16, (160, 96), (56, 20))]
TALL = 7
# the cases whose trunk and logits are compared too
MAPS_CASES = range(4)
# the cases each world runs: 3 ranks the ones whose splits only 3 ranks make (slabs of one row,
# an empty rank, a rank without a valid token), the tall one and a p8 case with its maps
WORLD_CASES = {2: range(len(CASES)), 3: [3, 4, 5, 6, 7, 8]}
# The token rows beyond a slab that the labels of its pixel rows read from the trunk maps (the
# adapter, the FPN's and the heads' convs and resizes), at most, for these models (measured by
# sharding.trunk_rows_read): more at p8, where a stride-32 row is 4 token rows.
POST_TRUNK_ROWS = {16: 11, 8: 22}


def _config(heads, patch_size):
    return dict(type='LeanEncoderDecoder', backbone=dict(BACKBONE, patch_size=patch_size),
                **copy.deepcopy(HEADS[heads]), test_cfg=ConfigDict(mode='stream', band_mb=BAND_MB))


def _build(heads, patch_size, state=None):
    """The model in eval mode: with ``state`` loaded, else with its parameters drawn here."""
    init_default_scope('mmseg')
    torch.manual_seed(patch_size)
    model = MODELS.build(_config(heads, patch_size))
    model.data_preprocessor = SegDataPreProcessor(mean=MEAN, std=STD, bgr_to_rgb=True)
    if state is not None:
        model.load_state_dict(state)
        return model.eval()
    model.init_weights()
    spread_statistics_and_logits(model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.backbone.named_parameters():
            if 'norm' in name and name.endswith('weight') or name.split('.')[-1].startswith(
                    'gamma'):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            elif 'norm' in name and name.endswith('bias'):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif name.endswith('temperature'):
                param.copy_(torch.rand(param.shape, generator=generator) * 1.5 + 0.5)
    return model.eval()


def _image(index):
    H, W = CASES[index][2]
    return np.random.RandomState(index).randint(0, 255, (H, W, 3), dtype=np.uint8)


def _valid_rows(index):
    collar = CASES[index][3]
    if collar is None:
        return None
    H, W = CASES[index][2]
    mask = np.zeros((H, W), dtype=bool)
    mask[collar[0]:, collar[1]:] = True
    return lambda a, b: mask[a:b]


def _inputs(model, img):
    """The image as the network's input (1, 3, H, W), as the data preprocessor makes it."""
    batch = dict(inputs=[torch.from_numpy(img).permute(2, 0, 1)])
    return model.data_preprocessor(batch, False)['inputs']


def _labels(model, index, shard=None):
    """``stream_labels`` of case ``index``: [(start, stop, labels, confidence)], and the pixel
    rows the model read."""
    img, asked = _image(index), []
    reader = lambda a, b: asked.append((a, b)) or img[a:b]  # noqa: E731
    out = [tuple(part) for part in model.stream_labels(
        reader, img.shape[:2], confidence=True, valid_rows=_valid_rows(index), shard=shard)]
    return out, asked


# Mask R-CNN (test_lean_detection's small model): a scene of 3 rows of 64 px cores (the last
# 72 px), so that 2 ranks run 2 and 1 rows, and 3 ranks one each.
DETECTOR_HW = (200, 328)
DETECTOR_CFG = dict(mode='stream', tile_size=64, feature_margin=64, band_mb=BAND_MB)


def _detector():
    """The detector in eval mode, the same on every process (seeded), with clearer winners than
    its random heads give."""
    model = _pair()[1]
    with torch.no_grad():
        model.rpn_head.rpn_cls.weight.mul_(20)
        model.roi_head.bbox_head.fc_cls.weight.mul_(20)
    model.test_cfg.rcnn.score_thr = 0.3
    model.test_cfg.update(DETECTOR_CFG)
    return model


def _instances(model, shard=None):
    """``stream_instances`` of a random uint8 scene: one process's merged instances, or a rank's
    rows of cores (not merged)."""
    img = np.random.RandomState(5).randint(0, 255, DETECTOR_HW + (3, ), dtype=np.uint8)
    return list(model.stream_instances(lambda a, b: img[a:b], DETECTOR_HW, shard=shard))


def _slab_maps(model, x, shard):
    """This rank's token rows of the last trunk map and its share of the logits' rows, made by
    the sharded trunk and the row maps of the logits (the rows they read worked out as
    ``stream_labels`` works them out for the labels)."""
    backbone, p = model.backbone, model.backbone.patch_size
    image_hw = tuple(x.shape[2:])
    slab = shard.slab(image_hw[0], p)
    grid = [-(-side // p) for side in image_hw]

    def logits_of(trunk):
        levels = [backbone.level_rows(m, i, image_hw) for i, m in enumerate(trunk)]
        return logits_rows(levels, getattr(model, 'neck', None), model.decode_head, BAND_MB, slab)

    placeholders = [SlabRows(*grid) for _ in backbone.out_indices]
    logits = logits_of(placeholders)
    rows = slab.rows_of(logits.height)
    read = trunk_rows_read(logits, *rows, placeholders)
    with TokenMaps('cpu') as maps, torch.no_grad():
        trunk = backbone.stream_trunk(lambda a, b: x[:, :, a:b], image_hw, maps, BAND_MB,
                                      shard=shard, read_rows=read)
        tokens = trunk[-1].rows(slab.first, slab.stop).clone()
        held = [(m.first, m.first + m.token_map.height) for m in trunk]
        distinct = {id(m.token_map): m.token_map for m in trunk}.values()  # out_indices repeat
        held_mb = sum(token_map.data.numel() * 4 for token_map in distinct) / 2**20
        logits = Crop(logits_of(trunk), rows[0], 0, rows[1] - rows[0], logits.width)
        run_poolings(logits)
        logits = materialize(logits, BAND_MB) if logits.height else None
    made, kept = held[-1][1] - held[-1][0], held[0][1] - held[0][0]
    return dict(rows=rows, token_rows=(slab.first, slab.stop), tokens=tokens, logits=logits,
                read=read, held=held, held_mb=held_mb,
                planned_mb=backbone.token_maps_mb(image_hw, made, kept)[1])


def _rank(rank, world, folder):
    """One rank of a spawned world: every case, saved to ``folder``."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        'gloo', init_method=f'file://{folder}/store_{world}', rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120))
    try:
        states = torch.load(os.path.join(folder, 'states.pt'))
        results = []
        for index, (heads, patch, _, _) in enumerate(CASES):
            if index not in WORLD_CASES[world]:
                results.append(None)
                continue
            model = _build(heads, patch, states[heads, patch])
            shard = Shard()
            labels, asked = _labels(model, index, shard)
            result = dict(labels=labels, asked=asked, exchanges=list(shard.exchanges),
                          token_rows=shard.token_rows(-(-CASES[index][2][0] // patch)))
            if index in MAPS_CASES:
                shard = Shard()
                result['maps'] = _slab_maps(model, _inputs(model, _image(index)), shard)
                result['maps_exchanges'] = list(shard.exchanges)
            results.append(result)
        shard = Shard()
        detector = dict(rows=_instances(_detector(), shard), exchanges=list(shard.exchanges))
        torch.save(dict(cases=results, detector=detector),
                   os.path.join(folder, f'rank{rank}_of{world}.pt'))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
    """The models (their parameters saved for the ranks) and what one process makes of each
    case: the labels, the whole forward's last trunk map and logits."""
    folder = tmp_path_factory.mktemp('sharded')
    states, models = {}, {}
    for heads, patch, _, _ in CASES:
        if (heads, patch) not in models:
            models[heads, patch] = _build(heads, patch)
            states[heads, patch] = models[heads, patch].state_dict()
    torch.save(states, folder / 'states.pt')
    expected = []
    for index, (heads, patch, _, _) in enumerate(CASES):
        model = models[heads, patch]
        case = dict(model=model, labels=_labels(model, index)[0])
        if index in MAPS_CASES:
            x = _inputs(model, _image(index))
            with torch.no_grad():
                case['tokens'] = model.backbone.forward_trunk(x)[-1]
                case['logits'] = model._network_forward(x)
        expected.append(case)
    return folder, dict(cases=expected, detector=_instances(_detector()))


@pytest.mark.parametrize('world', [2, 3])
def test_ranks_make_what_one_process_makes(world, one_process):
    """One world of ``world`` ranks, spawned once (one test, so that pytest-xdist does not spawn
    it on both of its workers), every check on every case."""
    folder, expected = one_process
    # the ranks import this file by its name on the path (tests/, setup.cfg's pythonpath): the
    # importlib import mode gives it a name no other process can import
    import test_sharded_stream
    mp.spawn(test_sharded_stream._rank, args=(world, str(folder)), nprocs=world, join=True)
    loaded = [torch.load(folder / f'rank{rank}_of{world}.pt', weights_only=False)
              for rank in range(world)]
    ranks = ([r['cases'] for r in loaded], expected['cases'], WORLD_CASES[world])
    check_detections([r['detector'] for r in loaded], expected['detector'])
    check_labels(ranks)
    check_pixel_rows_read(ranks)
    check_trunk_and_logits(ranks)
    check_bytes_sent(ranks)


def _joined(parts):
    """The labels and confidence of bands (start, stop, labels, confidence), checked to follow
    each other, and the rows they cover."""
    rows = [(start, stop) for start, stop, _, _ in parts]
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:])), rows
    if not parts:
        return None, None, None
    return (torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts]),
            (rows[0][0], rows[-1][1]))


def _by_class_and_box(instances):
    """The instances in the order of their class, then their box rounded to 0.01 px: two
    detections whose scores tie up to float rounding come in either order from the merge's
    sort, which the comparison must not count as a difference."""
    keys = np.round(instances.bboxes.numpy(), 2).T[::-1]
    return instances[torch.from_numpy(np.lexsort((*keys, instances.labels.numpy())))]


def check_detections(ranks, expected):
    """Mask R-CNN: each rank ran the rows of cores whose top lies in its slab (every rank some
    here), and every rank's rows merged in rank order (``merge_core_rows``) are the instances of
    one process: the same classes, boxes and scores up to float rounding, the same mask logits;
    the ranks' exchanges are the trunk's (a check, then one per XCA layer)."""
    model = _detector()
    rows = [row for rank in ranks for row in rank['rows']]
    assert all(rank['rows'] for rank in ranks) and len(rows) == 3
    got = _by_class_and_box(InstanceData.cat(list(model.merge_core_rows(rows))))
    want = _by_class_and_box(InstanceData.cat(expected))
    assert len(got) == len(want) > 5
    assert torch.equal(got.labels, want.labels)
    assert (got.bboxes - want.bboxes).abs().max() < 1e-3
    assert (got.scores - want.scores).abs().max() < 1e-4
    assert (got.mask_logits - want.mask_logits).abs().max() < 1e-3
    for rank in ranks:
        assert [what for what, _ in rank['exchanges']] == ['stream check'] + ['XCA sums'] * len(
            model.backbone.layers)


def check_labels(ranks):
    """Each rank's labels are the rows of its slab (whole-image numbers, pixel rows of its token
    rows), the ranks' slabs tile the image in rank order, and the labels equal one process's on
    every pixel (the confidence within one level of 255); each rank read only the pixel rows of
    its slab and the margin (fewer than the image's, where the image has more token rows than the
    margin's and the slab's)."""
    results, expected, indices = ranks
    world = len(results)
    for index in indices:
        case = expected[index]
        H, W = CASES[index][2]
        p = CASES[index][1]
        want, want_confidence, _ = _joined(case['labels'])
        got, confidence, covered = [], [], 0
        for rank in range(world):
            result = results[rank][index]
            first, stop = result['token_rows']
            labels, conf, rows = _joined(result['labels'])
            if first == stop:
                assert labels is None, (index, rank)
                continue
            assert rows == (covered, min(H, stop * p)), (index, rank, rows)
            covered = rows[1]
            got.append(labels)
            confidence.append(conf)
        assert covered == H
        got, confidence = torch.cat(got), torch.cat(confidence)
        assert got.shape == (H, W)
        assert torch.equal(got, want), (index, int((got != want).sum()))
        assert (confidence.int() - want_confidence.int()).abs().max() <= 1, index


def check_pixel_rows_read(ranks):
    """The pixel rows a rank read lie within its slab's token rows, the rows beyond them that
    its labels read (``POST_TRUNK_ROWS``), the margin (2 rows a layer) and the row above that
    the stem reads, so that the first and last rank read less than the 640-row image (40 token
    rows); a rank without a token row reads no pixel."""
    results, expected, indices = ranks
    for index in indices:
        heads, p, (H, W), _ = CASES[index]
        reach = POST_TRUNK_ROWS[p] + expected[index]['model'].backbone.stream_margin
        for result in (r[index] for r in results):
            first, stop = result['token_rows']
            asked = result['asked']
            if first == stop:
                assert asked == []
                continue
            lo, hi = min(a for a, _ in asked), max(b for _, b in asked)
            assert lo >= max(0, first - reach - 1) * p and hi <= min(H, (stop + reach) * p), (
                index, lo, hi)
    reads = [max(b for _, b in r[TALL]['asked']) - min(a for a, _ in r[TALL]['asked'])
             for r in results]
    assert reads[0] < 640 and reads[-1] < 640, reads


def check_trunk_and_logits(ranks):
    """The last trunk map's rows of each rank's slab and the logits of its share of their rows
    equal the whole forward's up to float rounding; the shares tile the logits."""
    results, expected, indices = ranks
    for index in (i for i in MAPS_CASES if i in indices):
        covered = 0
        for result in (r[index] for r in results):
            maps = result['maps']
            first, stop = maps['token_rows']
            torch.testing.assert_close(maps['tokens'], expected[index]['tokens'][:, :, first:stop],
                                       **TOLERANCE)
            # the copies of the maps before the last hold the slab and the rows read, no
            # margin; the plans count what the maps hold
            spans = [span for span in ((first, stop), maps['read']) if span[0] < span[1]]
            wanted = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None
            out_indices = expected[index]['model'].backbone.out_indices
            copies = [span for i, span in zip(out_indices, maps['held']) if i < max(out_indices)]
            assert copies and all(span == wanted for span in copies) or not spans, (
                index, maps['held'], wanted)
            assert maps['held_mb'] == pytest.approx(maps['planned_mb'])
            lo, hi = maps['rows']
            assert lo == covered
            covered = hi
            if hi > lo:
                torch.testing.assert_close(maps['logits'],
                                           expected[index]['logits'][:, :, lo:hi], **TOLERANCE)
        assert covered == expected[index]['logits'].shape[2]


def check_bytes_sent(ranks):
    """What each rank gives to the exchanges, per case: the check that all stream the same image
    (6 int64), the valid token rows and columns where there is a mask (float32 of the grid's
    rows and columns), per layer XCA's sums (per head a d x d product and two d-vectors of
    squared norms, float32), and for UperNet the pooled sums (float64, channels x s x s per
    scale, and with a mask each bin's count of cells with data); no row of any map."""
    results, expected, indices = ranks
    for index in indices:
        case = expected[index]
        heads, p, (H, W), collar = CASES[index]
        backbone = case['model'].backbone
        h, d = backbone.num_heads, backbone.embed_dims // backbone.num_heads
        want = [('stream check', 6 * 8)]
        if collar is not None:
            want.append(('valid token rows and columns', 4 * (-(-H // p) + -(-W // p))))
        want += [('XCA sums', 4 * (h * d * d + 2 * h * d))] * (max(backbone.out_indices) + 1)
        if heads == 'upernet':  # with a mask, each bin's count of cells with data too
            ppm = case['model'].decode_head.psp_modules
            want.append(('pyramid pooling sums', 8 * (ppm.in_channels + (collar is not None))
                         * sum(s * s for s in ppm.pool_scales)))
        for result in (r[index] for r in results):
            assert result['exchanges'] == want, index


# ---------------------------------------------------------------------------- one process
def test_a_shard_needs_a_process_group():
    with pytest.raises(RuntimeError, match='torch.distributed is not initialised: call '
                       'torch.distributed.init_process_group'):
        Shard()


def test_slab_rows_refuse_rows_not_made_exactly():
    """A slab's trunk map answers in whole-image rows and refuses a row outside those it made
    exactly (a margin too small is an error, not a wrong label)."""
    tokens = TensorRows(torch.arange(10.).view(1, 1, 10, 1))
    slab = SlabRows(30, 1, tokens, first=10, exact=(12, 18))
    assert slab.rows(12, 18).flatten().tolist() == [2., 3., 4., 5., 6., 7.]
    for start, stop in ((11, 14), (15, 19)):
        with pytest.raises(RuntimeError, match=f'token rows {start}..{stop - 1} were asked for, '
                           'but this rank made only rows 12..17 exactly'):
            slab.rows(start, stop)


def test_rows_read_follows_every_path_to_the_trunk():
    """The rows a map's rows are made from, through a 3x3 conv (1 row each side), a 2x2 stride-2
    transposed conv (half the rows) and a sum of both paths, are the span of both paths'."""
    trunk = SlabRows(40, 8)
    conv = module_rows(torch.nn.Conv2d(1, 1, 3, padding=1), trunk)
    up = module_rows(torch.nn.ConvTranspose2d(1, 1, 2, stride=2), conv)
    pooled = module_rows(torch.nn.MaxPool2d(2, 2), trunk)
    total = Local(lambda x: x, up)
    need = rows_read(total, 20, 30)
    assert need[id(up)][1:] == (20, 30) and need[id(conv)][1:] == (10, 15)
    assert need[id(trunk)][1:] == (9, 16)
    assert trunk_rows_read(total, 20, 30, [trunk]) == (9, 16)
    assert trunk_rows_read(pooled, 3, 5, [trunk]) == (6, 10)
    assert trunk_rows_read(total, 5, 5, [trunk]) == (0, 0)
