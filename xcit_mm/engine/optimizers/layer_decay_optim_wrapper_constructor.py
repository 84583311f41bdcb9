"""Layer-wise learning-rate decay for XCiT (``constructor='XCiTLayerDecayOptimizerConstructor'``).

Fine-tuning recipes of plain (columnar) transformers (BEiT, MAE, ViTDet) give layers close to the
input a smaller learning rate than those close to the task head. mmseg's
``LayerDecayOptimizerConstructor`` only knows ConvNeXt, BEiT and MAE (by class name); this
constructor does the same for :class:`~xcit_mm.models.backbones.xcit.XCiTBackbone`, from mmdet
and mmseg configs alike (registered in mmengine's root ``OPTIM_WRAPPER_CONSTRUCTORS``)::

    optim_wrapper = dict(
        constructor='XCiTLayerDecayOptimizerConstructor',
        paramwise_cfg=dict(decay_rate=0.75, custom_keys={'norm': dict(decay_mult=0.0)}))

Rule, with ``L`` the number of XCiT layers of the model's backbone (read from the model):

* depth 0: the patch embedding (``patch_embed.*``) and the position projection (``pos_embed.*``);
* depth ``i + 1``: XCiT layer ``i`` (``layers.{i}.*``);
* depth ``L + 1``: everything after the trunk -- the backbone's stride adapter (``fpn1``..``fpn4``),
  necks and heads;
* learning rate = the lr the config's other rules give (``optimizer.lr``, times a custom key's
  ``lr_mult`` or ``bias_lr_mult`` where one applies) x ``decay_rate ** (L + 1 - depth)``.

Weight decay (and every other option) is what mmengine's :class:`DefaultOptimWrapperConstructor`
gives with the same ``paramwise_cfg`` (``custom_keys``, ``norm_decay_mult``, ``bias_decay_mult``,
``dwconv_decay_mult``, ``flat_decay_mult``...): layer decay only rescales learning rates. Parameters
with ``requires_grad=False`` (``frozen_stages``) are in no group.

Groups: parameters with the same depth and the same options share one group. The groups are
ordered from the head down to the patch embedding, so the FIRST group is a head group (depth
``L + 1``, without a custom ``lr_mult`` where there is such a group): mmengine's
``RuntimeInfoHook`` logs ``lr`` as the lr of the first group, i.e. the head's lr, the config's
``optimizer.lr`` under the schedule. Each group carries its depth as ``group['layer_depth']``;
:class:`~xcit_mm.engine.hooks.LayerDecayLrHook` writes the lr of each depth to the message hub
(``train/depth_{d}_lr``). One table of the groups is logged when the optimizer is built.
"""
import logging
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import torch.nn as nn
from mmengine.logging import MMLogger, print_log
from mmengine.optim import DefaultOptimWrapperConstructor
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS

from xcit_mm.models.backbones.xcit import XCiTBackbone

# paramwise_cfg keys mmengine's DefaultOptimWrapperConstructor reads (mmengine 0.10).
MMENGINE_PARAMWISE_KEYS = ('bias_decay_mult', 'bias_lr_mult', 'bypass_duplicate', 'custom_keys',
                           'dcn_offset_lr_mult', 'dwconv_decay_mult', 'flat_decay_mult',
                           'norm_decay_mult')
LAYER_DECAY_KEYS = ('decay_rate', )
DEPTH_KEY = 'layer_depth'

# Per-parameter lines of mmengine's add_params: they would state learning rates before layer
# decay (and one warning per frozen tensor); the table below replaces them.
_BASE_RULE_MESSAGES = ('paramwise_options -- ', )
_FROZEN_MESSAGE_END = ' is skipped since its requires_grad=False'


class _DropBaseRuleLines(logging.Filter):

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith(_BASE_RULE_MESSAGES) or msg.endswith(_FROZEN_MESSAGE_END))


