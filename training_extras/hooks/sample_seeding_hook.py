"""Give every training sample random numbers of its own; stop dataloader workers on the way out.

The training dataloader is rebuilt from the config before the first iteration, around the dataset
mmengine built (not loaded twice), by :func:`training_extras.sample_seeding.seeded_train_dataloader`
(fresh samplers: the first loader's iterator may have advanced shared sampler state already):
each sample's augmentation is seeded by (seed, rank, epoch, position), whichever worker loads it,
so every epoch draws new augmentations and a resumed run draws those of an uninterrupted one, with
any ``num_workers`` / ``persistent_workers``; a sample that cannot be loaded is named by index and
file, or skipped (``on_bad_sample='skip'``) and counted.
"""
from mmengine.registry import HOOKS

from ..sample_seeding import ON_BAD_SAMPLE, seeded_train_dataloader
from .skipped_samples_hook import SkippedSamplesHook


def shutdown_dataloader_workers(runner) -> None:
    """Stop the worker processes of every dataloader of the runner's built loops, now.

    Otherwise a persistent worker's iterator is freed by the garbage collector (the Runner is
    full of reference cycles), and the collector runs the finalizers of its queues *before* the
    iterator's own: the queues stop feeding the workers, the shutdown message never reaches them,
    and torch waits 5 s per worker before killing it.
    """
    for name in ('_train_loop', '_val_loop', '_test_loop'):
        loop = getattr(runner, name, None)
        if loop is None or isinstance(loop, dict):
            continue
        _shutdown(getattr(getattr(loop, 'dataloader_iterator', None), '_iterator', None))
        dataloader = getattr(loop, 'dataloader', None)
        if dataloader is not None and getattr(dataloader, '_iterator', None) is not None:
            _shutdown(dataloader._iterator)
            dataloader._iterator = None  # a later epoch starts new workers


def _shutdown(iterator) -> None:
    if hasattr(iterator, '_shutdown_workers'):
        iterator._shutdown_workers()


@HOOKS.register_module()
class SampleSeedingHook(SkippedSamplesHook):
    """Seed every training sample from (seed, rank, epoch, position) (see the module docs).

    Args:
        on_bad_sample (str): ``'error'`` (default): an unreadable sample stops training with a
            message naming it. ``'skip'``: it is replaced by the next readable one, and each
            replacement is logged and counted.
    """

    priority = 'VERY_HIGH'

    def __init__(self, on_bad_sample: str = 'error') -> None:
        super().__init__()
        if on_bad_sample not in ON_BAD_SAMPLE:
            raise ValueError(f'SampleSeedingHook: on_bad_sample must be one of {ON_BAD_SAMPLE}, '
                             f'got {on_bad_sample!r}')
        self.on_bad_sample = on_bad_sample

    def before_train(self, runner) -> None:
        loop = runner.train_loop
        # the config the Runner built the loader from (Runner.from_cfg keeps the whole config)
        cfg = runner.cfg.get('train_dataloader')
        if not isinstance(cfg, dict):
            runner.logger.warning('SampleSeedingHook: the training dataloader was given built, '
                                  'not as a config, so it cannot be rebuilt: left as it is.')
            return
        cfg = dict(cfg, dataset=loop.dataloader.dataset, on_bad_sample=self.on_bad_sample)
        restart = getattr(loop, 'dataloader_iterator', None)  # IterBasedTrainLoop's: started
        if restart is not None:
            _shutdown(getattr(restart, '_iterator', None))
        loop.dataloader = runner.build_dataloader(
            seeded_train_dataloader(cfg, runner.seed), seed=runner.seed,
            diff_rank_seed=(runner.cfg.get('randomness') or {}).get('diff_rank_seed', False))
        if restart is not None:
            loop.dataloader_iterator = type(restart)(loop.dataloader)

    def after_train(self, runner) -> None:
        super().after_train(runner)
        shutdown_dataloader_workers(runner)

    def after_test(self, runner) -> None:
        shutdown_dataloader_workers(runner)
