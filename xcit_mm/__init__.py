"""xcit_mm: the XCiT backbone for mmdetection and mmsegmentation.

``import xcit_mm`` (or ``custom_imports = dict(imports=['xcit_mm'])`` in a config) registers, in
mmengine's root registries that mmdet's and mmseg's fall back to, exactly:

- ``XCiTBackbone`` (MODELS), which loads every published XCiT weight layout by itself;
- ``XCiTLayerDecayOptimizerConstructor`` (OPTIM_WRAPPER_CONSTRUCTORS) and ``LayerDecayLrHook``
  (HOOKS), the optional layer-wise learning-rate decay;
- ``LeanEncoderDecoder`` and ``LeanMaskRCNN`` (MODELS), whole-image inference with fewer
  full-size maps alive, as builders that import mmseg / mmdet only when a config builds them.

It also makes every door read checkpoints the same safe way
(:func:`~xcit_mm.models.utils.install_checkpoint_reader`): torch's ``weights_only`` allow-list
gains mmengine 0.10's pure-data training state (``HistoryBuffer``, plain numpy arrays, scalars and
dtypes, ``argparse.Namespace``; :mod:`xcit_mm.models.utils.safe_unpickling`), so the checkpoints
any config writes open in ``init_detector``, the inferencers, the upstream ``tools/test.py``,
``load_from`` and ``--resume``; mmengine's loader for local paths and URLs is this package's
reader, whose refusals name the file, the cause and the fix; and a script stopped by such an error
prints it as one line. And mmengine's FLOP counter, which mmdet's and mmseg's ``get_flops.py`` use,
counts XCA's fused output projection (``aten::baddbmm``;
:func:`~xcit_mm.models.utils.flop_count.install_flop_handles`).

The rest of the package is imported only when asked for: ``xcit_mm.deployment`` (ONNX export),
``xcit_mm.visualization`` and ``xcit_mm.apis`` (XCA maps). What is not about XCiT lives beside
the package: ``training_extras`` (reliable-training hooks, sample seeding, CPU AMP, CPU
distributed helpers, a faster CPU RoIAlign) and ``shapes_world`` (the quick-start data).
"""
from .engine import LayerDecayLrHook, XCiTLayerDecayOptimizerConstructor
from .models import XCiTBackbone
from .models.utils import install_checkpoint_reader
from .models.utils.flop_count import install_flop_handles
from .version import __version__

install_checkpoint_reader()
install_flop_handles()

__all__ = ['LayerDecayLrHook', 'XCiTBackbone', 'XCiTLayerDecayOptimizerConstructor', '__version__']
