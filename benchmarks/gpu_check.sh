#!/usr/bin/env bash
# The engine on one CUDA GPU, in one short call: `pytest -m cuda`, then a SmolLM2-shaped batch bench in bf16 with the
# kernels and host syncs a step (docs/engine.md), its verification forward eager and then captured per size.
#
# Here, on a machine with ../shared and pip (once):
#     benchmarks/gpu_check.sh prepare
# copies what a GPU machine that reaches nothing else lacks into .gpu/ (git-ignored): ../shared's stories260K and
# prompt sets, SmolLM2-135M's config and tokenizer, and wheels of the packages such an image may lack (pydantic).
# There, from the repository root, with .gpu beside it:
#     benchmarks/gpu_check.sh run OUTDIR
# writes OUTDIR/cuda_tests.log, OUTDIR/bench-{eager,capture}.{json,log} and prints the summaries.
#
# SmolLM2's weights (a 98 MB GGUF) are more than one such call carries (64 MiB), so the bench's target is SmolLM2's
# architecture with seeded random weights in bf16: a step's cost and counts are SmolLM2's, its acceptance is not
# (an untrained EAGLE-3 head of the recipe's shape and prompt lookup draft beside it). The bench runs twice, eager
# and with --capture (the verification forward and the head's draft forwards replayed as CUDA graphs); each writes its own results.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HERE=.gpu

prepare() {
    local shared=../shared
    [ -d "$shared/models/stories260K" ] || { echo "gpu_check prepare: $shared/models/stories260K not found" >&2; exit 1; }
    grep -qx "/$HERE/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$HERE/" >> .git/info/exclude; }
    rm -rf "$HERE" && mkdir -p "$HERE/shared/models" "$HERE/shared/data" "$HERE/smollm2" "$HERE/whl"
    cp -r "$shared/models/stories260K" "$HERE/shared/models/"
    cp "$shared/data/story_prompts_dev.jsonl" "$shared/data/mt_bench_question.jsonl" "$HERE/shared/data/"
    local smol="$shared/models/SmolLM2-135M-Instruct"
    cp "$smol"/config.json "$smol"/generation_config.json "$smol"/tokenizer.json "$smol"/tokenizer_config.json "$HERE/smollm2/"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$HERE/whl" pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    du -sh "$HERE"
}

run() {
    local out=${1:?usage: gpu_check.sh run OUTDIR}
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
    [ -e ../shared ] || ln -s "$PWD/$HERE/shared" ../shared  # where the tests look for their assets
    local site=/tmp/specgraft-site
    "$PY" -c "import pydantic" 2>/dev/null || "$PY" -m pip install -q --no-index --no-deps --target "$site" "$HERE"/whl/*.whl
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" . >/dev/null
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

    # 1. Exactness and the sync budgets on the GPU (tests/test_cuda.py).
    set +e
    timeout 240 "$PY" -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider -p no:randomly -n 0 2>&1 | tee "$out/cuda_tests.log"
    set -e

    # 2. A SmolLM2-shaped target (seeded random bf16 weights) and an untrained EAGLE-3 head of the recipe's shape.
    "$PY" - "$HERE/smollm2" "$out/target" "$out/eagle3" <<'EOF'
import shutil, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import specgraft as sg
from specgraft.heads import build_head, save_head
from specgraft.heads.configs import Eagle3Config

source, target_dir, head_dir = sys.argv[1:]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.bfloat16)
model.save_pretrained(target_dir)
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(f"{source}/{name}", target_dir)
target = sg.load_target(target_dir, device="cuda", dtype="bfloat16")
save_head(build_head(Eagle3Config(draft_vocab_size=2048), target), head_dir, target)
EOF
    for mode in eager capture; do
        local flag=""; [ "$mode" = capture ] && flag=--capture
        timeout 150 "$PY" -m specgraft.cli bench --target "$out/target" --device cuda --dtype bfloat16 $flag \
            --method "$out/eagle3" chain:3 --method "$out/eagle3" dynamic:4,4,12 --method prompt-lookup chain:4 --batch-size 1,8,32 \
            --prompts "$HERE/shared/data/mt_bench_question.jsonl" --limit 32 --max-new-tokens 32 --rounds 1 \
            --out "$out/bench-$mode" --json > "$out/bench-$mode.json" 2> "$out/bench-$mode.log" || true
        echo "== bench, $mode"; tail -n 30 "$out/bench-$mode.log"
    done
    rm -rf "$out/target" "$out/eagle3"  # nothing that large comes back
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) echo "usage: benchmarks/gpu_check.sh prepare | run OUTDIR" >&2; exit 2 ;;
esac
