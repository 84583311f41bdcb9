"""XCiTBackbone's gradients equal those of the straightforward reference, in every training mode.

What is compared with what: ``XCiTBackbone`` (hand-scheduled XCA, channels-last views, NCHW
upsampling written in blocks, and whatever memory-saving autograd it uses) against the reference of
``tests/xcit_reference.py``, built without xcit_mm: mmpretrain's XCiT trunk (plain autograd) plus
the official stride adapter in plain ``torch.nn``. The backbone gets the reference's weights
through the project's converter (``convert_backbone_state_dict``, strict loading), both run the
same image with the same seed, and a fixed random weighting of the four outputs is backpropagated.
Then the outputs, the image's gradient, EVERY parameter's gradient (names mapped one to one
through the same converter, none skipped) and the BN running statistics after the step must agree.

Why: an activation-saving rewrite (recomputation, custom ``autograd.Function``) can be right in
the forward and wrong in the backward, or update BN statistics twice while recomputing; only the
gradients and buffers show it. Covered: p8 / p16, train mode (BN batch statistics) with stochastic
depth off and on, frozen stages, eval and ``norm_eval``, batch sizes 1 and 2, an image whose sides
are not multiples of the patch size (the backbone pads bottom/right and crops to ceil(H / s); the
reference is fed the same padded image and cropped the same way) and one whose sides are.

Stochastic depth: mmpretrain builds every layer with the same rate (as the official code does)
and draws its masks with mmcv's ``drop_path`` (timm's: ``torch.rand((B, 1, 1))`` in the input's
dtype) per layer in the order XCA, LPI (norm3 / gamma3), FFN (norm2 / gamma2), as XCiTBackbone
does; so ``torch.manual_seed`` right before each forward gives both the same masks. Hooks on the
reference count dropped and kept sample-branches, so a drop-path case that drops nothing fails.

Weights are random throughout: ``randomise_`` (BN statistics, layer scales, temperatures) and,
here, random values for what mmpretrain initialises to constants (Linear biases, LayerNorm
affines), which a hand-written backward could otherwise drop unnoticed.

The reference differs from the official code in two details, both plain torch: mmpretrain feeds
its float32 Fourier code to a projection of the model's dtype (a pre-hook casts it), and the
official adapter pools without ``ceil_mode``, which only matters on patch grids that its pooling
does not divide (70 px with p8: 9 rows); there the backbone pools with ``ceil_mode`` to reach
ceil(H / s), and so does the reference here.

Precision: float64 is the check (rounding ~1e-14 relative, so tolerances of 1e-9 leave room for
nothing but bugs: a gradient off by 1e-5, a LayerNorm recomputed with another eps fail it). The
float32 cases run the dtype training uses, at 2e-4 of each module's gradient scale (measured
differences stay below 3e-5); they catch only gross errors (a missing term, a double BN update,
other drop-path masks). A bf16-autocast training step is compared with the float64 reference at
measured bf16 tolerances, in a regime where XCA's float32 attention is needed to meet them.

Fine-tuning as it runs (frozen_stages >= 0, an image that needs no gradient, with_cp on and off)
reaches the hand-written backwards with an input that needs no gradient; those cases are compared
in float64 too.
"""
import functools
import math
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn.bricks import DropPath
from torch.nn.modules.batchnorm import _BatchNorm

from xcit_reference import OfficialDenseXCiT, mmpretrain_trunk, to_official

from xcit_mm import XCiTBackbone
from xcit_mm.models.utils.ckpt_convert import convert_backbone_state_dict

D, DEPTH, HEADS = 64, 4, 4
STRIDES = (4, 8, 16, 32)
DROP_PATH = 0.3
# (batch, H, W): sides that are not multiples of 8 or 16, then multiples of 16.
INPUTS = ((2, 70, 90), (1, 64, 96))
# Relative tolerance, and absolute tolerance as a fraction of the module's largest gradient.
TOLERANCES = {torch.float64: (1e-9, 1e-11), torch.float32: (2e-4, 2e-4)}
DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ['float64', 'float32']
# Keys of mmpretrain's classifier (CLS token, class attention, final norm): not in the backbone.
CLASSIFIER_PREFIXES = ('trunk.cls_token', 'trunk.ca_layers.', 'trunk.norm.')


