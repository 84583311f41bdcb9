from .checkpoint_io import (CheckpointError, check_checkpoint, extract_state_dict,
                            install_checkpoint_reader, load_checkpoint_file)
from .ckpt_convert import (LAYOUTS, LayoutError, convert_backbone_state_dict,
                           convert_model_state_dict, detect_layout)
from .ckpt_load import (is_released_layout, load_backbone_checkpoint,
                        load_model_checkpoint, load_model_state_dict)

__all__ = [
    'CheckpointError', 'check_checkpoint', 'extract_state_dict', 'install_checkpoint_reader',
    'load_checkpoint_file',
    'LAYOUTS', 'LayoutError', 'convert_backbone_state_dict', 'convert_model_state_dict',
    'detect_layout', 'is_released_layout', 'load_backbone_checkpoint',
    'load_model_checkpoint', 'load_model_state_dict'
]
