#!/usr/bin/env bash
# Train a recipe on the GPUs of this machine (8 by default), one process per GPU, under DeepSpeed.
#
#   recipes/launch/launch_8gpu.sh CONFIG.yaml [section.key=value ...]
#   recipes/launch/launch_8gpu.sh recipes/llama3.1-8b/eagle3.yaml training.max_steps=50
#
# runs, from the repository root (the configs' relative paths resolve against it):
#
#   deepspeed --num_gpus 8 --module specgraft.train CONFIG.yaml [section.key=value ...]
#
# Environment:
#   NUM_GPUS          processes (GPUs) on this machine; default 8
#   MASTER_PORT       rendezvous port on localhost; default 29500 (pick another for a second job on the machine)
#   DEEPSPEED_TIMEOUT minutes a collective may wait; default 60 here (DeepSpeed's own is 10). Rank 0 alone
#                     re-reads the regenerated data and runs the final evaluation while the others wait.
#   PYTHON            interpreter used to check the config first; default: python
#
# The config is validated once here, before any process starts, so a typo is one clear error rather
# than eight. Regenerate the data first (`specgraft regenerate CONFIG.yaml`): regeneration runs on
# rank 0 alone and would keep the other ranks waiting far longer than any timeout.
set -euo pipefail

usage() {
    sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
[[ $# -ge 1 && "$1" != -h && "$1" != --help ]] || usage

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CONFIG="$1"
shift
# A config named relative to where the script was called from still works after the cd below.
if [[ "$CONFIG" != /* && -f "$CONFIG" ]]; then
    CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
fi
cd "$REPO_ROOT"
if [[ ! -f "$CONFIG" ]]; then
    echo "launch_8gpu.sh: config $CONFIG does not exist" >&2
    exit 2
fi

NUM_GPUS="${NUM_GPUS:-8}"
MASTER_PORT="${MASTER_PORT:-29500}"
export DEEPSPEED_TIMEOUT="${DEEPSPEED_TIMEOUT:-60}"

"${PYTHON:-python}" -c 'import sys
from specgraft.config import ConfigError, load_config
try:
    load_config(sys.argv[1], sys.argv[2:])
except (ConfigError, FileNotFoundError) as err:
    sys.exit(f"error: {err}")' "$CONFIG" "$@"

exec deepspeed --num_gpus "$NUM_GPUS" --master_port "$MASTER_PORT" --module specgraft.train "$CONFIG" "$@"
