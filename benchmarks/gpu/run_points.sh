#!/usr/bin/env bash
# On a GPU machine without network or OpenMMLab packages, from the repository root: install the
# wheels of .whl/ (benchmarks/gpu/make_wheels.sh) into /tmp/site, print the device and versions,
# then run benchmarks/gpu/whole_image_cuda.py (arguments passed on) into $OUT.
#
#   OUT=/some/dir bash benchmarks/gpu/run_points.sh [--budget-s 300] [--sizes ...] ...
#
# Needs there: python3 with torch (CUDA), numpy, opencv-python-headless, matplotlib, scipy,
# pyyaml, packaging, pillow, rich, regex (what the wheels' requirements name and .whl lacks).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/whole_image_cuda}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
export PYTHONDONTWRITEBYTECODE=1

start=$(date +%s)
if ! "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" .whl/*.whl; then
    # every wheel in .whl is a plain purelib zip (no .data, no build step): unzip them instead
    echo "pip install failed: unzipping the wheels into $SITE instead"
    mkdir -p "$SITE"
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$SITE"; done
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "wheels installed in $(( $(date +%s) - start )) s"

nvidia-smi --query-gpu=name,memory.total --format=csv || echo "nvidia-smi failed"
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/env.txt"
import sys
import warnings

warnings.simplefilter('ignore')
import cv2
import numpy
import torch

import mmcv
import mmengine
import mmseg
import mmseg.apis  # noqa: F401 (imports mmcv.ops: the mmcv._ext stand-in)
import xcit_mm

print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda,
      '| cudnn', torch.backends.cudnn.version(), '| numpy', numpy.__version__, '| cv2',
      cv2.__version__)
print('mmengine', mmengine.__version__, '| mmcv', mmcv.__version__, '| mmseg', mmseg.__version__,
      '| xcit_mm', xcit_mm.__version__, 'from', xcit_mm.__file__)
print('cuda available', torch.cuda.is_available(), '| devices', torch.cuda.device_count(),
      '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')
PYEOF

"$PY" benchmarks/gpu/whole_image_cuda.py --out "$OUT/whole_image_cuda" "$@"
echo "run_points.sh done in $(( $(date +%s) - start )) s"
