"""THE checkpoint reader: every file this package and its tools read goes through here.

One reader, one error class (:class:`CheckpointError`), one message per kind of failure:

- a missing file, an unsupported ``scheme://``, a failed download;
- a file that is not a PyTorch checkpoint at all (an HTML error page saved as ``.pth``, a text
  file): named as such, with its first bytes;
- safetensors files (by their header, or a ``.safetensors`` name) and Hugging Face Hub names
  (``hf-hub:OWNER/NAME[@REVISION]``) are read by :mod:`.safetensors_io`, which unpickles nothing,
  into the same ``{'state_dict': ..., 'meta': ...}`` a ``.pth`` checkpoint holds;
- a truncated or corrupt checkpoint (a killed job, a full disk);
- a checkpoint that holds pickled Python objects beyond tensors and mmengine's own training
  state: refused, nothing is executed, and the way out is named.

Files are read with ``torch.load(weights_only=True)``, with the pure-data types of mmengine's
training state allow-listed (:mod:`.safe_unpickling`). :func:`load_from_weights_only` serves
mmengine's ``CheckpointLoader`` for local paths, URLs and ``hf-hub:`` names, so every door
(``load_from``, ``--resume``, ``init_detector``, the inferencers, the upstream ``tools/test.py``)
reads through here and reports the same clear errors.

URLs are downloaded once into torch's hub cache (the file mmengine would have downloaded) and
then read like local files: nothing downloaded is ever unpickled unsafely.
"""
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

from .checkpoint_error import CheckpointError
from .ckpt_convert import LayoutError, convert_backbone_state_dict, kind_of_backbone
from .safe_unpickling import allow_training_state
from .safetensors_io import (HUB_EXAMPLE, HUB_PREFIXES, download_from_hub, hub_architecture,
                             hub_copy_advice, is_hub_name, is_safetensors, parse_hub_name,
                             read_safetensors)

_URL = re.compile(r'^https?://')
_ZIP_MAGIC = b'PK\x03\x04'
_PICKLE_PROTO = 0x80  # first byte of a protocol >= 2 pickle: torch's legacy (non-zip) format


def is_url(path: str) -> bool:
    """True for a name fetched over the network: an http(s) URL or an ``hf-hub:`` name.

    Callers check such names after the cheaper local checks, and do not look for a local file.
    """
    return bool(_URL.match(str(path))) or is_hub_name(path)


def _scheme(path: str) -> Optional[str]:
    match = re.match(r'^([a-zA-Z][a-zA-Z0-9+.-]*)://', str(path))
    return match.group(1).lower() if match else None


def hub_cache_path(url: str) -> str:
    """Where ``torch.hub.load_state_dict_from_url`` (hence mmengine) keeps a downloaded URL."""
    filename = osp.basename(urlparse(url).path)
    return osp.join(torch.hub.get_dir(), 'checkpoints', filename)


def download_checkpoint(url: str) -> str:
    """Download ``url`` into the hub cache once per machine; return the path.

    In a distributed job local rank 0 downloads while the machine's other ranks wait at a
    barrier, which rank 0 reaches even when the download fails (no rank is left waiting);
    without a process group every process downloads for itself.
    """
    from mmengine.dist import barrier, get_world_size
    cached = hub_cache_path(url)
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
    advice = 'Check the URL and the network, or download it yourself and pass the local file.'
    if failure is not None:
        raise CheckpointError(f'Cannot download checkpoint {url}: {type(failure).__name__}: '
                              f'{str(failure)[:300]}. {advice}') from failure
    if not osp.isfile(cached):
        raise CheckpointError(f'Cannot download checkpoint {url}: local rank 0 did not download '
                              f'it to {cached} (its own error says why). {advice}')
    return cached


# ---------------------------------------------------------------------------- reading
def _first_bytes(path: str, n: int = 16) -> bytes:
    with open(path, 'rb') as f:
        return f.read(n)


