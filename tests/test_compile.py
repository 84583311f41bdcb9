"""XCiTBackbone under torch.compile (issue 13, part 2): one graph, no graph break, no recompile
for a new image size, and the same values and gradients as eager.

While dynamo (or a TorchScript trace, see tests/test_onnx.py) records the forward, the backbone
takes a traceable path (``xcit._tracing()``): the adapter's 2x transposed convs as one matmul
(``_up2_traceable``) instead of row blocks written in place into a preallocated map, and padding /
cropping without Python branches on the size. The tests check that path against the eager one
directly and through torch.compile.
"""
import copy
import os.path as osp

import pytest
import torch
import torch._dynamo
import torch._inductor.config
import torch.nn as nn
from torch._dynamo.testing import CompileCounter

from xcit_mm import XCiTBackbone
from xcit_mm.models.backbones import xcit as xcit_module

TINY = dict(embed_dims=64, depth=4, num_heads=4)
# One layer feeding all four levels, for what dynamo traces: XCiT's layers are alike (one drop
# path rate, checkpointed one by one), so a graph break or a size guard in one is in each.
ONE_LAYER = dict(arch=dict(TINY, depth=1), out_indices=(0, 0, 0, 0))


# inductor's CPU vector instructions taken from the CPU's flags, without torch's trial compile and
# load of a program per instruction set (on a cold cache, a first step of its own): the same
# instruction set, so the same kernels, wherever the compiler builds them.
CPU_FLAGS_TRUSTED = torch._inductor.config.patch({'cpp.vec_isa_ok': True})


def tiny(patch_size=16, **kwargs):
    torch.manual_seed(0)
    model = XCiTBackbone(arch=kwargs.pop('arch', TINY), patch_size=patch_size,
                         out_indices=kwargs.pop('out_indices', (0, 1, 2, 3)), **kwargs)
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    for m in model.modules():  # non-trivial BN statistics for eval-mode comparisons
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


def assert_close_scaled(got, want, rel=1e-4, what='', floor=1e-12):
    """max |got - want| <= rel * max(max |want|, floor): float32 rounding, measured on the
    tensor's scale (gradients are sums over many terms; elementwise ratios blow up where they
    cancel). ``floor``: for gradients, a hundredth of the largest gradient of the model, since a
    gradient that is zero in exact arithmetic (the bias of a conv followed by a train-mode BN) is
    pure rounding noise of the large terms that cancel in it."""
    assert got.shape == want.shape, what
    scale = max(want.abs().max().item(), floor)
    diff = (got - want).abs().max().item()
    assert diff <= rel * scale, f'{what}: max |diff| {diff:.3e}, scale {scale:.3e}'


def grad_floor(grads):
    return 1e-2 * max(g.abs().max().item() for g in grads)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize('layout', [torch.contiguous_format, torch.channels_last],
                         ids=['nchw', 'channels_last'])
