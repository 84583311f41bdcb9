"""Layer-wise learning-rate decay over XCiT's layers, which mmseg's
``LayerDecayOptimizerConstructor`` (ConvNeXt, BEiT, MAE) does not know, and a hook that logs
the lr of each depth (docs/layer_decay.md)."""
import logging
from typing import Dict, List, Optional, Tuple

import torch.nn as nn
from mmengine.hooks import Hook
from mmengine.logging import MMLogger, print_log
from mmengine.optim import DefaultOptimWrapperConstructor, OptimWrapperDict
from mmengine.registry import HOOKS, OPTIM_WRAPPER_CONSTRUCTORS

from xcit_mm.models.backbones.xcit import XCiTBackbone

# paramwise_cfg keys mmengine's DefaultOptimWrapperConstructor reads (mmengine 0.10).
MMENGINE_PARAMWISE_KEYS = ('bias_decay_mult', 'bias_lr_mult', 'bypass_duplicate', 'custom_keys',
                           'dcn_offset_lr_mult', 'dwconv_decay_mult', 'flat_decay_mult',
                           'norm_decay_mult')
DEPTH_KEY = 'layer_depth'


def _drop_base_rule_lines(record: logging.LogRecord) -> bool:
    """Drops mmengine's per-parameter lines (lrs before decay): the group table replaces them."""
    msg = str(record.msg)
    return not (msg.startswith('paramwise_options -- ')
                or msg.endswith(' is skipped since its requires_grad=False'))


def find_xcit_backbone(model: nn.Module) -> Tuple[str, XCiTBackbone]:
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, XCiTBackbone)]
    if not found:
        raise ValueError(
            f'XCiTLayerDecayOptimizerConstructor: the model ({type(model).__name__}) contains no '
            f'XCiTBackbone, so there are no XCiT layers to decay the learning rate over. Use it '
            f'with an XCiT backbone, or drop `constructor` from optim_wrapper (and `decay_rate` '
            f'from paramwise_cfg) for mmengine\'s default constructor.')
    if len(found) > 1:
        raise ValueError(
            f'XCiTLayerDecayOptimizerConstructor: the model ({type(model).__name__}) contains '
            f'{len(found)} XCiTBackbones ({", ".join(n or "<model>" for n, _ in found)}); the '
            f'layer depth of a parameter would be ambiguous.')
    return found[0]


