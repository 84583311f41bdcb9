"""The one checkpoint reader of xcit_mm, its tools and mmengine's loader: ``torch.load`` with
``weights_only=True`` (mmengine's training state allow-listed), safetensors, URLs and ``hf-hub:``
names. Every failure is a :class:`CheckpointError` naming the file, the cause and the fix."""
import importlib
import os
import os.path as osp
import pickle
import re
import struct
import sys
from typing import Optional, Tuple
from urllib.parse import urlparse

import torch

from .ckpt_convert import LayoutError, convert_backbone_state_dict, kind_of_backbone
from .safe_unpickling import allow_training_state
from .safetensors_io import (HUB_EXAMPLE, HUB_PREFIXES, SUFFIX, CheckpointError,
                             download_from_hub, hub_architecture, hub_copy_advice, is_hub_name,
                             looks_like_safetensors, parse_hub_name, read_safetensors)

_URL = re.compile(r'^https?://')
_ZIP_MAGIC = b'PK\x03\x04'
# what torch.load raises on a file cut short or corrupt
_CORRUPT = (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError,
            UnicodeDecodeError, KeyError, IndexError, struct.error)


def is_url(path: str) -> bool:
    """True for an http(s) URL or an ``hf-hub:`` name."""
    return bool(_URL.match(str(path))) or is_hub_name(path)


def download_checkpoint(url: str) -> str:
    """Download ``url`` into torch's hub cache once per machine (by local rank 0, every rank
    meeting at a barrier even when it fails); return the path."""
    from mmengine.dist import barrier, get_world_size
    cached = osp.join(torch.hub.get_dir(), 'checkpoints', osp.basename(urlparse(url).path))
    distributed = get_world_size() > 1
    failure = None
    if not osp.isfile(cached) and (not distributed
                                   or int(os.environ.get('LOCAL_RANK', '0')) == 0):
        try:
            os.makedirs(osp.dirname(cached), exist_ok=True)
            torch.hub.download_url_to_file(url, cached, progress=False)
        except Exception as e:  # urllib raises URLError, HTTPError, OSError, ValueError...
            failure = e
    if distributed:
        barrier()
    if failure is not None or not osp.isfile(cached):
        cause = (f'{type(failure).__name__}: {str(failure)[:300]}' if failure is not None else
                 f'local rank 0 did not download it to {cached} (its own error says why)')
        raise CheckpointError(
            f'Cannot download checkpoint {url}: {cause}. Check the URL and the network, or '
            f'download it yourself and pass the local file.') from failure
    return cached


def _unsafe_detail(error: Exception) -> Optional[str]:
    """What a weights_only refusal asked for, or None when the file is corrupt, not unsafe (a
    ``GLOBAL`` name cut short names nothing importable; "Unsupported operand" is no pickle)."""
    text = str(error)
    found = re.search(r'GLOBAL ([\w.]+)', text)
    if found:
        module, _, name = found[1].rpartition('.')
        try:
            importable = hasattr(importlib.import_module(module), name)
        except Exception:  # ImportError, ValueError for an empty name...
            importable = False
        return f'it asks to import {found[1]}' if importable else None
    found = re.search(r'Can only build .*? but got (<class [^>]*>)', text)
    if found:
        return f'it asks to build a {found[1]}'
    found = re.search(r'asks for (.*?), which is not part of an mmengine', text, re.S)
    return f'it asks for {found[1]}' if found else None  # the latter: safe_unpickling's refusal


def load_from_weights_only(filename: str, map_location=None):
    """mmengine's ``CheckpointLoader`` backend for local paths, http(s) URLs and ``hf-hub:``."""
    return load_checkpoint_file(osp.expanduser(filename), map_location=map_location)


