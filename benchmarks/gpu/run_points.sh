#!/usr/bin/env bash
# On a GPU machine without network or OpenMMLab packages: unzip .whl/ (make_wheels.sh) into
# $SITE, then run benchmarks/peak_memory.py on CUDA into $OUT (its artifact names the device and
# the versions): the points of docs/benchmark_gpu.md, or with `stream` those of
# docs/benchmark_gigapixel.md. Further arguments override them (--device cpu --sizes 256 tries it
# on a CPU). REVISION=<commit> names the code measured where the copy has no .git. Needs python3
# with torch, numpy, opencv, scipy, matplotlib, pyyaml, packaging, pillow, rich, regex.
#
#   OUT=/some/dir bash benchmarks/gpu/run_points.sh [stream] [--budget-s 300] [--sizes ...] ...
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/peak_memory}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
export PYTHONDONTWRITEBYTECODE=1

start=$(date +%s)
# every wheel in .whl is a plain purelib zip (no .data, no build step): unzipped, no pip needed
for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$SITE"; done
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "wheels installed in $(( $(date +%s) - start )) s"


points=(--paths lean stock auto --budgets 8192:40000 8192:16000 4096:4000
        --out "$OUT/whole_image_cuda")
if [[ ${1:-} == stream ]]; then  # whole's series (one process), then the stream's; whole may oom
    shift
    points=(--backbones xcit --paths stream lean --sizes 8192 16384 32768 --skip lean:32768
            --limit-gb 100 --timeout 420 --budget-s 360 --grace-s 60
            --out "$OUT/whole_image_cuda_stream")
fi
status=0
"$PY" benchmarks/peak_memory.py --device cuda --tasks segmentor --warmup 256 --repeat-below-s 5 \
    --log "$OUT/peak_memory.log" "${points[@]}" "$@" || status=$?
echo "run_points.sh done in $(( $(date +%s) - start )) s, exit status $status"
exit $status
