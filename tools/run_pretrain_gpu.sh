#!/bin/bash
# examples/pretrain_dflash.py on a 2-GPU machine (nvidia-h200-x2): 100 iterations at CP=2 (2 processes,
# --context-parallel-impl splitkv), then the same seed / data / global batch at CP=1 (1 process), then
# the loss curves of both (tools/plot_loss.py). Self-contained: run from anywhere, on the GPU machine.
#
#   bash tools/run_pretrain_gpu.sh                       # logs and curves into $OUT (default out/pretrain_gpu)
#   BUDGET_S=300 ITERS=100 bash tools/run_pretrain_gpu.sh
#
# Needs (carried, git-ignored): .gpu/feat, the offline features made beforehand on CPU by
# `bash tools/make_gpu_features.sh` (target 6 layers x hidden 128, taps [1, 3], 10 ShareGPT conversations,
# ~4 MB), and .whl/megatron_core-*.whl when megatron-core is not importable (installed with pip --target
# /tmp/site, no index, no deps). The features hold 2-3 packed 4096-token batches per epoch; the training
# iterator (`_batches` in pretrain_dflash.py) cycles epochs endlessly with a new packing order each, so
# 100 iterations x global batch 2 = 200 micro-batches run ~70 epochs of the same 10 conversations.
#
# Env: OUT (output folder), BUDGET_S (wall seconds for both training runs together, default 200: the CP=2
# run gets 55% of it, the CP=1 run what is left, at least 30 s; each run is under `timeout`), ITERS
# (default 100), FEAT (default .gpu/feat), PY (default python3), SEED (default 1234).
# Output in $OUT: pretrain_cp2.log, pretrain_cp1.log (full Megatron logs), commands.txt (the exact
# commands and environment), loss_curves.md and loss_curves.png. No checkpoint is written.
# Exit status: 0 when both runs logged ITERS iterations, 1 otherwise (the curves are written anyway).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/pretrain_gpu}
BUDGET_S=${BUDGET_S:-200}
ITERS=${ITERS:-100}
FEAT=${FEAT:-.gpu/feat}
PY=${PYTHON:-${PY:-python3}}  # PYTHON, as in tests/nightly/run.sh and tools/run_gpu_suite.sh (PY still works)
SITE=${SITE:-/tmp/site}  # where the megatron-core wheel goes when it is not importable
SEED=${SEED:-1234}
mkdir -p "$OUT"
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export CUDA_DEVICE_MAX_CONNECTIONS=1
# keep NVLink multicast off (the lent machines' rule), also for the processes torchrun starts
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}

t0=$SECONDS
# presence check without importing megatron (its import takes ~10 s on a fresh machine)
have_mcore() { "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('megatron') is None or u.find_spec('megatron.training') is None)" 2>/dev/null; }
if ! have_mcore; then
    whl=$(ls .whl/megatron_core-*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || { echo "error: megatron-core not importable and no .whl/megatron_core-*.whl (carry .whl)"; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$whl" 2>&1 | tail -2
    have_mcore || { echo "error: megatron-core not found after installing $whl"; exit 2; }
fi
echo "[run_pretrain_gpu] megatron-core ready in $((SECONDS - t0)) s"
if ! "$PY" -c "import json,sys; m=json.load(open('$FEAT/meta.json')); sys.exit(m['dim']!=256 or m['tap_layers']!=[1,3])" 2>/dev/null; then
    echo "error: $FEAT missing or not made for this shape: run 'bash tools/make_gpu_features.sh' on CPU and carry .gpu"
    exit 2
fi
NGPU=${NGPU:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}

COMMON="--num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2
 --kv-channels 32 --ffn-hidden-size 256 --normalization RMSNorm --qk-layernorm --swiglu --disable-bias-linear
 --position-embedding-type rope --rotary-base 1000000 --attention-dropout 0 --hidden-dropout 0
 --untie-embeddings-and-output-weights --vocab-size 151936 --seq-length 4096 --max-position-embeddings 4096
 --micro-batch-size 1 --global-batch-size 2 --train-iters $ITERS --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine
 --lr-warmup-iters 2 --seed $SEED --data-seed 0 --bf16 --transformer-impl local --no-gradient-accumulation-fusion
 --no-masked-softmax-fusion --no-rope-fusion --no-persist-layer-norm --context-parallel-impl splitkv
 --num-anchors 32 --block-size 16 --target-num-layers 6 --target-ffn-hidden-size 256 --features-path $FEAT
 --log-interval 1 --eval-iters 0 --eval-interval 100000"
COMMON=$(echo $COMMON)  # one line
CMD2="torchrun --nnodes 1 --nproc-per-node 2 --master-port 29511 examples/pretrain_dflash.py $COMMON --context-parallel-size 2"
CMD1="torchrun --nnodes 1 --nproc-per-node 1 --master-port 29512 examples/pretrain_dflash.py $COMMON --context-parallel-size 1"
{
    echo "# tools/run_pretrain_gpu.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    "$PY" -c "import torch, importlib.metadata as md; print('# torch', torch.__version__, 'megatron-core', md.version('megatron-core'), 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>/dev/null
    echo "# env: CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE PYTHONPATH=$SITE:\$PWD; features: $FEAT ($(du -sh "$FEAT" | cut -f1))"
    echo "$CMD2"
    echo "CUDA_VISIBLE_DEVICES=0 $CMD1"
} > "$OUT/commands.txt"
cat "$OUT/commands.txt"

count_iters() { grep -cE "iteration +[0-9]+/ *$ITERS \|.*lm loss:" "$1" 2>/dev/null || true; }
status=0
T2=$((BUDGET_S * 55 / 100))
echo "[run_pretrain_gpu] CP=2 run, timeout ${T2} s"
t1=$SECONDS
if [ "$NGPU" -ge 2 ]; then
    timeout -k 10 "$T2" $CMD2 > "$OUT/pretrain_cp2.log" 2>&1
    rc2=$?
else
    echo "error: $NGPU GPU(s), CP=2 needs 2" | tee "$OUT/pretrain_cp2.log"
    rc2=3
fi
n2=$(count_iters "$OUT/pretrain_cp2.log")
echo "[run_pretrain_gpu] CP=2 rc=$rc2, $n2/$ITERS iterations, $((SECONDS - t1)) s"
T1=$((BUDGET_S - (SECONDS - t1)))
[ "$T1" -ge 30 ] || T1=30
echo "[run_pretrain_gpu] CP=1 run, timeout ${T1} s"
t1=$SECONDS
CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$T1" $CMD1 > "$OUT/pretrain_cp1.log" 2>&1
rc1=$?
n1=$(count_iters "$OUT/pretrain_cp1.log")
echo "[run_pretrain_gpu] CP=1 rc=$rc1, $n1/$ITERS iterations, $((SECONDS - t1)) s"
for f in "$OUT/pretrain_cp2.log" "$OUT/pretrain_cp1.log"; do
    if grep -qE "Traceback|Error" "$f"; then
        echo "---- errors in $f"; grep -E -B2 -A12 "Traceback" "$f" | head -60; grep -E "Error" "$f" | sort | uniq -c | head -10
    fi
done
[ "$rc2" = 0 ] && [ "$rc1" = 0 ] && [ "$n2" -ge "$ITERS" ] && [ "$n1" -ge "$ITERS" ] || status=1
echo "[run_pretrain_gpu] total $((SECONDS - t0)) s, status $status"
"$PY" tools/plot_loss.py --cp2 "$OUT/pretrain_cp2.log" --cp1 "$OUT/pretrain_cp1.log" --out "$OUT/loss_curves"
exit $status
