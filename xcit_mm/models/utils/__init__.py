from .checkpoint_io import (CheckpointError, check_checkpoint, check_pretrained,
                            extract_state_dict, find_pretrained, install_checkpoint_reader,
                            load_checkpoint_file, resolve_auto_resume)
from .ckpt_convert import (LAYOUTS, LayoutError, convert_backbone_state_dict,
                           convert_model_state_dict, detect_layout)
from .ckpt_load import (is_released_layout, load_backbone_checkpoint,
                        load_model_checkpoint, load_model_state_dict)

__all__ = [
    'CheckpointError', 'check_checkpoint', 'check_pretrained', 'extract_state_dict',
    'find_pretrained', 'install_checkpoint_reader', 'load_checkpoint_file', 'resolve_auto_resume',
    'LAYOUTS', 'LayoutError', 'convert_backbone_state_dict', 'convert_model_state_dict',
    'detect_layout', 'is_released_layout', 'load_backbone_checkpoint',
    'load_model_checkpoint', 'load_model_state_dict'
]
