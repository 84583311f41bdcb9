#!/usr/bin/env bash
# Distributed testing with torchrun (GPUs, or CPU processes with gloo on machines without a GPU).
#
#   tools/dist_test.sh CONFIG CHECKPOINT GPUS [test.py arguments...]
#
# The interpreter is $PYTHON (default: python), as for tools/install.sh.
# Multi-node: run on every node with NNODES, NODE_RANK, MASTER_ADDR (node 0's address) and PORT.
set -euo pipefail

CONFIG=$1
CHECKPOINT=$2
GPUS=$3
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
PYTHON=${PYTHON:-python}

PYTHONPATH="$(dirname "$0")/..${PYTHONPATH:+:$PYTHONPATH}" \
"$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$GPUS" \
    --master_port="$PORT" \
    "$(dirname "$0")/test.py" \
    "$CONFIG" \
    "$CHECKPOINT" \
    --launcher pytorch "${@:4}"
