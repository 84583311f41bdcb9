"""The OpenMMLab model index (model-index.yml -> configs/metafile.yml) against the configs
and the paper.

Plain YAML and file checks (no mmdet / mmseg import): the index lists exactly the 24 paper configs,
each entry's config, README and code paths exist, its results are the paper's numbers (the
tables below, copied from paper Tables 5 and 6 independently of the metafile), and its weights
are the released-weight URL quoted in the config's own header comment. It also lists the
Cityscapes recipes (not from the paper), with no results and no weights.
"""
import glob
import numbers
import os.path as osp
import re

import pytest
import yaml

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
MODEL_INDEX = osp.join(ROOT, 'model-index.yml')
METAFILE = 'configs/metafile.yml'

ARCHS = ('t12', 's12', 's24', 'm24')
PATCHES = (16, 8)

# Paper Table 5 (Mask R-CNN 3x, COCO val2017): whole-detector params (M), box AP, mask AP.
MASK_RCNN = {
    ('t12', 16): (26.1, 42.7, 38.5),
    ('t12', 8): (25.8, 44.5, 40.3),
    ('s12', 16): (44.3, 45.3, 40.8),
    ('s12', 8): (43.1, 47.0, 42.3),
    ('s24', 16): (65.8, 46.5, 41.8),
    ('s24', 8): (64.5, 48.1, 43.0),
    ('m24', 16): (101.1, 46.7, 42.0),
    ('m24', 8): (98.9, 48.5, 43.7),
}
# Paper Table 6 (ADE20k val, single scale): mIoU of Semantic FPN (80k) and UperNet (160k).
SEM_FPN = {
    ('t12', 16): 38.1, ('t12', 8): 39.9,
    ('s12', 16): 43.9, ('s12', 8): 44.2,
    ('s24', 16): 44.6, ('s24', 8): 47.1,
    ('m24', 16): 45.9, ('m24', 8): 46.9,
}
UPERNET = {
    ('t12', 16): 41.5, ('t12', 8): 43.5,
    ('s12', 16): 45.9, ('s12', 8): 46.6,
    ('s24', 16): 46.9, ('s24', 8): 48.1,
    ('m24', 16): 47.6, ('m24', 8): 48.4,
}


# The Cityscapes recipes (configs/*_80k_cityscapes.py): not from the paper, no released weights.
RECIPES = {f'configs/{task}_xcit_s12_p{patch}_80k_cityscapes.py':
           {'Training Data': 'Cityscapes', 'Iterations': 80000, 'Batch Size': 8,
            'Crop Size': '512x1024'}
           for task in ('sem_fpn', 'upernet') for patch in PATCHES}


def _expected():
    """Config path -> (metadata expected, [(task, dataset, {metric: value})])."""
    table = {}
    for (arch, patch), (params, box, mask) in MASK_RCNN.items():
        table[f'configs/mask_rcnn_xcit_{arch}_p{patch}_3x_coco.py'] = (
            {'Training Data': 'COCO', 'Epochs': 36, 'Parameters': params},
            [('Object Detection', 'COCO', {'box AP': box}),
             ('Instance Segmentation', 'COCO', {'mask AP': mask})])
    for (arch, patch), miou in SEM_FPN.items():
        table[f'configs/sem_fpn_xcit_{arch}_p{patch}_80k_ade20k.py'] = (
            {'Training Data': 'ADE20K', 'Iterations': 80000},
            [('Semantic Segmentation', 'ADE20K', {'mIoU': miou})])
    for (arch, patch), miou in UPERNET.items():
        table[f'configs/upernet_xcit_{arch}_p{patch}_160k_ade20k.py'] = (
            {'Training Data': 'ADE20K', 'Iterations': 160000},
            [('Semantic Segmentation', 'ADE20K', {'mIoU': miou})])
    return table


EXPECTED = _expected()


def _load(path):
    with open(osp.join(ROOT, path)) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope='module')
def metafile():
    return _load(METAFILE)


@pytest.fixture(scope='module')
def models(metafile):
    return metafile['Models']