def test_up2_traceable_equals_conv_transpose(layout):
    """The traceable upsampling (one matmul, oriented by the output layout) equals
    nn.ConvTranspose2d in values and gradients: odd sides, in != out channels, batch 2
    (float64: only a wrong index, not the summation order, can make a difference)."""
    torch.manual_seed(0)
    conv = nn.ConvTranspose2d(64, 48, kernel_size=2, stride=2).double().to(
        memory_format=torch.channels_last)
    for shape in [(1, 64, 21, 131), (2, 64, 5, 7)]:
        x = torch.randn(shape, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
        xs = [x.detach().clone().requires_grad_() for _ in range(2)]
        out, ref = xcit_module._up2_traceable(conv, xs[0], layout), conv(xs[1])
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        grad = torch.randn_like(ref)
        got = torch.autograd.grad(out, [xs[0], conv.weight, conv.bias], grad)
        want = torch.autograd.grad(ref, [xs[1], conv.weight, conv.bias], grad)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('patch_size, channels_last', [(8, False), (16, False), (16, True)],
                         ids=['p8', 'p16', 'p16-channels_last'])
def test_traceable_path_equals_the_eager_path(monkeypatch, patch_size, channels_last):
    """The whole forward with the traceable path forced on (as under torch.compile / ONNX
    export) equals the eager path in values and gradients: padded and unpadded sizes, NCHW and
    channels-last outputs (float32: XCA keeps its attention in float32 whatever the input; the
    paths differ only in the summation order of the upsampling matmuls)."""
    model = tiny(patch_size, out_channels_last=channels_last)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    for hw in [(64, 96), (97, 131)]:
        x = torch.randn(2, 3, *hw)
        results = []
        for tracing in (False, True):
            monkeypatch.setattr(xcit_module, '_tracing', lambda t=tracing: t)
            model.zero_grad()
            outs = model.train()(x)
            sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum()
                for o in outs).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            results.append(([o.detach() for o in outs], grads))
            assert all(o.is_contiguous(memory_format=layout) for o in outs)
        (eager_out, eager_grad), (traced_out, traced_grad) = results
        for a, b in zip(traced_out, eager_out):
            assert_close_scaled(a, b, 1e-5, f'{hw} output')
        floor = grad_floor(eager_grad)
        for (name, _), a, b in zip(model.named_parameters(), traced_grad, eager_grad):
            assert_close_scaled(a, b, 1e-4, f'{hw} grad {name}', floor)


def test_no_graph_break():
    """torch._dynamo.explain: the forward is one graph in eval, train (drop path, BN in train
    mode), bf16 autocast (the float32 XCA island) and with gradient checkpointing."""
    x = torch.randn(2, 3, 64, 96)
    cases = [('p16 eval', tiny(16, **ONE_LAYER).eval(), False),
             ('p8 train', tiny(8, drop_path_rate=0.1, **ONE_LAYER), False),
             ('p16 train amp', tiny(16, **ONE_LAYER), True),
             ('p8 with_cp', tiny(8, with_cp=True, **ONE_LAYER), False)]
    for name, model, amp in cases:
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=amp):
            explanation = torch._dynamo.explain(model)(x.requires_grad_(name.endswith('cp')))
        print(name, explanation.graph_count, 'graph(s),', explanation.graph_break_count,
              'graph break(s)')
        assert explanation.graph_break_count == 0, (name, explanation.break_reasons)
        assert explanation.graph_count == 1, name


@pytest.mark.parametrize('patch_size', [8, 16])
def test_new_image_sizes_do_not_recompile(patch_size):
    """dynamic=True: one graph serves every size, same padding class or not (the traceable path
    has no branch on the size). Sizes above ~300x300 px: below that torch's CPU convolution picks
    another backend for the small stem inputs of this tiny model, a guard of its own."""
    model = tiny(patch_size, **ONE_LAYER).eval()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, dynamic=True)
    sizes = [(288, 320), (320, 352),  # multiples of 32: no padding
             (300, 330), (310, 341)]  # padded to the patch size, outputs cropped
    with torch.no_grad():
        for hw in sizes:
            x = torch.randn(1, 3, *hw)
            for got, want in zip(compiled(x), model(x)):
                assert got.is_contiguous()
                assert_close_scaled(got, want, 1e-5, f'{hw}')
    assert counter.frame_count == 1, f'{counter.frame_count} compilations for {sizes}'