# ----------------------------------------------------------------------------- construction
def randomise_constant_parameters_(model):
    """Parameters still at a constant init (zero Linear biases, unit / zero LayerNorm affines) get
    random values: a bias or a LayerNorm affine dropped by a hand-written backward would go
    unnoticed while they are zero / one."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def build_pair(mmpretrain_xcit, patch_size, dtype, drop_path_rate=0., **backbone_kwargs):
    """(reference, backbone) in ``dtype``, the backbone holding the reference's weights."""
    trunk = mmpretrain_trunk(functools.partial(mmpretrain_xcit, drop_path_rate=drop_path_rate),
                             patch_size, D, DEPTH, HEADS)
    for layer in trunk.xca_layers:  # one rate for every layer, as in the official code
        if drop_path_rate:
            assert isinstance(layer.drop_path, DropPath)
            assert layer.drop_path.drop_prob == drop_path_rate
        else:
            assert isinstance(layer.drop_path, nn.Identity)
    randomise_constant_parameters_(trunk)
    # mmpretrain computes the Fourier code in float32 and feeds it to the projection as it is.
    trunk.pos_embed.token_projection.register_forward_pre_hook(
        lambda module, args: (args[0].to(module.conv.weight.dtype), ))
    reference = OfficialDenseXCiT(trunk, D, patch_size)
    for module in reference.adapter.modules():
        if isinstance(module, nn.MaxPool2d):
            module.ceil_mode = True  # no effect where the pooling divides the grid
    reference.to(dtype)
    backbone = XCiTBackbone(arch=dict(embed_dims=D, depth=DEPTH, num_heads=HEADS),
                            patch_size=patch_size, out_indices=(0, 1, 2, 3),
                            drop_path_rate=drop_path_rate, init_cfg=None,
                            **backbone_kwargs).to(dtype)
    state, info = convert_backbone_state_dict(reference.released_state_dict())
    assert info['layout'] == 'official'
    backbone.load_state_dict(state, strict=True)
    return reference, backbone


def reference_names(reference, backbone):
    """{backbone tensor name: reference tensor name}, through the converter; one to one."""
    official = to_official(OrderedDict((k, 'trunk.' + k) for k in reference.trunk.state_dict()),
                           classifier=False)
    official.update((k, 'adapter.' + k) for k in reference.adapter.state_dict())
    names, _ = convert_backbone_state_dict(official)
    assert set(names) == set(backbone.state_dict())
    assert len(set(names.values())) == len(names)
    return names


def count_drops(reference):
    """Counts of dropped / kept sample-branches in the reference's forward passes."""
    counts = dict(dropped=0, kept=0)

    def hook(module, args, output):
        if module.training:
            zero = (output.flatten(1) == 0).all(dim=1)
            counts['dropped'] += int(zero.sum())
            counts['kept'] += int((~zero).sum())

    for module in reference.modules():
        if isinstance(module, DropPath):
            module.register_forward_hook(hook)
    return counts


# ----------------------------------------------------------------------------- one step
def forward_backward(model, image, weights, seed, pad_to=None, image_requires_grad=True):
    """Outputs (cropped to ceil(H / s)) and the image's gradient (None if it requires none), after
    backpropagating the weighted sum of the four outputs. ``pad_to``: zero-pad bottom/right to a
    multiple first."""
    H, W = image.shape[-2:]
    image = image.clone().requires_grad_(image_requires_grad)
    x = F.pad(image, (0, -W % pad_to, 0, -H % pad_to)) if pad_to else image
    torch.manual_seed(seed)  # the same drop-path masks in both models
    outs = [out[..., :math.ceil(H / s), :math.ceil(W / s)] for out, s in zip(model(x), STRIDES)]
    sum((out * w).sum() for out, w in zip(outs, weights)).backward()
    return [out.detach() for out in outs], image.grad


def assert_close(got, want, dtype, scale=None, msg=''):
    rtol, atol = TOLERANCES[dtype]
    scale = float(want.abs().max()) if scale is None else scale
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol * max(scale, 1e-30), msg=msg)


