"""Whole-image inference schedules of the lean models: the same FPN, Semantic FPN and UperNet
outputs as mmdet's and mmseg's, computed in data-flow order and in bands of rows so that fewer
full-size maps are alive at once. Imported by ``LeanEncoderDecoder`` / ``LeanMaskRCNN`` on first
build, never by ``import xcit_mm`` (``sem_fpn_bands`` and ``uper_data_flow`` import mmseg)."""