def install_checkpoint_reader() -> None:
    """Make this module the reader of every checkpoint the process opens, and a script stopped
    by a :class:`CheckpointError` print ``error: ...`` instead of a traceback."""
    from mmengine.runner import CheckpointLoader
    allow_training_state()
    CheckpointLoader.register_scheme(prefixes=('', 'http://', 'https://') + HUB_PREFIXES,
                                     loader=load_from_weights_only, force=True)
    previous = sys.excepthook
    if getattr(previous, 'reports_checkpoint_errors', False):
        return

    def excepthook(kind, error, traceback):
        if issubclass(kind, CheckpointError):  # the message names the file, cause and fix
            print(f'error: {error}', file=sys.stderr)
        else:
            previous(kind, error, traceback)

    excepthook.reports_checkpoint_errors = True
    sys.excepthook = excepthook


def resolve_checkpoint_path(path: str, what: str = 'checkpoint') -> str:
    """The local file for ``path``: itself, or the cached download of a URL or ``hf-hub:``."""
    if is_hub_name(path):
        return download_from_hub(path, what)
    if is_url(path):
        return download_checkpoint(path)
    scheme = re.match(r'^([a-zA-Z][a-zA-Z0-9+.-]*)://', str(path))
    if scheme:
        raise CheckpointError(
            f'{what} {path}: {scheme.group(1).lower()}:// checkpoints are resolved by mmengine '
            f'and may be unpickled without torch\'s weights_only protection, so xcit_mm does not '
            f'accept them. Download the file and pass its local path (or its http(s) URL).')
    if not osp.isfile(path):
        raise CheckpointError(
            f'{what} not found: {osp.abspath(path)} (working directory {os.getcwd()}). '
            f'Check the path; relative paths are relative to the working directory.')
    return path


def load_checkpoint_file(path: str, what: str = 'checkpoint', weights_only: bool = True,
                         map_location='cpu'):
    """What a path, URL or ``hf-hub:`` name holds (safetensors as ``{'state_dict', 'meta'}``),
    running no pickled code unless ``weights_only=False``; ``what`` names it in messages."""
    return _resolve_and_read(path, what, weights_only, map_location)[1]


def _resolve_and_read(path: str, what: str, weights_only: bool = True, map_location='cpu',
                      mmap: bool = False) -> Tuple[str, object]:
    """(the local file, what it holds); a Hub file must be XCiT."""
    local = resolve_checkpoint_path(path, what)
    name, fresh = f'{what} {local}', ''
    if is_hub_name(path):
        name, fresh = f'{what} {path}, cached at {local}', hub_copy_advice(path)
    elif is_url(path):
        name, fresh = f'{what} {path}, downloaded to {local}', (
            f' The download is cached and the next run would read the same copy: delete {local} '
            f'and run again, or download the file yourself and pass the local path.')
    with open(local, 'rb') as f:
        head = f.read(16)
    named = local.lower().endswith(SUFFIX)
    # zip or legacy pickle (protocol >= 2), even cut short
    if head and (head[0] == 0x80 or head.startswith(_ZIP_MAGIC) or _ZIP_MAGIC.startswith(head)):
        try:
            checkpoint = torch.load(local, map_location=map_location, weights_only=weights_only,
                                    mmap=mmap and head.startswith(_ZIP_MAGIC))
        except _CORRUPT as e:
            unsafe = weights_only and isinstance(e, pickle.UnpicklingError) and _unsafe_detail(e)
            if unsafe:
                raise CheckpointError(
                    f'Refusing to load {what} {local}: the file contains pickled Python objects '
                    f'beyond tensors and mmengine\'s own training state ({unsafe}), and '
                    f'unpickling them could run arbitrary code. Nothing from the file was '
                    f'executed. If you trust the file (e.g. you wrote it), re-save its weights '
                    f'once: python tools/model_converters/convert_checkpoint.py {local} OUT.pth '
                    f'--full-model --trust, then use OUT.pth (for a backbone init_cfg, '
                    f'weights_only=False also opts in).') from e
            text = str(e).strip()
            found = re.search(r'WeightsUnpickler error:\s*(.+?)\s*(\n\n|$)', text, re.S)
            first = found.group(1) if found else text.splitlines()[0] if text else ''
            first = re.split(r'(?<=[.:])\s', first, maxsplit=1)[0][:200]  # its first sentence
            raise CheckpointError(
                f'Cannot read {name} ({osp.getsize(local)} bytes): the file is truncated '
                f'or corrupt ({type(e).__name__}: {first}). A checkpoint cut short while being '
                f'written (a killed job, a full disk) looks like this: use an earlier '
                f'checkpoint, or copy the file again.{fresh}') from e
    elif looks_like_safetensors(head) or (named and len(head) <= 8):  # or cut in its length
        checkpoint = read_safetensors(local, name, map_location, fresh)
    else:
        shown = head.decode('utf-8', 'replace').replace('\n', ' ').strip()
        start = f'starts with {shown[:12]!r}...' if shown else 'is empty'
        kind, under = (('a safetensors file', 'the file\'s name') if named else
                       ('a PyTorch checkpoint', 'the .pth name'))
        raise CheckpointError(
            f'{name} ({osp.getsize(local)} bytes) is not {kind} (it {start}). A failed download '
            f'often saves an HTML error page or a text message under {under}: download the file '
            f'again, or check the path.{fresh}')
    if is_hub_name(path):
        _check_hub_model_is_xcit(path, checkpoint)
    return local, checkpoint