def _paper_configs():
    found = set()
    for task in ('mask_rcnn', 'sem_fpn', 'upernet'):
        for path in glob.glob(osp.join(ROOT, 'configs', f'{task}_xcit_*.py')):
            if not path.endswith(('_ld.py', '_cityscapes.py')):
                found.add(osp.relpath(path, ROOT).replace(osp.sep, '/'))
    return found


def _header_weights(config):
    """The released-weight URLs quoted in the config's header comment (before ``_base_``)."""
    with open(osp.join(ROOT, config)) as f:
        header = f.read().split('_base_', 1)[0]
    return re.findall(r'https://\S+?\.pth', header)


def test_model_index_imports_metafile():
    index = _load(MODEL_INDEX)
    assert index == {'Import': [METAFILE]}
    assert osp.isfile(osp.join(ROOT, METAFILE))


def test_collection(metafile):
    (collection, ) = metafile['Collections']
    assert collection['Name'] == 'XCiT'
    assert collection['Paper'] == {
        'Title': 'XCiT: Cross-Covariance Image Transformers',
        'URL': 'https://arxiv.org/abs/2106.09681'
    }
    assert {'Cross-Covariance Attention', 'Local Patch Interaction',
            'Layer Scale'} <= set(collection['Metadata']['Architecture'])
    assert {'ImageNet-1k', 'COCO', 'ADE20K'} <= set(collection['Metadata']['Training Data'])
    assert osp.isfile(osp.join(ROOT, collection['README']))
    assert osp.isfile(osp.join(ROOT, collection['Code']['URL']))


def test_configs_are_exactly_the_paper_configs(models):
    paper = _paper_configs()
    assert len(paper) == 24, sorted(paper)
    assert paper == set(EXPECTED)
    configs = [m['Config'] for m in models]
    assert len(configs) == len(set(configs)), 'a config is listed twice'
    assert set(configs) == paper | set(RECIPES)
    for config in configs:
        assert osp.isfile(osp.join(ROOT, config)), config


def test_names_unique_and_match_configs(models):
    names = [m['Name'] for m in models]
    assert len(names) == len(set(names))
    for m in models:
        assert m['Name'] == osp.splitext(osp.basename(m['Config']))[0]
        assert m['In Collection'] == 'XCiT'


def test_recipes_claim_no_result_and_no_weights(models):
    recipes = {m['Config']: m for m in models if m['Config'] in RECIPES}
    assert set(recipes) == set(RECIPES)
    for config, m in recipes.items():
        assert m['Results'] == [] and 'Weights' not in m, config
        assert m['Metadata']['Weights'].startswith('none released'), config
        assert {k: m['Metadata'][k] for k in RECIPES[config]} == RECIPES[config], config
        assert not _header_weights(config), config


def test_results_are_numeric(models):
    for m in models:
        if m['Config'] in RECIPES:
            continue
        assert m['Results'], m['Name']
        for result in m['Results']:
            assert result['Metrics'], m['Name']
            for metric, value in result['Metrics'].items():
                assert isinstance(value, numbers.Real) and not isinstance(value, bool), (
                    m['Name'], metric, value)


def test_results_and_metadata_match_paper(models):
    for m in (m for m in models if m['Config'] not in RECIPES):
        metadata, results = EXPECTED[m['Config']]
        got = [(r['Task'], r['Dataset'], r['Metrics']) for r in m['Results']]
        assert got == results, m['Name']
        meta = dict(m['Metadata'])
        for key, value in metadata.items():
            if key == 'Parameters':  # the paper's count in M, to 0.1M
                assert meta[key] == pytest.approx(value * 1e6, abs=1), m['Name']
            else:
                assert meta[key] == value, (m['Name'], key)


def test_weights_are_the_config_headers_urls(models):
    for m in models:
        quoted = _header_weights(m['Config'])
        if quoted:
            assert len(quoted) == 1, (m['Config'], quoted)
            assert m.get('Weights') == quoted[0], m['Name']
        else:
            assert 'Weights' not in m, m['Name']
