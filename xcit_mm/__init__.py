"""xcit_mm: the XCiT backbone for mmdetection and mmsegmentation. ``import xcit_mm`` registers
the backbone, layer decay and the lean models, and installs the safe checkpoint reader and XCA's
FLOP handle (docs/backbone.md, "What import xcit_mm does")."""
from .engine import LayerDecayLrHook, XCiTLayerDecayOptimizerConstructor
from .models import XCiTBackbone
from .models.utils import install_checkpoint_reader
from .models.utils.flop_count import install_flop_handles
from .version import __version__

install_checkpoint_reader()
install_flop_handles()

__all__ = ['LayerDecayLrHook', 'XCiTBackbone', 'XCiTLayerDecayOptimizerConstructor', '__version__']
