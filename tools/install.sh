#!/usr/bin/env bash
# Install xcit_mm and everything it needs into the active Python, on a fresh CPU machine.
# Safe to run again: every step is skipped or is a no-op when already satisfied.
#
#   bash tools/install.sh
#
# Why the pins:
#   torch==2.13.0        the CPU wheel that ships on this machine; a bare `torch` pulls GBs of CUDA.
#   setuptools<82        mmcv's setup.py and mmengine's `mmdet::`/`mmseg::` config lookup import
#                        pkg_resources, which setuptools 82 removed.
#   numpy<2              mmcv 2.1 / mmdet 3.3 / mmseg 1.2 were written and tested against numpy 1.x.
#   mmcv==2.1.0          mmdet 3.3.0 and mmseg 1.2.2 need mmcv>=2.0,<2.2; no CPU wheel exists, so it
#                        is built from source with its ops (RoIAlign, NMS; ~15 min on 2 cores, then
#                        cached by pip).
#   mmpretrain --no-deps its requirements name `modelindex`; the package that works is `model-index`,
#                        and its extras would pull torchvision (no CPU build exists).
#   pytest-xdist         the test suite runs on 2 worker processes (setup.cfg: -n 2), one per core.
#   psutil seaborn       what mmdet's own tools/analysis_tools/benchmark.py and analyze_logs.py
#                        import (mmdet installs neither); resolved with numpy<2 in the same call.
#   onnx==1.17.0         ONNX export / ONNX Runtime check (tools/deployment/export_onnx.py):
#   onnxruntime==1.20.1  releases that install with numpy 1.26 (checked; onnx 1.23 needs
#                        ml_dtypes>=0.5.4, which needs numpy 2). Resolved in the same pip call as
#                        numpy<2, so the pin holds; xcit_mm imports without them.
#   safetensors==0.8.0  safetensors files and `hf-hub:OWNER/NAME` weights (timm's XCiT on the
#   huggingface_hub==2.4.0  Hugging Face Hub; xcit_mm/models/utils/checkpoint_io.py). Neither needs
#                        numpy (checked with numpy 1.26, Python 3.11; huggingface_hub 2.x needs
#                        Python >= 3.10); imported only when such a file or name is read.
#   tifffile==2026.3.3   tools/segment_large_image.py reads OME-TIFF and slide TIFFs tile by tile
#   imagecodecs==2026.1.14  (level 0); imagecodecs decodes their LZW, JPEG, ... tiles (deflate
#                        needs only zlib). Checked with numpy 1.26 (both need Python >= 3.11).
#   rasterio==1.4.4      the same tool reads every other raster through GDAL by windows and writes
#                        the label and confidence COGs; wheels bundle GDAL, numpy>=1.24.
#                        These five are setup.py's `geo` extra; imported only by that tool.
#   pyogrio==0.13.0      the large-image tool's polygons (GeoPackage / FlatGeobuf / GeoJSON) through
#                        GDAL's OGR; wheels bundle GDAL. Checked with numpy 1.26.
#   rio-cogeo==7.0.4     its cog_validate checks the label COG in the tests (pulls morecantile,
#                        pyproj, pydantic); not imported by xcit_mm.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
step() { printf '\n[install %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
pipi() { "$PY" -m pip install --disable-pip-version-check "$@"; }

step "1/6 build tools (setuptools>=77.0.3,<82, wheel, ninja)"
pipi "setuptools>=77.0.3,<82" wheel ninja

step "2/6 torch (keeps an installed torch, else the local CPU wheel torch==2.13.0)"
if "$PY" -c "import torch" 2>/dev/null; then
    echo "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed: kept"
else
    pipi torch==2.13.0
fi

step "3/6 runtime dependencies of mmengine/mmcv/mmdet/mmseg/mmpretrain"
pipi "numpy<2" "opencv-python-headless>=4.8,<4.11" mmengine==0.10.7 \
    pycocotools shapely scipy terminaltables tqdm six prettytable ftfy regex \
    einops importlib-metadata mat4py matplotlib model-index rich \
    scikit-image pytest pytest-xdist onnx==1.17.0 onnxruntime==1.20.1 psutil seaborn \
    safetensors==0.8.0 huggingface_hub==2.4.0 tifffile==2026.3.3 imagecodecs==2026.1.14 \
    rasterio==1.4.4 pyogrio==0.13.0 rio-cogeo==7.0.4

step "4/6 mmcv 2.1.0 with ops (skipped when mmcv.ops already imports)"
if "$PY" -c "import mmcv, mmcv.ops; assert mmcv.__version__ == '2.1.0'" 2>/dev/null; then
    echo "mmcv 2.1.0 with ops already installed: kept"
else
    echo "building mmcv 2.1.0 from source; this takes ~15 minutes on 2 cores the first time"
    MMCV_WITH_OPS=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} pipi --no-build-isolation mmcv==2.1.0
fi

step "5/6 mmdet 3.3.0, mmsegmentation 1.2.2, mmpretrain 1.2.0"
pipi --no-deps mmdet==3.3.0 mmsegmentation==1.2.2 mmpretrain==1.2.0

step "6/6 xcit_mm (editable)"
pipi --no-deps --no-build-isolation -e .

"$PY" - <<'PY'
import numpy, onnx, onnxruntime, psutil, seaborn, safetensors, huggingface_hub
import tifffile, imagecodecs, rasterio, pyogrio, rio_cogeo
import torch, mmcv, mmcv.ops, mmengine, mmdet, mmseg, mmpretrain, xcit_mm
print('installed: numpy', numpy.__version__, '| onnx', onnx.__version__, '| onnxruntime',
      onnxruntime.__version__, '| safetensors', safetensors.__version__, '| huggingface_hub',
      huggingface_hub.__version__)
print('installed: tifffile', tifffile.__version__, '| imagecodecs', imagecodecs.__version__,
      '| rasterio', rasterio.__version__)
print('installed: torch', torch.__version__, '| mmengine', mmengine.__version__,
      '| mmcv', mmcv.__version__, '| mmdet', mmdet.__version__, '| mmseg', mmseg.__version__,
      '| mmpretrain', mmpretrain.__version__, '| xcit_mm', xcit_mm.__version__)
PY
