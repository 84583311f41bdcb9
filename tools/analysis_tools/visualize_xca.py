# Copyright (c) xcit_mm contributors. All rights reserved.
"""Draw what XCiT's cross-covariance attention (XCA) looks at, for chosen layers.

Usage::

    python tools/visualize_xca.py IMAGE MODEL --out FILE.png \
        [--arch s12] [--patch-size 16] [--checkpoint CKPT] [--layers 0 5 11] \
        [--size 512] [--cell 160] [--device cpu]

``IMAGE`` is an image file or one of the photos that ship with matplotlib / scikit-image
(no download): ``grace_hopper``, ``astronaut``, ``chelsea``, ``coffee``.

``MODEL`` is one of

* a config (``*.py``): its ``model.backbone`` (an ``XCiTBackbone``) is built; its ``init_cfg``
  is applied, or ``--checkpoint`` is loaded instead (any layout the backbone's ``Pretrained``
  loader accepts, e.g. a detector / segmentor checkpoint trained with that config);
* a checkpoint file: ``XCiTBackbone(arch=--arch, patch_size=--patch-size,
  init_cfg=dict(type='Pretrained', checkpoint=MODEL))`` is built and initialised;
* ``random``: a randomly initialised ``XCiTBackbone(--arch, --patch-size)``.

The image is resized so that its longer side is ``--size`` pixels (aspect kept; ``--size 0``
keeps it as is), normalised with the config's ``data_preprocessor`` mean/std (ImageNet
statistics otherwise) and sent once through the trunk inside ``backbone.capture_xca(layers)``.
For every chosen layer and every head the figure shows (paper Figure D.2 and Section 3):

* ``|q̂|``: for each patch token, the L2 norm over the head's d channels of the queries
  q̂ (queries L2-normalised along the token axis), on the (Hp, Wp) patch grid;
* ``|k̂|``: the same for the keys;
* ``XCA``: the d x d channel attention ``softmax(q̂ k̂ᵀ · τ)`` (rows: query channels).

Every map has its own min-max colour scale (viridis for norms, magma for attention), printed
under it as ``min .. max``.

Figure layout (pixels, at 100 dpi): ``1 + heads`` columns (the image, then one per head) of
``cell`` x ``cell`` cells and ``3 x len(layers)`` rows, plus a left margin of ``LEFT_PX`` for
the row titles and a top margin of ``TOP_PX`` for the title and the column titles:
``width = LEFT_PX + cell * (1 + heads)``, ``height = TOP_PX + cell * 3 * len(layers)``
(see :func:`figure_size`).
"""
import argparse
import os
import os.path as osp
import sys
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

# Run from a checkout without installing: make `import xcit_mm` find the repository.
_REPO_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

LEFT_PX = 110
TOP_PX = 70
DPI = 100
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
SAMPLE_IMAGES = ('grace_hopper', 'astronaut', 'chelsea', 'coffee')


# --------------------------------------------------------------------------------------------
# image
# --------------------------------------------------------------------------------------------
def load_image(spec: str) -> Tuple[np.ndarray, str]:
    """Load an RGB image from a file or one of the offline sample photos.

    Args:
        spec: Image path, or a name in :data:`SAMPLE_IMAGES` (``grace_hopper`` comes with
            matplotlib, the others with scikit-image).

    Returns:
        ``(image, name)``: an (H, W, 3) uint8 RGB array and a short name for titles.

    Raises:
        FileNotFoundError: If ``spec`` is neither a file nor a sample name.
        ValueError: If the file cannot be decoded as an image (the message names it).
    """
    if osp.isfile(spec):
        import cv2
        data = np.fromfile(spec, dtype=np.uint8)
        img = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
        if img is None:
            raise ValueError(f'cannot read image {spec!r}: not a decodable image file')
        return np.ascontiguousarray(img[..., ::-1]), osp.basename(spec)
    name = osp.splitext(spec)[0].lower()
    if name == 'grace_hopper':
        import matplotlib.cbook as cbook
        import matplotlib.image as mpimg
        with cbook.get_sample_data('grace_hopper.jpg') as f:
            img = mpimg.imread(f, format='jpg')
    elif name in SAMPLE_IMAGES:
        import skimage.data
        img = getattr(skimage.data, name)()
    else:
        raise FileNotFoundError(f'IMAGE {spec!r} is not a file nor one of the sample images '
                                f'{", ".join(SAMPLE_IMAGES)}')
    img = np.asarray(img)
    if img.dtype != np.uint8:
        img = (np.clip(img, 0, 1) * 255).astype(np.uint8) if img.max() <= 1 else \
            img.astype(np.uint8)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return np.ascontiguousarray(img[..., :3]), name


