"""The reference XCiT, built without xcit_mm: expected values for the checkpoint tests.

* the trunk is mmpretrain's port (``mmpretrain.models.backbones.xcit.XCiT``), with random weights
  and randomised BN statistics, layer scales and temperatures;
* the stride adapter is plain ``torch.nn`` in the structure of the official detection /
  segmentation backbone (facebookresearch/xcit ``detection/backbone/xcit.py``: ``nn.Sequential``
  wherever it wraps a module; SyncBN there, BatchNorm2d here on the CPU, same state-dict keys);
* key names of the published layouts are written out by hand.
"""
import re
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm


def randomise_(model: nn.Module) -> nn.Module:
    """Non-trivial BN statistics, layer scales and temperatures (defaults would hide bugs)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                m.running_mean.normal_(0, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.normal_(1, 0.2)
                m.bias.normal_(0, 0.2)
        for name, p in model.named_parameters():
            if 'gamma' in name or 'temperature' in name:
                p.uniform_(0.5, 1.5)
    return model


def mmpretrain_trunk(mmpretrain_xcit, patch_size, embed_dims=64, depth=4, num_heads=4,
                     out_indices=(0, 1, 2, 3)):
    """mmpretrain's XCiT returning the (B, D, H/p, W/p) maps of ``out_indices``, in eval mode."""
    torch.manual_seed(patch_size + embed_dims)
    model = mmpretrain_xcit(
        patch_size=patch_size, embed_dims=embed_dims, depth=depth, num_heads=num_heads,
        cls_attn_layers=2, out_type='featmap', out_indices=out_indices, final_norm=True,
        init_cfg=dict(type='TruncNormal', layer='Linear', std=0.02))
    model.init_weights()
    randomise_(model)
    model.eval()  # mmpretrain's train() returns None
    return model


def to_official(sd, classifier=True):
    """mmpretrain names -> facebookresearch/xcit names, written out by hand.

    ``classifier``: keep the ImageNet classifier's keys (CLS token, class attention, final norm,
    a 1000-class head), as the ImageNet files have; the detection backbone has none of them.
    """
    out = OrderedDict()
    for k, v in sd.items():
        if not classifier and k.startswith(('cls_token', 'ca_layers.', 'norm.')):
            continue
        m = re.match(r'patch_embed\.proj\.(\d)\.(conv|bn)\.(.*)', k)
        if m:
            k = f'patch_embed.proj.{int(m[1]) * 2}.{0 if m[2] == "conv" else 1}.{m[3]}'
        k = k.replace('pos_embed.token_projection.conv.', 'pos_embeder.token_projection.')
        k = k.replace('xca_layers.', 'blocks.').replace('ca_layers.', 'cls_attn_blocks.')
        k = k.replace('local_mp.conv1.conv.', 'local_mp.conv1.')
        k = k.replace('local_mp.conv1.bn.', 'local_mp.bn.')
        k = k.replace('local_mp.conv2.conv.', 'local_mp.conv2.')
        k = k.replace('ffn.layers.0.0.', 'mlp.fc1.').replace('ffn.layers.1.', 'mlp.fc2.')
        out[k] = v
    if classifier:
        out['norm.weight'] = torch.ones(sd['cls_token'].shape[-1])
        out['head.weight'] = torch.zeros(1000, sd['cls_token'].shape[-1])
        out['head.bias'] = torch.zeros(1000)
    return out


class OfficialAdapter(nn.Module):
    """fpn1..fpn4 of the official dense XCiT, module for module (SyncBN -> BatchNorm2d)."""

    def __init__(self, dim: int, patch_size: int):
        super().__init__()

        def up():
            return nn.ConvTranspose2d(dim, dim, kernel_size=2, stride=2)

        if patch_size == 16:
            self.fpn1 = nn.Sequential(up(), nn.BatchNorm2d(dim), nn.GELU(), up())
            self.fpn2 = nn.Sequential(up())
            self.fpn3 = nn.Identity()
            self.fpn4 = nn.MaxPool2d(kernel_size=2, stride=2)
        else:
            self.fpn1 = nn.Sequential(up())
            self.fpn2 = nn.Identity()
            self.fpn3 = nn.Sequential(nn.MaxPool2d(kernel_size=2, stride=2))
            self.fpn4 = nn.Sequential(nn.MaxPool2d(kernel_size=4, stride=4))

    def forward(self, feats):
        return [op(f) for op, f in zip((self.fpn1, self.fpn2, self.fpn3, self.fpn4), feats)]


class OfficialDenseXCiT(nn.Module):
    """The official detection / segmentation backbone: reference trunk + official adapter."""

    def __init__(self, trunk: nn.Module, dim: int, patch_size: int, randomise: bool = True):
        super().__init__()
        self.trunk = trunk
        torch.manual_seed(dim + patch_size + 1)
        self.adapter = OfficialAdapter(dim, patch_size)
        if randomise:
            randomise_(self.adapter).eval()

    def forward(self, x):
        return self.adapter(list(self.trunk(x)))

    def released_state_dict(self):
        """The backbone as the released files hold it (without the ``backbone.`` prefix)."""
        sd = to_official(self.trunk.state_dict(), classifier=False)
        sd.update(self.adapter.state_dict())
        return sd
