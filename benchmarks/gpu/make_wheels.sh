#!/usr/bin/env bash
# Build .whl/ (ignored by git): the pure-Python wheels that bring mmengine / mmcv (lite) / mmseg
# to a GPU machine with torch, numpy, opencv, ... but no OpenMMLab package and no network
# (benchmarks/gpu/run_points.sh installs them there).
#
#   PYTHON=/path/to/python bash benchmarks/gpu/make_wheels.sh   # any Python >= 3.8 with pip
#
# mmcv 2.1.0 is built without ops; mmcv_ext_stub stands for mmcv._ext, which mmseg's import of
# mmcv.ops needs (Semantic FPN and UperNet inference call no op); setuptools<82 keeps
# pkg_resources (mmcv's setup.py; mmengine's Config resolving mmseg:: bases).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
OUT=.whl
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

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
"""Stand-in for mmcv's compiled ops (mmcv-lite has none): every name, raising when called."""


def __getattr__(name):
    if name.startswith('__'):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f'mmcv._ext.{name}: this mmcv is mmcv-lite with a stand-in '
                                  'for the compiled ops (.whl/mmcv_ext_stub)')

    missing.__name__ = name
    return missing
PYEOF
echo "from setuptools import setup; setup(name='mmcv_ext_stub', version='0.1.0', packages=['mmcv'])" \
    > "$TMP/stub/setup.py"
"$TMP/venv/bin/pip" wheel -q --no-deps --no-build-isolation "$TMP/stub" -w "$OUT"
ls -la "$OUT"
du -sh "$OUT"