def resize_longer_side(img: np.ndarray, size: int) -> np.ndarray:
    """Resize so that the longer side is ``size`` px, keeping the aspect; 0 keeps the image.

    Args:
        img: (H, W, 3) uint8 image.
        size: Target longer side in pixels (0: no resize).
    """
    if size <= 0:
        return img
    import cv2
    h, w = img.shape[:2]
    scale = size / max(h, w)
    new_w, new_h = max(1, round(w * scale)), max(1, round(h * scale))
    if (new_h, new_w) == (h, w):
        return img
    interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR
    return cv2.resize(img, (new_w, new_h), interpolation=interp)


def to_tensor(img_rgb: np.ndarray, mean: Sequence[float], std: Sequence[float],
              rgb: bool = True):
    """Normalise an RGB uint8 image into a (1, 3, H, W) float tensor.

    Args:
        img_rgb: (H, W, 3) uint8 RGB image.
        mean: Per-channel mean, in the model's channel order.
        std: Per-channel std, in the model's channel order.
        rgb: Whether the model expects RGB (else BGR).
    """
    import torch
    img = img_rgb if rgb else img_rgb[..., ::-1]
    x = (img.astype(np.float32) - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))[None]


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------
def _preprocess_from_cfg(cfg) -> dict:
    """mean / std / channel order of a config's ``data_preprocessor`` (ImageNet default)."""
    dp = cfg.get('model', {}).get('data_preprocessor', None) or \
        cfg.get('data_preprocessor', None) or {}
    mean = dp.get('mean', None) or IMAGENET_MEAN
    std = dp.get('std', None) or IMAGENET_STD
    # mmdet/mmseg loaders give BGR; `bgr_to_rgb=True` turns it into RGB before normalising.
    rgb = bool(dp.get('bgr_to_rgb', False) or dp.get('rgb_to_bgr', False)) if dp else True
    return dict(mean=tuple(mean), std=tuple(std), rgb=rgb)


