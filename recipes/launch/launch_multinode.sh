#!/usr/bin/env bash
# Train a recipe on several nodes of 8 GPUs each, under DeepSpeed's ssh (pdsh) launcher. Run it on node 0.
#
#   HOSTFILE=hostfile NUM_NODES=2 recipes/launch/launch_multinode.sh CONFIG.yaml [section.key=value ...]
#
# runs, from the repository root (the configs' relative paths resolve against it):
#
#   deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 [--master_addr ADDR] --master_port 29500 \
#       --module specgraft.train CONFIG.yaml [section.key=value ...]
#
# Before the first run (recipes/README.md, "Several nodes", says more):
#   hostfile   one line per node, "HOSTNAME slots=8" (recipes/launch/hostfile.example); the first host is
#              node 0, where rank 0 runs. NUM_NODES takes the first N hosts.
#   ssh        this machine reaches every host in the hostfile, itself included, by passwordless ssh, and
#              has pdsh installed. DeepSpeed runs `cd <this repository>; <this python> -m deepspeed.launcher.launch`
#              on every host: the repository and its virtual environment must sit at the same paths there.
#   storage    training.output_dir and data.regenerate.output on a filesystem every node sees: rank 0
#              writes them, every rank reads the regenerated data and resumes from the checkpoints.
#   variables  DeepSpeed forwards only names starting NCCL, PYTHON, UCX, MV2 or MLFLOW to the hosts,
#              plus the KEY=VALUE lines of ~/.deepspeed_env or ./.deepspeed_env. Put HF_HOME, HF_TOKEN and
#              DEEPSPEED_TIMEOUT=60 (minutes a collective may wait; DeepSpeed's default is 10) there.
#
# Environment:
#   HOSTFILE       default: ./hostfile (relative to where this script is called from)
#   NUM_NODES      nodes to use; default: every host in the hostfile
#   GPUS_PER_NODE  default 8
#   MASTER_ADDR    node 0's address on the network the nodes share. Default: DeepSpeed asks the first host
#                  over ssh (`hostname -I`) and takes the first address, which is wrong on hosts with
#                  several networks (management, InfiniBand): set it there.
#   MASTER_PORT    default 29500; must be open from every node to node 0
#   NCCL_*         forwarded to every node as they are: NCCL_SOCKET_IFNAME=eth0 picks the interface for
#                  bootstrap and socket traffic, NCCL_IB_HCA=mlx5 the InfiniBand adapters (NCCL_IB_DISABLE=1
#                  when there is none), NCCL_DEBUG=INFO prints what NCCL chose.
#   PYTHON         interpreter used to check the config first; default: python
set -euo pipefail

usage() {
    sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
[[ $# -ge 1 && "$1" != -h && "$1" != --help ]] || usage

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
absolute() {  # an existing file named relative to the caller's directory, as an absolute path
    if [[ "$1" != /* && -f "$1" ]]; then echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; else echo "$1"; fi
}
CONFIG="$(absolute "$1")"
shift
HOSTFILE="$(absolute "${HOSTFILE:-hostfile}")"
cd "$REPO_ROOT"
if [[ ! -f "$CONFIG" ]]; then
    echo "launch_multinode.sh: config $CONFIG does not exist" >&2
    exit 2
fi
if [[ ! -f "$HOSTFILE" ]]; then
    echo "launch_multinode.sh: hostfile $HOSTFILE does not exist; start from recipes/launch/hostfile.example" >&2
    exit 2
fi

HOSTS="$(grep -cE '^[[:space:]]*[^#[:space:]]' "$HOSTFILE" || true)"
NUM_NODES="${NUM_NODES:-$HOSTS}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_PORT="${MASTER_PORT:-29500}"
if (( NUM_NODES < 1 || NUM_NODES > HOSTS )); then
    echo "launch_multinode.sh: NUM_NODES=$NUM_NODES, but $HOSTFILE lists $HOSTS hosts" >&2
    exit 2
fi
if ! grep -qs '^DEEPSPEED_TIMEOUT=' "$HOME/.deepspeed_env" .deepspeed_env; then
    echo "launch_multinode.sh: note: no DEEPSPEED_TIMEOUT in ~/.deepspeed_env or ./.deepspeed_env;" \
        "the other ranks wait at most DeepSpeed's default 10 minutes while rank 0 evaluates" >&2
fi

"${PYTHON:-python}" -c 'import sys
from specgraft.config import ConfigError, load_config
try:
    load_config(sys.argv[1], sys.argv[2:])
except (ConfigError, FileNotFoundError) as err:
    sys.exit(f"error: {err}")' "$CONFIG" "$@"

MASTER=()
if [[ -n "${MASTER_ADDR:-}" ]]; then
    MASTER=(--master_addr "$MASTER_ADDR")
fi
exec deepspeed --hostfile "$HOSTFILE" --num_nodes "$NUM_NODES" --num_gpus "$GPUS_PER_NODE" \
    "${MASTER[@]}" --master_port "$MASTER_PORT" --module specgraft.train "$CONFIG" "$@"