@CPU_FLAGS_TRUSTED
def test_inductor_train_step_equals_eager():
    """inductor (CPU), train mode, compiled as ``CompileFeatureExtractorHook`` compiles
    (``dynamic=False``), at a size padded to an odd grid (100x90 px: 13x12 patches of 8 px,
    cropped back): the outputs and every parameter gradient equal eager to float32 rounding.

    One size: with ``dynamic=False`` another size compiles the same graph with other constants,
    all of its kernels anew (on a cold inductor cache, the slowest step of the suite). The traced
    path's values and gradients at padded and unpadded sizes are tested in eager
    (test_traceable_path_equals_the_eager_path), inductor's dynamic graph at three sizes below."""
    # one layer, all four levels from it, p8: every kind of kernel a deeper or p16 model has (p16
    # adds a fourth conv-BN-GELU stem layer and a BN-GELU between two transposed convs: more
    # kernels of the same kinds; on a cold inductor cache the compile time grows with the
    # kernels, not with the values tested)
    model = tiny(8, arch=dict(embed_dims=32, depth=1, num_heads=2), out_indices=(0, 0, 0, 0))
    twin = copy.deepcopy(model)  # BN running statistics move in train mode: one copy each
    compiled = torch.compile(twin, backend='inductor', dynamic=False)
    x = torch.randn(2, 3, 100, 90)
    results = []
    for m, f in ((model, model), (twin, compiled)):
        m.train()
        m.zero_grad(set_to_none=True)
        outs = f(x)
        sum((o * o).mean() for o in outs).backward()
        grads = {n: p.grad for n, p in m.named_parameters()}
        results.append(([o.detach() for o in outs], grads))
    (eager_out, eager_grad), (comp_out, comp_grad) = results
    for a, b in zip(comp_out, eager_out):
        assert a.is_contiguous()
        assert_close_scaled(a, b, 1e-5, 'output')
    assert eager_grad.keys() == comp_grad.keys()
    floor = grad_floor(eager_grad.values())
    for name in eager_grad:
        assert_close_scaled(comp_grad[name], eager_grad[name], 1e-4, f'grad {name}', floor)


@CPU_FLAGS_TRUSTED
def test_inductor_serves_every_image_size():
    """inductor (CPU), eval, p8 (as the train-step test above), ``dynamic=True``: the
    dynamic-shape graph serves three image sizes, padded or not (in detection every batch can
    have another size), equal to eager. torch 2.13's inductor failed on the dynamic graph while
    the backbone computed its padding as ``-H % patch_size`` (a modulo of symbolic sizes).

    Starting dynamic (``torch.compile``'s default compiles the first size statically, the
    second dynamically) and sizes that pass the same guards of inductor's graph (torch 2.13:
    more than 160 patches, for the stem convolution's small-input backend; per side, the
    number of patches 2 mod 4 and ``ceil(S / 4) == 2 * ceil(S / 8)``, for the pooling and
    upsampling sizes) make it one compilation: on a cold inductor cache, each is the slowest
    step of the suite."""
    from torch._dynamo.utils import counters
    model = tiny(8, arch=dict(embed_dims=32, depth=1, num_heads=2),
                 out_indices=(0, 0, 0, 0)).eval()
    compiled = torch.compile(model, backend='inductor', dynamic=True)
    counters.clear()
    with torch.no_grad():
        for size in ((110, 142), (144, 112), (142, 110)):  # padded, unpadded, padded
            x = torch.randn(1, 3, *size)
            for a, b in zip(compiled(x), model(x)):
                assert_close_scaled(a, b, 1e-5, f'output at {size}')
    print('inductor graphs compiled:', counters['stats']['unique_graphs'])


def test_benchmark_compile_names():
    """The benchmark's +compile models: names, and --compile both pairs compiled with eager."""
    from xcit_benchmark.models import parse_model
    from xcit_benchmark.runner import variants
    spec = parse_model('xcit_s12_p16+compile+cp')
    assert (spec.name, spec.compiled, spec.with_cp) == ('xcit_s12_p16+cp+compile', True, True)
    assert 'torch.compile' in spec.description
    pairs = []
    specs = variants([parse_model('xcit_s12_p8'), parse_model('swin_t')], 'both', pairs,
                     '+compile')
    assert [s.name for s in specs] == ['xcit_s12_p8', 'xcit_s12_p8+compile', 'swin_t',
                                       'swin_t+compile']
    assert pairs == [('xcit_s12_p8+compile', 'xcit_s12_p8'), ('swin_t+compile', 'swin_t')]
    assert [s.name for s in variants(specs[:1], 'on', [], '+compile')] == ['xcit_s12_p8+compile']


