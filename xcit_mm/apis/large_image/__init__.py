# Copyright (c) xcit_mm contributors. All rights reserved.
"""Images larger than memory in, tiled labels out, around ``LeanEncoderDecoder.stream_labels``
(``tools/segment_large_image.py``, docs/gigapixel.md): :mod:`.reader` reads windows of rows,
:mod:`.writer` writes the label and confidence rasters band by band, :mod:`.polygons` the
polygons. Not imported by ``import xcit_mm``."""
from .errors import LargeImageError, check_output
from .polygons import PolygonWriter, check_vector_output
from .reader import ModelRows, model_rows, open_image
from .writer import write_label_rasters

__all__ = ['LargeImageError', 'ModelRows', 'PolygonWriter', 'check_output', 'check_vector_output',
           'model_rows', 'open_image', 'write_label_rasters']
