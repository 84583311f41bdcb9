"""The one checkpoint reader of xcit_mm, its tools and mmengine's loader: ``torch.load`` with
``weights_only=True`` (mmengine's training state allow-listed), safetensors files read into the
``{'state_dict', 'meta'}`` of a ``.pth`` checkpoint, URLs and ``hf-hub:OWNER/NAME[@REVISION]``
names. Every failure is a :class:`CheckpointError` naming the file, the cause and the fix."""
import contextlib
import importlib
import json
import os
import os.path as osp
import pickle
import re
import struct
import sys
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlparse

import torch

from .ckpt_convert import LayoutError, convert_backbone_state_dict, kind_of_backbone
from .safe_unpickling import training_state_entries

SUFFIX = '.safetensors'
HUB_PREFIXES = ('hf-hub:', 'hf_hub:')
HUB_FILENAME = 'model.safetensors'
HUB_EXAMPLE = 'hf-hub:timm/xcit_small_12_p16_384.fb_dist_in1k'
_FORMAT_KEY = 'format'
_HEADER_LIMIT = 100_000_000  # safetensors refuses larger headers
_REPO_ID = re.compile(r'^[\w.-]+/[\w.-]+$')
_URL = re.compile(r'^https?://')
_ZIP_MAGIC = b'PK\x03\x04'
# what torch.load raises on a file cut short or corrupt
_CORRUPT = (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError,
            UnicodeDecodeError, KeyError, IndexError, struct.error)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, unsafe to unpickle, or does not fit the model."""


def is_hub_name(path) -> bool:
    """True for ``hf-hub:OWNER/NAME[@REVISION]`` (``hf_hub:`` too, as timm accepts)."""
    return str(path).startswith(HUB_PREFIXES)


def is_url(path: str) -> bool:
    """True for an http(s) URL or an ``hf-hub:`` name."""
    return bool(_URL.match(str(path))) or is_hub_name(path)


def looks_like_safetensors(head: bytes) -> bool:
    """A safetensors header by its first bytes: an 8-byte little-endian length, then JSON."""
    if len(head) < 9 or head[8:9] != b'{':
        return False
    return 2 <= struct.unpack('<Q', head[:8])[0] <= _HEADER_LIMIT


def read_safetensors(path: str, name: str, map_location='cpu',
                     fresh: str = '') -> Dict[str, object]:
    """``{'state_dict', 'meta'}`` of the local file ``path``, which messages call ``name``."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError(f'{name} is a safetensors file: reading it needs the safetensors '
                              f'package: pip install safetensors (tools/install.sh installs '
                              f'it).') from None
    try:
        with safe_open(path, framework='pt', device='cpu') as f:
            metadata = f.metadata() or {}
            tensors = OrderedDict((key, f.get_tensor(key)) for key in f.keys())
    except Exception as e:  # SafetensorError (a Rust error, no finer class), OSError
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else ''
        raise CheckpointError(
            f'Cannot read {name} ({osp.getsize(path)} bytes): the safetensors file is truncated or '
            f'corrupt ({type(e).__name__}: {detail}). A file cut short while being downloaded or '
            f'written looks like this: download or copy it again.{fresh}') from None
    # a callable or dict map_location keeps the CPU; outside the try: not a corrupt file
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != 'cpu':
        tensors = OrderedDict((key, value.to(map_location)) for key, value in tensors.items())
    meta = {key: value for key, value in metadata.items() if key != _FORMAT_KEY}
    for key, value in meta.items():
        with contextlib.suppress(ValueError):  # JSON as save_safetensors writes it, else text
            meta[key] = json.loads(value)
    return {'state_dict': tensors, 'meta': meta}


def save_safetensors(state_dict: Dict[str, torch.Tensor], path: str,
                     meta: Optional[dict] = None) -> List[str]:
    """Write ``state_dict`` (shared tensors as copies) and ``meta``; return the ``meta`` keys left
    out (not JSON data)."""
    from safetensors.torch import save_file
    metadata, left_out = {_FORMAT_KEY: 'pt'}, []
    for key, value in (meta or {}).items():
        try:  # numpy arrays and scalars and tensors, which json cannot write, as lists
            metadata[str(key)] = json.dumps(value, default=lambda v: v.tolist())
        except (TypeError, ValueError, AttributeError):
            left_out.append(str(key))
    tensors, seen = OrderedDict(), set()
    for key, value in state_dict.items():
        value = value.detach().contiguous()
        storage = (value.untyped_storage().data_ptr(), value.device.type)
        if storage in seen and value.numel():
            value = value.clone()
        seen.add(storage)
        tensors[key] = value
    save_file(tensors, path, metadata=metadata)
    return left_out


def parse_hub_name(name: str) -> Tuple[str, Optional[str]]:
    """``'hf-hub:OWNER/NAME@REVISION'`` -> ``('OWNER/NAME', 'REVISION' or None)``."""
    body = str(name).split(':', 1)[1]
    repo_id, at, revision = body.partition('@')
    if not _REPO_ID.match(repo_id) or (at and not revision):
        raise CheckpointError(
            f'{name} is not a Hugging Face Hub name: write hf-hub:OWNER/NAME or '
            f'hf-hub:OWNER/NAME@REVISION (a branch, tag or commit), e.g. {HUB_EXAMPLE}.')
    return repo_id, revision or None