def _downloaded(path: str, url: Optional[str]) -> Tuple[str, str]:
    """How a message names a file, and for a download the way to get a fresh copy."""
    if url is None:
        return path, ''
    if is_hub_name(url):
        return f'{url}, cached at {path}', hub_copy_advice(url)
    return (f'{url}, downloaded to {path}',
            f' The download is cached and the next run would read the same copy: delete {path} '
            f'and run again, or download the file yourself and pass the local path.')


def _is_torch_file(head: bytes) -> bool:
    """A PyTorch checkpoint by its first bytes (zip or legacy pickle), even one cut short."""
    return bool(head.startswith(_ZIP_MAGIC) or (head and head[0] == _PICKLE_PROTO)
                or (head and _ZIP_MAGIC.startswith(head)))


def _not_a_checkpoint(path: str, what: str, head: bytes,
                      url: Optional[str] = None) -> Optional[str]:
    """A message if ``path`` is not a PyTorch checkpoint by its first bytes, else None."""
    if _is_torch_file(head):
        return None
    size = osp.getsize(path)
    shown = head.decode('utf-8', 'replace').replace('\n', ' ').strip()
    start = f"starts with {shown[:12]!r}..." if shown else 'is empty'
    name, fresh = _downloaded(path, url)
    return (f'{what} {name} ({size} bytes) is not a PyTorch checkpoint (it {start}). A failed '
            f'download often saves an HTML error page or a text message under the .pth name: '
            f'download the file again, or check the path.{fresh}')


def _importable(dotted: str) -> bool:
    module, _, name = dotted.rpartition('.')
    try:
        return hasattr(importlib.import_module(module), name)
    except Exception:  # ImportError, ValueError for an empty name...
        return False


def _unsafe_detail(error: Exception) -> Optional[str]:
    """What a weights_only refusal was about, or None if it was not about a Python object."""
    text = str(error)
    found = re.search(r'GLOBAL ([\w.]+)', text)
    if found:
        # a name cut short by truncation names nothing importable: that file is corrupt
        return f'it asks to import {found.group(1)}' if _importable(found.group(1)) else None
    found = re.search(r'Can only build .*? but got (<class [^>]*>)', text)
    if found:
        return f'it asks to build a {found.group(1)}'
    found = re.search(r'asks for (.*?), which is not part of an mmengine', text, re.S)
    if found:  # refused by a stand-in of safe_unpickling
        return f'it asks for {found.group(1)}'
    return None  # e.g. "Unsupported operand 60": not a pickle of objects at all


def _unsafe_message(path: str, what: str, error: Exception) -> str:
    return (
        f'Refusing to load {what} {path}: the file contains pickled Python objects beyond '
        f'tensors and mmengine\'s own training state ({_unsafe_detail(error)}), and unpickling '
        f'them could run arbitrary code. Nothing from the file was executed. If you trust the '
        f'file (e.g. you wrote it), re-save its weights once: python '
        f'tools/model_converters/convert_checkpoint.py {path} OUT.pth --full-model --trust, '
        f'then use OUT.pth (for a backbone init_cfg, weights_only=False also opts in).')


# ---------------------------------------------------------------------------- every door
def load_from_weights_only(filename: str, map_location=None):
    """mmengine's ``CheckpointLoader`` backend for local paths, http(s) URLs and ``hf-hub:`` names.

    The same reader as ours, hence the same refusals and messages, wherever mmengine loads:
    ``load_from``, ``--resume``, ``init_detector`` / ``init_model``, the inferencers, the upstream
    ``tools/test.py``. mmengine logs it as "Loads checkpoint by weights_only backend".
    """
    return load_checkpoint_file(osp.expanduser(filename), 'checkpoint',
                                map_location=map_location)


def _report_in_one_line(previous_hook):
    def excepthook(kind, error, traceback):
        if issubclass(kind, CheckpointError):  # the message names the file, cause and fix
            print(f'error: {error}', file=sys.stderr)
        else:
            previous_hook(kind, error, traceback)

    excepthook.reports_checkpoint_errors = True
    return excepthook


