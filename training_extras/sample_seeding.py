"""Training samples with their own random numbers, and bad files named by path and index.

mmengine seeds a dataloader worker once, with ``num_workers * rank + worker_id + seed``; the epoch
is not part of it. So, with the random augmentations of the paper configs (flips, multi-scale
resizes, crops, photometric distortion):

- non-persistent workers are re-created, and re-seeded identically, every epoch: every epoch draws
  the random numbers of the first one again (the images differ only by the shuffle);
- persistent workers keep their generators, but a resumed epoch-based run starts new workers from
  the seed, where the uninterrupted run's workers had advanced: it draws other augmentations.

Here the random numbers of a sample do not depend on which process loads it, or when:

- :class:`SampleKeyBatchSampler` (main process) turns every index into a :class:`SampleKey`
  carrying ``(seed, rank, epoch, position)``, where ``position`` counts the samples this rank has
  drawn in the epoch (for an infinite sampler: since the start of training) and ``epoch`` is the
  sampler's epoch (set before every epoch by mmengine's ``DistSamplerSeedHook``; samplers without
  one count their passes).
- :class:`SeededSampleDataset` (wherever the sample is loaded: a worker, persistent or not, or the
  main process) seeds Python's, NumPy's and torch's generators from the key, runs the dataset's
  pipeline, and puts the generators back as they were (so, with ``num_workers=0``, loading data
  does not move the training process's random stream).

Every epoch therefore draws new augmentations, and a resumed run draws exactly those of an
uninterrupted one, with any ``num_workers`` / ``persistent_workers``. Even the number of workers
does not change what is drawn.

:class:`SeededSampleDataset` also names the sample that cannot be loaded (a missing or unreadable
image halfway through an epoch): :class:`SampleLoadError` gives its index and file paths, instead of
a traceback relayed from a worker process. With ``on_bad_sample='skip'`` the sample is replaced by
the next loadable one and the replacement is recorded, so that the training loop can count it
(``SkippedSamplesHook``).

:class:`~training_extras.hooks.SampleSeedingHook` applies both to the training dataloader (see
:func:`seeded_train_dataloader`); its ``on_bad_sample='skip'`` skips unreadable samples.
"""
import random
from collections import namedtuple
from contextlib import contextmanager
from typing import List, Optional

import numpy as np
import torch
from mmengine.dist import get_rank
from mmengine.registry import DATA_SAMPLERS, DATASETS

# What the batch sampler hands the dataset in place of an index: the index, and the entropy of
# its random numbers (seed, rank, epoch, position).
SampleKey = namedtuple('SampleKey', ['index', 'entropy'])

# Metainfo key under which a replacement sample records the samples it replaced.
SKIPPED_KEY = 'skipped_bad_samples'
ON_BAD_SAMPLE = ('error', 'skip')


class SampleLoadError(RuntimeError):
    """A training sample could not be loaded; the message names its index and files.

    Raised in a dataloader worker, torch re-raises it in the main process with the worker's
    traceback prepended; the message is reduced to the original one again here, and the relayed
    text is kept in :attr:`worker_traceback`.
    """

    def __init__(self, text: str = ''):
        self.worker_traceback = None
        if 'Original Traceback' in text:  # re-raised by torch from a worker process
            self.worker_traceback = text
            marker = f'{type(self).__name__}: '
            text = text.rsplit(marker, 1)[-1].strip() if marker in text else text
        super().__init__(text)


def _entropy_seeds(entropy) -> tuple:
    """(numpy seed words, a 63-bit int for Python and torch) derived from ``entropy``."""
    words = np.random.SeedSequence([int(v) % (1 << 63) for v in entropy]).generate_state(
        4, np.uint32)
    return words, (int(words[0]) << 31) ^ (int(words[1]) << 1) ^ int(words[2])


