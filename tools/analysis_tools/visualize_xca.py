# Copyright (c) xcit_mm contributors. All rights reserved.
"""Draw what XCiT's cross-covariance attention (XCA) looks at, for chosen layers.

Usage::

    python tools/analysis_tools/visualize_xca.py IMAGE MODEL --out FILE.png \
        [--arch s12] [--patch-size 16] [--checkpoint CKPT] [--layers 0 5 11] \
        [--size 512] [--cell 160] [--device cpu]

``IMAGE`` is an image file or one of the photos that ship with matplotlib / scikit-image
(no download): ``grace_hopper``, ``astronaut``, ``chelsea``, ``coffee``.

``MODEL`` is a config (``*.py``: its ``model.backbone``), a backbone checkpoint (any released
XCiT layout, or an mmengine training checkpoint) or ``random``; see
:func:`xcit_mm.apis.init_backbone`. The maps and the figure are those of
:func:`xcit_mm.visualization.visualize_xca`; the title gives the image and the patch grid both
as H x W.

Exit status 0, or 2 with one ``error: ...`` line for a bad image, config, argument or
checkpoint (checked before the backbone is built).
"""
import argparse
import os.path as osp
import sys
import warnings

if __name__ == '__main__':
    # setuptools >= 80 warns about pkg_resources on every mmengine import: keep the
    # command's stderr for its own messages (one `error: ...` line on failure).
    warnings.filterwarnings('ignore', message='pkg_resources is deprecated',
                            category=UserWarning)

# Run from a checkout without installing: make `import xcit_mm` find the repository.
_REPO_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from xcit_mm.models.backbones.xcit import arch_zoo  # noqa: E402
from xcit_mm.visualization.xca import SAMPLE_IMAGES  # noqa: E402


def parse_args(argv=None):
    """Parse the command line; a wrong ``--arch`` is an argparse error listing the choices."""
    parser = argparse.ArgumentParser(
        description='Draw per-head |q̂| / |k̂| token-norm maps and XCA channel-attention '
                    'matrices of an XCiT backbone as one PNG grid.')
    parser.add_argument('image', help='image file, or a sample: ' + ', '.join(SAMPLE_IMAGES))
    parser.add_argument('model', help="config (*.py), backbone checkpoint, or 'random'")
    parser.add_argument('--out', required=True, help='output PNG file')
    parser.add_argument('--arch', default='s12', choices=list(arch_zoo),
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
    args = parser.parse_args(argv)
    if args.cell < 32:
        parser.error(f'--cell must be at least 32 px, got {args.cell}')
    return args


def main(argv=None) -> int:
    """Command-line entry point; returns 0 on success, 2 on a bad input or checkpoint."""
    from xcit_mm.apis import error_line
    from xcit_mm.models.utils.checkpoint_io import CheckpointError
    from xcit_mm.visualization import visualize_xca
    args = parse_args(argv)
    try:
        fig = visualize_xca(args.image, args.model, args.out, arch=args.arch,
                            patch_size=args.patch_size, checkpoint=args.checkpoint,
                            layers=args.layers, size=args.size, cell=args.cell,
                            device=args.device, progress=True)
    except (FileNotFoundError, ValueError, CheckpointError) as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    width, height = fig.png_size
    print(f'wrote {args.out} ({width} px wide, {height} px high): {fig.title}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
