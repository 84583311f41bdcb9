"""Whole-image inference of the lean models: FPN, Semantic FPN and UperNet in data-flow order, the
row stream and the ``test_cfg`` settings. Only ``row_stream`` (torch only) comes with the backbone;
the rest is imported on a lean model's first build, as ``seg_stream`` imports mmseg."""
