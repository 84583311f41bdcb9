"""The Runner the XCiT configs use, and what the tools add to a config before building it."""
import errno
import os
import os.path as osp
import shutil
from typing import Callable, Optional, Union

import torch
from mmengine.dist import master_only
from mmengine.hooks import CheckpointHook
from mmengine.model import is_model_wrapper
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

from xcit_mm.datasets.sample_seeding import seeded_train_dataloader
from xcit_mm.models.utils.ckpt_load import is_released_layout, load_model_state_dict
from xcit_mm.utils.checkpoint_io import extract_state_dict, load_checkpoint_file

from .hooks.safe_checkpoint_hook import TMP_SUFFIX, SafeCheckpointHook, fsync_dir
from .hooks.skipped_samples_hook import SkippedSamplesHook


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (full disk, quota, permissions...).

    The message names the file, the free space of its directory and the earlier checkpoints,
    which are left intact.
    """


def _human(size: float) -> str:
    for unit in ('B', 'KB', 'MB', 'GB'):
        if size < 1024:
            return f'{size:.0f} {unit}' if unit == 'B' else f'{size:.1f} {unit}'
        size /= 1024
    return f'{size:.1f} TB'


def _save_error_message(path: str, error: BaseException) -> str:
    directory = osp.dirname(osp.abspath(path))
    try:
        free = _human(shutil.disk_usage(directory).free)
    except OSError:
        free = 'unknown'
    full = getattr(error, 'errno', None) in (errno.ENOSPC, errno.EDQUOT) or \
        'No space left' in str(error)
    earlier = sorted((osp.join(directory, n) for n in os.listdir(directory)
                      if n.endswith('.pth')), key=osp.getmtime, reverse=True) \
        if osp.isdir(directory) else []
    kept = 'No earlier checkpoint exists.'
    if earlier:
        kept = f'The earlier checkpoints are intact ({", ".join(earlier[:3])}).'
        try:
            with open(osp.join(directory, 'last_checkpoint')) as f:
                last = f.read().strip()
            kept += (f' last_checkpoint names {last}, so tools/train.py CONFIG --resume '
                     f'continues from it.')
        except OSError:
            pass
    cause = 'the disk is full' if full else 'the file could not be written'
    return (f'Cannot save checkpoint {path}: {cause} ({type(error).__name__}: {error}). Free '
            f'space on {directory}: {free}. Nothing was written under that name. {kept} Free '
            f'some space (or keep fewer checkpoints: default_hooks.checkpoint.max_keep_ckpts) '
            f'and resume.')


RELIABILITY_HOOKS = ('CheckFiniteLossHook', 'RandomStateHook')


@RUNNERS.register_module()
class XCiTRunner(Runner):
    """mmengine's ``Runner`` whose ``load_from`` / ``--resume`` loading is safe and strict.

    mmengine 0.10 loads whole-model checkpoints non-strictly (a key mismatch is a warning, the
    affected modules stay random), unpickles downloaded URLs without ``weights_only``, and cannot
    read its own checkpoints under torch >= 2.6's ``weights_only`` default. This runner reads
    every file through :func:`xcit_mm.utils.checkpoint_io.load_checkpoint_file`, converts the
    released XCiT COCO / ADE20k layouts in memory (no separate conversion step), and loads the
    whole model strictly. The XCiT configs select it with ``runner_type = 'XCiTRunner'``, so
    upstream ``mmdet`` / ``mmseg`` ``tools/train.py`` and ``tools/test.py`` use it too.

    It also makes long runs survive faults (docs/reliability.md):

    - the training dataloader gives every sample random numbers of its own, seeded by (seed,
      rank, epoch, position), whichever worker loads it: every epoch draws new augmentations,
      and ``--resume`` continues exactly, with any ``num_workers`` / ``persistent_workers``; a
      sample that cannot be loaded is named by index and file (:meth:`build_train_loop`);
    - a checkpoint appears under its name only once complete, a full disk is an error naming
      the file and the free space (:meth:`save_checkpoint`), and ``CheckpointHook`` becomes
      :class:`~xcit_mm.engine.hooks.SafeCheckpointHook` (old checkpoints deleted only after the
      new one is written, ``last_checkpoint`` replaced atomically);
    - dataloader workers are shut down when training or testing ends, also after an error.
    """

    def _maybe_compile(self, target: str) -> None:
        """``compile=True``: compile the feature extractor, not mmengine's whole train step.

        mmengine compiles ``train_step``, optimizer step included, and dynamo (torch 2.13) fails
        in ``AdamW.step`` on mmengine's ``ConfigDict`` parameter groups. The backbone and neck
        (``extract_feat`` of mmdet's and mmseg's models) hold nearly all the FLOPs and compile as
        one graph without breaks (tests/test_compile.py); heads, losses and the optimizer stay
        eager. Models without ``extract_feat`` get mmengine's behaviour.
        """
        compile_cfg = self.cfg.get('compile', None)
        if not compile_cfg:
            return
        compile_cfg = {} if compile_cfg is True else dict(compile_cfg)
        model = self.model.module if is_model_wrapper(self.model) else self.model
        if not hasattr(model, 'extract_feat'):
            return super()._maybe_compile(target)
        if not getattr(model, '_xcit_compiled', False):  # train_step then val_step: once
            model.extract_feat = torch.compile(model.extract_feat, **compile_cfg)
            model._xcit_compiled = True
            self.logger.info('compile: torch.compile of the feature extractor (backbone + neck); '
                             'the first iterations of each input size are slow.')

    def load_checkpoint(self,
                        filename: str,
                        map_location: Union[str, Callable] = 'cpu',
                        strict: bool = True,
                        revise_keys: list = [(r'^module.', '')]):
        """Load ``filename`` into the model, strictly; return the checkpoint dict.

        ``strict`` and ``revise_keys`` are accepted for mmengine's signature: loading is always
        strict (a mismatch is a :class:`~xcit_mm.utils.checkpoint_io.CheckpointError`) and a DDP
        ``module.`` prefix is always removed.
        """
        checkpoint = load_checkpoint_file(filename, 'checkpoint', map_location=map_location)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        model = self.model.module if is_model_wrapper(self.model) else self.model
        report = load_model_state_dict(model, extract_state_dict(checkpoint, str(filename)),
                                       source=str(filename))
        self._has_loaded = True
        layout = (f' (released {report["layout"]} layout, converted in memory)'
                  if is_released_layout(report['layout']) else '')
        self.logger.info(f'Load checkpoint from {filename}{layout}: {report["loaded"]} tensors, '
                         f'strict')
        return checkpoint

    # ------------------------------------------------------------------ reliable data
    def build_train_loop(self, loop):
        """Build the training loop; its dataloader gives every sample its own random numbers.

        The dataset and batch sampler of ``train_dataloader`` are wrapped (see
        :func:`xcit_mm.datasets.sample_seeding.seeded_train_dataloader`): each sample's
        augmentation is seeded by (seed, rank, epoch, position), whichever worker loads it, so
        every epoch draws new augmentations and a resumed run draws those of an uninterrupted one;
        a sample that cannot be loaded is named by index and path (or skipped, with
        ``train_dataloader.on_bad_sample='skip'``, counted by :class:`SkippedSamplesHook`).
        """
        if isinstance(self._train_dataloader, dict):
            skip = self._train_dataloader.get('on_bad_sample') == 'skip'
            self._train_dataloader = seeded_train_dataloader(self._train_dataloader, self.seed)
            if skip and not any(isinstance(h, SkippedSamplesHook) for h in self._hooks):
                self.register_hook(SkippedSamplesHook())
        return super().build_train_loop(loop)

    def train(self):
        """Train; the dataloader workers are shut down on the way out, also after an error.

        Otherwise a persistent worker's iterator is freed by the garbage collector (the Runner is
        full of reference cycles), and the collector runs the finalizers of its queues *before*
        the iterator's own: the queues stop feeding the workers, the shutdown message never
        reaches them, and torch waits 5 s per worker before killing it.
        """
        try:
            return super().train()
        finally:
            self.shutdown_dataloader_workers()

    def test(self):
        """Test; dataloader workers are shut down on the way out (see :meth:`train`)."""
        try:
            return super().test()
        finally:
            self.shutdown_dataloader_workers()

    def shutdown_dataloader_workers(self) -> None:
        """Stop the worker processes of every dataloader of the built loops, now."""
        for name in ('_train_loop', '_val_loop', '_test_loop'):
            loop = getattr(self, name, None)
            if isinstance(loop, dict) or loop is None:
                continue
            iterators = [getattr(getattr(loop, 'dataloader_iterator', None), '_iterator', None)]
            dataloader = getattr(loop, 'dataloader', None)
            iterators.append(getattr(dataloader, '_iterator', None))
            for iterator in iterators:
                if hasattr(iterator, '_shutdown_workers'):
                    iterator._shutdown_workers()
            if dataloader is not None and getattr(dataloader, '_iterator', None) is not None:
                dataloader._iterator = None  # a later epoch starts new workers

    # ------------------------------------------------------------------ reliable saving
    def register_hook(self, hook, priority=None) -> None:
        """Register ``hook``; mmengine's ``CheckpointHook`` becomes :class:`SafeCheckpointHook`
        (new checkpoint written before the old one is deleted, ``last_checkpoint`` replaced
        atomically)."""
        if isinstance(hook, dict) and hook.get('type') in ('CheckpointHook', CheckpointHook):
            hook = dict(hook, type=SafeCheckpointHook)
        super().register_hook(hook, priority)

    @master_only
    def save_checkpoint(self, out_dir: str, filename: str, file_client_args: Optional[dict] = None,
                        save_optimizer: bool = True, save_param_scheduler: bool = True,
                        meta: Optional[dict] = None, by_epoch: bool = True,
                        backend_args: Optional[dict] = None):
        """As mmengine's, but a local checkpoint appears under its name only when complete.

        The file is written to ``NAME.tmp``, flushed to disk and renamed (atomic on POSIX file
        systems): a job killed while saving leaves at most a ``.tmp`` file, never a truncated
        checkpoint under the final name. A failed write (full disk...) removes the ``.tmp`` and
        raises :class:`CheckpointSaveError` naming the file and the free space. Remote
        (``backend_args``) destinations are written by mmengine as before.
        """
        args = (file_client_args, save_optimizer, save_param_scheduler, meta, by_epoch,
                backend_args)
        if file_client_args is not None or backend_args is not None or '://' in str(out_dir):
            return super().save_checkpoint(out_dir, filename, *args)
        final = osp.join(out_dir, filename)
        tmp = final + TMP_SUFFIX
        try:
            super().save_checkpoint(out_dir, filename + TMP_SUFFIX, *args)
            with open(tmp, 'rb+') as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException as error:
            try:
                os.remove(tmp)
            except OSError:
                pass
            # torch.save reports a failed write as a RuntimeError ("file write failed")
            if isinstance(error, OSError) or (isinstance(error, RuntimeError)
                                              and 'write' in str(error).lower()):
                raise CheckpointSaveError(_save_error_message(final, error)) from error
            raise
        fsync_dir(osp.dirname(osp.abspath(final)))


def ensure_reliability_hooks(cfg) -> list:
    """Add :data:`RELIABILITY_HOOKS` to ``cfg.custom_hooks`` unless the config has them.

    Args:
        cfg (mmengine.Config): The full config; modified in place.

    Returns:
        list[str]: The hook types that were added.
    """
    hooks = list(cfg.get('custom_hooks', None) or [])
    present = {getattr(h.get('type'), '__name__', h.get('type')) for h in hooks
               if isinstance(h, dict)}
    added = [name for name in RELIABILITY_HOOKS if name not in present]
    cfg.custom_hooks = hooks + [dict(type=name) for name in added]
    return added


def build_runner(cfg):
    """The Runner a config asks for: :class:`XCiTRunner` unless it sets ``runner_type``.

    Args:
        cfg (mmengine.Config): The full config.

    Returns:
        mmengine.runner.Runner: The built runner.
    """
    if 'runner_type' not in cfg:
        return XCiTRunner.from_cfg(cfg)
    return RUNNERS.build(cfg)