def find_xcit_backbone(model: nn.Module) -> Tuple[str, XCiTBackbone]:
    """The (prefix, module) of the one :class:`XCiTBackbone` in ``model``.

    Raises:
        ValueError: if the model has none, or more than one.
    """
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
    """Depth of parameter ``name`` (a full name in the model) for layer-wise lr decay.

    0 for the patch embedding and position projection, ``i + 1`` for XCiT layer ``i``,
    ``num_layers + 1`` for the adapter (``fpn1``..``fpn4``) and everything outside the backbone.

    Raises:
        ValueError: for a backbone parameter of no known part (so that a new backbone parameter
            cannot silently get the head's learning rate).
    """
    head = num_layers + 1
    prefix = f'{backbone_prefix}.' if backbone_prefix else ''
    if not name.startswith(prefix):
        return head
    parts = name[len(prefix):].split('.')
    if parts[0] in ('patch_embed', 'pos_embed'):
        return 0
    if parts[0] == 'layers' and len(parts) > 2 and parts[1].isdigit():
        index = int(parts[1])
        if index < num_layers:
            return index + 1
    if parts[0] in ('fpn1', 'fpn2', 'fpn3', 'fpn4'):
        return head
    raise ValueError(f'XCiTLayerDecayOptimizerConstructor: no layer depth is defined for the '
                     f'backbone parameter {name!r} (known: patch_embed.*, pos_embed.* -> 0, '
                     f'layers.{{i}}.* -> i + 1, fpn1..fpn4.* -> {head})')