def install_checkpoint_reader() -> None:
    """Make this module the reader of every checkpoint the process opens (``import xcit_mm``).

    - torch's ``weights_only`` allow-list gains mmengine's pure-data training state
      (:mod:`.safe_unpickling`), for every ``torch.load`` of the process;
    - mmengine's ``CheckpointLoader`` reads local paths, http(s) URLs and ``hf-hub:`` names with
      :func:`load_from_weights_only` (safetensors files too, by their header);
    - a script (mmdet's / mmseg's ``tools/test.py``, ours) that stops on a
      :class:`CheckpointError` prints its message as one line, ``error: ...``, not a traceback;
      every other exception is reported by the previous ``sys.excepthook`` as before.
    """
    from mmengine.runner import CheckpointLoader
    allow_training_state()
    CheckpointLoader.register_scheme(prefixes=('', 'http://', 'https://') + HUB_PREFIXES,
                                     loader=load_from_weights_only, force=True)
    if not getattr(sys.excepthook, 'reports_checkpoint_errors', False):
        sys.excepthook = _report_in_one_line(sys.excepthook)


def _corrupt_message(path: str, what: str, error: Exception, url: Optional[str] = None) -> str:
    size = osp.getsize(path)
    text = str(error).strip()
    found = re.search(r'WeightsUnpickler error:\s*(.+?)\s*(\n\n|$)', text, re.S)
    first = found.group(1) if found else text.splitlines()[0] if text else ''
    first = re.split(r'(?<=[.:])\s', first, maxsplit=1)[0][:200]  # its first sentence
    name, fresh = _downloaded(path, url)
    return (f'Cannot read {what} {name} ({size} bytes): the file is truncated or corrupt '
            f'({type(error).__name__}: {first}). A checkpoint cut short while being written (a '
            f'killed job, a full disk) looks like this: use an earlier checkpoint, or copy the '
            f'file again.{fresh}')


def resolve_checkpoint_path(path: str, what: str = 'checkpoint') -> str:
    """The local file for ``path``: itself, the hub-cache copy of a downloaded URL, or the
    Hugging Face cache's copy of an ``hf-hub:`` name's ``model.safetensors``.

    Raises:
        CheckpointError: for a missing file, a failed download, or another ``scheme://``.
    """
    scheme = _scheme(path)
    if is_hub_name(path):
        return download_from_hub(path, what)
    if is_url(path):
        return download_checkpoint(path)
    if scheme is not None:
        raise CheckpointError(
            f'{what} {path}: {scheme}:// checkpoints are resolved by mmengine and may be '
            f'unpickled without torch\'s weights_only protection, so xcit_mm does not accept '
            f'them. Download the file and pass its local path (or its http(s) URL).')
    if not osp.isfile(path):
        raise CheckpointError(
            f'{what} not found: {osp.abspath(path)} (working directory {os.getcwd()}). '
            f'Check the path; relative paths are relative to the working directory.')
    return path


def load_checkpoint_file(path: str, what: str = 'checkpoint', weights_only: bool = True,
                         map_location='cpu', mmap: bool = False):
    """Read a checkpoint file or URL, never running pickled code unless opted in.

    Args:
        path (str): Local path, http(s) URL or ``hf-hub:OWNER/NAME[@REVISION]``.
        what (str): How messages name the file, e.g. ``'load_from checkpoint'``.
        weights_only (bool): Keep ``True`` for downloaded or shared files. ``False`` unpickles
            arbitrary objects and so can run code: only for files you trust.
        map_location: As for ``torch.load``. Defaults to ``'cpu'``.
        mmap (bool): Memory-map a zip checkpoint (cheap checks that do not read the tensors).

    Returns:
        The unpickled object (normally a dict); for safetensors ``{'state_dict', 'meta'}``.

    Raises:
        CheckpointError: naming the file, the problem and the fix.
    """
    return _resolve_and_read(path, what, weights_only, map_location, mmap)[1]


def _resolve_and_read(path: str, what: str, weights_only: bool = True, map_location='cpu',
                      mmap: bool = False) -> Tuple[str, object]:
    """(the local file, what it holds) for a path, URL or Hub name; a Hub file must be XCiT."""
    local = resolve_checkpoint_path(path, what)
    checkpoint = _read_local(local, what, weights_only, map_location, mmap,
                             url=path if is_url(path) else None)
    if is_hub_name(path):
        check_hub_model_is_xcit(path, checkpoint)
    return local, checkpoint


