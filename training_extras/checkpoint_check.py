"""Checks of the checkpoints a training run will read, before any work: every ``Pretrained``
init config of the model, and the file a bare ``--resume`` continues from.

Each file is read by xcit_mm's one checked reader (:func:`xcit_mm.models.utils.check_checkpoint`),
so a missing, truncated or code-carrying file stops the run with a message naming the config key
and the fix, before the Runner logs its environment and builds anything.
"""
import os
import os.path as osp
from typing import Iterator, List, Optional, Tuple

from xcit_mm.models.utils.checkpoint_io import CheckpointError, check_checkpoint, is_url


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
        CheckpointError: For the first checkpoint that fails :func:`check_checkpoint`; the
            message names the config key to fix.
    """
    checked = []
    for key, init in find_pretrained(cfg.get('model', {})):
        path = init['checkpoint']
        what = f'{key}.checkpoint'
        if init.get('weights_only', True) is False:
            if not is_url(path) and not osp.isfile(path):
                raise CheckpointError(f'{what} not found: {osp.abspath(path)}. Fix the path '
                                      f'(--cfg-options {what}=...) or set it to None.')
            continue
        try:
            local = check_checkpoint(path, what)
        except CheckpointError as e:
            raise CheckpointError(f'{e} (set with --cfg-options {what}=PATH)') from e
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
        CheckpointError: If ``last_checkpoint`` names a missing or unreadable file.
    """
    marker = osp.join(work_dir, 'last_checkpoint')
    if not osp.isfile(marker):
        return None
    with open(marker) as f:
        last = f.read().strip()
    try:
        return check_checkpoint(last, f'latest checkpoint (from {marker})', kind='resume')
    except CheckpointError as e:
        others = sorted(
            (osp.join(work_dir, name) for name in os.listdir(work_dir)
             if name.endswith('.pth') and osp.join(work_dir, name) != last),
            key=osp.getmtime, reverse=True)
        hint = (f' Other checkpoints in {work_dir}, newest first: {others[:5]}; resume from '
                f'one with --resume PATH.' if others else
                f' No other checkpoint exists in {work_dir}; start again without --resume.')
        raise CheckpointError(str(e) + hint) from e
