"""Check every checkpoint a run will read, before any work, and never run pickled code.

mmengine's Runner reads whole-model checkpoints itself (``load_from``, ``resume``, and
``init_cfg=dict(type='Pretrained')`` of modules other than the XCiT backbone), and what it does
depends on where the file is:

- local files: ``torch.load(path)``, which is ``weights_only=True`` since torch 2.6 but then fails
  with torch's raw ``UnpicklingError`` / zip-reader traceback, minutes into the start-up;
- http(s) URLs (and ``open-mmlab://``-style names that resolve to URLs):
  ``torch.hub.load_state_dict_from_url``, whose ``weights_only`` defaults to **False**: a
  downloaded file can execute arbitrary code while it is unpickled.

:func:`check_checkpoint` is what ``tools/train.py`` and ``tools/test.py`` call on each such file
before the Runner is built. It downloads a URL into torch's hub cache (the file mmengine would
have downloaded) and returns the local path, which the tools then hand to the Runner, so
mmengine never unpickles a URL. It reads the file with ``torch.load(weights_only=True)``
(memory-mapped for zip checkpoints, so the tensors are not read) after
:func:`xcit_mm.checkpoint.allow_runner_checkpoints` has allow-listed mmengine's own classes, and
turns every failure into a :class:`CheckpointFileError` that names the file, the problem and the
fix. :func:`find_pretrained` lists the ``Pretrained`` init configs of a model config, and
:func:`resolve_auto_resume` picks (and checks) the checkpoint a bare ``--resume`` would use.
"""
import os
import os.path as osp
import pickle
import re
from typing import Iterator, List, Optional, Tuple
from urllib.parse import urlparse

import torch

_URL = re.compile(r'^https?://')
_ZIP_MAGIC = b'PK\x03\x04'


class CheckpointFileError(RuntimeError):
    """A checkpoint file that is missing, unreadable, unsafe to unpickle or of the wrong kind."""


def is_url(path: str) -> bool:
    """True for http(s) URLs."""
    return bool(_URL.match(str(path)))


def _scheme(path: str) -> Optional[str]:
    match = re.match(r'^([a-zA-Z][a-zA-Z0-9+.-]*)://', str(path))
    return match.group(1).lower() if match else None


def hub_cache_path(url: str) -> str:
    """Where ``torch.hub.load_state_dict_from_url`` (hence mmengine) keeps a downloaded URL."""
    filename = osp.basename(urlparse(url).path)
    return osp.join(torch.hub.get_dir(), 'checkpoints', filename)


def _download(url: str) -> str:
    """Download ``url`` into the hub cache once per machine (local rank 0), like mmengine."""
    from mmengine.dist import barrier, get_world_size
    cached = hub_cache_path(url)
    if int(os.environ.get('LOCAL_RANK', '0')) == 0 and not osp.isfile(cached):
        os.makedirs(osp.dirname(cached), exist_ok=True)
        try:
            torch.hub.download_url_to_file(url, cached, progress=False)
        except Exception as e:  # urllib raises URLError, HTTPError, OSError, ValueError...
            raise CheckpointFileError(
                f'Cannot download checkpoint {url}: {type(e).__name__}: {str(e)[:300]}. Check '
                f'the URL and the network, or download it yourself and pass the local file.'
            ) from e
    if get_world_size() > 1:
        barrier()
    return cached


def _weights_only_load(path: str):
    """``torch.load(weights_only=True)``, memory-mapped when the file is a zip checkpoint."""
    with open(path, 'rb') as f:
        is_zip = f.read(4) == _ZIP_MAGIC
    return torch.load(path, map_location='cpu', weights_only=True, mmap=is_zip)


def _unsafe_detail(error: Exception) -> Optional[str]:
    """What a weights_only refusal was about, or None if it was not about a Python object."""
    text = str(error)
    found = re.search(r'GLOBAL ([\w.]+)', text)
    if found:
        return f'it asks to import {found.group(1)}'
    found = re.search(r'Can only build .*? but got (<class [^>]*>)', text)
    if found:
        return f'it asks to build a {found.group(1)}'
    return None  # e.g. "Unsupported operand 60": not a pickle at all


