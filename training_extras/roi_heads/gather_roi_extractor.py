"""mmdet's ``SingleRoIExtractor`` with :class:`~xcit_mm.models.layers.GatherRoIAlign` as its
RoI layer: the same RoI features (level mapping, rescaling and values), faster on CPU."""
from typing import List

import torch.nn as nn
from mmdet.models.roi_heads.roi_extractors import SingleRoIExtractor
from mmengine.registry import MODELS

from .roi_align import GatherRoIAlign


@MODELS.register_module()
class GatherRoIExtractor(SingleRoIExtractor):
    """``SingleRoIExtractor`` whose ``roi_layer=dict(type='RoIAlign', ...)`` is computed by
    :class:`~xcit_mm.models.layers.GatherRoIAlign` (mmcv's kernel off the CPU).

    mmdet looks the RoI layer type up in ``mmcv.ops`` only, so a faster RoIAlign enters a config
    through the extractor type: replace ``type='SingleRoIExtractor'`` by
    ``type='GatherRoIExtractor'`` and keep every other argument. It also reads channels-last
    feature maps correctly, which mmcv's CPU kernel does not.
    """

    def build_roi_layers(self, layer_cfg: dict, featmap_strides: List[int]) -> nn.ModuleList:
        cfg = dict(layer_cfg)
        layer_type = cfg.pop('type')
        if layer_type not in ('RoIAlign', GatherRoIAlign):
            raise ValueError(
                f"GatherRoIExtractor computes RoIAlign only, got roi_layer type {layer_type!r}; "
                "use mmdet's SingleRoIExtractor for other RoI layers")
        return nn.ModuleList([GatherRoIAlign(spatial_scale=1 / s, **cfg) for s in featmap_strides])
