#!/usr/bin/env bash
# Build .whl/ (ignored by git): the wheels that bring mmengine / mmcv (lite) / mmseg to a GPU
# machine with torch, numpy, opencv, matplotlib, scipy, ... but no OpenMMLab package and no
# network; benchmarks/gpu/run_points.sh installs them there and runs benchmarks/peak_memory.py.
#
#   PYTHON=/path/to/python bash benchmarks/gpu/make_wheels.sh   # any Python >= 3.8 with pip
#
# All pure Python or abi3 (they install on cp312 too): mmengine 0.10.7 and mmsegmentation 1.2.2
# (--no-deps); mmcv 2.1.0 built without ops (mmcv_lite; its setup.py needs setuptools<82 for
# pkg_resources); mmcv_ext_stub, an mmcv._ext whose ops raise NotImplementedError (mmseg imports
# mmcv.ops at import time, which needs mmcv._ext; Semantic FPN and UperNet inference call no op);
# the requirements addict, yapf, termcolor, platformdirs, prettytable, wcwidth, ftfy (imported by
# mmseg.utils.tokenizer); setuptools<82 (mmengine's Config resolves mmseg:: bases with
# pkg_resources, which setuptools 82, pulled in by torch on Python >= 3.12, removed).
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