def compare_step(reference, backbone, dtype, seed, frozen=frozenset(), image_requires_grad=True,
                 inputs=INPUTS):
    """One forward/backward of both models on each of ``inputs``; everything must agree.

    ``frozen``: backbone parameters that must get no gradient (None). ``image_requires_grad``:
    False as in training (data loaders give plain tensors): the image then gets no gradient, and
    the first trainable module after frozen ones gets an input that needs none. Returns, per
    input, the reference's state-dict keys that the step changed (BN statistics).
    """
    changed_per_input = []
    names = reference_names(reference, backbone)
    patch_size = backbone.patch_size
    generator = torch.Generator().manual_seed(seed)
    for batch, H, W in inputs:
        for model in (reference, backbone):
            model.zero_grad(set_to_none=True)
        image = torch.randn(batch, 3, H, W, generator=generator, dtype=dtype)
        shapes = [(batch, D, math.ceil(H / s), math.ceil(W / s)) for s in STRIDES]
        weights = [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]
        case = f'p{patch_size} {batch}x{H}x{W}'
        ref_buffers = {k: v.clone() for k, v in reference.state_dict().items()}

        # the backbone's outputs have the cropped shapes themselves (cropping changes nothing)
        got_outs, got_grad = forward_backward(backbone, image, weights, seed,
                                              image_requires_grad=image_requires_grad)
        assert [tuple(out.shape) for out in got_outs] == shapes, case
        want_outs, want_grad = forward_backward(reference, image, weights, seed, patch_size,
                                                image_requires_grad=image_requires_grad)

        for level, (got, want) in enumerate(zip(got_outs, want_outs)):
            assert_close(got, want, dtype, msg=f'{case}: output {level}')
        if image_requires_grad:
            assert_close(got_grad, want_grad, dtype, msg=f'{case}: image gradient')
        else:
            assert got_grad is None and want_grad is None, case

        ref_params = dict(reference.named_parameters())
        params = dict(backbone.named_parameters())
        mapped = {names[n] for n in params}
        unmapped = set(ref_params) - mapped
        assert all(n.startswith(CLASSIFIER_PREFIXES) for n in unmapped), sorted(unmapped)
        assert all(ref_params[n].grad is None for n in unmapped), case  # unused by dense outputs
        # each gradient at the scale of its module's gradients: the bias of a transposed conv
        # feeding a train-mode BN (fpn1.0 of p16) has an analytic gradient of zero, so what
        # both compute there is rounding noise of the size of that conv's weight gradient.
        module_scale = {}
        for name in params:
            if name not in frozen:
                grad = ref_params[names[name]].grad
                assert grad is not None, f'{case}: reference {names[name]} got no gradient'
                module = name.rsplit('.', 1)[0]
                module_scale[module] = max(module_scale.get(module, 0.), float(grad.abs().max()))
        for name, param in params.items():
            if name in frozen:
                assert param.grad is None, f'{case}: frozen {name} got a gradient'
                continue
            assert param.grad is not None, f'{case}: {name} got no gradient'
            assert_close(param.grad, ref_params[names[name]].grad, dtype,
                         scale=module_scale[name.rsplit('.', 1)[0]],
                         msg=f'{case}: gradient of {name}')

        # BN running statistics after the step (updated once, with the same batch statistics)
        ref_state = reference.state_dict()
        for name, buffer in backbone.named_buffers():
            want = ref_state[names[name]]
            if buffer.is_floating_point():
                assert_close(buffer, want, dtype, msg=f'{case}: {name}')
            else:
                assert torch.equal(buffer, want), f'{case}: {name}'
        changed_per_input.append(
            [k for k, v in ref_state.items() if not torch.equal(v, ref_buffers[k])])
    return changed_per_input