def build_backbone(model: str, arch: Union[str, dict] = 's12', patch_size: int = 16,
                   checkpoint: Optional[str] = None):
    """Build the XCiT backbone to visualise.

    Args:
        model: A config path (``*.py``), a checkpoint path, or ``'random'``.
        arch: Arch name or dict, used when ``model`` is a checkpoint or ``'random'``.
        patch_size: 8 or 16, used when ``model`` is a checkpoint or ``'random'``.
        checkpoint: With a config: weights to load into its backbone instead of the config's
            ``init_cfg`` (any layout the backbone's ``Pretrained`` loader accepts).

    Returns:
        ``(backbone, preprocess)``: the backbone in eval mode and a dict with ``mean``,
        ``std`` and ``rgb`` for :func:`to_tensor`.

    Raises:
        FileNotFoundError: If a config or checkpoint file does not exist.
        ValueError: If the config's backbone is not an XCiTBackbone.
    """
    from xcit_mm import XCiTBackbone
    preprocess = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, rgb=True)
    if model.endswith('.py'):
        from mmengine.config import Config
        if not osp.isfile(model):
            raise FileNotFoundError(f'config not found: {model!r}')
        cfg = Config.fromfile(model)
        bb_cfg = cfg.get('model', {}).get('backbone', None)
        if bb_cfg is None:
            raise ValueError(f'config {model!r} has no model.backbone')
        bb_cfg = bb_cfg.to_dict() if hasattr(bb_cfg, 'to_dict') else dict(bb_cfg)
        bb_type = str(bb_cfg.pop('type', '')).split('.')[-1]
        if bb_type != 'XCiTBackbone':
            raise ValueError(f'config {model!r} backbone is {bb_type!r}, not XCiTBackbone')
        norm = bb_cfg.get('norm_cfg', None)
        if isinstance(norm, dict) and 'SyncBN' in str(norm.get('type', '')):
            bb_cfg['norm_cfg'] = dict(norm, type='BN')  # same weights, runs on one CPU
        if checkpoint is not None:
            bb_cfg['init_cfg'] = dict(type='Pretrained', checkpoint=checkpoint)
        # forward_trunk stops at max(out_indices); the default ends at the last layer, so every
        # layer can be captured. out_indices do not change any weight.
        bb_cfg['out_indices'] = None
        preprocess = _preprocess_from_cfg(cfg)
    elif model == 'random':
        bb_cfg = dict(arch=arch, patch_size=patch_size)
        if checkpoint is not None:
            bb_cfg['init_cfg'] = dict(type='Pretrained', checkpoint=checkpoint)
    else:
        if checkpoint is not None:
            raise ValueError('MODEL is already a checkpoint; --checkpoint only goes with a '
                             "config or 'random'")
        bb_cfg = dict(arch=arch, patch_size=patch_size,
                      init_cfg=dict(type='Pretrained', checkpoint=model))
    init = bb_cfg.get('init_cfg', None)
    ckpt = init.get('checkpoint', None) if isinstance(init, dict) else None
    if ckpt:
        if '://' not in ckpt and not osp.isfile(ckpt):
            hint = ('; pass --checkpoint PATH (e.g. the checkpoint trained with this config) '
                    "or use MODEL=random") if model.endswith('.py') and ckpt != checkpoint \
                else ''
            raise FileNotFoundError(f'checkpoint not found: {ckpt!r}{hint}')
    backbone = XCiTBackbone(**bb_cfg)
    # Truncated-normal init, then the checkpoint if any; the backbone's loader is strict and
    # raises xcit_mm.utils.checkpoint_io.CheckpointError for a checkpoint of another arch / patch size.
    backbone.init_weights()
    backbone.eval()
    return backbone, preprocess


