"""``torch.compile`` of the feature extractor (backbone + neck) only, as a hook."""
import torch
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS


@HOOKS.register_module()
class CompileFeatureExtractorHook(Hook):
    """Compile ``model.extract_feat`` before training / testing; heads, losses and the
    optimizer stay eager.

    mmengine's ``compile=True`` compiles the whole ``train_step``, optimizer step included, and
    dynamo (torch 2.13) fails in ``AdamW.step`` on mmengine's ``ConfigDict`` parameter groups. The
    backbone and neck of mmdet's and mmseg's models hold nearly all the FLOPs and compile as one
    graph (tests/test_compile.py).

    Args:
        **compile_kwargs: Arguments of ``torch.compile`` (``backend``, ``mode``...). ``dynamic``
            defaults to False: torch 2.13's inductor fails on training graphs of symbolic image
            sizes (docs/deployment.md), so each new size compiles once, up to dynamo's
            ``cache_size_limit``, after which that size runs eager.
    """

    priority = 'VERY_HIGH'

    def __init__(self, **compile_kwargs) -> None:
        self.compile_kwargs = dict(dict(dynamic=False), **compile_kwargs)

    def before_run(self, runner) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        if not hasattr(model, 'extract_feat'):
            raise TypeError(f'CompileFeatureExtractorHook: {type(model).__name__} has no '
                            f'extract_feat; use mmengine\'s compile=True for this model')
        if not getattr(model, '_xcit_compiled', False):
            model.extract_feat = torch.compile(model.extract_feat, **self.compile_kwargs)
            model._xcit_compiled = True
            runner.logger.info('CompileFeatureExtractorHook: torch.compile of the feature '
                               'extractor (backbone + neck); the first iterations of each input '
                               'size are slow.')
