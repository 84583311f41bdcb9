# Copyright (c) xcit_mm contributors. All rights reserved.
"""What XCiT's cross-covariance attention (XCA) looks at, per layer and head (paper Figure D.2):
``|q̂|`` and ``|k̂|`` per patch token and the d x d channel attention (docs/visualisation.md)."""
import os
import os.path as osp
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

LEFT_PX = 110
TOP_PX = 70
DPI = 100
SAMPLE_IMAGES = ('grace_hopper', 'astronaut', 'chelsea', 'coffee')


class XCAFigure(NamedTuple):
    """What :func:`visualize_xca` drew; sizes are (H, W) except the PNG's (width, height)."""
    maps: Dict[int, Dict[str, np.ndarray]]
    title: str
    image_hw: Tuple[int, int]
    grid_hw: Tuple[int, int]
    png_size: Tuple[int, int]


def load_image(spec: str) -> Tuple[np.ndarray, str]:
    """``(RGB uint8 image, short name)`` of an image file or one of :data:`SAMPLE_IMAGES`
    (offline sample photos of matplotlib and scikit-image)."""
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
    return np.ascontiguousarray(img), name  # each sample is (H, W, 3) uint8 RGB


def resize_longer_side(img: np.ndarray, size: int) -> np.ndarray:
    """Resize so that the longer side is ``size`` px, keeping the aspect; 0 keeps the image."""
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
    """(H, W, 3) uint8 RGB -> normalised (1, 3, H, W) tensor; ``rgb=False`` feeds BGR."""
    import torch
    img = img_rgb if rgb else img_rgb[..., ::-1]
    x = (img.astype(np.float32) - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))[None]


