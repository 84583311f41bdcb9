#!/usr/bin/env bash
# Distributed training on one or more machines with torchrun (one process per GPU, or per CPU
# process on machines without a GPU, where tools/train.py switches to gloo).
#
#   tools/dist_train.sh CONFIG GPUS [train.py arguments...]
#
# The interpreter is $PYTHON (default: python), as for tools/install.sh.
# Multi-node: run on every node with NNODES, NODE_RANK, MASTER_ADDR (node 0's address) and PORT.
set -euo pipefail

CONFIG=$1
GPUS=$2
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
    "$(dirname "$0")/train.py" \
    "$CONFIG" \
    --launcher pytorch "${@:3}"