# ----------------------------------------------------------------------------- the cases
@pytest.mark.parametrize('dtype', DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize('drop_path_rate', [0., DROP_PATH])
@pytest.mark.parametrize('patch_size', [8, 16])
def test_train_mode_gradients_equal_the_reference(mmpretrain_xcit, patch_size, drop_path_rate,
                                                  dtype):
    """Train mode: BN on batch statistics, stochastic depth drawn identically when on."""
    reference, backbone = build_pair(mmpretrain_xcit, patch_size, dtype, drop_path_rate)
    reference.train()
    backbone.train()
    drops = count_drops(reference)
    for changed in compare_step(reference, backbone, dtype, seed=11):
        assert any(k.endswith('running_mean') for k in changed)  # BN did run on batch stats
    if drop_path_rate:
        assert drops['dropped'] > 0 and drops['kept'] > 0, drops
    else:
        assert drops == dict(dropped=0, kept=0)


@pytest.mark.parametrize('dtype', DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize('patch_size', [8, 16])
def test_channels_last_outputs_equal_the_reference(mmpretrain_xcit, patch_size, dtype):
    """out_channels_last=True: the same values and gradients as the reference's NCHW maps (the
    adapter's channels-last upsampling writes row blocks into a channels-last map), every output
    laid out channels-last, the padded inputs' crops included."""
    reference, backbone = build_pair(mmpretrain_xcit, patch_size, dtype, out_channels_last=True)
    reference.train()
    backbone.train()
    compare_step(reference, backbone, dtype, seed=13)
    for batch, H, W in INPUTS:
        outs = backbone(torch.randn(batch, 3, H, W, dtype=dtype))
        for out in outs:
            assert out.is_contiguous(memory_format=torch.channels_last), tuple(out.shape)


@pytest.mark.parametrize('dtype', DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize('patch_size', [8, 16])
def test_frozen_stages_get_no_gradient(mmpretrain_xcit, patch_size, dtype):
    """frozen_stages=2: embeddings and layers 0-1 get no gradient and keep their BN statistics;
    the rest, and the image, get the reference's gradients (the reference runs the same modules
    in eval mode: the official code has no frozen stages)."""
    reference, backbone = build_pair(mmpretrain_xcit, patch_size, dtype, DROP_PATH,
                                     frozen_stages=2)
    reference.train()
    backbone.train()
    trunk = reference.trunk
    for module in [trunk.patch_embed, trunk.pos_embed, *trunk.xca_layers[:2]]:
        module.eval()
    frozen = {n for n, p in backbone.named_parameters() if not p.requires_grad}
    prefixes = ('patch_embed.', 'pos_embed.', 'layers.0.', 'layers.1.')
    assert frozen == {n for n, _ in backbone.named_parameters() if n.startswith(prefixes)}
    drops = count_drops(reference)
    for changed in compare_step(reference, backbone, dtype, seed=12, frozen=frozen):
        assert not any(k.startswith(('trunk.patch_embed.', 'trunk.xca_layers.0.',
                                     'trunk.xca_layers.1.')) for k in changed), changed
        assert any(k.startswith('trunk.xca_layers.2.') for k in changed)
    assert drops['dropped'] > 0 and drops['kept'] > 0, drops


# Sub-blocks of layer 0 frozen by hand (requires_grad=False, modules left in train mode), on top
# of frozen_stages=0: the LPI residual, then the FFN residual, get an input that needs no grad.
XCA_PART = ('layers.0.norm1.', 'layers.0.attn.', 'layers.0.gamma1')
LPI_PART = ('layers.0.norm3.', 'layers.0.lpi.', 'layers.0.gamma3')
FINE_TUNING_CASES = {
    # the first trainable layer's XCA residual gets an input that needs no gradient
    'p16-frozen0': (16, 0, ()),
    # ... and (p8: fpn1 upsamples layer 0, which is frozen) the NCHW upsampling too
    'p8-frozen1': (8, 1, ()),
    'p16-frozen0-xca-by-hand': (16, 0, XCA_PART),  # the recomputed LPI residual
    'p8-frozen0-xca-lpi-by-hand': (8, 0, XCA_PART + LPI_PART),  # the FFN residual
}


@pytest.mark.parametrize('with_cp', [False, True], ids=['plain', 'with_cp'])
@pytest.mark.parametrize('case', list(FINE_TUNING_CASES))
def test_fine_tuning_with_an_image_that_needs_no_gradient(mmpretrain_xcit, case, with_cp):
    """Fine-tuning as it runs: frozen_stages >= 0 and an image from the data loader (no
    requires_grad), with and without with_cp, float64. The first trainable module after the
    frozen ones then gets an input that needs no gradient: the hand-written backwards skip the
    input's gradient there (``ctx.needs_input_grad``) and must still give every trainable
    parameter the reference's gradient; frozen parameters get none, frozen BN statistics stay.
    Sub-blocks frozen by hand reach the same branch in the LPI and FFN residuals."""
    patch_size, frozen_stages, by_hand = FINE_TUNING_CASES[case]
    dtype = torch.float64
    reference, backbone = build_pair(mmpretrain_xcit, patch_size, dtype, DROP_PATH,
                                     frozen_stages=frozen_stages, with_cp=with_cp)
    for name, param in backbone.named_parameters():
        if name.startswith(by_hand):
            param.requires_grad_(False)
    reference.train()
    backbone.train()
    trunk = reference.trunk
    for module in [trunk.patch_embed, trunk.pos_embed, *trunk.xca_layers[:frozen_stages]]:
        module.eval()  # what frozen_stages does to the backbone's frozen modules
    frozen = {n for n, p in backbone.named_parameters() if not p.requires_grad}
    prefixes = ('patch_embed.', 'pos_embed.') + tuple(
        f'layers.{i}.' for i in range(frozen_stages)) + by_hand
    assert frozen == {n for n, _ in backbone.named_parameters() if n.startswith(prefixes)}
    drops = count_drops(reference)
    # one input (a batch of two, sides not multiples of the patch size): 8 cases stay short
    for changed in compare_step(reference, backbone, dtype, seed=14, frozen=frozen,
                                image_requires_grad=False, inputs=INPUTS[:1]):
        assert not any(k.startswith('trunk.patch_embed.') for k in changed), changed
        assert any(k.startswith(f'trunk.xca_layers.{frozen_stages}.') for k in changed), changed
    assert drops['dropped'] > 0 and drops['kept'] > 0, drops


@pytest.mark.parametrize('dtype', DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize('mode', ['eval', 'norm_eval'])
@pytest.mark.parametrize('patch_size', [8, 16])
def test_eval_and_norm_eval_gradients_equal_the_reference(mmpretrain_xcit, patch_size, mode,
                                                          dtype):
    """BN on running statistics, gradients enabled: ``model.eval()`` (no stochastic depth) and
    ``norm_eval=True`` in train mode (stochastic depth on); no statistic changes."""
    reference, backbone = build_pair(mmpretrain_xcit, patch_size, dtype, DROP_PATH,
                                     norm_eval=mode == 'norm_eval')
    if mode == 'eval':
        reference.eval()
        backbone.eval()
    else:
        reference.train()
        for module in reference.modules():
            if isinstance(module, _BatchNorm):
                module.eval()
        backbone.train()
    drops = count_drops(reference)
    assert torch.is_grad_enabled()
    for changed in compare_step(reference, backbone, dtype, seed=13):
        assert changed == [], changed
    if mode == 'eval':
        assert drops == dict(dropped=0, kept=0)
    else:
        assert drops['dropped'] > 0 and drops['kept'] > 0, drops


# ----------------------------------------------------------------------------- bf16 autocast
# The regime where XCA's float32 attention matters (see the test's docstring): p8 on a 256 x 256
# image (a 32 x 32 grid, 1024 tokens), a qkv bias of std QKV_OFFSET (the token-dependent part
# of q, k and v has std ~0.16: LayerNorm output times Linear weights of std 0.02) and
# temperatures drawn in BF16_TEMPERATURES.
BF16_IMAGE = (1, 256, 256)
QKV_OFFSET = 6.
BF16_TEMPERATURES = (8., 12.)
# Relative errors (2-norm of the difference over 2-norm of the reference) against float64, with
# the code as it is / with XCA's autocast-disabled block removed (q^T k and the mixing then run
# in bf16), measured for the test's seed 21 [and the range over seeds 21-26]:
# - the temperatures' gradients of all layers, as one vector: 0.0051 [0.0033-0.0114] /
#   0.199 [0.141-0.503]; the bound sits a factor ~3.5 from both ranges.
BF16_TEMPERATURE_TOL = 0.04
# - every other gradient: at most 0.134 [0.134-0.251] / 0.247 [0.187-0.312] (LayerNorm and LPI
#   biases); the image's gradient 0.045 / 0.044; the outputs 0.0058 / 0.0076. bf16 noise: this
#   bound catches only gross errors (a missing term, a cast that loses a gradient).
BF16_TOL = 0.5


def bf16_autocast_errors(mmpretrain_xcit, seed=21, qkv_offset=QKV_OFFSET,
                         temperatures=BF16_TEMPERATURES, image_size=BF16_IMAGE):
    """{name: relative error} of a bf16-autocast training step (train mode, forward and backward)
    of a float32 p8 XCiTBackbone against the float64 reference: ``out{level}``, ``image`` (its
    gradient), every parameter's gradient, and ``temperatures`` (all layers' at once).
    ``qkv_offset`` / ``temperatures`` None: the weights of :func:`build_pair` as they are."""
    reference, backbone = build_pair(mmpretrain_xcit, 8, torch.float64)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in reference.trunk.xca_layers:
            if qkv_offset is not None:
                bias = layer.attn.qkv.bias
                bias.copy_(qkv_offset * torch.randn(bias.shape, generator=generator,
                                                    dtype=bias.dtype))
            if temperatures is not None:
                low, high = temperatures
                temperature = layer.attn.temperature
                temperature.copy_(low + (high - low) * torch.rand(
                    temperature.shape, generator=generator, dtype=temperature.dtype))
        # weights that bf16 represents exactly: the error measured is the computation's, not
        # that of rounding the stored weights (which autocast does with or without the block)
        for param in reference.parameters():
            param.copy_(param.to(torch.bfloat16))
    state, _ = convert_backbone_state_dict(reference.released_state_dict())
    backbone.load_state_dict(state, strict=True)
    backbone.float()
    names = reference_names(reference, backbone)
    reference.train()
    backbone.train()

    batch, H, W = image_size
    image = torch.randn(batch, 3, H, W, generator=generator, dtype=torch.float64)
    image = image.to(torch.bfloat16).double()
    shapes = [(batch, D, math.ceil(H / s), math.ceil(W / s)) for s in STRIDES]
    weights = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    with torch.autocast('cpu', dtype=torch.bfloat16):
        got_outs, got_grad = forward_backward(backbone, image.float(),
                                              [w.float() for w in weights], seed)
    want_outs, want_grad = forward_backward(reference, image, weights, seed, 8)

    def error(got, want):
        return float((got.double() - want).norm() / want.norm())

    errors = {f'out{level}': error(got, want)
              for level, (got, want) in enumerate(zip(got_outs, want_outs))}
    errors['image'] = error(got_grad, want_grad)
    ref_params = dict(reference.named_parameters())
    got_temperatures, want_temperatures = [], []
    for name, param in backbone.named_parameters():
        assert param.grad is not None, name
        want = ref_params[names[name]].grad
        if name.endswith('attn.temperature'):
            got_temperatures.append(param.grad.flatten())
            want_temperatures.append(want.flatten())
        else:
            errors[name] = error(param.grad, want)
    errors['temperatures'] = error(torch.cat(got_temperatures), torch.cat(want_temperatures))
    return errors


def test_bf16_autocast_training_gradients_keep_attention_in_float32(mmpretrain_xcit):
    """A bf16-autocast training step (train mode, backward) of a float32 backbone against the
    float64 reference: every gradient and output within bf16 noise, and the temperatures'
    gradients within a bound that needs XCA's float32 attention (the autocast-disabled block
    around the normalisation, the product q^T k, the softmax and the mixing).

    Why this regime: the cosines ``q_i^T k_j / (|q_i| |k_j|)`` are sums over all tokens. The
    per-token bf16 rounding of q and k averages out in a float32 product (its effect shrinks like
    1 / sqrt(tokens)); rounding the product itself to bf16 adds 2^-9 of its size, which does not
    average out. The softmax sees that error times the temperature, and it matters where the q
    and k channels are nearly parallel over the tokens (a large token-independent part, here
    from the qkv bias): the cosines then crowd near +-1, and the attention, the normalisation's
    backward and the temperatures' gradients live on their small differences. Measured
    temperatures' gradient error with / without the block: qkv bias std 1 (6x the
    token-dependent part; seeds 21-23) 0.007-0.012 / 0.046-0.076, std 6 (used here, for the
    margin; seeds 21-26) 0.003-0.011 / 0.14-0.50. Without the offset no difference, neither at
    temperatures ~10 and 1024 tokens (seeds 21-23: 0.027-0.041 / 0.031-0.046) nor on the usual
    random weights (temperatures 0.5-1.5, a 2 x 70 x 90 batch; seeds 21-24: 0.016-0.075 /
    0.016-0.065): no test can see the block there. The outputs' and the other gradients'
    errors come from the rest of the bf16 network, with or without the block.
    """
    errors = bf16_autocast_errors(mmpretrain_xcit)
    assert all(math.isfinite(e) for e in errors.values()), errors
    worst = max(errors, key=errors.get)
    assert errors[worst] < BF16_TOL, (worst, errors[worst])
    assert errors['temperatures'] < BF16_TEMPERATURE_TOL, errors['temperatures']