def resolve_layers(layers: Optional[Sequence[int]], num_layers: int) -> List[int]:
    """Layer indices checked (negative ones count from the end); default first/middle/last."""
    if not layers:
        layers = [0, num_layers // 2 - 1, num_layers - 1] if num_layers > 2 else \
            list(range(num_layers))
    for i in layers:
        if not -num_layers <= i < num_layers:
            raise ValueError(f'layer {i} out of range: the backbone has {num_layers} layers '
                             f'(0..{num_layers - 1})')
    return list(dict.fromkeys(i % num_layers for i in layers))  # each once, in the given order


def xca_maps(backbone, x, layers: Sequence[int]) -> Dict[int, Dict[str, np.ndarray]]:
    """``{layer: dict(q_norm=(h, Hp, Wp), k_norm=(h, Hp, Wp), attn=(h, d, d), grid=(Hp, Wp))}``
    of the first image of ``x``."""
    import torch
    with torch.no_grad(), backbone.capture_xca(list(layers)) as record:
        backbone.forward_trunk(x)
    maps = {}
    for layer in layers:
        rec = record[layer]
        hp, wp = rec['grid']
        norms = {f'{n}_norm': rec[n][0].float().norm(dim=1).reshape(-1, hp, wp).cpu().numpy()
                 for n in 'qk'}
        maps[layer] = dict(norms, attn=rec['attn'][0].float().cpu().numpy(),
                           grid=(int(hp), int(wp)))
    return maps


def draw_grid(image: np.ndarray, maps: Dict[int, Dict[str, np.ndarray]], out_file: str,
              cell: int = 160, title: str = '', progress: bool = False) -> Tuple[int, int]:
    """Draw ``image`` and its :func:`xca_maps` as one PNG; return its ``(width, height)``."""
    import matplotlib
    matplotlib.use('Agg', force=False)
    import matplotlib.pyplot as plt
    from tqdm import tqdm
    layers = list(maps)
    heads = maps[layers[0]]['q_norm'].shape[0]
    # the image column and one per head; 3 rows per layer
    width, height = LEFT_PX + cell * (1 + heads), TOP_PX + cell * 3 * len(layers)
    fig = plt.figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    pad = 0.05 * cell
    foot = 0.09 * cell  # room under each map for its value range
    fs = max(6.0, cell / 18)

    def text(x, y, words, size, **kwargs):  # x, y in px from the left and the top
        fig.text(x / width, (height - y) / height, words, va='center', fontsize=size, **kwargs)

    def axes_at(row, col):
        return fig.add_axes([(LEFT_PX + col * cell + pad) / width,
                             (height - TOP_PX - (row + 1) * cell + pad + foot) / height,
                             (cell - 2 * pad) / width, (cell - 2 * pad - foot) / height],
                            xticks=[], yticks=[])

    text(width / 2, 18, title, fs * 1.3, ha='center', weight='bold')
    for col, words in enumerate(['image'] + [f'head {h}' for h in range(heads)]):
        text(LEFT_PX + (col + 0.5) * cell, TOP_PX - 14, words, fs, ha='center')
    row_kinds = [('q_norm', '|q̂| per token', 'viridis'), ('k_norm', '|k̂| per token', 'viridis'),
                 ('attn', 'XCA softmax\n(q̂k̂ᵀτ), d×d', 'magma')]
    for li, layer in enumerate(tqdm(layers, desc='drawing', unit='layer',
                                    disable=not progress, file=sys.stderr)):
        for ki, (key, label, cmap) in enumerate(row_kinds):
            row = 3 * li + ki
            text(8, TOP_PX + (row + 0.5) * cell, f'layer {layer}\n{label}', fs * 0.9, ha='left')
            if key != 'attn':
                axes_at(row, 0).imshow(image)
            fmt = '.3f' if key == 'attn' else '.2f'
            for h, m in enumerate(maps[layer][key]):  # each map with its own colour scale
                lo, hi = float(m.min()), float(m.max())
                axes_at(row, 1 + h).imshow(m, cmap=cmap, vmin=lo, interpolation='nearest',
                                           vmax=hi if hi > lo else lo + 1e-12)
                text(LEFT_PX + (1.5 + h) * cell, TOP_PX + (row + 1) * cell - pad - foot / 2,
                     f'{lo:{fmt}} .. {hi:{fmt}}', fs * 0.75, ha='center', color='0.3')
    os.makedirs(osp.dirname(osp.abspath(out_file)), exist_ok=True)
    fig.savefig(out_file, dpi=DPI, metadata={'Title': title} if title else None)
    plt.close(fig)
    return width, height


def visualize_xca(image: str, model: str, out_file: str, arch: Union[str, dict] = 's12',
                  patch_size: int = 16, checkpoint: Optional[str] = None,
                  layers: Optional[Sequence[int]] = None, size: int = 512, cell: int = 160,
                  device: str = 'cpu', progress: bool = False) -> XCAFigure:
    """Image (longer side ``size``) -> backbone (``model``: see ``init_backbone``) -> XCA grid
    PNG at ``layers``."""
    from xcit_mm.apis import init_backbone
    img, name = load_image(image)
    img = resize_longer_side(img, size)
    if min(img.shape[:2]) < 32:
        raise ValueError(f'image {name!r} is {img.shape[0]}x{img.shape[1]} px (HxW) after '
                         'resizing; XCiTBackbone needs sides of at least 32 px (raise --size)')
    backbone, pre = init_backbone(model, arch, patch_size, checkpoint, device=device)
    layers = resolve_layers(layers, backbone.num_layers)
    x = to_tensor(img, pre['mean'], pre['std'], pre['rgb']).to(device)
    maps = xca_maps(backbone, x, layers)
    grid_hw = maps[layers[0]]['grid']
    src = osp.basename(model) if model != 'random' else f'random-init {arch}/{patch_size}'
    if checkpoint:
        src += f' + {osp.basename(checkpoint)}'
    image_hw = (int(img.shape[0]), int(img.shape[1]))
    title = (f'XCA of {src} on {name}: image {image_hw[0]}x{image_hw[1]} px, '
             f'patch grid {grid_hw[0]}x{grid_hw[1]} (both HxW)')
    png_size = draw_grid(img, maps, out_file, cell=cell, title=title, progress=progress)
    return XCAFigure(maps, title, image_hw, grid_hw, png_size)