def xcit_layer_depth(name: str, num_layers: int, backbone_prefix: str = 'backbone') -> int:
    """Layer depth of a parameter; an error for an unknown backbone part, which would otherwise
    train at the head's lr."""
    head = num_layers + 1
    prefix = f'{backbone_prefix}.' if backbone_prefix else ''
    if not name.startswith(prefix):
        return head
    parts = name[len(prefix):].split('.')
    if parts[0] in ('patch_embed', 'pos_embed'):
        return 0
    if parts[0] == 'layers' and len(parts) > 2 and parts[1].isdigit() \
            and int(parts[1]) < num_layers:
        return int(parts[1]) + 1
    if parts[0] in ('fpn1', 'fpn2', 'fpn3', 'fpn4'):
        return head
    raise ValueError(f'XCiTLayerDecayOptimizerConstructor: no layer depth is defined for the '
                     f'backbone parameter {name!r} (known: patch_embed.*, pos_embed.* -> 0, '
                     f'layers.{{i}}.* -> i + 1, fpn1..fpn4.* -> {head})')


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class XCiTLayerDecayOptimizerConstructor(DefaultOptimWrapperConstructor):
    """mmengine's rules, then each lr times ``decay_rate ** (L + 1 - depth)``: depth 0 the
    embeddings, ``i + 1`` layer ``i``, ``L + 1`` all after the trunk, as BEiT's decay."""

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg: Optional[dict] = None):
        name = 'XCiTLayerDecayOptimizerConstructor'
        if paramwise_cfg is not None and not isinstance(paramwise_cfg, dict):
            raise TypeError(f'{name}: paramwise_cfg must be a dict, '
                            f'got {type(paramwise_cfg).__name__}')
        base_cfg = dict(paramwise_cfg or {})
        valid = sorted(('decay_rate', ) + MMENGINE_PARAMWISE_KEYS)
        unknown = sorted(set(base_cfg) - set(valid))
        if unknown:
            hint = (' (num_layers is not a setting here: it is read from the model\'s '
                    'XCiTBackbone)') if 'num_layers' in unknown else ''
            raise KeyError(f'{name}: unknown paramwise_cfg key(s) {unknown}{hint}; '
                           f'valid keys: {valid}')
        if 'decay_rate' not in base_cfg:
            raise KeyError(f'{name}: paramwise_cfg needs `decay_rate` (e.g. 0.75); '
                           f'valid keys: {valid}')
        rate = base_cfg.pop('decay_rate')
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ValueError(f'{name}: decay_rate must be a number in (0, 1], got {rate!r}')
        self.decay_rate = float(rate)
        super().__init__(optim_wrapper_cfg, paramwise_cfg)
        if self.base_lr is None:
            raise ValueError(f'{name}: optim_wrapper.optimizer needs an explicit `lr` to scale')
        # mmengine's own rules, applied per parameter by an mmengine constructor (its add_params
        # recurses through self.add_params, which is overridden here).
        self._base_rules = DefaultOptimWrapperConstructor(optim_wrapper_cfg, base_cfg)

    def add_params(self, params: List[dict], module: nn.Module, prefix: str = '',
                   is_dcn_module=None) -> None:
        """Append the layer-decayed groups of all trainable parameters of ``module`` to
        ``params`` (``module`` is the whole model, as mmengine's ``__call__`` passes it)."""
        backbone_prefix, backbone = find_xcit_backbone(module)
        num_layers = backbone.num_layers
        head = num_layers + 1
        names = {id(param): name for name, param in module.named_parameters(prefix=prefix)}
        # mmengine's rules: one group per trainable parameter, with its lr / weight decay / ...
        per_param: List[dict] = []
        logger = MMLogger.get_current_instance()
        logger.addFilter(_drop_base_rule_lines)
        try:
            self._base_rules.add_params(per_param, module, prefix=prefix,
                                        is_dcn_module=is_dcn_module)
        finally:
            logger.removeFilter(_drop_base_rule_lines)
        # Layer decay on top, then one group per (depth, options).
        merged: Dict[tuple, dict] = {}
        sort_keys: Dict[tuple, tuple] = {}  # head first, a group without custom lr_mult first
        for order, group in enumerate(per_param):
            (param, ) = group['params']
            depth = xcit_layer_depth(names[id(param)], num_layers, backbone_prefix)
            options = {k: v for k, v in group.items() if k != 'params'}
            options.setdefault('lr', self.base_lr)
            if self.base_wd is not None:
                options.setdefault('weight_decay', self.base_wd)
            custom_lr = options['lr'] != self.base_lr
            options['lr'] = options['lr'] * self.decay_rate**(head - depth)
            options[DEPTH_KEY] = depth
            key = (depth, repr(sorted(options.items())))
            merged.setdefault(key, dict(params=[], **options))['params'].append(param)
            sort_keys.setdefault(key, (-depth, custom_lr, order))
        groups = [merged[key] for key in sorted(merged, key=sort_keys.get)]
        self._log_table(groups, module, backbone_prefix, num_layers)
        params.extend(groups)
        if groups and groups[0][DEPTH_KEY] != head:
            print_log(f'XCiTLayerDecayOptimizerConstructor: no trainable parameter after the XCiT '
                      f'trunk, so the logged `lr` is that of depth {groups[0][DEPTH_KEY]}',
                      logger='current', level=logging.WARNING)

    def _log_table(self, groups: List[dict], model: nn.Module, backbone_prefix: str,
                   num_layers: int) -> None:
        head = num_layers + 1
        where = f'{backbone_prefix}.' if backbone_prefix else ''
        parts = {0: f'{where}patch_embed, {where}pos_embed',
                 head: 'after the trunk (adapter, neck, heads)'}
        rows = [('group', 'depth', 'part', 'lr scale', 'lr', 'weight decay', 'tensors',
                 'parameters')]
        for index, group in enumerate(groups):
            depth, wd = group[DEPTH_KEY], group.get('weight_decay')
            rows.append((str(index), str(depth), parts.get(depth, f'{where}layers.{depth - 1}'),
                         f'{self.decay_rate**(head - depth):.6g}', f'{group["lr"]:.4e}',
                         'optimizer default' if wd is None else f'{wd:g}',
                         str(len(group['params'])),
                         f'{sum(p.numel() for p in group["params"]):,}'))
        widths = [max(map(len, column)) for column in zip(*rows)]
        lines = ['  '.join(cell.ljust(w) if i == 2 else cell.rjust(w)
                           for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                 for row in rows]
        frozen = [p for p in model.parameters() if not p.requires_grad]
        trainable = sum(len(g['params']) for g in groups)
        header = (f'XCiTLayerDecayOptimizerConstructor: decay_rate={self.decay_rate:g}, '
                  f'{num_layers} XCiT layers ({backbone_prefix or "the model"}): lr = '
                  f'lr of the config\'s rules x decay_rate ** ({head} - depth); {len(groups)} '
                  f'groups, {trainable} trainable tensors; {len(frozen)} frozen tensors '
                  f'({sum(p.numel() for p in frozen):,} parameters, requires_grad=False) are in '
                  f'no group. The logged `lr` is that of group 0.')
        print_log('\n'.join([header] + lines), logger='current')


def _depth_lrs(optim_wrapper) -> Dict[str, float]:
    """``{'train/[name.]depth_{d}_lr': lr}`` of the first group of each depth (head first; one
    without a custom ``lr_mult`` if any), per wrapper of an ``OptimWrapperDict``."""
    wrappers = optim_wrapper.items() if isinstance(optim_wrapper, OptimWrapperDict) else \
        [('', optim_wrapper)]
    lrs: Dict[str, float] = {}
    for name, wrapper in wrappers:
        prefix = f'{name}.' if name else ''
        for group in wrapper.optimizer.param_groups:
            if group.get(DEPTH_KEY) is not None:
                lrs.setdefault(f'train/{prefix}depth_{group[DEPTH_KEY]}_lr', group['lr'])
    return lrs


@HOOKS.register_module()
class LayerDecayLrHook(Hook):
    """Record ``train/depth_{d}_lr`` for each depth of a layer-decayed optimizer, which
    ``LogProcessor`` prints like ``lr``."""

    priority = 'VERY_HIGH'  # with RuntimeInfoHook, which records `lr` at the same point

    def before_train(self, runner) -> None:
        if not _depth_lrs(runner.optim_wrapper):
            print_log('LayerDecayLrHook: no param group has a layer depth (build the optimizer '
                      "with constructor='XCiTLayerDecayOptimizerConstructor'); nothing to record",
                      logger='current', level=logging.WARNING)

    def before_train_iter(self, runner, batch_idx: int, data_batch: Optional[dict] = None) -> None:
        for scalar, lr in _depth_lrs(runner.optim_wrapper).items():
            runner.message_hub.update_scalar(scalar, lr)