def test_compile_hook_compiles_the_feature_extractor_once():
    """``CompileFeatureExtractorHook`` compiles ``extract_feat`` (backbone + neck), not
    mmengine's whole train step (whose optimizer step dynamo cannot trace on torch 2.13), once
    for train and val, and the compiled features equal eager. (The aot_eager backend: what is
    compiled and how often; inductor's values are the other tests'.)"""
    from types import SimpleNamespace

    from mmengine.registry import HOOKS, MODELS, init_default_scope

    import training_extras  # noqa: F401  (registers the hook)
    init_default_scope('mmseg')
    torch.manual_seed(0)
    model = MODELS.build(dict(
        type='EncoderDecoder',
        backbone=dict(type='XCiTBackbone', arch=dict(embed_dims=32, depth=2, num_heads=4),
                      patch_size=16, out_indices=(0, 0, 1, 1)),
        neck=dict(type='FPN', in_channels=[32] * 4, out_channels=16, num_outs=4),
        decode_head=dict(type='FPNHead', in_channels=[16] * 4, in_index=[0, 1, 2, 3],
                         feature_strides=[4, 8, 16, 32], channels=16, num_classes=3,
                         loss_decode=dict(type='CrossEntropyLoss')))).eval()
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        eager = model.extract_feat(x)
    logs = []
    runner = SimpleNamespace(model=model, logger=SimpleNamespace(info=logs.append))
    hook = HOOKS.build(dict(type='CompileFeatureExtractorHook', backend='aot_eager'))
    hook.before_run(runner)  # runner.train()
    compiled_fn = model.extract_feat
    hook.before_run(runner)  # a later runner.test() of the same model
    assert model.extract_feat is compiled_fn and len(logs) == 1
    assert 'train_step' not in vars(model)  # mmengine's whole-step compile is not used
    with torch.no_grad():
        for got, want in zip(model.extract_feat(x), eager):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_config_compile_true_compiles_the_feature_extractor_not_the_train_step():
    """Every XCiT config carries ``CompileFeatureExtractorHook(follow_config=True)`` (the runtime
    base): idle without ``compile`` in the config; with ``compile=True`` / ``compile=dict(...)``
    it compiles ``extract_feat`` with those arguments and removes ``compile`` from the runner's
    config, so mmengine's ``_maybe_compile`` leaves ``train_step`` alone."""
    from types import SimpleNamespace

    from mmengine.config import Config
    from mmengine.registry import HOOKS

    import training_extras  # noqa: F401  (registers the hook)
    base = Config.fromfile(osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'configs',
                                    '_base_', 'training_extras.py'))
    (entry,) = [h for h in base.custom_hooks
                if h['type'] == 'training_extras.CompileFeatureExtractorHook']

    class Detector(nn.Module):
        def extract_feat(self, x):
            return x * 2

        def train_step(self, data):
            return data

    for compile_cfg, expected in ((None, None), (False, None), (True, {'dynamic': False}),
                                  (dict(backend='eager', dynamic=True),
                                   {'dynamic': True, 'backend': 'eager'})):
        model, logs = Detector(), []
        cfg = Config(dict(compile=compile_cfg) if compile_cfg is not None else {})
        runner = SimpleNamespace(model=model, cfg=cfg, logger=SimpleNamespace(info=logs.append))
        HOOKS.build(copy.deepcopy(entry)).before_run(runner)
        if expected is None:
            assert 'extract_feat' not in vars(model) and not logs, compile_cfg
            continue
        assert 'extract_feat' in vars(model) and 'train_step' not in vars(model)
        assert cfg.get('compile') is None  # mmengine's _maybe_compile now does nothing
        assert f'torch.compile({expected})' in logs[0]
        assert torch.equal(model.extract_feat(torch.ones(2)), torch.full((2,), 2.))
    runner = SimpleNamespace(model=Detector(), cfg=Config(dict(compile='yes')),
                             logger=SimpleNamespace(info=print))
    with pytest.raises(TypeError, match='compile must be True or a dict'):
        HOOKS.build(copy.deepcopy(entry)).before_run(runner)
