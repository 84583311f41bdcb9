from .checkpoint_io import (CheckpointError, check_checkpoint, extract_state_dict,
                            install_checkpoint_reader, load_checkpoint_file)
from .ckpt_convert import LayoutError, convert_backbone_state_dict, convert_model_state_dict

__all__ = [
    'CheckpointError', 'check_checkpoint', 'extract_state_dict', 'install_checkpoint_reader',
    'load_checkpoint_file', 'LayoutError', 'convert_backbone_state_dict',
    'convert_model_state_dict'
]