def _unsafe_message(path: str, what: str, error: Exception) -> str:
    detail = _unsafe_detail(error)
    return (
        f'Refusing to load {what} {path}: the file contains pickled Python objects beyond '
        f'tensors and mmengine\'s own training state ({detail}), and unpickling them could run '
        f'arbitrary code. Nothing from the file was executed. If you trust the file (e.g. you '
        f'wrote it), re-save its weights once: python tools/convert_checkpoint.py {path} '
        f'OUT.pth --full-model --trust, then use OUT.pth.')


def check_checkpoint(path: str, what: str = 'checkpoint', kind: str = 'weights') -> str:
    """Check that ``path`` is a readable, safe checkpoint of the expected kind.

    Args:
        path (str): Local path or http(s) URL.
        what (str): How the message names the file (e.g. ``'--resume checkpoint'``).
        kind (str): ``'weights'``: a dict holding a ``state_dict`` (or tensors directly), what
            ``load_from`` and testing need; ``'resume'``: a training checkpoint written by the
            Runner (``meta`` with the iteration/epoch, ``state_dict``, ``optimizer``).

    Returns:
        str: The local file to give the Runner: ``path`` itself, or the downloaded copy of a URL
        in torch's hub cache.

    Raises:
        CheckpointFileError: If the file does not exist, cannot be downloaded, is truncated or
            not a PyTorch checkpoint, holds pickled objects other than tensors and mmengine's
            training state, or is not of ``kind``.
    """
    from xcit_mm.checkpoint import allow_runner_checkpoints
    allow_runner_checkpoints()
    scheme = _scheme(path)
    if is_url(path):
        local = _download(path)
    elif scheme is not None:
        raise CheckpointFileError(
            f'{what} {path}: {scheme}:// checkpoints are resolved by mmengine and may be '
            f'unpickled without torch\'s weights_only protection, so the tools do not accept '
            f'them. Download the file and pass its local path (or its http(s) URL).')
    else:
        local = path
        if not osp.isfile(local):
            raise CheckpointFileError(
                f'{what} not found: {osp.abspath(local)} (working directory {os.getcwd()}). '
                f'Check the path; relative paths are relative to the working directory.')
    try:
        checkpoint = _weights_only_load(local)
    except pickle.UnpicklingError as e:
        if _unsafe_detail(e):
            raise CheckpointFileError(_unsafe_message(local, what, e)) from e
        raise CheckpointFileError(_corrupt_message(local, what, e)) from e
    except (RuntimeError, EOFError, OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointFileError(_corrupt_message(local, what, e)) from e
    _check_kind(checkpoint, local, what, kind)
    return local


def _corrupt_message(path: str, what: str, error: Exception) -> str:
    size = osp.getsize(path)
    text = str(error).strip()
    found = re.search(r'WeightsUnpickler error:\s*(.+?)\s*(\n\n|$)', text, re.S)
    first = found.group(1)[:200] if found else text.splitlines()[0][:200] if text else ''
    return (f'Cannot read {what} {path} ({size} bytes): the file is truncated, corrupt or not a '
            f'PyTorch checkpoint ({type(error).__name__}: {first}). A checkpoint cut short while '
            f'being written (a killed job, a full disk) looks like this: use an earlier '
            f'checkpoint, or copy the file again.')


def _check_kind(checkpoint, path: str, what: str, kind: str) -> None:
    if not isinstance(checkpoint, dict):
        raise CheckpointFileError(f'{what} {path} holds a {type(checkpoint).__name__}, not a '
                                  f'dict of weights: it is not a model checkpoint.')
    keys = list(checkpoint)[:8]
    if kind == 'resume':
        meta = checkpoint.get('meta')
        if not (isinstance(meta, dict) and 'iter' in meta and 'epoch' in meta
                and 'state_dict' in checkpoint):
            raise CheckpointFileError(
                f'{what} {path} is not a training checkpoint (top-level keys {keys}): --resume '
                f'needs a file written by tools/train.py, with the iteration, optimizer and '
                f'scheduler state. To start a new training from these weights, use '
                f'--cfg-options load_from={path} instead of --resume.')
        return
    state = checkpoint.get('state_dict', checkpoint)
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise CheckpointFileError(f'{what} {path} has no weights (top-level keys {keys}): '
                                  f'expected a state_dict of tensors.')


def find_pretrained(model_cfg, prefix: str = 'model') -> Iterator[Tuple[str, dict]]:
    """Yield ``(config key, init_cfg dict)`` for every ``Pretrained`` init config in a model cfg.

    Args:
        model_cfg (dict): ``cfg.model`` (or any sub-dict).
        prefix (str): Key of ``model_cfg`` in the full config, used in the returned keys.
    """
    if isinstance(model_cfg, dict):
        init_cfg = model_cfg.get('init_cfg')
        inits = init_cfg if isinstance(init_cfg, (list, tuple)) else [init_cfg]
        for index, init in enumerate(inits):
            if isinstance(init, dict) and init.get('type') == 'Pretrained' \
                    and init.get('checkpoint'):
                suffix = f'[{index}]' if isinstance(init_cfg, (list, tuple)) else ''
                yield f'{prefix}.init_cfg{suffix}', init
        for key, value in model_cfg.items():
            if key != 'init_cfg':
                yield from find_pretrained(value, f'{prefix}.{key}')
    elif isinstance(model_cfg, (list, tuple)):
        for index, value in enumerate(model_cfg):
            yield from find_pretrained(value, f'{prefix}[{index}]')


def check_pretrained(cfg) -> List[str]:
    """Check (and, for URLs, download) every ``Pretrained`` checkpoint of ``cfg.model``.

    URLs are replaced in ``cfg`` by the checked local copy, so no module's initialisation
    unpickles a download. An init config that opts out with ``weights_only=False`` (the XCiT
    backbone's "I trust this file" switch) is only checked for existence.

    Returns:
        list[str]: The checked local paths.

    Raises:
        CheckpointFileError: For the first checkpoint that fails :func:`check_checkpoint`; the
            message names the config key to fix.
    """
    checked = []
    for key, init in find_pretrained(cfg.get('model', {})):
        path = init['checkpoint']
        what = f'{key}.checkpoint'
        if init.get('weights_only', True) is False:
            if not is_url(path) and not osp.isfile(path):
                raise CheckpointFileError(f'{what} not found: {osp.abspath(path)}. Fix the path '
                                          f'(--cfg-options {what}=...) or set it to None.')
            continue
        try:
            local = check_checkpoint(path, what)
        except CheckpointFileError as e:
            raise CheckpointFileError(f'{e} (set with --cfg-options {what}=PATH)') from e
        init['checkpoint'] = local
        checked.append(local)
    return checked


def resolve_auto_resume(work_dir: str) -> Optional[str]:
    """The checkpoint a bare ``--resume`` continues from, checked; None if there is none.

    mmengine resumes from the file named in ``WORK_DIR/last_checkpoint``. That file is written
    after the checkpoint itself, so a job killed while saving leaves it pointing at the previous,
    complete checkpoint; but it can also point at a file that was deleted or cut short. Then the
    error lists the other checkpoints of the work dir, newest first.

    Raises:
        CheckpointFileError: If ``last_checkpoint`` names a missing or unreadable file.
    """
    marker = osp.join(work_dir, 'last_checkpoint')
    if not osp.isfile(marker):
        return None
    with open(marker) as f:
        last = f.read().strip()
    try:
        return check_checkpoint(last, f'latest checkpoint (from {marker})', kind='resume')
    except CheckpointFileError as e:
        others = sorted(
            (osp.join(work_dir, name) for name in os.listdir(work_dir)
             if name.endswith('.pth') and osp.join(work_dir, name) != last),
            key=osp.getmtime, reverse=True)
        hint = (f' Other checkpoints in {work_dir}, newest first: {others[:5]}; resume from '
                f'one with --resume PATH.' if others else
                f' No other checkpoint exists in {work_dir}; start again without --resume.')
        raise CheckpointFileError(str(e) + hint) from e