def resolve_layers(layers: Optional[Sequence[int]], num_layers: int) -> List[int]:
    """Validate layer indices (negative ones count from the end); default first/middle/last.

    Args:
        layers: 0-based layer indices or None.
        num_layers: Depth of the trunk.

    Raises:
        ValueError: If an index is out of range.
    """
    if not layers:
        layers = [0, num_layers // 2 - 1, num_layers - 1] if num_layers > 2 else \
            list(range(num_layers))
    out = []
    for i in layers:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise ValueError(f'layer {i} out of range: the backbone has {num_layers} layers '
                             f'(0..{num_layers - 1})')
        if j not in out:
            out.append(j)
    return out


def xca_maps(backbone, x, layers: Sequence[int]) -> Dict[int, Dict[str, np.ndarray]]:
    """Run the trunk once and turn the captured XCA tensors into per-head maps.

    Uses ``backbone.capture_xca(layers)``; for each layer the captured ``q`` / ``k`` are
    (B, h, d, N) L2-normalised along N, ``attn`` is (B, h, d, d), ``grid`` is (Hp, Wp).

    Args:
        backbone: An ``XCiTBackbone``.
        x: (1, 3, H, W) normalised image tensor.
        layers: 0-based layer indices.

    Returns:
        ``{layer: dict(q_norm=(h, Hp, Wp), k_norm=(h, Hp, Wp), attn=(h, d, d), grid=(Hp, Wp))}``
        as float numpy arrays, for the first image of the batch.
    """
    import torch
    with torch.no_grad(), backbone.capture_xca(list(layers)) as record:
        backbone.forward_trunk(x)
    maps = {}
    for layer in layers:
        if layer not in record:
            raise RuntimeError(f'capture_xca recorded nothing for layer {layer}')
        rec = record[layer]
        hp, wp = rec['grid']
        q, k, attn = rec['q'][0].float(), rec['k'][0].float(), rec['attn'][0].float()
        heads = q.shape[0]
        maps[layer] = dict(
            q_norm=q.norm(dim=1).reshape(heads, hp, wp).cpu().numpy(),
            k_norm=k.norm(dim=1).reshape(heads, hp, wp).cpu().numpy(),
            attn=attn.cpu().numpy(),
            grid=(int(hp), int(wp)))
    return maps


# --------------------------------------------------------------------------------------------
# figure
# --------------------------------------------------------------------------------------------
def figure_size(num_layers: int, num_heads: int, cell: int = 160) -> Tuple[int, int]:
    """Pixel size ``(width, height)`` of the grid PNG.

    Args:
        num_layers: Number of visualised layers (3 rows each).
        num_heads: Number of heads (one column each, after the image column).
        cell: Cell side in pixels.
    """
    return LEFT_PX + cell * (1 + num_heads), TOP_PX + cell * 3 * num_layers


def draw_grid(image: np.ndarray, maps: Dict[int, Dict[str, np.ndarray]], out_file: str,
              cell: int = 160, title: str = '', progress: bool = False) -> Tuple[int, int]:
    """Draw the image, the |q̂| / |k̂| norm maps and the XCA matrices as one PNG.

    Args:
        image: (H, W, 3) uint8 RGB image that went through the network.
        maps: Output of :func:`xca_maps`.
        out_file: PNG path (folders are created).
        cell: Cell side in pixels (each map is fitted into its cell, aspect kept).
        title: Figure title.
        progress: Show a tqdm bar over layers (useful for many layers / heads).

    Returns:
        The PNG's ``(width, height)`` in pixels, equal to :func:`figure_size`.
    """
    import matplotlib
    matplotlib.use('Agg', force=False)
    import matplotlib.pyplot as plt
    from tqdm import tqdm

    layers = list(maps)
    heads = maps[layers[0]]['q_norm'].shape[0]
    width, height = figure_size(len(layers), heads, cell)
    fig = plt.figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    pad = 0.05 * cell
    foot = 0.09 * cell  # room under each map for its value range
    fs = max(6.0, cell / 18)

    def axes_at(row, col):
        x0 = LEFT_PX + col * cell + pad
        y0 = height - TOP_PX - (row + 1) * cell + pad + foot
        ax = fig.add_axes([x0 / width, y0 / height, (cell - 2 * pad) / width,
                           (cell - 2 * pad - foot) / height])
        ax.set_xticks([])
        ax.set_yticks([])
        return ax

    fig.text(0.5, 1 - 18 / height, title, ha='center', va='center', fontsize=fs * 1.3,
             weight='bold')
    col_titles = ['image'] + [f'head {h}' for h in range(heads)]
    for col, text in enumerate(col_titles):
        fig.text((LEFT_PX + (col + 0.5) * cell) / width, 1 - (TOP_PX - 14) / height, text,
                 ha='center', va='center', fontsize=fs)
    row_kinds = [('q_norm', '|q̂| per token', 'viridis'), ('k_norm', '|k̂| per token', 'viridis'),
                 ('attn', 'XCA softmax\n(q̂k̂ᵀτ), d×d', 'magma')]
    for li, layer in enumerate(tqdm(layers, desc='drawing', unit='layer',
                                    disable=not progress, file=sys.stderr)):
        for ki, (key, label, cmap) in enumerate(row_kinds):
            row = 3 * li + ki
            fig.text(8 / width, (height - TOP_PX - (row + 0.5) * cell) / height,
                     f'layer {layer}\n{label}', ha='left', va='center', fontsize=fs * 0.9)
            if key != 'attn':
                ax = axes_at(row, 0)
                ax.imshow(image)
            for h in range(heads):
                ax = axes_at(row, 1 + h)
                m = maps[layer][key][h]
                lo, hi = float(m.min()), float(m.max())
                ax.imshow(m, cmap=cmap, vmin=lo, vmax=hi if hi > lo else lo + 1e-12,
                          interpolation='nearest')
                fmt = '.3f' if key == 'attn' else '.2f'
                fig.text((LEFT_PX + (1.5 + h) * cell) / width,
                         (height - TOP_PX - (row + 1) * cell + pad + foot / 2) / height,
                         f'{lo:{fmt}} .. {hi:{fmt}}', ha='center', va='center',
                         fontsize=fs * 0.75, color='0.3')
    os.makedirs(osp.dirname(osp.abspath(out_file)), exist_ok=True)
    fig.savefig(out_file, dpi=DPI)
    plt.close(fig)
    return width, height


def visualize_xca(image: str, model: str, out_file: str, arch: Union[str, dict] = 's12',
                  patch_size: int = 16, checkpoint: Optional[str] = None,
                  layers: Optional[Sequence[int]] = None, size: int = 512, cell: int = 160,
                  device: str = 'cpu', progress: bool = False):
    """Load an image and a backbone, capture XCA at ``layers`` and write the grid PNG.

    Args:
        image: Image path or sample name (see :func:`load_image`).
        model: Config, checkpoint or ``'random'`` (see :func:`build_backbone`).
        out_file: Output PNG.
        arch: Arch for checkpoint / random models.
        patch_size: Patch size for checkpoint / random models.
        checkpoint: Weights for a config's backbone.
        layers: Layer indices (default: first, middle, last).
        size: Longer image side fed to the network (0: unchanged).
        cell: Figure cell size in pixels.
        device: Torch device.
        progress: Show a progress bar while drawing.

    Returns:
        ``(maps, (width, height))``: the maps of :func:`xca_maps` and the PNG size.
    """
    img, name = load_image(image)
    img = resize_longer_side(img, size)
    if min(img.shape[:2]) < 32:
        raise ValueError(f'image {name!r} is {img.shape[1]}x{img.shape[0]} after resizing; '
                         'XCiTBackbone needs sides of at least 32 px (raise --size)')
    backbone, pre = build_backbone(model, arch, patch_size, checkpoint)
    backbone.to(device)
    layers = resolve_layers(layers, backbone.num_layers)
    x = to_tensor(img, pre['mean'], pre['std'], pre['rgb']).to(device)
    maps = xca_maps(backbone, x, layers)
    hp, wp = maps[layers[0]]['grid']
    src = osp.basename(model) if model != 'random' else f'random-init {arch}/{patch_size}'
    if checkpoint:
        src += f' + {osp.basename(checkpoint)}'
    title = (f'XCA of {src} on {name} ({img.shape[1]}x{img.shape[0]} px, '
             f'{hp}x{wp} patches)')
    size_px = draw_grid(img, maps, out_file, cell=cell, title=title, progress=progress)
    return maps, size_px


def parse_args(argv=None):
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description='Draw per-head |q̂| / |k̂| token-norm maps and XCA channel-attention '
                    'matrices of an XCiT backbone as one PNG grid.')
    parser.add_argument('image', help='image file, or a sample: ' + ', '.join(SAMPLE_IMAGES))
    parser.add_argument('model', help="config (*.py), backbone checkpoint, or 'random'")
    parser.add_argument('--out', required=True, help='output PNG file')
    parser.add_argument('--arch', default='s12',
                        help='arch for a checkpoint or random model (default s12)')
    parser.add_argument('--patch-size', type=int, default=16, choices=(8, 16))
    parser.add_argument('--checkpoint', default=None,
                        help="weights for a config's backbone (replaces its init_cfg)")
    parser.add_argument('--layers', type=int, nargs='+', default=None,
                        help='0-based layers (default: first, middle, last; -1 = last)')
    parser.add_argument('--size', type=int, default=512,
                        help='longer image side fed to the network, 0 = unchanged '
                             '(default 512)')
    parser.add_argument('--cell', type=int, default=160, help='cell size in px (default 160)')
    parser.add_argument('--device', default='cpu')
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Command-line entry point; returns 0 on success, 2 on a bad input or checkpoint."""
    from xcit_mm.utils.checkpoint_io import CheckpointError
    args = parse_args(argv)
    if args.cell < 32:
        print('error: --cell must be at least 32 px', file=sys.stderr)
        return 2
    try:
        _, (w, h) = visualize_xca(args.image, args.model, args.out, arch=args.arch,
                                  patch_size=args.patch_size, checkpoint=args.checkpoint,
                                  layers=args.layers, size=args.size, cell=args.cell,
                                  device=args.device, progress=True)
    except (FileNotFoundError, ValueError, CheckpointError) as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    print(f'wrote {args.out} ({w}x{h} px)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