def _hub():
    try:
        import huggingface_hub
        from huggingface_hub import constants, utils
    except ImportError:
        raise CheckpointError(
            'Reading hf-hub: names needs the huggingface_hub package: pip install '
            'huggingface_hub (tools/install.sh installs it).') from None
    return huggingface_hub, constants, utils


def download_from_hub(name: str, what: str = 'checkpoint') -> str:
    """The local copy of a Hub name's ``model.safetensors``, cached or downloaded."""
    repo_id, revision = parse_hub_name(name)
    hub, constants, errors = _hub()
    at = f' at revision {revision!r}' if revision else ''
    page = f'https://huggingface.co/{repo_id}'
    try:
        return hub.hf_hub_download(repo_id, HUB_FILENAME, revision=revision)
    except Exception as e:
        # is_offline_mode() from huggingface_hub 1.0 on, the constant before it
        offline = getattr(constants, 'is_offline_mode', lambda: constants.HF_HUB_OFFLINE)()
        why = ('HF_HUB_OFFLINE is set' if offline else
               f'the Hub could not be reached ({type(e.__cause__ or e).__name__})')
        detail = (str(e).strip().splitlines() or [''])[0][:300]
        # the most specific class first: Gated is a RepositoryNotFound, LocalEntryNotFound an
        # EntryNotFound; the last, for network, proxy and server errors, quotes huggingface_hub
        problems = [
            (errors.LocalEntryNotFoundError,  # neither cached nor reachable
             f'{HUB_FILENAME} of {repo_id}{at} is not in the Hugging Face cache '
             f'({constants.HF_HUB_CACHE}) and {why}. Download it once with network access '
             f'(HF_HUB_OFFLINE unset), point HF_HUB_CACHE or HF_HOME at a cache that holds '
             f'it, or download {HUB_FILENAME} yourself and pass its local path.'),
            (errors.RevisionNotFoundError,
             f'the repository {repo_id} has no revision {revision!r} (a branch, tag or commit). '
             f'Check the part after "@" against {page}, or drop it for the default branch.'),
            (errors.GatedRepoError, f'{repo_id} is a gated repository. Accept its terms at '
             f'{page}, then log in (hf auth login) or set HF_TOKEN.'),
            (errors.RepositoryNotFoundError,
             f'no repository {repo_id} on the Hugging Face Hub (or it is private). Check the '
             f'name (OWNER/NAME as in {page}, e.g. {HUB_EXAMPLE}); for a private one, log in '
             f'(hf auth login) or set HF_TOKEN.'),
            (errors.EntryNotFoundError, f'{repo_id}{at} has no {HUB_FILENAME}. xcit_mm reads '
             f'only safetensors weights from the Hub (they carry no code); use a repository '
             f'that has {HUB_FILENAME}, or download its weights and pass the local file.'),
            (Exception, f'cannot download {HUB_FILENAME} of {repo_id}{at} from the Hugging '
             f'Face Hub ({type(e).__name__}: {detail}). Check the network, or download the '
             f'file yourself and pass its local path.')]
        problem = next(text for kind, text in problems if isinstance(e, kind))
        raise CheckpointError(f'{what} {name}: {problem}') from None


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
    torch.serialization.add_safe_globals(training_state_entries())
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
        folder = osp.join(_hub()[1].HF_HUB_CACHE,
                          'models--' + parse_hub_name(path)[0].replace('/', '--'))
        name, fresh = f'{what} {path}, cached at {local}', (
            f' The Hub file is cached: delete {folder} and run again to download it afresh.')
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
    with contextlib.suppress(LayoutError):
        convert_backbone_state_dict(state_dict)
        return
    repo_id, revision = parse_hub_name(name)
    try:  # the architecture config.json names (its cached copy when offline)
        with open(_hub()[0].hf_hub_download(repo_id, 'config.json', revision=revision)) as f:
            config = json.load(f)
    except Exception:  # no config.json, no network, not JSON: the keys still tell
        config = None
    config = config if isinstance(config, dict) else {}
    # timm's ``architecture``, transformers' ``architectures`` (a list) / ``model_type``
    found = config.get('architecture') or config.get('architectures') or config.get('model_type')
    architecture = str(found[0] if isinstance(found, list) else found) if found else None
    kind = kind_of_backbone(state_dict)
    what = [f'its config.json names the architecture {architecture!r}'] if architecture else []
    what.append(f'its weights look like {kind}' if kind else
                f'its keys match no XCiT layout (first keys {list(state_dict)[:4]})')
    raise CheckpointError(
        f'{name} is not an XCiT model: {", ".join(what)}. Use the Hub name of an XCiT model '
        f'(timm\'s are timm/xcit_*, e.g. {HUB_EXAMPLE}).')
