# Copyright (c) xcit_mm contributors. All rights reserved.
"""Drawing detector / segmentor predictions with the upstream visualizers."""
import itertools
import os.path as osp
from copy import deepcopy
from typing import Optional

import numpy as np

from xcit_mm.apis.inference import config_task

_VIS_COUNTER = itertools.count()


def build_visualizer(model, opacity: Optional[float] = None):
    """The task's upstream visualizer, with the model's class names and palette.

    The config's ``visualizer`` type is kept when it is ``DetLocalVisualizer`` /
    ``SegLocalVisualizer`` (or a subclass); its storage backends are dropped: images are written
    to explicit files.

    Args:
        model: A model from :func:`xcit_mm.apis.init_model`.
        opacity (float, optional): Opacity of masks (detection) or of the label-map overlay
            (segmentation); None keeps the config's / upstream default (0.8 / 0.5).
    """
    from mmengine.registry import VISUALIZERS
    task = config_task(model.cfg)
    if task == 'det':
        from mmdet.visualization import DetLocalVisualizer as base
    else:
        from mmseg.visualization import SegLocalVisualizer as base
    vis_cfg = deepcopy(model.cfg.get('visualizer', None) or {})
    vis_type = vis_cfg.get('type', base.__name__)
    try:
        cls = VISUALIZERS.get(vis_type) if isinstance(vis_type, str) else vis_type
    except Exception:
        cls = None
    if cls is None or not (isinstance(cls, type) and issubclass(cls, base)):
        cls = base
    kwargs = {k: v for k, v in vis_cfg.items()
              if k not in ('type', 'name', 'vis_backends', 'save_dir') and not k.startswith('_')}
    if opacity is not None:
        kwargs['alpha'] = opacity
    # Visualizers are named singletons; a fresh name gives a fresh instance each call.
    vis = cls.get_instance(f'xcit_mm_{task}_{next(_VIS_COUNTER)}', **kwargs)
    vis.dataset_meta = dict(classes=model.dataset_meta['classes'],
                            palette=model.dataset_meta['palette'])
    return vis


def draw_prediction(visualizer, image_bgr: np.ndarray, data_sample, out_file: str,
                    score_thr: float = 0.3) -> None:
    """Write the prediction drawn over the image as ``out_file`` (same H x W as the image).

    Args:
        visualizer: From :func:`build_visualizer`.
        image_bgr: (H, W, 3) uint8 BGR image, as given to the model.
        data_sample: The model's prediction (``DetDataSample`` / ``SegDataSample``).
        out_file: Output PNG.
        score_thr: Detections scoring below this are not drawn (detection only).
    """
    image_rgb = np.ascontiguousarray(image_bgr[..., ::-1])
    kwargs = dict(pred_score_thr=score_thr) if hasattr(data_sample, 'pred_instances') \
        else dict(draw_pred=True)
    visualizer.add_datasample(osp.basename(out_file), image_rgb, data_sample=data_sample,
                              draw_gt=False, show=False, out_file=out_file, **kwargs)
