#!/usr/bin/env bash
# Testing on a slurm cluster (one task per GPU; tools/test.py reads the rank from slurm).
#
#   [GPUS=8 GPUS_PER_NODE=8 CPUS_PER_TASK=5 SRUN_ARGS=...] \
#   tools/slurm_test.sh PARTITION JOB_NAME CONFIG CHECKPOINT [test.py arguments...]
#
# The master port is MASTER_PORT if set, else 29500; the interpreter is $PYTHON (default: python),
# as for tools/install.sh.
set -x

PARTITION=$1
JOB_NAME=$2
CONFIG=$3
CHECKPOINT=$4
GPUS=${GPUS:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
SRUN_ARGS=${SRUN_ARGS:-""}
PYTHON=${PYTHON:-python}
PY_ARGS=("${@:5}")

PYTHONPATH="$(dirname "$0")/..${PYTHONPATH:+:$PYTHONPATH}" \
srun -p "${PARTITION}" \
    --job-name="${JOB_NAME}" \
    --gres=gpu:"${GPUS_PER_NODE}" \
    --ntasks="${GPUS}" \
    --ntasks-per-node="${GPUS_PER_NODE}" \
    --cpus-per-task="${CPUS_PER_TASK}" \
    --kill-on-bad-exit=1 \
    ${SRUN_ARGS} \
    "$PYTHON" -u "$(dirname "$0")/test.py" "${CONFIG}" "${CHECKPOINT}" \
    --launcher=slurm "${PY_ARGS[@]}"
