"""One-off: the artifacts of the five old peak-memory scripts in peak_memory.py's row schema.

Every measured figure stays; rows get task / backbone / path (and pipeline, max_memory, band_mb);
each meta gets the peak_memory.py command that measures the same points and, in ``measured_by``,
the old command(s) and the commit that wrote the figures. The CSVs are rewritten from the JSON.
"""
import json
import os.path as osp
import sys

HERE = osp.dirname(osp.abspath(__file__))
sys.path.insert(0, HERE)
import peak_memory  # noqa: E402

RESULTS = osp.join(osp.dirname(HERE), 'docs', 'results')
NEW = 'python benchmarks/peak_memory.py '
# artifact: (commit that wrote the figures, the new commands in the order they ran)
COMMANDS = {
    'whole_image_inference': ('3aa50f9', [
        "--paths stock lean --limit-gb 20 --note AMD EPYC 2 cores; lean models as of commit "
        "3b1dda1; helpers' test runs shared the CPU during the first points (see load_before / "
        "load_after per row) --out docs/results/whole_image_inference",
        '--tasks detector --backbones xcit --paths bands lean --sizes 1024 2048 4096 8192 '
        '--limit-gb 20 --update --out docs/results/whole_image_inference',
        '--tasks detector --backbones xcit --paths lean --sizes 4096 --limit-gb 20 --update '
        '--out docs/results/whole_image_inference',
        '--tasks segmentor --backbones xcit --paths bands --sizes 1024 2048 4096 8192 --update '
        '--limit-gb 20 --note XCiT segmentor bands rows added on a quiet machine (AVX2-only AMD '
        'EPYC), the other rows kept --out docs/results/whole_image_inference']),
    'whole_image_cuda_h200': ('30ea9e9', [
        '--device cuda --tasks segmentor --paths lean stock auto --budgets 8192:40000 '
        '8192:16000 4096:4000 --warmup 256 --repeat-below-s 5 --log /root/out/peak_memory.log '
        '--out /root/out/whole_image_cuda --backbones xcit uper swin vit --budget-s 290 '
        '--grace-s 60']),
    'lean_segmentation_sem_fpn_s12_p16': ('ecb63fc', [
        '--tasks segmentor --backbones xcit --paths lean stock --pipeline paper --sizes 4096 '
        '--limit-gb 20 --out docs/results/lean_segmentation_sem_fpn_s12_p16',
        '--tasks segmentor --backbones xcit --paths lean stock --sizes 2048 4096 8192 '
        '--limit-gb 20 --note one fresh process per point; nothing else ran --update --out '
        'docs/results/lean_segmentation_sem_fpn_s12_p16']),
    'lean_segmentation_upernet_s12_p16': ('f56237d', [
        '--tasks segmentor --backbones uper --paths lean stock --pipeline network --sizes 2048 '
        '--limit-gb 20 --note network only (no post-processing), one fresh process per point; '
        'other sessions may have shared the 2 cores (times only) --out '
        'docs/results/lean_segmentation_upernet_s12_p16']),
    'lean_segmentation_upernet_s12_p16_door': ('0307229', [
        '--tasks segmentor --backbones uper --paths lean stock --sizes 2048 --limit-gb 20 --note '
        'through mmseg.apis.inference_model, full resolution, one fresh process per point; the '
        'test suite shared the 2 cores (times are upper bounds) --out '
        'docs/results/lean_segmentation_upernet_s12_p16_door']),
    'lean_detection_mask_rcnn_s12_p16': ('ecb63fc', [
        '--tasks detector --backbones xcit --paths lean stock --sizes 2048 4096 --parts --out '
        'docs/results/lean_detection_mask_rcnn_s12_p16',
        '--tasks detector --backbones swin --paths stock --sizes 2048 4096 --parts --note one '
        'fresh process per point; score_thr=0, 100 detections; nothing else heavy ran --update '
        '--out docs/results/lean_detection_mask_rcnn_s12_p16']),
    'memory_budget': ('4332bb2', [
        '--tasks segmentor --paths auto --budgets 4096:8000 4096:4000 8192:12000 --out '
        'docs/results/memory_budget',
        '--tasks detector --paths auto --budgets 4096:8000 4096:3500 --note AMD EPYC 2 cores, '
        'nothing else ran --update --out docs/results/memory_budget']),
    'memory_budget_8192': ('7f9eaff', [
        '--tasks segmentor --paths auto --budgets 8192:16000 --note AMD EPYC 2 cores, nothing '
        'else ran --out docs/results/memory_budget_8192']),
    'memory_budget_bands': ('dd6fa39', [
        '--tasks detector --paths auto --budgets 4096:3500:64 --out '
        'docs/results/memory_budget_bands']),
}
RENAMED = dict(labels_shape='out_shape', masks_shape='out_shape', logits_shape='out_shape',
               results_sha256='digest', logits_sha256='digest')


def convert_row(name: str, row: dict, meta: dict) -> dict:
    """The row in the new schema: the point's keys first, every figure as it was."""
    if 'backbone' in row:  # whole_image_inference / whole_image_cuda: already so
        return row
    rest = {RENAMED.get(k, k): v for k, v in row.items()}
    if 'digest' in rest:
        rest['digest'] = rest['digest'][:16]
    if name.startswith('lean_segmentation'):
        point = dict(task='segmentor', path=rest.pop('segmentor'),
                     backbone='uper' if 'upernet' in name else 'xcit')
        if rest['pipeline'] == 'full':
            del rest['pipeline']
    elif name.startswith('lean_detection'):
        backbone, path = rest.pop('model').split('-')
        point = dict(task='detector', backbone=backbone, path=path)
        if backbone == 'swin':
            rest['config'] = meta['swin_config']
    else:  # memory_budget*
        point = dict(task=dict(seg='segmentor', det='detector')[rest.pop('task')],
                     backbone='xcit', path='auto')
        rest['max_memory'] = int(rest['max_memory'])
        band = rest.pop('band_mb', None)
        if band is not None:
            rest['band_mb'] = int(band)
    first = dict(point, size=rest.pop('size'))
    for key in ('pipeline', 'max_memory', 'band_mb', 'config'):
        if key in rest:
            first[key] = rest.pop(key)
    return dict(first, **rest)


def main():
    for name, (commit, commands) in COMMANDS.items():
        path = osp.join(RESULTS, name)
        with open(path + '.json') as f:
            artifact = json.load(f)
        meta = artifact['meta']
        if 'measured_by' in meta:
            continue  # converted already
        old = meta.get('earlier_commands', []) + [meta['command']]
        rows = [convert_row(name, r, meta) for r in artifact['rows']]
        meta.update(command=NEW + commands[-1],
                    measured_by=dict(commit=commit, commands=old,
                                     note='the figures of these commands, converted to '
                                     'peak_memory.py rows by benchmarks/convert_artifacts.py'))
        if len(commands) > 1:
            meta['earlier_commands'] = [NEW + c for c in commands[:-1]]
        peak_memory.write(path, meta, rows)


if __name__ == '__main__':
    main()
