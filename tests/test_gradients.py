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
other drop-path masks).
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
def forward_backward(model, image, weights, seed, pad_to=None):
    """Outputs (cropped to ceil(H / s)) and the image's gradient, after backpropagating the
    weighted sum of the four outputs. ``pad_to``: zero-pad bottom/right to a multiple first."""
    H, W = image.shape[-2:]
    image = image.clone().requires_grad_()
    x = F.pad(image, (0, -W % pad_to, 0, -H % pad_to)) if pad_to else image
    torch.manual_seed(seed)  # the same drop-path masks in both models
    outs = [out[..., :math.ceil(H / s), :math.ceil(W / s)] for out, s in zip(model(x), STRIDES)]
    sum((out * w).sum() for out, w in zip(outs, weights)).backward()
    return [out.detach() for out in outs], image.grad


def assert_close(got, want, dtype, scale=None, msg=''):
    rtol, atol = TOLERANCES[dtype]
    scale = float(want.abs().max()) if scale is None else scale
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol * max(scale, 1e-30), msg=msg)


def compare_step(reference, backbone, dtype, seed, frozen=frozenset()):
    """One forward/backward of both models on each of INPUTS; everything must agree.

    ``frozen``: backbone parameters that must get no gradient (None). Returns, per input, the
    reference's state-dict keys that the step changed (BN statistics).
    """
    changed_per_input = []
    names = reference_names(reference, backbone)
    patch_size = backbone.patch_size
    generator = torch.Generator().manual_seed(seed)
    for batch, H, W in INPUTS:
        for model in (reference, backbone):
            model.zero_grad(set_to_none=True)
        image = torch.randn(batch, 3, H, W, generator=generator, dtype=dtype)
        shapes = [(batch, D, math.ceil(H / s), math.ceil(W / s)) for s in STRIDES]
        weights = [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]
        case = f'p{patch_size} {batch}x{H}x{W}'
        ref_buffers = {k: v.clone() for k, v in reference.state_dict().items()}

        # the backbone's outputs have the cropped shapes themselves (cropping changes nothing)
        got_outs, got_grad = forward_backward(backbone, image, weights, seed)
        assert [tuple(out.shape) for out in got_outs] == shapes, case
        want_outs, want_grad = forward_backward(reference, image, weights, seed, patch_size)

        for level, (got, want) in enumerate(zip(got_outs, want_outs)):
            assert_close(got, want, dtype, msg=f'{case}: output {level}')
        assert_close(got_grad, want_grad, dtype, msg=f'{case}: image gradient')

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
    adapter's channels-last upsampling is one matmul and an interleaving copy), every output
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
