"""mmengine's ``CheckpointHook``, with nothing lost when a save is interrupted.

mmengine 0.10's ``CheckpointHook._save_checkpoint_with_step``

1. deletes the checkpoint that ``max_keep_ckpts`` drops, *before* writing the new one;
2. writes the new checkpoint (``Runner.save_checkpoint``) in place;
3. rewrites ``WORK_DIR/last_checkpoint`` in place (``open(..., 'w')``).

A job killed during 2 leaves a checkpoint cut short under the final name and, with
``max_keep_ckpts=1``, no complete checkpoint at all; killed during 3, an empty ``last_checkpoint``,
so a bare ``--resume`` has nothing to resume from. :class:`SafeCheckpointHook` (select it with
``default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook', ...))``, as the XCiT configs
do) writes the checkpoint to ``NAME.tmp``, flushes and renames it, only then deletes the one
dropped, and replaces ``last_checkpoint`` atomically. At every moment the work dir holds the
previous complete checkpoint and a ``last_checkpoint`` that names a complete file. A failed write
(full disk...) is a :class:`CheckpointSaveError` naming the file and the free space.
"""
import errno
import glob
import os
import os.path as osp
import shutil

from mmengine.dist import is_main_process
from mmengine.hooks import CheckpointHook, Hook
from mmengine.registry import HOOKS

TMP_SUFFIX = '.tmp'


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


def fsync_dir(path: str) -> None:
    """Make a rename in directory ``path`` durable (best effort: not every file system can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomically(path: str, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: readers see the old or the new content."""
    tmp = path + TMP_SUFFIX
    with open(tmp, 'w') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(osp.dirname(osp.abspath(path)))


def is_local(file_backend) -> bool:
    from mmengine.fileio.backends import LocalBackend
    return isinstance(file_backend, LocalBackend)


@HOOKS.register_module()
class SafeCheckpointHook(CheckpointHook):
    """``CheckpointHook`` that writes the new checkpoint before deleting the one
    ``max_keep_ckpts`` drops, and replaces ``last_checkpoint`` atomically.

    Same arguments and checkpoints as mmengine's ``CheckpointHook``; configs select it with
    ``default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook', ...))`` or, from
    ``custom_hooks``, :class:`AtomicCheckpointHook`. Also removes, at the start of training,
    ``*.pth.tmp`` files that an interrupted save left behind.
    """

    def before_train(self, runner) -> None:
        super().before_train(runner)
        if not is_main_process() or not is_local(self.file_backend):
            return
        for stale in sorted(glob.glob(osp.join(glob.escape(str(self.out_dir)),
                                               '*' + TMP_SUFFIX))):
            if stale.endswith(('.pth' + TMP_SUFFIX, 'last_checkpoint' + TMP_SUFFIX)):
                os.remove(stale)
                runner.logger.warning(f'Removed {stale}: an incomplete checkpoint left by a save '
                                      f'that was interrupted.')

    def _save_atomically(self, runner, filename: str, meta) -> None:
        """``runner.save_checkpoint`` into ``NAME.tmp``, flushed, then renamed to ``NAME``
        (atomic on POSIX file systems). Remote destinations are written by mmengine as before."""
        def save(name):
            runner.save_checkpoint(
                self.out_dir, name, self.file_client_args, save_optimizer=self.save_optimizer,
                save_param_scheduler=self.save_param_scheduler, meta=meta, by_epoch=self.by_epoch,
                backend_args=self.backend_args, **self.args)

        if not is_local(self.file_backend):
            return save(filename)
        final = osp.join(self.out_dir, filename)
        tmp = final + TMP_SUFFIX
        try:
            save(filename + TMP_SUFFIX)
            if is_main_process():
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
        if is_main_process():
            fsync_dir(osp.dirname(osp.abspath(final)))

    def _save_checkpoint_with_step(self, runner, step, meta):
        dropped = None
        if self.max_keep_ckpts > 0:
            # _save_checkpoint and _save_best_checkpoint may both save at this step
            if not (len(self.keep_ckpt_ids) > 0 and self.keep_ckpt_ids[-1] == step):
                if len(self.keep_ckpt_ids) == self.max_keep_ckpts:
                    dropped = self.keep_ckpt_ids.popleft()
                self.keep_ckpt_ids.append(step)
                runner.message_hub.update_info('keep_ckpt_ids', list(self.keep_ckpt_ids))

        ckpt_filename = self.filename_tmpl.format(step)
        self.last_ckpt = self.file_backend.join_path(self.out_dir, ckpt_filename)
        runner.message_hub.update_info('last_ckpt', self.last_ckpt)

        self._save_atomically(runner, ckpt_filename, meta)

        if not is_main_process():
            return
        write_text_atomically(osp.join(runner.work_dir, 'last_checkpoint'), self.last_ckpt)
        # Only now that a newer complete checkpoint exists, delete the one dropped.
        if dropped is not None and dropped != step:
            path = self.file_backend.join_path(self.out_dir, self.filename_tmpl.format(dropped))
            if self.file_backend.isfile(path):
                self.file_backend.remove(path)
            elif self.file_backend.isdir(path):  # checkpoints saved by deepspeed are directories
                self.file_backend.rmtree(path)


@HOOKS.register_module()
class AtomicCheckpointHook(Hook):
    """Switches the run's checkpoints to :class:`SafeCheckpointHook` from ``custom_hooks``.

    mmengine refuses a key that two bases of one ``_base_`` list define, and every runtime base
    defines ``default_hooks``, so ``configs/_base_/training_extras.py`` cannot select the
    checkpoint hook there. This hook does it before the run: the stock ``CheckpointHook`` built
    from ``default_hooks.checkpoint`` is replaced, in its place and with the same settings, by a
    :class:`SafeCheckpointHook`. A checkpoint hook of any other class is left as it is.
    """

    priority = 'VERY_HIGH'

    def before_run(self, runner) -> None:
        for index, hook in enumerate(runner.hooks):
            if type(hook) is CheckpointHook:
                args = dict(runner.cfg.get('default_hooks', {}).get('checkpoint') or {})
                for registry_key in ('type', '_scope_', 'priority'):
                    args.pop(registry_key, None)
                safe = SafeCheckpointHook(**args)
                safe.priority = hook.priority
                runner.hooks[index] = safe
