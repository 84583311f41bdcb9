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

    With ``follow_config=True`` (how ``configs/_base_/training_extras.py`` adds it) the hook does
    nothing unless the config says ``compile=True`` (or ``compile=dict(...)``, the arguments of
    ``torch.compile``); it then compiles the feature extractor with those arguments and takes
    ``compile`` out of the runner's config, so that mmengine does not also compile the whole
    train step. So ``--cfg-options compile=True`` works with mmengine's Runner and with mmdet's /
    mmseg's own tools.

    Args:
        follow_config (bool): Compile only when the runner's config sets ``compile``.
        **compile_kwargs: Arguments of ``torch.compile`` (``backend``, ``mode``...). ``dynamic``
            defaults to False: torch 2.13's inductor fails on training graphs of symbolic image
            sizes, and recompiles per size even where they compile (docs/deployment.md). So each
            new size compiles once, up to dynamo's ``recompile_limit`` sizes, after which dynamo
            runs new sizes eager.
    """

    priority = 'VERY_HIGH'

    def __init__(self, follow_config: bool = False, **compile_kwargs) -> None:
        self.follow_config = follow_config
        self.compile_kwargs = dict(dict(dynamic=False), **compile_kwargs)

    def _requested_kwargs(self, runner):
        """The torch.compile arguments to use, or None to leave the model eager."""
        if not self.follow_config:
            return self.compile_kwargs
        cfg = getattr(runner, 'cfg', None)
        requested = cfg.get('compile', None) if cfg is not None else None
        if not requested:
            return None
        if requested is not True and not isinstance(requested, dict):
            raise TypeError(f'compile must be True or a dict of torch.compile arguments, got '
                            f'{requested!r}')
        cfg['compile'] = None  # mmengine would compile the whole train step on top
        return dict(self.compile_kwargs, **(requested if isinstance(requested, dict) else {}))

    def before_run(self, runner) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        if getattr(model, '_xcit_compiled', False):
            return
        kwargs = self._requested_kwargs(runner)
        if kwargs is None:
            return
        if not hasattr(model, 'extract_feat'):
            raise TypeError(f'CompileFeatureExtractorHook: {type(model).__name__} has no '
                            f'extract_feat; use mmengine\'s compile=True for this model')
        model.extract_feat = torch.compile(model.extract_feat, **kwargs)
        model._xcit_compiled = True
        runner.logger.info(f'CompileFeatureExtractorHook: torch.compile({kwargs}) of the feature '
                           'extractor (backbone + neck); the first iterations of each input '
                           'size are slow.')
