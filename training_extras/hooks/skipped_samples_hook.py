"""Count and report the training samples skipped as unreadable (``on_bad_sample='skip'``).

With ``SampleSeedingHook(on_bad_sample='skip')`` a sample whose files cannot be loaded is replaced
by the next loadable one (``training_extras.sample_seeding.SeededSampleDataset``), in whichever
process loads it; the replacement carries a record of what it replaced. This hook (the base class
of ``SampleSeedingHook``) reads those records from every training batch in the main process,
logs each skipped sample with its index, files and reason and counts them
(:attr:`SkippedSamplesHook.count`, per process, since this run started or resumed). At the end
of training it logs the total of all ranks.
"""
from mmengine.dist import all_reduce, get_world_size
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from training_extras.sample_seeding import skipped_in_batch


@HOOKS.register_module()
class SkippedSamplesHook(Hook):
    """Log every skipped training sample and count them (see the module docs)."""

    priority = 'NORMAL'

    def __init__(self) -> None:
        self.count = 0

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        skipped = skipped_in_batch(data_batch)
        if not skipped:
            return
        self.count += len(skipped)
        for record in skipped:
            runner.logger.warning(
                f'Skipped training sample {record["index"]} ({record["files"]}) at iteration '
                f'{runner.iter + 1}: {record["reason"]}. It was replaced by the next readable '
                f'sample ({self.count} skipped so far by this process; on_bad_sample=skip).')

    def after_train(self, runner) -> None:
        import torch
        count = torch.tensor([self.count])
        if get_world_size() > 1:
            all_reduce(count, op='sum')
        if int(count):
            runner.logger.warning(f'{int(count)} unreadable training sample(s) were skipped '
                                  f'(on_bad_sample=skip); see the warnings above.')