def _read_local(local: str, what: str, weights_only: bool = True, map_location='cpu',
                mmap: bool = False, url: Optional[str] = None):
    """:func:`load_checkpoint_file` of a local file; ``url``: where it was downloaded from."""
    head = _first_bytes(local)
    if not _is_torch_file(head) and is_safetensors(local, head):
        name, fresh = _downloaded(local, url)
        return read_safetensors(local, f'{what} {name}', map_location, fresh)
    problem = _not_a_checkpoint(local, what, head, url)
    if problem:
        raise CheckpointError(problem)
    mmap = mmap and head.startswith(_ZIP_MAGIC)
    try:
        return torch.load(local, map_location=map_location, weights_only=weights_only,
                          mmap=mmap)
    except pickle.UnpicklingError as e:
        if weights_only and _unsafe_detail(e):
            raise CheckpointError(_unsafe_message(local, what, e)) from e
        raise CheckpointError(_corrupt_message(local, what, e, url)) from e
    except (RuntimeError, EOFError, OSError, ValueError, UnicodeDecodeError, KeyError,
            IndexError, struct.error) as e:
        raise CheckpointError(_corrupt_message(local, what, e, url)) from e


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


# ---------------------------------------------------------------------------- early checks
def check_checkpoint(path: str, what: str = 'checkpoint', kind: str = 'weights') -> str:
    """Check that ``path`` is a readable, safe checkpoint of the expected kind, before any work.

    Args:
        path (str): Local path, http(s) URL or ``hf-hub:`` name.
        what (str): How the message names the file (e.g. ``'--resume checkpoint'``).
        kind (str): ``'weights'``: a dict holding a ``state_dict`` (or tensors directly), what
            ``load_from`` and testing need; ``'resume'``: a training checkpoint written by the
            Runner (``meta`` with the iteration/epoch, ``state_dict``, ``optimizer``).

    Returns:
        str: The local file to give the Runner: ``path`` itself, or the downloaded copy of a URL
        or Hub name.

    Raises:
        CheckpointError: see :func:`load_checkpoint_file`, or a file not of ``kind``.
    """
    local, checkpoint = _resolve_and_read(path, what, mmap=True)
    if kind == 'resume':
        meta = checkpoint.get('meta') if isinstance(checkpoint, dict) else None
        if not (isinstance(meta, dict) and 'iter' in meta and 'epoch' in meta
                and 'state_dict' in checkpoint):
            keys = list(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint)
            raise CheckpointError(
                f'{what} {local} is not a training checkpoint (top-level keys {keys}): --resume '
                f'needs a file written by tools/train.py, with the iteration, optimizer and '
                f'scheduler state. To start a new training from these weights, use '
                f'--cfg-options load_from={local} instead of --resume.')
    else:
        extract_state_dict(checkpoint, f'{what} {local}')
    return local


def check_hub_model_is_xcit(name: str, checkpoint: dict) -> None:
    """Raise unless a Hub checkpoint holds XCiT weights (any published layout, alone or as the
    backbone of a whole model), naming what the repository holds instead."""
    state_dict = extract_state_dict(checkpoint, name)
    try:
        convert_backbone_state_dict(state_dict)
        return
    except LayoutError:
        pass
    repo_id, revision = parse_hub_name(name)
    architecture = hub_architecture(repo_id, revision)
    kind = kind_of_backbone(state_dict)
    what = []
    if architecture:
        what.append(f'its config.json names the architecture {architecture!r}')
    what.append(f'its weights look like {kind}' if kind else
                f'its keys match no XCiT layout (first keys {list(state_dict)[:4]})')
    raise CheckpointError(
        f'{name} is not an XCiT model: {", ".join(what)}. Use the Hub name of an XCiT model '
        f'(timm\'s are timm/xcit_*, e.g. {HUB_EXAMPLE}).')
