"""Whole-image inference schedules of the lean models: the same FPN, Semantic FPN and UperNet
outputs as mmdet's and mmseg's, computed in data-flow order, and the stream (``row_stream``: the
trunk layer by layer, every later map a band of rows at a time) so that fewer full-size maps are
alive at once; ``settings`` reads both models' ``test_cfg``. ``row_stream`` is torch only and
comes with the backbone; the others are imported by ``LeanEncoderDecoder`` / ``LeanMaskRCNN`` on
first build, never by ``import xcit_mm`` (``seg_stream`` and ``uper_data_flow`` import mmseg)."""