def layer_depth_lrs(param_groups: Sequence[dict]) -> 'OrderedDict[int, float]':
    """{depth: lr} of optimizer param groups built by :class:`XCiTLayerDecayOptimizerConstructor`.

    The lr of a depth is that of its first group, i.e. the one without a custom ``lr_mult`` where
    there is one (groups of a depth differ in weight decay, and in lr only through such
    multipliers). Ordered as the groups: head first. Empty for groups without ``layer_depth``.
    """
    lrs: 'OrderedDict[int, float]' = OrderedDict()
    for group in param_groups:
        depth = group.get(DEPTH_KEY)
        if depth is not None and depth not in lrs:
            lrs[depth] = group['lr']
    return lrs


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class XCiTLayerDecayOptimizerConstructor(DefaultOptimWrapperConstructor):
    """mmengine's default constructor plus layer-wise lr decay over the XCiT layers.

    Args:
        optim_wrapper_cfg (dict): As for :class:`DefaultOptimWrapperConstructor` (``type``,
            ``optimizer`` with ``lr`` and ``weight_decay``...).
        paramwise_cfg (dict): ``decay_rate`` (float in (0, 1], required): the lr ratio between
            consecutive depths; plus any key of mmengine's ``paramwise_cfg``
            (:data:`MMENGINE_PARAMWISE_KEYS`), applied as mmengine applies them. Any other key is
            an error. The number of layers is read from the model's :class:`XCiTBackbone`.
    """

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg: Optional[dict] = None):
        if paramwise_cfg is not None and not isinstance(paramwise_cfg, dict):
            raise TypeError(f'XCiTLayerDecayOptimizerConstructor: paramwise_cfg must be a dict, '
                            f'got {type(paramwise_cfg).__name__}')
        paramwise_cfg = dict(paramwise_cfg or {})
        self.decay_rate = self._check_layer_decay_cfg(paramwise_cfg)
        super().__init__(optim_wrapper_cfg, paramwise_cfg)
        if self.base_lr is None:
            raise ValueError('XCiTLayerDecayOptimizerConstructor: optim_wrapper.optimizer needs '
                             'an explicit `lr` to scale')
        # mmengine's own rules, applied per parameter by an mmengine constructor (its add_params
        # recurses through self.add_params, which is overridden here).
        base_cfg = {k: v for k, v in paramwise_cfg.items() if k not in LAYER_DECAY_KEYS}
        self._base_rules = DefaultOptimWrapperConstructor(optim_wrapper_cfg, base_cfg)

    @staticmethod
    def _check_layer_decay_cfg(paramwise_cfg: dict) -> float:
        valid = sorted(LAYER_DECAY_KEYS + MMENGINE_PARAMWISE_KEYS)
        unknown = sorted(set(paramwise_cfg) - set(valid))
        if unknown:
            hint = ''
            if 'num_layers' in unknown:
                hint = (' (num_layers is not a setting here: it is read from the model\'s '
                        'XCiTBackbone)')
            raise KeyError(f'XCiTLayerDecayOptimizerConstructor: unknown paramwise_cfg key(s) '
                           f'{unknown}{hint}; valid keys: {valid}')
        if 'decay_rate' not in paramwise_cfg:
            raise KeyError(f'XCiTLayerDecayOptimizerConstructor: paramwise_cfg needs '
                           f'`decay_rate` (e.g. 0.75); valid keys: {valid}')
        rate = paramwise_cfg['decay_rate']
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ValueError(f'XCiTLayerDecayOptimizerConstructor: decay_rate must be a number '
                             f'in (0, 1], got {rate!r}')
        return float(rate)

    def add_params(self, params: List[dict], module: nn.Module, prefix: str = '',
                   is_dcn_module=None) -> None:
        """Append the layer-decayed groups of all trainable parameters of ``module`` to
        ``params`` (``module`` is the whole model, as mmengine's ``__call__`` passes it)."""
        backbone_prefix, backbone = find_xcit_backbone(module)
        num_layers = backbone.num_layers
        head = num_layers + 1
        names = {}
        for name, param in module.named_parameters(prefix=prefix):
            names.setdefault(id(param), name)

        # mmengine's rules: one group per trainable parameter, with its lr / weight decay / ...
        per_param: List[dict] = []
        logger = MMLogger.get_current_instance()
        line_filter = _DropBaseRuleLines()
        logger.addFilter(line_filter)
        try:
            self._base_rules.add_params(per_param, module, prefix=prefix,
                                        is_dcn_module=is_dcn_module)
        finally:
            logger.removeFilter(line_filter)

        # Layer decay on top, then one group per (depth, options).
        merged: Dict[tuple, dict] = {}
        for order, group in enumerate(per_param):
            (param, ) = group['params']
            name = names[id(param)]
            depth = xcit_layer_depth(name, num_layers, backbone_prefix)
            options = {k: v for k, v in group.items() if k != 'params'}
            options.setdefault('lr', self.base_lr)
            if self.base_wd is not None:
                options.setdefault('weight_decay', self.base_wd)
            custom_lr = options['lr'] != self.base_lr
            options['lr'] = options['lr'] * self.decay_rate**(head - depth)
            options[DEPTH_KEY] = depth
            key = (depth, repr(sorted(options.items())))
            if key not in merged:
                merged[key] = dict(params=[], _sort=(-depth, custom_lr, order), _names=[],
                                   **options)
            merged[key]['params'].append(param)
            merged[key]['_names'].append(name)

        groups = sorted(merged.values(), key=lambda g: g['_sort'])
        self._log_table(groups, module, backbone_prefix, num_layers)
        for group in groups:
            del group['_sort'], group['_names']
            params.append(group)
        if groups and groups[0][DEPTH_KEY] != head:
            print_log(f'XCiTLayerDecayOptimizerConstructor: no trainable parameter after the XCiT '
                      f'trunk, so the logged `lr` is that of depth {groups[0][DEPTH_KEY]}',
                      logger='current', level=logging.WARNING)

    def _log_table(self, groups: List[dict], model: nn.Module, backbone_prefix: str,
                   num_layers: int) -> None:
        head = num_layers + 1
        where = f'{backbone_prefix}.' if backbone_prefix else ''

        def part(depth):
            if depth == 0:
                return f'{where}patch_embed, {where}pos_embed'
            if depth == head:
                return 'after the trunk (adapter, neck, heads)'
            return f'{where}layers.{depth - 1}'

        rows = [('group', 'depth', 'part', 'lr scale', 'lr', 'weight decay', 'tensors',
                 'parameters')]
        for index, group in enumerate(groups):
            wd = group.get('weight_decay')
            rows.append((str(index), str(group[DEPTH_KEY]), part(group[DEPTH_KEY]),
                         f'{self.decay_rate**(head - group[DEPTH_KEY]):.6g}',
                         f'{group["lr"]:.4e}', 'optimizer default' if wd is None else f'{wd:g}',
                         str(len(group['params'])),
                         f'{sum(p.numel() for p in group["params"]):,}'))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
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