@contextmanager
def seeded_random_state(entropy):
    """Seed Python's, NumPy's and torch's generators from ``entropy`` inside the block, and put
    the previous states back afterwards."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    words, number = _entropy_seeds(entropy)
    random.seed(number)
    np.random.seed(words)
    torch.manual_seed(number)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


@DATA_SAMPLERS.register_module()
class SampleKeyBatchSampler:
    """Batches of :class:`SampleKey` (index + random-number entropy) instead of indices.

    Args:
        sampler: The index sampler (mmengine's ``DefaultSampler`` / ``InfiniteSampler``...).
        batch_size (int): Samples per batch (for the default batching).
        batch_sampler (dict, optional): A batch sampler config to wrap (e.g. mmdet's
            ``AspectRatioBatchSampler``); built with ``sampler`` and ``batch_size``. By default,
            torch's ``BatchSampler``, as ``DataLoader`` would build it.
        drop_last (bool): For the default batching, as ``DataLoader``'s ``drop_last``.
        seed (int): The run's seed (``runner.seed``).
        rank (int, optional): This process's rank; read from the process group by default.
    """

    def __init__(self, sampler, batch_size: int, batch_sampler: Optional[dict] = None,
                 drop_last: bool = False, seed: int = 0, rank: Optional[int] = None):
        if batch_sampler is None:
            self.batch_sampler = torch.utils.data.BatchSampler(sampler, batch_size, drop_last)
        elif isinstance(batch_sampler, dict):
            self.batch_sampler = DATA_SAMPLERS.build(
                batch_sampler, default_args=dict(sampler=sampler, batch_size=batch_size))
        else:
            self.batch_sampler = batch_sampler
        # mmengine's DistSamplerSeedHook sets the epoch on `dataloader.batch_sampler.sampler`.
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.seed = int(seed or 0)
        if rank is None:
            rank = get_rank()
        self.rank = int(rank)
        self._passes = 0  # for samplers without an epoch

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the index sampler (shuffle and augmentation seeds follow it)."""
        if hasattr(self.sampler, 'set_epoch'):
            self.sampler.set_epoch(epoch)

    def _epoch(self) -> int:
        epoch = getattr(self.sampler, 'epoch', None)
        if isinstance(epoch, int):
            return epoch
        return self._passes - 1

    def __iter__(self):
        self._passes += 1
        epoch, position = self._epoch(), 0
        for batch in self.batch_sampler:
            keys = []
            for index in batch:
                keys.append(SampleKey(index, (self.seed, self.rank, epoch, position)))
                position += 1
            yield keys

    def __len__(self) -> int:
        return len(self.batch_sampler)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere)."""
    try:
        import ctypes
        import signal
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def worker_init_fn(worker_id: int, num_workers: int, rank: int, seed: Optional[int],
                   disable_subprocess_warning: bool = False) -> None:
    """mmengine's worker seeding, and the worker dies with the training process.

    A worker forked by a distributed rank holds copies of that rank's sockets: if the rank is
    killed, the other ranks only see the connection close once its workers have exited, and torch's
    workers notice that their parent is gone only every 5 s. With this, they die at once.
    """
    _die_with_parent()
    if seed is not None:
        from mmengine.dataset import worker_init_fn as mmengine_worker_init_fn
        mmengine_worker_init_fn(worker_id, num_workers, rank, seed, disable_subprocess_warning)


def _describe(dataset, index) -> str:
    """The file paths of sample ``index`` (``img_path``, ``seg_map_path``...), for messages."""
    try:
        info = dataset.get_data_info(index)
    except Exception:  # noqa: BLE001 - only for the message
        return 'files unknown'
    paths = [f'{k}={v}' for k, v in sorted(info.items())
             if k.endswith(('_path', 'file_name')) and isinstance(v, str)]
    return ', '.join(paths) or 'files unknown'


def _one_line(error: BaseException) -> str:
    text = ' '.join(str(error).split())
    return f'{type(error).__name__}: {text[:300]}' if text else type(error).__name__


@DATASETS.register_module()
class SeededSampleDataset:
    """Loads a sample under random numbers seeded by its :class:`SampleKey`; names bad samples.

    Plain integer indices load as with the wrapped dataset (no seeding), so anything that reads
    the dataset directly is unaffected. Attributes not defined here (``metainfo``,
    ``get_data_info``, ``pipeline``...) are those of the wrapped dataset.

    Args:
        dataset (dict | Dataset): The dataset (config) to wrap.
        on_bad_sample (str): ``'error'`` (default): a sample that cannot be loaded stops training
            with :class:`SampleLoadError`, naming its index and files. ``'skip'``: it is replaced
            by the next loadable sample (in index order, at most ``max_skip_tries`` tried), and the
            replacement's ``metainfo[SKIPPED_KEY]`` records what was skipped and why.
        max_skip_tries (int): With ``'skip'``, how many following samples are tried.
    """

    def __init__(self, dataset, on_bad_sample: str = 'error', max_skip_tries: int = 16):
        if on_bad_sample not in ON_BAD_SAMPLE:
            raise ValueError(f'on_bad_sample must be one of {ON_BAD_SAMPLE}, got '
                             f'{on_bad_sample!r}')
        if isinstance(dataset, dict):
            dataset = DATASETS.build(dataset)
        self.dataset = dataset
        self.on_bad_sample = on_bad_sample
        self.max_skip_tries = max_skip_tries

    def __deepcopy__(self, memo):
        """A new wrapper around the same dataset: mmengine deep-copies a dataloader config
        before building it, and the built dataset (all its annotations) is read-only here."""
        return type(self)(self.dataset, self.on_bad_sample, self.max_skip_tries)

    def full_init(self) -> None:
        if hasattr(self.dataset, 'full_init'):
            self.dataset.full_init()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):
        if name == 'dataset':  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key):
        if isinstance(key, SampleKey):
            with seeded_random_state(key.entropy):
                return self._load(key.index)
        return self._load(key)

    def _name(self) -> str:
        return type(self.dataset).__name__

    def _load(self, index: int):
        try:
            return self.dataset[index]
        except Exception as error:  # noqa: BLE001 - reported with the sample's files
            if self.on_bad_sample == 'error':
                raise SampleLoadError(
                    f'Cannot load training sample {index} of {self._name()} '
                    f'({_describe(self.dataset, index)}): {_one_line(error)}. Fix or remove the '
                    f'file (then the annotations), or skip unreadable samples with '
                    f"SampleSeedingHook(on_bad_sample='skip') in custom_hooks.") from error
            skipped = [dict(index=int(index), files=_describe(self.dataset, index),
                            reason=_one_line(error))]
        size = len(self.dataset)
        for step in range(1, min(self.max_skip_tries, size - 1) + 1):
            other = (index + step) % size
            try:
                data = self.dataset[other]
            except Exception as error:  # noqa: BLE001
                skipped.append(dict(index=int(other), files=_describe(self.dataset, other),
                                    reason=_one_line(error)))
                continue
            _record_skipped(data, skipped)
            return data
        raise SampleLoadError(
            f'Cannot load training sample {index} of {self._name()}, nor the '
            f'{len(skipped) - 1} samples after it (on_bad_sample=skip): '
            + '; '.join(f'{s["index"]} ({s["files"]}): {s["reason"]}' for s in skipped))


def _record_skipped(data, skipped: List[dict]) -> None:
    """Attach ``skipped`` to the data sample(s) packed in ``data`` (mmdet / mmseg layouts)."""
    samples = data.get('data_samples') if isinstance(data, dict) else None
    if samples is None:
        return
    for sample in samples if isinstance(samples, (list, tuple)) else [samples]:
        if hasattr(sample, 'set_metainfo'):
            sample.set_metainfo({SKIPPED_KEY: list(skipped)})
            return


def skipped_in_batch(data_batch) -> List[dict]:
    """The skipped-sample records carried by a collated training batch (see ``on_bad_sample``)."""
    samples = data_batch.get('data_samples') if isinstance(data_batch, dict) else None
    found = []
    for sample in samples or []:
        metainfo = getattr(sample, 'metainfo', None) or {}
        found.extend(metainfo.get(SKIPPED_KEY, []))
    return found


def seeded_train_dataloader(dataloader_cfg: dict, seed: int) -> dict:
    """The training dataloader config with :class:`SeededSampleDataset` and
    :class:`SampleKeyBatchSampler` around the configured dataset and batch sampler.

    Its workers die with the training process (:func:`worker_init_fn`, otherwise mmengine's).
    The dataloader also gets its own ``generator``: torch draws a base seed for the workers from
    it whenever it creates an iterator, which otherwise comes from the global torch generator.
    With persistent workers the iterator is created once, in the first epoch *of the process*:
    a run resumed in epoch 3 would draw one number more from the global generator than the
    uninterrupted run, and its drop-path masks and RoI samples would differ from there on.

    Keys read (and removed) from ``dataloader_cfg``: ``sample_seeding`` (default True; False
    leaves the config as mmengine's, with per-worker seeds) and ``on_bad_sample`` (``'error'``,
    default, or ``'skip'``). A built dataset is wrapped as it is; a built batch sampler is left
    alone.

    Args:
        dataloader_cfg (dict): ``train_dataloader`` of the config (not modified).
        seed (int): The run's seed (``runner.seed``).

    Returns:
        dict: The config to build the dataloader from.
    """
    cfg = dict(dataloader_cfg)
    if cfg.get('generator') is None:
        _, number = _entropy_seeds((int(seed or 0), get_rank(), 1 << 40))
        cfg['generator'] = torch.Generator().manual_seed(number)
    if cfg.get('worker_init_fn') is None and cfg.get('num_workers', 0) > 0:
        cfg['worker_init_fn'] = dict(
            type=worker_init_fn, num_workers=cfg['num_workers'], rank=get_rank(), seed=seed,
            disable_subprocess_warning=cfg.pop('disable_subprocess_warning', False))
    enabled = cfg.pop('sample_seeding', True)
    on_bad_sample = cfg.pop('on_bad_sample', 'error')
    if on_bad_sample not in ON_BAD_SAMPLE:
        raise ValueError(f'train_dataloader.on_bad_sample must be one of {ON_BAD_SAMPLE}, got '
                         f'{on_bad_sample!r}')
    dataset = cfg.get('dataset')
    if isinstance(dataset, dict):
        cfg['dataset'] = dict(type=SeededSampleDataset, dataset=dataset,
                              on_bad_sample=on_bad_sample)
    elif dataset is not None:  # built (by the Runner): wrapped as it is
        cfg['dataset'] = SeededSampleDataset(unwrap_dataset(dataset), on_bad_sample=on_bad_sample)
    if not enabled:
        return cfg
    batch_sampler = cfg.get('batch_sampler')
    if batch_sampler is not None and not isinstance(batch_sampler, dict):
        return cfg
    cfg['batch_sampler'] = dict(type=SampleKeyBatchSampler, batch_sampler=batch_sampler,
                                drop_last=cfg.pop('drop_last', False), seed=seed)
    return cfg


def unwrap_dataset(dataset):
    """The dataset inside :class:`SeededSampleDataset` (or ``dataset`` itself)."""
    return dataset.dataset if isinstance(dataset, SeededSampleDataset) else dataset


__all__ = [
    'SKIPPED_KEY', 'SampleKey', 'SampleKeyBatchSampler', 'SampleLoadError',
    'SeededSampleDataset', 'seeded_random_state', 'seeded_train_dataloader', 'skipped_in_batch',
    'unwrap_dataset'
]
