"""XCiTBackbone behaviour an mmdet/mmseg user relies on: shapes, options, errors, registries."""
import math
import os
import tempfile
from unittest import TestCase

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from xcit_mm import XCiTBackbone
from xcit_mm.models.backbones.xcit import arch_zoo

TINY = dict(embed_dims=64, depth=4, num_heads=4)


def tiny(**kwargs):
    kwargs.setdefault('arch', TINY)
    kwargs.setdefault('out_indices', (0, 1, 2, 3))
    model = XCiTBackbone(**kwargs)
    model.init_weights()
    return model


def randomise_bn(model, seed=0):
    """Give BNs non-trivial running statistics so eval-mode tests see them."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


class TestShapes(TestCase):

    def test_output_shapes_any_size(self):
        for patch_size in (8, 16):
            model = tiny(patch_size=patch_size).eval()
            self.assertEqual(model.out_channels, [64] * 4)
            self.assertEqual(tuple(model.strides), (4, 8, 16, 32))
            for H, W in [(64, 64), (32, 32), (97, 131), (224, 160), (33, 250)]:
                with torch.no_grad():
                    outs = model(torch.randn(2, 3, H, W))
                self.assertEqual(len(outs), 4)
                for out, stride in zip(outs, model.strides):
                    self.assertEqual(tuple(out.shape),
                                     (2, 64, math.ceil(H / stride), math.ceil(W / stride)),
                                     f'p{patch_size} {H}x{W} stride {stride}')
                trunk = model.forward_trunk(torch.randn(1, 3, H, W))
                for feat in trunk:
                    self.assertEqual(tuple(feat.shape), (1, 64, math.ceil(H / patch_size),
                                                         math.ceil(W / patch_size)))

    def test_outputs_are_contiguous_nchw_for_roi_align(self):
        """Downstream ops read raw NCHW memory: mmcv's CPU RoIAlign returns wrong values for a
        channels-last map (this is what kept the shapes Mask R-CNN from learning)."""
        from mmcv.ops import RoIAlign
        roi_align = RoIAlign((7, 7), spatial_scale=0.25, sampling_ratio=2, aligned=True)
        rois = torch.tensor([[0., 4., 6., 50., 40.], [1., 20., 10., 90., 70.]])
        for patch_size in (8, 16):
            model = tiny(patch_size=patch_size).eval()
            with torch.no_grad():
                outs = model(torch.randn(2, 3, 97, 131))  # cropped outputs too
                for out in outs:
                    self.assertTrue(out.is_contiguous(), f'p{patch_size} {tuple(out.shape)}')
                # the premise: the same values laid out channels-last give other RoI features
                channels_last = outs[0].contiguous(memory_format=torch.channels_last)
                self.assertFalse(torch.allclose(roi_align(outs[0], rois),
                                                roi_align(channels_last, rois)))

    def test_channels_last_outputs(self):
        """out_channels_last=True: the same maps (values and gradients; the reference check is
        tests/test_gradients.py), laid out channels-last at every size, cropped ones included,
        and still read right by RoIAlign through GatherRoIAlign."""
        from mmcv.ops import RoIAlign

        from training_extras.roi_heads import GatherRoIAlign
        rois = torch.tensor([[0., 4., 6., 50., 40.], [1., 20., 10., 90., 70.]],
                            dtype=torch.float64)
        for patch_size in (8, 16):
            nchw = randomise_bn(tiny(patch_size=patch_size)).double().eval()
            channels_last = tiny(patch_size=patch_size, out_channels_last=True).double().eval()
            channels_last.load_state_dict(nchw.state_dict())
            for H, W in [(64, 96), (97, 131)]:
                image = torch.randn(2, 3, H, W, dtype=torch.float64)
                want = nchw(image.clone().requires_grad_())
                x = image.clone().requires_grad_()
                got = channels_last(x)
                for g, w in zip(got, want):
                    self.assertTrue(g.is_contiguous(memory_format=torch.channels_last))
                    self.assertFalse(g.is_contiguous())
                    torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
                sum(out.sum() for out in got).backward()
                self.assertTrue(torch.isfinite(x.grad).all())
                torch.testing.assert_close(
                    GatherRoIAlign(7, 0.25, 2)(got[0], rois),
                    RoIAlign(7, 0.25, 2)(want[0], rois), rtol=1e-10, atol=1e-10)

    def test_blockwise_upsampling_equals_conv_transpose(self):
        """The adapter's eager 2x upsampling (up2_blockwise), written row block by row block into
        an NCHW or a channels-last map, equals nn.ConvTranspose2d in values and gradients (output
        gradients in either layout, as a crop hands them back), across block boundaries (21 rows
        in blocks of 10, 10 and 1), odd sides and in != out channels, and for a map done in one
        block. float64, so that only a wrong index, not the summation order, can make a
        difference."""
        from xcit_mm.models.layers import up2_blockwise
        torch.manual_seed(0)
        conv = nn.ConvTranspose2d(64, 48, kernel_size=2, stride=2).double().to(
            memory_format=torch.channels_last)  # as the backbone holds it
        params = [conv.weight, conv.bias]
        for shape in [(1, 64, 21, 1023), (2, 64, 5, 7)]:
            x = torch.randn(shape, dtype=torch.float64).contiguous(
                memory_format=torch.channels_last).requires_grad_()
            ref = conv(x)
            for layout in (torch.contiguous_format, torch.channels_last):
                out = up2_blockwise(conv, x, layout)
                self.assertTrue(out.is_contiguous(memory_format=layout))
                torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
                for grad_layout in (torch.contiguous_format, torch.channels_last):
                    grad = torch.randn_like(ref).contiguous(memory_format=grad_layout)
                    got = torch.autograd.grad(out, [x] + params, grad, retain_graph=True)
                    want = torch.autograd.grad(ref, [x] + params, grad, retain_graph=True)
                    for g, w in zip(got, want):
                        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)

    def test_published_archs_build_with_paper_widths(self):
        # Paper Table 1 (D, depth, heads), written out here: an outside source for arch_zoo.
        paper = {'n12': (128, 12, 4), 't12': (192, 12, 4), 't24': (192, 24, 4),
                 's12': (384, 12, 8), 's24': (384, 24, 8), 'm24': (512, 24, 8),
                 'l24': (768, 24, 16)}
        self.assertEqual(sorted(arch_zoo), sorted(paper))
        for name, (dims, depth, heads) in paper.items():
            with torch.device('meta'):  # shapes only: no memory for L24
                model = XCiTBackbone(arch=name, patch_size=16)
            self.assertEqual(model.embed_dims, dims)
            self.assertEqual(len(model.layers), depth)
            self.assertEqual(model.layers[0].attn.num_heads, heads)
            self.assertEqual(tuple(model.layers[0].attn.qkv.weight.shape), (3 * dims, dims))
            self.assertEqual(tuple(model.layers[0].ffn.fc1.weight.shape), (4 * dims, dims))
            expected = (3, 5, 7, 11) if depth == 12 else (7, 11, 15, 23)
            self.assertEqual(model.out_indices, expected)
        for depth, eta in ((12, 1.0), (24, 1e-5)):
            model = XCiTBackbone(arch=dict(embed_dims=64, depth=depth, num_heads=4))
            self.assertTrue(torch.all(model.layers[0].gamma1.detach() == eta))

    def test_out_indices_order_is_respected(self):
        model = tiny(out_indices=(3, 0, -1, 1)).eval()
        self.assertEqual(model.out_indices, (3, 0, 3, 1))
        x = torch.randn(1, 3, 64, 64)
        feats = model.forward_trunk(x)
        ref = tiny(out_indices=(0, 1, 2, 3))
        ref.load_state_dict(model.state_dict())
        ref_feats = ref.eval().forward_trunk(x)
        torch.testing.assert_close(feats[0], ref_feats[3])
        torch.testing.assert_close(feats[1], ref_feats[0])
        torch.testing.assert_close(feats[3], ref_feats[1])

    def test_sides_not_multiple_of_the_patch_are_zero_padded_bottom_right(self):
        # 100 x 90 px with p16: zero-padded to 112 x 96, outputs cropped to ceil(side / stride).
        model = randomise_bn(tiny(patch_size=16)).eval()
        x = torch.randn(1, 3, 100, 90)
        padded = torch.zeros(1, 3, 112, 96)
        padded[..., :100, :90] = x
        with torch.no_grad():
            outs, full = model(x), model(padded)
        self.assertEqual([tuple(o.shape[-2:]) for o in outs],
                         [(25, 23), (13, 12), (7, 6), (4, 3)])
        for out, ref in zip(outs, full):
            h, w = out.shape[-2:]
            torch.testing.assert_close(out, ref[..., :h, :w])


class TestErrors(TestCase):

    def test_bad_arch(self):
        with self.assertRaisesRegex(ValueError, r"Unknown XCiT arch 'x99'.*s12"):
            XCiTBackbone(arch='x99')
        with self.assertRaisesRegex(ValueError, 'num_heads'):
            XCiTBackbone(arch=dict(embed_dims=64, depth=4))
        with self.assertRaisesRegex(ValueError, 'divisible by num_heads'):
            XCiTBackbone(arch=dict(embed_dims=64, depth=2, num_heads=3), out_indices=(0, 0, 1, 1))

    def test_bad_patch_size(self):
        with self.assertRaisesRegex(ValueError, 'patch_size must be 8 or 16'):
            XCiTBackbone(arch='n12', patch_size=14)

    def test_bad_out_indices(self):
        with self.assertRaisesRegex(ValueError, 'out of range for a 12-layer'):
            XCiTBackbone(arch='n12', out_indices=(3, 5, 7, 12))
        with self.assertRaisesRegex(ValueError, 'exactly 4'):
            XCiTBackbone(arch='n12', out_indices=(3, 5, 7))

    def test_bad_frozen_stages(self):
        with self.assertRaisesRegex(ValueError, r'frozen_stages must be in \[-1, 12\]'):
            XCiTBackbone(arch='n12', frozen_stages=13)

    def test_pretrained_from_mmsegs_model_bases(self):
        """mmseg's EncoderDecoder hands ``model.pretrained`` to the backbone, and its model bases
        set their ResNet's: an error naming the fix. A path is taken as init_cfg, as mmseg's own
        backbones do."""
        import mmseg.models  # noqa: F401  (registers EncoderDecoder)
        from mmengine.config import Config
        from mmseg.registry import MODELS
        cfg = Config.fromfile(os.path.join(os.path.dirname(mmseg.models.__file__), '..', '.mim',
                                           'configs', 'sem_fpn',
                                           'fpn_r50_4xb4-160k_ade20k-512x512.py')).model
        cfg.backbone = dict(type='XCiTBackbone', arch='n12')
        from mmengine.registry import DefaultScope
        with DefaultScope.overwrite_default_scope('mmseg'):
            with self.assertRaisesRegex(ValueError, r"pretrained='open-mmlab://resnet50_v1c'.*"
                                                    r"Fix: set model\.pretrained=None"):
                MODELS.build(cfg)
            cfg.pretrained = 'xcit_nano_12_p16_224.pth'
            cfg.backbone = dict(type='XCiTBackbone', arch='n12')  # the build wrote into it
            with self.assertWarnsRegex(UserWarning, 'pretrained is deprecated'):
                model = MODELS.build(cfg)
        self.assertEqual(model.backbone.init_cfg,
                         dict(type='Pretrained', checkpoint='xcit_nano_12_p16_224.pth'))

    def test_bad_inputs(self):
        model = tiny().eval()
        with self.assertRaisesRegex(ValueError, 'in_channels=3 but the image has 1 channels'):
            model(torch.randn(1, 1, 64, 64))
        with self.assertRaisesRegex(ValueError, r'20x64 px is too small.*at least 32'):
            model(torch.randn(1, 3, 20, 64))
        with self.assertRaisesRegex(ValueError, 'empty batch'):
            model(torch.randn(0, 3, 64, 64))
        with self.assertRaisesRegex(ValueError, r'\(B, C, H, W\)'):
            model(torch.randn(3, 64, 64))

    def test_in_channels_other_than_rgb(self):
        model = tiny(in_channels=4).eval()
        self.assertEqual(model(torch.randn(1, 4, 64, 64))[0].shape[1], 64)


class TestTrainingOptions(TestCase):

    def test_frozen_stages(self):
        model = tiny(frozen_stages=2)
        model.train()
        frozen = [model.patch_embed, model.pos_embed, model.layers[0], model.layers[1]]
        for module in frozen:
            self.assertTrue(all(not p.requires_grad for p in module.parameters()))
            self.assertTrue(all(not m.training for m in module.modules()))
        for module in [model.layers[2], model.layers[3], model.fpn1]:
            self.assertTrue(all(p.requires_grad for p in module.parameters()))
            self.assertTrue(module.training)
        # frozen BN statistics must not move during a training forward
        bn = model.patch_embed.proj[0].bn
        before = bn.running_mean.clone()
        model(torch.randn(2, 3, 64, 64))
        torch.testing.assert_close(bn.running_mean, before)
        # frozen_stages=0 freezes only the embeddings
        model0 = tiny(frozen_stages=0).train()
        self.assertFalse(any(p.requires_grad for p in model0.patch_embed.parameters()))
        self.assertTrue(all(p.requires_grad for p in model0.layers[0].parameters()))

    def test_norm_eval(self):
        model = tiny(norm_eval=True)
        randomise_bn(model)
        model.train()
        norms = [m for m in model.modules() if isinstance(m, (_BatchNorm, nn.LayerNorm))]
        self.assertTrue(any(isinstance(m, _BatchNorm) for m in norms))
        self.assertTrue(any(isinstance(m, nn.LayerNorm) for m in norms))
        self.assertTrue(all(not m.training for m in norms))
        self.assertTrue(model.layers[0].ffn.training)
        stats = {n: b.clone() for n, b in model.named_buffers() if 'running' in n}
        model(torch.randn(2, 3, 64, 64))
        for name, value in model.named_buffers():
            if 'running' in name:
                torch.testing.assert_close(value, stats[name], msg=name)

    def test_with_cp_same_outputs_and_gradients(self):
        """Also the same BN running statistics: the checkpoint's re-run of a layer in the backward
        must not update the LPI's BN a second time."""
        torch.manual_seed(0)
        plain = tiny(patch_size=16, drop_path_rate=0.3)
        ckpt = tiny(patch_size=16, drop_path_rate=0.3, with_cp=True)
        ckpt.load_state_dict(plain.state_dict())
        x = torch.randn(2, 3, 64, 80)
        results = []
        for model in (plain, ckpt):
            model.train()
            inp = x.clone().requires_grad_(True)
            torch.manual_seed(1)
            outs = model(inp)
            sum(o.square().mean() for o in outs).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            results.append(([o.detach() for o in outs], grads, inp.grad))
        for name, buffer in plain.named_buffers():
            torch.testing.assert_close(buffer, dict(ckpt.named_buffers())[name], msg=name)
        for a, b in zip(results[0][0], results[1][0]):
            torch.testing.assert_close(a, b)
        for name in results[0][1]:
            torch.testing.assert_close(results[0][1][name], results[1][1][name], msg=name,
                                       rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(results[0][2], results[1][2], rtol=1e-4, atol=1e-7)

    def test_training_layer_keeps_ten_activation_maps(self):
        """A training XCiT layer keeps, for its backward, only the three residual-stream maps,
        the qkv projection (3 maps) and the FFN's pre-GELU hidden layer (4 maps): 10 maps of
        (B, N, C), plus per-image (C x C) / (d x d) matrices. Plain autograd of the same code
        keeps ~26 (LayerNorm outputs, q/k copies, LPI and GELU intermediates, branch outputs);
        values and gradients of the lean path are checked in tests/test_gradients.py."""
        torch.manual_seed(0)
        model = tiny(patch_size=16, drop_path_rate=0.2).train()
        layer = model.layers[0]
        B, grid, C = 2, (32, 32), TINY['embed_dims']
        N = grid[0] * grid[1]
        x = torch.randn(B, N, C, requires_grad=True)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(x, grid)
        map_bytes = B * N * C * x.element_size()
        small = (B * C * C + 3 * B * C * C // TINY['num_heads']) * x.element_size()
        self.assertLessEqual(sum(saved.values()), 10 * map_bytes + small + 4096)
        out.square().mean().backward()  # the kept tensors suffice for the backward
        self.assertTrue(all(p.grad is not None for p in layer.parameters()))

    def test_training_step_under_flop_counter(self):
        """Tools that hook module inputs for the backward (torch's FlopCounterMode, through its
        ModuleTracker) work with the recomputing backward and count the backward's FLOPs."""
        from torch.utils.flop_counter import FlopCounterMode
        model = tiny(patch_size=16).train()
        x = torch.randn(1, 3, 96, 96)
        with FlopCounterMode(display=False) as forward_only:
            with torch.no_grad():
                model(x)
        with FlopCounterMode(display=False) as train_step:
            sum(o.mean() for o in model(x)).backward()
        self.assertGreater(train_step.get_total_flops(), 2 * forward_only.get_total_flops())

    def test_every_parameter_gets_a_gradient(self):
        for patch_size in (8, 16):
            model = tiny(patch_size=patch_size).train()
            outs = model(torch.randn(2, 3, 64, 64))
            sum(o.mean() for o in outs).backward()
            for name, param in model.named_parameters():
                self.assertIsNotNone(param.grad, name)
                self.assertTrue(torch.isfinite(param.grad).all(), name)
                self.assertGreater(param.grad.abs().sum().item(), 0, name)

    def test_drop_path_is_stochastic_in_train_only(self):
        model = tiny(drop_path_rate=0.5)
        x = torch.randn(4, 3, 64, 64)
        model.eval()
        no_drop = tiny(drop_path_rate=0.0).eval()
        no_drop.load_state_dict(model.state_dict())
        with torch.no_grad():  # eval: exactly the model without stochastic depth
            torch.testing.assert_close(model(x)[2], no_drop(x)[2])
        model.train()
        torch.manual_seed(1)
        a = model(x)[2]
        torch.manual_seed(2)
        b = model(x)[2]
        self.assertFalse(torch.allclose(a, b))

    def test_learns_a_simple_target(self):
        """A few SGD steps reduce a regression loss on the stride-8 map: gradients are usable."""
        torch.manual_seed(0)
        model = tiny(patch_size=8).train()
        x = torch.randn(4, 3, 64, 64)
        target = torch.randn(4, 64, 8, 8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(15):
            loss = (model(x)[1] - target).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        self.assertLess(losses[-1], 0.7 * losses[0])

    def test_state_dict_round_trip(self):
        model = randomise_bn(tiny()).eval()
        x = torch.randn(1, 3, 64, 96)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, 'xcit.pth')
            torch.save(model.state_dict(), path)
            other = tiny().eval()
            other.load_state_dict(torch.load(path, weights_only=True))
        for a, b in zip(model(x), other(x)):
            torch.testing.assert_close(a, b)


class TestCaptureXCA(TestCase):

    def test_captured_tensors(self):
        model = tiny(patch_size=16).eval()
        with model.capture_xca([0, -1]) as xca:
            model(torch.randn(2, 3, 50, 70))
        self.assertEqual(sorted(xca), [0, 3])
        rec = xca[3]
        self.assertEqual(rec['grid'], (4, 5))
        self.assertEqual(tuple(rec['q'].shape), (2, 4, 16, 20))
        self.assertEqual(tuple(rec['attn'].shape), (2, 4, 16, 16))
        # q and k are L2-normalised along the tokens; attention rows are distributions
        torch.testing.assert_close(rec['q'].norm(dim=-1), torch.ones(2, 4, 16))
        torch.testing.assert_close(rec['k'].norm(dim=-1), torch.ones(2, 4, 16))
        torch.testing.assert_close(rec['attn'].sum(-1), torch.ones(2, 4, 16))
        # hooks are gone after the block
        self.assertEqual(len(model.layers[3].attn.probe._forward_hooks), 0)

    def test_bad_layer(self):
        model = tiny()
        with self.assertRaisesRegex(ValueError, 'out of range'):
            with model.capture_xca([9]):
                pass


@pytest.mark.parametrize('scope', ['mmdet', 'mmseg'])
def test_registered_for_mmdet_and_mmseg(scope):
    from mmengine.registry import init_default_scope
    registry = __import__(f'{scope}.registry', fromlist=['MODELS']).MODELS
    init_default_scope(scope)
    model = registry.build(dict(type='XCiTBackbone', arch=TINY, patch_size=8,
                                out_indices=(0, 1, 2, 3)))
    assert isinstance(model, XCiTBackbone)
    assert registry.get('XCiTBackbone') is XCiTBackbone


def test_importing_the_package_changes_only_what_it_documents():
    """``import xcit_mm`` registers its modules (the lean models too, without importing mmdet or
    mmseg), adds exactly mmengine's pure-data training state to torch's weights_only allow-list,
    and makes its reader mmengine's loader for local paths, URLs and Hugging Face Hub names; the
    warning filters, the default dtype and the other loaders are as before. Neither the import
    nor a forward needs torchvision, which has no CPU build here."""
    import subprocess
    import sys
    code = (
        'import warnings, torch, mmengine, mmcv.cnn\n'
        'from mmengine.runner import CheckpointLoader\n'
        'loaders = dict(CheckpointLoader._schemes)\n'
        'before = (list(torch.serialization.get_safe_globals()), list(warnings.filters), '
        'torch.get_default_dtype())\n'
        'import xcit_mm\n'
        'from xcit_mm.models.utils import checkpoint_io, safe_unpickling\n'
        'after = (list(torch.serialization.get_safe_globals()), list(warnings.filters), '
        'torch.get_default_dtype())\n'
        'names = lambda entries: sorted(e[1] if isinstance(e, tuple) else e.__qualname__ '
        'for e in entries)\n'
        'assert names(after[0]) == names(before[0] + safe_unpickling.training_state_entries()), '
        'names(after[0])\n'
        'assert after[1:] == before[1:]\n'
        'changed = {k for k, v in CheckpointLoader._schemes.items() if loaders.get(k) is not v}\n'
        'assert changed == {"", "http://", "https://", "hf-hub:", "hf_hub:"}, changed\n'
        'assert CheckpointLoader._schemes[""] is checkpoint_io.load_from_weights_only\n'
        'from mmengine.registry import HOOKS, MODELS, OPTIM_WRAPPER_CONSTRUCTORS\n'
        'assert MODELS.get("XCiTBackbone") and HOOKS.get("LayerDecayLrHook") and '
        'OPTIM_WRAPPER_CONSTRUCTORS.get("XCiTLayerDecayOptimizerConstructor")\n'
        'assert {"LeanMaskRCNN", "LeanEncoderDecoder"} <= set(MODELS.module_dict)\n'
        '# the training extras, the data and the upstream task packages are other imports\n'
        'import sys\n'
        'loaded = [m for m in sys.modules if m.startswith(("training_extras", "shapes_world", '
        '"xcit_mm.apis", "mmdet", "mmseg"))]\n'
        'assert not loaded, loaded\n'
        'assert HOOKS.get("RandomStateHook") is None\n'
        'xcit_mm.XCiTBackbone(arch="n12")(torch.randn(1, 3, 32, 32))\n'
        'assert "torchvision" not in sys.modules\n')
    subprocess.run([sys.executable, '-c', code], check=True)
