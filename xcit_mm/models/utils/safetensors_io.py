"""safetensors files and ``hf-hub:OWNER/NAME[@REVISION]`` names, read with no unpickling into the
``{'state_dict', 'meta'}`` of a ``.pth`` checkpoint (each ``meta`` entry as JSON under its key)."""
import json
import os.path as osp
import re
import struct
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

SUFFIX = '.safetensors'
HUB_PREFIXES = ('hf-hub:', 'hf_hub:')
HUB_FILENAME = 'model.safetensors'
HUB_EXAMPLE = 'hf-hub:timm/xcit_small_12_p16_384.fb_dist_in1k'
_FORMAT_KEY = 'format'
_HEADER_LIMIT = 100_000_000  # safetensors refuses larger headers
_REPO_ID = re.compile(r'^[\w.-]+/[\w.-]+$')


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, unsafe to unpickle, or does not fit the model."""


def is_hub_name(path) -> bool:
    """True for ``hf-hub:OWNER/NAME[@REVISION]`` (``hf_hub:`` too, as timm accepts)."""
    return str(path).startswith(HUB_PREFIXES)


def looks_like_safetensors(head: bytes) -> bool:
    """A safetensors header by its first bytes: an 8-byte little-endian length, then JSON."""
    if len(head) < 9 or head[8:9] != b'{':
        return False
    return 2 <= struct.unpack('<Q', head[:8])[0] <= _HEADER_LIMIT


def _decode(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


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
    meta = {key: _decode(value) for key, value in metadata.items() if key != _FORMAT_KEY}
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


def _offline(constants) -> bool:
    check = getattr(constants, 'is_offline_mode', None)
    return bool(check() if callable(check) else constants.HF_HUB_OFFLINE)


def download_from_hub(name: str, what: str = 'checkpoint') -> str:
    """The local copy of a Hub name's ``model.safetensors``, cached or downloaded."""
    repo_id, revision = parse_hub_name(name)
    hub, constants, errors = _hub()
    at = f' at revision {revision!r}' if revision else ''
    page = f'https://huggingface.co/{repo_id}'
    try:
        return hub.hf_hub_download(repo_id, HUB_FILENAME, revision=revision)
    except Exception as e:  # the most specific class first: Gated is a RepositoryNotFound...
        if isinstance(e, errors.LocalEntryNotFoundError):  # neither cached nor reachable
            why = ('HF_HUB_OFFLINE is set' if _offline(constants) else
                   f'the Hub could not be reached ({type(e.__cause__ or e).__name__})')
            problem = (
                f'{HUB_FILENAME} of {repo_id}{at} is not in the Hugging Face cache '
                f'({constants.HF_HUB_CACHE}) and {why}. Download it once with network access '
                f'(HF_HUB_OFFLINE unset), point HF_HUB_CACHE or HF_HOME at a cache that holds '
                f'it, or download {HUB_FILENAME} yourself and pass its local path.')
        elif isinstance(e, errors.RevisionNotFoundError):
            problem = (f'the repository {repo_id} has no revision {revision!r} (a branch, tag or '
                       f'commit). Check the part after "@" against {page}, or drop it for the '
                       f'default branch.')
        elif isinstance(e, errors.GatedRepoError):
            problem = (f'{repo_id} is a gated repository. Accept its terms at {page}, then log in '
                       f'(hf auth login) or set HF_TOKEN.')
        elif isinstance(e, errors.RepositoryNotFoundError):
            problem = (f'no repository {repo_id} on the Hugging Face Hub (or it is private). '
                       f'Check the name (OWNER/NAME as in {page}, e.g. {HUB_EXAMPLE}); for a '
                       f'private one, log in (hf auth login) or set HF_TOKEN.')
        elif isinstance(e, errors.EntryNotFoundError):
            problem = (f'{repo_id}{at} has no {HUB_FILENAME}. xcit_mm reads only safetensors '
                       f'weights from the Hub (they carry no code); use a repository that has '
                       f'{HUB_FILENAME}, or download its weights and pass the local file.')
        else:  # network, proxy, server errors: huggingface_hub's own message
            detail = (str(e).strip().splitlines() or [''])[0][:300]
            problem = (f'cannot download {HUB_FILENAME} of {repo_id}{at} from the Hugging Face '
                       f'Hub ({type(e).__name__}: {detail}). Check the network, or download the '
                       f'file yourself and pass its local path.')
        raise CheckpointError(f'{what} {name}: {problem}') from None


def hub_copy_advice(name: str) -> str:
    """How to replace a cached Hub file that turned out truncated or corrupt."""
    folder = osp.join(_hub()[1].HF_HUB_CACHE,
                      'models--' + parse_hub_name(name)[0].replace('/', '--'))
    return f' The Hub file is cached: delete {folder} and run again to download it afresh.'


def hub_architecture(repo_id: str, revision: Optional[str]) -> Optional[str]:
    """The architecture the repository's config.json names, or None if none is at hand."""
    hub, constants, _ = _hub()
    try:
        path = hub.try_to_load_from_cache(repo_id, 'config.json', revision=revision)
        if not isinstance(path, str) and not _offline(constants):
            path = hub.hf_hub_download(repo_id, 'config.json', revision=revision)
        if not isinstance(path, str):
            return None
        with open(path) as f:
            config = json.load(f)
    except Exception:  # no config.json, no network, not JSON: the keys still tell
        return None
    if not isinstance(config, dict):
        return None
    # timm's ``architecture``, transformers' ``architectures`` (a list) / ``model_type``
    found = config.get('architecture') or config.get('architectures') or config.get('model_type')
    return str(found[0] if isinstance(found, list) else found) if found else None
