#!/usr/bin/env bash
# Build .whl/ (ignored by git): the wheels that bring mmengine / mmcv (lite) / mmseg to a GPU
# machine that has torch, numpy, opencv-python-headless, matplotlib, scipy, ... but no OpenMMLab
# package and no network. benchmarks/gpu/run_points.sh installs them there with
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
#
#   PYTHON=/path/to/python bash benchmarks/gpu/make_wheels.sh   # any Python >= 3.8 with pip
#
# What goes in, and why (every wheel is pure Python or abi3, so it installs on cp312 too):
#   mmengine 0.10.7, mmsegmentation 1.2.2      the packages themselves (--no-deps)
#   mmcv_lite 2.1.0                            mmcv 2.1.0 built with MMCV_WITH_OPS=0 (no CUDA /
#                                              C++ ops; built here with setuptools<82, whose
#                                              pkg_resources mmcv's setup.py imports)
#   mmcv_ext_stub 0.1.0                        mmcv/_ext.py: a stand-in for the compiled ops.
#                                              mmseg 1.2.2 imports mmcv.ops at import time
#                                              (mmseg/utils/mask_classification.py,
#                                              models/utils/point_sample.py, models/losses/
#                                              focal_loss.py, models/decode_heads/san_head.py),
#                                              and mmcv.ops needs mmcv._ext to import; the
#                                              stand-in has every name, each raising
#                                              NotImplementedError when called. Semantic FPN and
#                                              UPerNet inference call none of them
#                                              (point_sample is pure torch).
#   addict, yapf, termcolor                    mmengine's / mmcv's requirements
#   platformdirs                               yapf's requirement (tomli only below 3.11)
#   prettytable, wcwidth                       mmseg's requirement and prettytable's
#   ftfy                                       imported by mmseg.utils.tokenizer at import time
#   setuptools<82                              pkg_resources, which mmengine's Config imports to
#                                              resolve the configs' `mmseg::` bases
#                                              (mmengine.utils.package_utils.is_installed);
#                                              setuptools 82 removed it, and torch pulls in the
#                                              newest setuptools on Python >= 3.12
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
OUT=.whl
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

DL=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_17_x86_64 -d "$OUT")
"$PY" -m pip download -q "${DL[@]}" mmengine==0.10.7 mmsegmentation==1.2.2 addict yapf \
    termcolor platformdirs prettytable wcwidth ftfy "setuptools<82"

# mmcv 2.1.0 without ops, from its sdist, in a throw-away venv (setuptools<82: pkg_resources)
"$PY" -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install -q "setuptools<82" wheel
"$TMP/venv/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation mmcv==2.1.0 \
    -d "$TMP"
MMCV_WITH_OPS=0 "$TMP/venv/bin/pip" wheel -q --no-deps --no-build-isolation \
    "$TMP"/mmcv-2.1.0.tar.gz -w "$OUT"

# the mmcv._ext stand-in, as its own wheel (a file in mmcv/, no mmcv/__init__.py)
mkdir -p "$TMP/stub/mmcv"
cat > "$TMP/stub/mmcv/_ext.py" <<'PYEOF'
"""Stand-in for mmcv's compiled ops module (mmcv-lite has none).

``mmcv.ops`` checks at import that this module has each op's name; mmseg imports ``mmcv.ops``
at import time. Every name is here, and calling one raises NotImplementedError.
"""


def __getattr__(name):
    if name.startswith('__'):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f'mmcv._ext.{name}: this mmcv is mmcv-lite with a stand-in '
                                  'for the compiled ops (.whl/mmcv_ext_stub)')

    missing.__name__ = name
    return missing
PYEOF
cat > "$TMP/stub/setup.py" <<'PYEOF'
from setuptools import setup

setup(name='mmcv_ext_stub', version='0.1.0', packages=['mmcv'],
      description='mmcv._ext stand-in for mmcv-lite (raises NotImplementedError)')
PYEOF
(cd "$TMP/stub" && "$TMP/venv/bin/pip" wheel -q --no-deps --no-build-isolation . \
    -w "$TMP/stubwheel")
cp "$TMP"/stubwheel/mmcv_ext_stub-*.whl "$OUT"/

if unzip -l "$OUT"/mmcv_ext_stub-*.whl | grep -q 'mmcv/__init__.py'; then
    echo "mmcv_ext_stub must not carry mmcv/__init__.py" >&2
    exit 1
fi
ls -la "$OUT"
du -sh "$OUT"