def extract_state_dict(checkpoint, source: str = 'checkpoint') -> dict:
    """The tensor dict inside a checkpoint (``state_dict``, ``model``, ``module`` or itself)."""
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f'{source} holds a {type(checkpoint).__name__}, not a dict of '
                              f'weights: it is not a model checkpoint.')
    for key in ('state_dict', 'model', 'module'):
        if key in checkpoint and isinstance(checkpoint[key], dict):
            return extract_state_dict(checkpoint[key], source)
    tensors = {k: v for k, v in checkpoint.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise CheckpointError(f'{source} has no weights (top-level keys {list(checkpoint)[:8]}): '
                              f'expected a state_dict of tensors.')
    return tensors


def check_checkpoint(path: str, what: str = 'checkpoint', kind: str = 'weights') -> str:
    """Check, before any work, that ``path`` is a readable, safe checkpoint of ``kind``
    (``'weights'`` or ``'resume'``); return the local file (a download's cached copy)."""
    local, checkpoint = _resolve_and_read(path, what, mmap=True)
    if kind != 'resume':
        extract_state_dict(checkpoint, f'{what} {local}')
        return local
    meta = checkpoint.get('meta') if isinstance(checkpoint, dict) else None
    if not (isinstance(meta, dict) and 'iter' in meta and 'epoch' in meta
            and 'state_dict' in checkpoint):
        keys = list(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint)
        raise CheckpointError(
            f'{what} {local} is not a training checkpoint (top-level keys {keys}): --resume '
            f'needs a file written by tools/train.py, with the iteration, optimizer and '
            f'scheduler state. To start a new training from these weights, use '
            f'--cfg-options load_from={local} instead of --resume.')
    return local


def _check_hub_model_is_xcit(name: str, checkpoint: dict) -> None:
    """Raise unless a Hub checkpoint holds XCiT weights, naming what it holds instead."""
    state_dict = extract_state_dict(checkpoint, name)
    try:
        convert_backbone_state_dict(state_dict)
        return
    except LayoutError:
        pass
    architecture = hub_architecture(*parse_hub_name(name))
    kind = kind_of_backbone(state_dict)
    what = [f'its config.json names the architecture {architecture!r}'] if architecture else []
    what.append(f'its weights look like {kind}' if kind else
                f'its keys match no XCiT layout (first keys {list(state_dict)[:4]})')
    raise CheckpointError(
        f'{name} is not an XCiT model: {", ".join(what)}. Use the Hub name of an XCiT model '
        f'(timm\'s are timm/xcit_*, e.g. {HUB_EXAMPLE}).')
