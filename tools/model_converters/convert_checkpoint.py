#!/usr/bin/env python
"""Convert any published XCiT checkpoint to xcit_mm's backbone layout.

    python tools/model_converters/convert_checkpoint.py SRC DST [--full-model] [--arch s12]

SRC: a .pth or safetensors file, URL or hf-hub:OWNER/NAME, read with weights_only unless --trust.
DST keeps the source's meta; a DST ending in .safetensors is written as safetensors. Examples and
layouts: docs/weights.md.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from xcit_mm.models import arch_zoo  # noqa: E402
from xcit_mm.models.utils import (CheckpointError, LayoutError,  # noqa: E402
                                  convert_backbone_state_dict, convert_model_state_dict,
                                  extract_state_dict, load_checkpoint_file)
from xcit_mm.models.utils.ckpt_convert import strip_prefix  # noqa: E402
from xcit_mm.models.utils.checkpoint_io import (SUFFIX, is_hub_name,  # noqa: E402
                                                save_safetensors)
from training_extras.hooks.portable_checkpoint_hook import to_plain_data  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('src', help='checkpoint to convert (path, URL or hf-hub:OWNER/NAME)')
    parser.add_argument('dst', help='where to write the xcit_mm checkpoint')
    parser.add_argument('--prefix', default=None,
                        help="sub-module to take, e.g. 'backbone.' (default: auto)")
    parser.add_argument('--trust', action='store_true',
                        help='unpickle SRC (weights_only=False): only for files you trust')
    parser.add_argument('--full-model', action='store_true',
                        help='keep neck and heads (a whole detector/segmentor checkpoint)')
    parser.add_argument('--arch', default=None, choices=sorted(arch_zoo),
                        help='check the result loads into this arch')
    parser.add_argument('--patch-size', type=int, default=16, choices=(8, 16))
    parser.add_argument('--format', default=None, choices=('pth', 'safetensors'),
                        help='file format of DST (default: safetensors for a DST ending in '
                             '.safetensors, else pth)')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        checkpoint = load_checkpoint_file(args.src, 'checkpoint', weights_only=not args.trust)
        raw = extract_state_dict(checkpoint, args.src)
        if args.full_model:
            converted, info = convert_model_state_dict(raw)
            backbone = strip_prefix(converted, 'backbone.')[0]
        else:
            converted, info = convert_backbone_state_dict(raw, args.prefix)
            backbone = converted
        if args.arch:
            from xcit_mm import XCiTBackbone
            # strict; the backbone's load hook names what does not fit
            XCiTBackbone(arch=args.arch, patch_size=args.patch_size).load_state_dict(backbone)
    except (CheckpointError, LayoutError) as e:
        sys.exit(f'error: {e}')
    os.makedirs(os.path.dirname(os.path.abspath(args.dst)), exist_ok=True)
    # The source's meta (dataset_meta: class names and palette for the inferencers, epoch...)
    # is kept, as plain data, so that the file opens with torch's weights_only loading.
    meta = checkpoint.get('meta') if isinstance(checkpoint, dict) else None
    meta = to_plain_data(dict(meta)) if isinstance(meta, dict) else {}
    source = str(args.src) if is_hub_name(args.src) else os.path.basename(str(args.src))
    meta.update(source=source, layout=info['layout'])
    fmt = args.format or ('safetensors' if args.dst.lower().endswith(SUFFIX) else 'pth')
    left_out = []
    if fmt == 'safetensors':
        left_out = save_safetensors(converted, args.dst, meta)
    else:
        torch.save({'state_dict': converted, 'meta': meta}, args.dst)
    n_params = sum(v.numel() for k, v in backbone.items() if 'num_batches' not in k)
    print(f'{args.src}: {info["layout"]} layout, {len(raw)} tensors')
    print(f'  kept      {len(backbone)} backbone tensors ({n_params / 1e6:.2f}M values)')
    if args.full_model:
        print(f'  kept      {len(converted) - len(backbone)} neck/head tensors unchanged')
    print(f'  dropped   {len(info["classifier"])} classification-only keys '
          f'(cls token, class attention, norm, head)')
    if info['outside']:
        print(f'  dropped   {len(info["outside"])} keys outside the backbone')
    if args.arch:
        print(f'  verified  loads into XCiTBackbone(arch={args.arch!r}, '
              f'patch_size={args.patch_size})')
    if left_out:
        print(f'  dropped   meta entries that are not JSON data: {left_out}')
    print(f'wrote {args.dst} ({fmt})')


if __name__ == '__main__':
    main()
