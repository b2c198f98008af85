#!/usr/bin/env bash
# One-call GPU measurement for nvidia-h200-x2 (issue 6: Split-KV against its baselines on H200s).
#
#   bash tools/run_gpu_suite.sh            # from the repository root; writes to $OUT (default out/suite)
#   SUITE_CPU=1 PYTHON=.venv/bin/python bash tools/run_gpu_suite.sh     # every step on CPU, tiny shapes
#
# One GPU (nvidia-h200): bench runs CP = 1 only (its chunk A/B needs CP >= 2: a "SKIPPED" row), slow / exact are
# skipped (logged), simulate takes the link fit from SUITE_LINK_JSON (default
# docs/lab/results/link_h200x2_2026-11-30f.json) and times every shard on the one GPU. SUITE_NPROC forces the rank
# count of the torchrun steps (default: 1 on a one-GPU machine, else 2).
#
# Steps (SUITE_STEPS, comma list, default "kernels,tune,bench,slow,simulate,exact"), in this order of
# priority; each runs under `timeout`, clipped to what is left of SUITE_BUDGET_S (default 540 s of a 600 s
# call), so one failure or hang cannot eat the call (a failed step is logged and the suite goes on; the
# benchmarks also stop starting rows at their own --budget-s and still write their tables):
#   0. environment: GPUs, torch, NCCL env; Transformer Engine from /tmp/site when it is there
#   te. only when TE does not import and its pieces are in /tmp/tp (/work/shared/gpu/README.md): install it
#      with .gpu/small/te_install.sh (carry ".gpu/small"; ~10 s with the built .so there, ~2 min without)
#   fa4. only when /tmp/tp holds tools/fa4_prepare.sh's first part and ".gpu/fa4b" is carried: install
#      FlashAttention-4 (tools/fa4_install.sh) and put /tmp/fa4site on PYTHONPATH ("auto" then picks fa4)
#   kernels (a). tools/gpu_check.py compare on GPU 0: flex vs te (when it imports) vs dense SDPA for the
#      DFlash interval mask, 16K and 64K keys, fwd and fwd+bwd, exactness vs float64; the own block (einsum
#      pass vs kernels on a block-diagonal mask; context + own block fused in one call)
#   tune (e). tools/tune_flex.py: <= 6 FlexAttention kernel_options configs at 16K and 64K keys. With 2+
#      GPUs it runs on GPU 1 AT THE SAME TIME as `kernels` (own budget SUITE_TUNE_S, default 75 s), else
#      after `simulate`
#   bench (b). torchrun 2 x tools/bench_attention.py, CP=1 and CP=2 over NCCL (NVLink), contexts
#      SUITE_CONTEXTS (default 32K, 128K, 512K, 256K, 64K, 16K: the order they run in, so a budget cut
#      drops the last), splitkv / allgather-kv / ring-kv, LPT vs zigzag, then the A/B of splitkv's
#      chunk counts SUITE_CHUNKS_AB (default 1,2,4; "" = none) at 128K in the same process, with each
#      chunk axis of SUITE_CHUNK_AXIS_AB (e.g. rows,heads; default: the op's default)
#   slow (b). the same at 32K and 128K, CP=2, LPT, with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (socket
#      transport over lo: the inter-node stand-in), plus the chunk A/B at 128K
#   simulate (c). torchrun 2 x tools/simulate_scaling.py: collectives measured on the 2 GPUs (alpha-beta
#      fit), real per-rank shards timed (kernel SUITE_SIM_BACKEND, default auto = fa4 / flex; e.g. staircase),
#      CP 1, 2, 8..64, splitkv at k = 1, 2, 4 chunks (best k per P), with and without the Q-gather /
#      dQ all-to-all overlap with the k/v projections (timed on the GPU), under the node topology (8
#      GPUs per node, 50 GB/s NIC per GPU) and the old flat-ring model (SUITE_SIM_CHUNK_AXIS=heads: splitkv's
#      chunks split heads, the op's chunk_axis); measuring budget SUITE_SIM_S
#      (default 65 s); tables + PNG (+ the model's CP=2 row next to the measured op from `bench`).
#      SUITE_SIM_ROUNDS=R (> 0): --paired-rounds R, the P = 1
#      reference shard and every measured splitkv shard re-timed in R interleaved rounds (efficiency per round,
#      median [min-max]); the tool then runs as ONE process (every shard on GPU 0, the link from SUITE_LINK_JSON
#      instead of measured collectives) and the step's limit grows by R x the measuring budget
#   exact. torchrun 2 x tools/gpu_check.py dist --skip op: op exactness at CP=2 over NCCL (bf16 vs float64,
#      out + five gradients) of this tree's ops
#   not by default (name them in SUITE_STEPS; carry ".whl" / ".gpu" as noted): gputests (FIRST, alone: pytest
#      of SUITE_GPU_TESTS, default the GPU test files of kernels, merges, staircase, env), chunkcost
#      (after simulate: tools/chunk_cost.py, query vs head chunks at 16K / 64K keys; SUITE_CHUNKCOST_CP /
#      _CTX / _CHUNKS / _BACKENDS, _HEADS=1 adds the head-chunk variants, _SPLITS=6,2:5,3 uneven head splits), gpucheck (gpu_check dist
#      exactness + timing table at 32K/128K), nightly (tests/nightly/run.sh, Megatron-Core from .whl),
#      pretrain (tools/run_pretrain_gpu.sh, needs .gpu/feat and .whl), stepcost (after pretrain:
#      tools/step_overhead.py, planner + sharding + prepare + BlockMask against a real drafter training step
#      at the Qwen3-8B drafter shapes, CP=1 on GPU 0 then CP=2 with 2 GPUs, Megatron-Core from .whl; each
#      under SUITE_STEPCOST_S, default 270 s; contexts SUITE_STEPCOST_CONTEXTS, default 16K,32K,128K; with
#      SUITE_CPU=1 the --cpu-smoke shapes, default 256,512),
#      nometa (bench without per-step metadata); any extra command in $SUITE_EXTRA
#
# Local kernels: SUITE_BACKEND (default auto = fa4 where installed, else flex) for bench / slow / exact / simulate; SUITE_BENCH_BACKENDS
# (comma list, e.g. staircase) reruns bench's LPT rows with each of them (tables bench_attention_<name>.md,
# budget SUITE_BENCH2_S, contexts SUITE_BENCH2_CONTEXTS); SUITE_EXACT_BACKENDS likewise for `exact`;
# SUITE_GC_KERNELS / SUITE_GC_SWEEP / SUITE_KERNELS_S set gpu_check compare's --kernels / --staircase-sweep /
# time limit.
#
# What comes back in $OUT (<= 8 files): suite.log (everything), suite.json (every step's JSON merged),
# tables.md (every markdown table), simulate_scaling.png (and TE's built .so when `te` built it); the
# compact summary is printed last. Intermediate files live in $WORK (default: a new /tmp/suite.XXXXXX per run),
# not in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ -d /tmp/site && ":$PYTHONPATH:" != *":/tmp/site:"* ]]; then export PYTHONPATH="$PYTHONPATH:/tmp/site"; fi
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/suite_inductor}"  # shared by all steps
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/out/suite}
WORK=${WORK:-$(mktemp -d /tmp/suite.XXXXXX)}  # a fresh one per run: concurrent runs do not clobber each other
export WORK  # SUITE_EXTRA commands write to "$WORK/<name>" to have their tables collected
BUDGET=${SUITE_BUDGET_S:-540}
NPROC_SET=${SUITE_NPROC:-}
STEPS=",${SUITE_STEPS:-kernels,tune,bench,slow,simulate,exact},"
CONTEXTS=${SUITE_CONTEXTS:-32768,131072,524288,262144,65536,16384}
SLOW_CTX=${SUITE_SLOW_CONTEXTS:-32768,131072}
CHUNKS_AB=${SUITE_CHUNKS_AB-1,2,4}
AB_CTX=${SUITE_AB_CONTEXTS:-131072}
TUNE_S=${SUITE_TUNE_S:-75}
CPU=${SUITE_CPU:-0}
BACKEND=${SUITE_BACKEND:-auto}  # local kernel of the ops in bench / slow / exact / simulate
GC_X=(); BENCH_X=(--row-target-s 0.6 --sdpa-max-lk 32768); TUNE_X=()
SIM_X=(--cps 1,2,8,16,32,64 --backend "${SUITE_SIM_BACKEND:-$BACKEND}" --topology node,flat --bwd-gather auto,separate,fused --cp-ranks-per-node 1,8)
if [[ "$CPU" == 1 ]]; then
  GC_X=(--cpu); BENCH_X=(--cpu-smoke --row-target-s 0.2); TUNE_X=(--cpu); CONTEXTS=512,1024; SLOW_CTX=512
  AB_CTX=1024
  SIM_X=(--cpu --cps 1,2,4 --ctx-per-rank 256 --anchors 8 --B 4 --Hq 4 --Hkv 2 --D 16 --hidden 64 --reps 2 \
         --gpus-per-node 2 --topology node,flat --bwd-gather auto,separate,fused --cp-ranks-per-node 1,2)
  export NIGHTLY_CPU=1
fi
AB_X=()
if [[ -n "$CHUNKS_AB" ]]; then AB_X=(--chunks-ab "$CHUNKS_AB" --ab-contexts "$AB_CTX"); fi
# what the chunks split (the op's chunk_axis, docs/lab/perf-notes.md item 21): SUITE_CHUNK_AXIS_AB (e.g. "rows,heads")
# runs every A/B chunk count with each axis side by side; SUITE_SIM_CHUNK_AXIS (rows | heads) for simulate
if [[ -n "$CHUNKS_AB" && -n "${SUITE_CHUNK_AXIS_AB:-}" ]]; then AB_X+=(--chunk-axis-ab "$SUITE_CHUNK_AXIS_AB"); fi
if [[ -n "${SUITE_SIM_CHUNK_AXIS:-}" ]]; then SIM_X+=(--chunk-axis "$SUITE_SIM_CHUNK_AXIS"); fi
mkdir -p "$OUT" "$WORK"
# a rerun on a warm machine must not collect the previous run's files
(cd "$WORK" && rm -rf kernels tune bench slow sim exact gpucheck nometa pretrain stepcost ./*.out)
LOG="$OUT/suite.log"
: > "$LOG"
declare -A STATUS
declare -A BG_PID BG_T0
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NGPU=${NGPU:-0}
# ranks of the torchrun steps: 2, or 1 on a one-GPU machine (then bench runs CP=1 only, slow / exact are
# skipped, simulate takes the intra-node link fit from SUITE_LINK_JSON instead of measuring it)
if [[ -n "$NPROC_SET" ]]; then NPROC=$NPROC_SET; elif [[ "$CPU" != 1 ]] && (( NGPU == 1 )); then NPROC=1; else NPROC=2; fi
LINK_JSON=${SUITE_LINK_JSON:-docs/lab/results/link_h200x2_2026-11-30f.json}
BENCH_CPS=$([[ "$NPROC" -ge 2 ]] && echo 1,2 || echo 1)
RUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")

# the local-kernel names must be registered backends: a typo fails here, not after minutes of steps
KNOWN_BACKENDS=" auto math flex te staircase fa4 "
for VAR in SUITE_BACKEND SUITE_SIM_BACKEND SUITE_BENCH_BACKENDS SUITE_EXACT_BACKENDS; do
  for BK in ${!VAR:+${!VAR//,/ }}; do
    if [[ "$KNOWN_BACKENDS" != *" $BK "* ]]; then
      echo "run_gpu_suite.sh: $VAR: unknown local kernel '$BK' (one of:$KNOWN_BACKENDS)" >&2; exit 2
    fi
  done
done
# step names and time limits are checked here too: a misspelled step would run nothing, a non-integer limit
# breaks the budget arithmetic (exit 2 naming the variable, before any step)
KNOWN_STEPS=" gputests kernels tune bench slow simulate exact gpucheck nightly pretrain stepcost chunkcost nometa "
for ST in ${STEPS//,/ }; do
  if [[ "$KNOWN_STEPS" != *" $ST "* ]]; then
    echo "run_gpu_suite.sh: SUITE_STEPS: unknown step '$ST' (one of:$KNOWN_STEPS)" >&2; exit 2
  fi
done
for VAR in SUITE_BUDGET_S SUITE_TUNE_S SUITE_GPU_TESTS_S SUITE_KERNELS_S SUITE_BENCH_S SUITE_BENCH2_S \
           SUITE_AFTER_BENCH_S SUITE_SIM_S SUITE_CHUNKCOST_S SUITE_PRETRAIN_S SUITE_STEPCOST_S; do
  if [[ -n "${!VAR+x}" && ! "${!VAR}" =~ ^[0-9]+$ ]]; then
    echo "run_gpu_suite.sh: $VAR must be a whole number of seconds, got '${!VAR}'" >&2; exit 2
  fi
done
if [[ -n "${SUITE_SIM_CHUNK_AXIS:-}" && ! "$SUITE_SIM_CHUNK_AXIS" =~ ^(rows|heads)$ ]]; then
  echo "run_gpu_suite.sh: SUITE_SIM_CHUNK_AXIS must be rows or heads, got '$SUITE_SIM_CHUNK_AXIS'" >&2; exit 2
fi
if [[ -n "${SUITE_CHUNK_AXIS_AB:-}" && ! "$SUITE_CHUNK_AXIS_AB" =~ ^(rows|heads)(,(rows|heads))*$ ]]; then
  echo "run_gpu_suite.sh: SUITE_CHUNK_AXIS_AB must be a comma list of rows / heads, got '$SUITE_CHUNK_AXIS_AB'" >&2
  exit 2
fi
# uneven head splits are gone from the op and the tools: refuse their variables rather than ignore them
for V in SUITE_SIM_HEAD_SPLIT SUITE_CHUNKCOST_SPLITS; do
  if [[ -n "${!V:-}" ]]; then
    echo "run_gpu_suite.sh: $V was removed (the op has no uneven head splits; SUITE_SIM_CHUNK_AXIS=heads times its even head chunks)" >&2
    exit 2
  fi
done
# simulate's paired rounds (tools/simulate_scaling.py --paired-rounds)
if [[ -n "${SUITE_SIM_ROUNDS+x}" && ! "${SUITE_SIM_ROUNDS}" =~ ^[0-9]+$ ]]; then
  echo "run_gpu_suite.sh: SUITE_SIM_ROUNDS must be a whole number of rounds (0 = none), got '${SUITE_SIM_ROUNDS}'" >&2
  exit 2
fi
SIM_ROUNDS=$(( 10#${SUITE_SIM_ROUNDS:-0} ))
if (( SIM_ROUNDS > 0 )); then SIM_X+=(--paired-rounds "$SIM_ROUNDS"); fi
want() { [[ "$STEPS" == *",$1,"* ]]; }
left() { echo $(( BUDGET - SECONDS )); }
clip() {  # clip MAX: MAX seconds, or what is left of the budget minus 5 s if less
  local rem; rem=$(left); local lim=$(( $1 < rem - 5 ? $1 : rem - 5 )); echo "$lim"
}

log_step_output() {  # keep the log readable: drop repeated warnings
  grep -v -E "UserWarning|warnings.warn|^\s*$" "$WORK/$1.out" >> "$LOG"
}

skipped() {  # skipped NAME LIMIT: true (and logged) when the budget leaves the step under 15 s
  if (( $2 < 15 )); then
    echo "=== [$1] SKIPPED: $(left)s left of ${BUDGET}s" | tee -a "$LOG"
    STATUS[$1]="skipped (budget)"
    return 0
  fi
  return 1
}

step() {  # step NAME MAX_SECONDS command...
  local name=$1 max=$2; shift 2
  local lim; lim=$(clip "$max")
  skipped "$name" "$lim" && return 0
  echo "=== [$name] start at ${SECONDS}s, limit ${lim}s: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$lim" "$@" > "$WORK/$name.out" 2>&1
  local rc=$?
  log_step_output "$name"
  echo "=== [$name] rc=$rc in $(( SECONDS - t0 ))s" | tee -a "$LOG"
  STATUS[$name]="rc=$rc $(( SECONDS - t0 ))s"
  tail -n 3 "$WORK/$name.out"
  return 0
}

step_bg() {  # step_bg NAME MAX_SECONDS command...: like step, in the background (finish with wait_bg NAME)
  local name=$1 max=$2; shift 2
  local lim; lim=$(clip "$max")
  skipped "$name" "$lim" && return 0
  echo "=== [$name] start (background) at ${SECONDS}s, limit ${lim}s: $*" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=10 "$lim" "$@" > "$WORK/$name.out" 2>&1 &
  BG_PID[$name]=$!
  BG_T0[$name]=$SECONDS
}

wait_bg() {
  local name=$1
  [[ -n "${BG_PID[$name]:-}" ]] || return 0
  wait "${BG_PID[$name]}"
  local rc=$?
  log_step_output "$name"
  echo "=== [$name] (background) rc=$rc in $(( SECONDS - BG_T0[$name] ))s, done at ${SECONDS}s" | tee -a "$LOG"
  STATUS[$name]="rc=$rc $(( SECONDS - BG_T0[$name] ))s (background)"
  tail -n 3 "$WORK/$name.out"
  unset "BG_PID[$name]"
}

two_ranks() {  # two_ranks NAME: true when the step can run (2 ranks), else logged as skipped
  if (( NPROC >= 2 )); then return 0; fi
  echo "=== [$1] SKIPPED: needs 2 GPUs (this machine: $NGPU)" | tee -a "$LOG"
  STATUS[$1]="skipped (one GPU)"
  return 1
}

# 0. environment
{
  echo "date: $(date -u)"; echo "steps: $STEPS budget ${BUDGET}s cpu=$CPU gpus=$NGPU"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -4
  nvidia-smi topo -m 2>&1 | head -6
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM|MEGATRON_SPLITKV)" | sort
} >> "$LOG" 2>&1
te_ok() { "$PY" -c "import transformer_engine.pytorch" > /dev/null 2>&1; }

# te. Transformer Engine from the pieces an earlier warm call left in /tmp/tp (see /work/shared/gpu/README.md)
if [[ "$CPU" != 1 && "${SUITE_TE_INSTALL:-1}" == 1 ]] && compgen -G "/tmp/tp/p0*" > /dev/null \
   && [[ -f .gpu/small/te_install.sh ]] && ! te_ok; then
  step te_install 200 env OUT="$OUT" bash .gpu/small/te_install.sh
  if [[ ":$PYTHONPATH:" != *":/tmp/site:"* ]]; then export PYTHONPATH="$PYTHONPATH:/tmp/site"; fi
fi
echo "transformer_engine: $(te_ok && echo importable || echo 'not importable (te rows say so)')" | tee -a "$LOG"

# fa4. FlashAttention-4 (CuTe DSL) from the pieces of tools/fa4_prepare.sh: .gpu/fa4a copied to /tmp/tp by an
# earlier warm call, .gpu/fa4b carried now (tools/fa4_install.sh -> /tmp/fa4site); then on PYTHONPATH
fa4_ok() { "$PY" -c "import cutlass.cute, flash_attn.cute.interface" > /dev/null 2>&1; }
FA4_PATH="/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages"
if [[ "$CPU" != 1 ]] && [[ -f /tmp/tp/cu13name && -d .gpu/fa4b && ! -d /tmp/fa4site/flash_attn ]]; then
  step fa4_install 120 bash tools/fa4_install.sh
fi
if [[ -d /tmp/fa4site/flash_attn && ":$PYTHONPATH:" != *":/tmp/fa4site:"* ]]; then export PYTHONPATH="$PYTHONPATH:$FA4_PATH"; fi
echo "flash_attn.cute (fa4): $(fa4_ok && echo importable || echo 'not importable (auto uses flex / staircase)')" | tee -a "$LOG"

# g. the GPU tests, alone on the machine (a benchmark beside them spoils its rows): SUITE_GPU_TESTS
if want gputests; then
  GT=${SUITE_GPU_TESTS:-tests/test_fa4_kernel.py tests/test_splitkv_head_chunks_gpu.py tests/test_fused_merge.py tests/test_gpu_kernels.py tests/test_staircase_kernel.py tests/test_auto_kernel_env_gpu.py}
  # shellcheck disable=SC2086
  step g_gputests "${SUITE_GPU_TESTS_S:-200}" "$PY" -m pytest -q -p no:cacheprovider $GT
fi

# a + e. local-kernel comparison on GPU 0; the kernel_options sweep on GPU 1 at the same time
TUNE_BG=0
if want tune && { (( NGPU >= 2 )) || [[ "$CPU" == 1 ]]; } && [[ "${SUITE_TUNE_PARALLEL:-1}" == 1 ]]; then
  TUNE_BG=1
  step_bg e_tune $(( TUNE_S + 30 )) env CUDA_VISIBLE_DEVICES=1 "$PY" tools/tune_flex.py --budget-s "$TUNE_S" \
    --out "$WORK/tune" "${TUNE_X[@]}"
fi
if want kernels; then
  GC_K=(); if [[ -n "${SUITE_GC_KERNELS:-}" ]]; then GC_K+=(--kernels "$SUITE_GC_KERNELS"); fi
  if [[ -n "${SUITE_GC_SWEEP:-}" ]]; then GC_K+=(--staircase-sweep "$SUITE_GC_SWEEP"); fi
  step a_kernels "${SUITE_KERNELS_S:-170}" env CUDA_VISIBLE_DEVICES=0 "$PY" tools/gpu_check.py compare \
    --out "$WORK/kernels" "${GC_K[@]}" "${GC_X[@]}"
fi
if (( TUNE_BG )); then wait_bg e_tune; fi

# old step a: gpu_check dist (op exactness + its own timing table at 32K / 128K)
if want gpucheck; then
  step a_gpu_check 110 "${RUN[@]}" tools/gpu_check.py dist --out "$WORK/gpucheck" \
    --contexts "$([[ $CPU == 1 ]] && echo 1024 || echo 32768,131072)" "${GC_X[@]}"
fi

# Megatron-Core from the carried wheel, only for the steps that need it (carry ".whl")
if { want nightly || want pretrain || want stepcost; } && compgen -G ".whl/*.whl" > /dev/null && ! "$PY" -c "import megatron.core" 2>/dev/null; then
  step megatron_install 40 "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  if [[ ":$PYTHONPATH:" != *":/tmp/site:"* ]]; then export PYTHONPATH="$PYTHONPATH:/tmp/site"; fi
fi
if want nightly && [[ -f tests/nightly/run.sh ]]; then
  step nightly 100 bash tests/nightly/run.sh --nproc-per-node "$NPROC" -- -x
fi
if want pretrain && [[ -d .gpu/feat && "$CPU" != 1 ]]; then
  step pretrain "${SUITE_PRETRAIN_S:-170}" env OUT="$WORK/pretrain" BUDGET_S=$(( ${SUITE_PRETRAIN_S:-170} - 10 )) \
    bash tools/run_pretrain_gpu.sh
fi
# s. planner + sharding overhead against a real DFlash drafter training step (tools/step_overhead.py): CP=1 on
#    GPU 0, then CP=2 over NCCL; the tool stops starting contexts 40 s before its limit (files written per context)
if want stepcost; then
  SC_S=${SUITE_STEPCOST_S:-270}
  SC_X=(--contexts "${SUITE_STEPCOST_CONTEXTS:-16384,32768,131072}")
  if [[ "$CPU" == 1 ]]; then SC_X=(--cpu-smoke --reps 2 --contexts "${SUITE_STEPCOST_CONTEXTS:-256,512}"); fi
  sc_budget() { local lim; lim=$(clip "$SC_S"); echo $(( lim > 80 ? lim - 40 : 40 )); }  # the tool's --budget-s
  step s_stepcost_cp1 "$SC_S" env CUDA_VISIBLE_DEVICES=0 "$PY" tools/step_overhead.py --out "$WORK/stepcost" \
    --budget-s "$(sc_budget)" "${SC_X[@]}"
  if two_ranks s_stepcost_cp2; then
    step s_stepcost_cp2 "$SC_S" "${RUN[@]}" tools/step_overhead.py --out "$WORK/stepcost" --budget-s "$(sc_budget)" \
      "${SC_X[@]}"
  fi
fi

# b. bench, NVLink, CP=1 and CP=2 (+ the chunk A/B at 128K): rows until its budget, which leaves the later
#    steps ~SUITE_AFTER_BENCH_S (default 150 s: slow ~85 s and simulate's minimum; exact gets what is left;
#    0 when none of them is in SUITE_STEPS),
#    at most SUITE_BENCH_S (default 240 s) of rows. CP=1: splitkv only (the three ops
#    do the same kernel work there); zigzag: splitkv and ring-kv (allgather-kv's compute ignores placement)
if want bench; then
  AB_RES=$(( ${#AB_X[@]} ? 35 : 0 ))
  AFTER=0  # reserve time for the later steps only when they will run
  if want slow || want simulate || want exact; then AFTER=${SUITE_AFTER_BENCH_S:-150}; fi
  BB=$(( $(left) - AFTER - 60 ))
  BB=$(( BB > ${SUITE_BENCH_S:-240} ? ${SUITE_BENCH_S:-240} : BB ))
  BB=$(( BB < 60 ? 60 : BB ))
  step b_bench $(( BB + 60 )) "${RUN[@]}" tools/bench_attention.py --cp "$BENCH_CPS" --contexts "$CONTEXTS" \
    --placements lpt,zigzag --cp1-methods splitkv --alt-placement-methods splitkv,ring-kv --budget-s "$BB" \
    --ab-reserve-s "$AB_RES" --backend "$BACKEND" --out "$WORK/bench" "${AB_X[@]}" "${BENCH_X[@]}"
fi
# b'. the same ops with other local kernels (SUITE_BENCH_BACKENDS, comma list, e.g. "staircase"), LPT only,
#     SUITE_BENCH2_CONTEXTS (default: CONTEXTS), in their own process: tables bench_attention_<backend>.md
if want bench && [[ -n "${SUITE_BENCH_BACKENDS:-}" ]]; then
  for BK in ${SUITE_BENCH_BACKENDS//,/ }; do
    step "b_bench_$BK" $(( ${SUITE_BENCH2_S:-90} + 60 )) "${RUN[@]}" tools/bench_attention.py --cp "$BENCH_CPS" \
      --contexts "${SUITE_BENCH2_CONTEXTS:-$CONTEXTS}" --placements lpt --cp1-methods splitkv --no-sdpa \
      --budget-s "${SUITE_BENCH2_S:-90}" --ab-reserve-s 0 --backend "$BK" --tag "$BK" --out "$WORK/bench" \
      "${BENCH_X[@]}"
  done
fi

# b. the same over sockets (NCCL network transport on lo: the inter-node stand-in)
if want slow && two_ranks b_slow; then
  step b_slow 100 env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
    "${RUN[@]}" tools/bench_attention.py --cp 2 --contexts "$SLOW_CTX" --placements lpt --no-sdpa --slow-path \
    --tag slow --budget-s 45 --ab-reserve-s 0 --reps 6 --backend "$BACKEND" --out "$WORK/slow" "${AB_X[@]}" \
    "${BENCH_X[@]}"
fi

# c. weak-scaling simulation with measured collectives and measured per-rank shards
if want simulate; then
  SIM_J=()  # inputs from earlier steps, when they exist (a missing file would stop the tool at its flag check)
  BJ="$WORK/bench/bench_attention.json"; KJ="$WORK/kernels/gpu_check_compare$([[ $CPU == 1 ]] && echo _cpu)_w1.json"
  if [[ -s "$BJ" ]]; then SIM_J+=(--bench-json "$BJ"); fi
  if [[ -s "$KJ" ]]; then SIM_J+=(--kernels-json "$KJ"); fi
  SIM_RUN=("${RUN[@]}")
  if (( SIM_ROUNDS > 0 )); then SIM_RUN=("$PY"); fi  # paired rounds: one process, every shard on one device
  if (( NPROC < 2 || SIM_ROUNDS > 0 )) && [[ "$CPU" != 1 ]]; then SIM_J+=(--link-json "$LINK_JSON"); fi
  SIM_S=${SUITE_SIM_S:-65}  # shards measured for SB s (k = 1 of every method first), the rest modelled
  SB=$(( $(left) - 45 )); SB=$(( SB > SIM_S ? SIM_S : (SB < 20 ? 20 : SB) ))
  step c_simulate $(( SIM_S + 45 + SIM_ROUNDS * SB )) "${SIM_RUN[@]}" tools/simulate_scaling.py "${SIM_X[@]}" \
    --budget-s "$SB" "${SIM_J[@]}" --out "$WORK/sim"
fi

# e. the kernel_options sweep, when it could not run next to `kernels`
if want tune && (( ! TUNE_BG )); then
  step e_tune $(( TUNE_S + 30 )) "$PY" tools/tune_flex.py --budget-s "$TUNE_S" --out "$WORK/tune" "${TUNE_X[@]}"
fi

# exactness of this tree's ops at CP=2 over NCCL (chunked merge pipeline and fused own block included)
if want exact && two_ranks x_exact; then
  step x_exact 75 "${RUN[@]}" tools/gpu_check.py dist --skip op --backend "$BACKEND" --out "$WORK/exact" "${GC_X[@]}"
  for BK in ${SUITE_EXACT_BACKENDS:+${SUITE_EXACT_BACKENDS//,/ }}; do  # more kernels' op exactness (e.g. "staircase")
    step "x_exact_$BK" 75 "${RUN[@]}" tools/gpu_check.py dist --skip op --backend "$BK" --out "$WORK/exact_$BK" \
      "${GC_X[@]}"
  done
fi

# k. what a chunk of the merge pipeline costs the local kernel
if want chunkcost; then
  step k_chunkcost "${SUITE_CHUNKCOST_S:-120}" "$PY" tools/chunk_cost.py --cp "${SUITE_CHUNKCOST_CP:-2}" \
    --ctx-per-rank "$([[ $CPU == 1 ]] && echo 256 || echo "${SUITE_CHUNKCOST_CTX:-16384,65536}")" \
    --chunks "${SUITE_CHUNKCOST_CHUNKS:-2,4}" \
    --backends "$([[ $CPU == 1 ]] && echo math || echo "${SUITE_CHUNKCOST_BACKENDS:-flex,staircase}")" \
    $([[ "${SUITE_CHUNKCOST_HEADS:-0}" == 1 ]] || echo --no-heads) \
    --reps 7 --out "$WORK/chunkcost" \
    $([[ $CPU == 1 ]] && echo "--cpu --anchors 8")
fi

if want nometa; then
  step b_nometa 45 "${RUN[@]}" tools/bench_attention.py --cp 1,2 --contexts "$(echo "$SLOW_CTX" | cut -d, -f1)" \
    --methods splitkv --placements lpt --no-metadata --no-sdpa --tag nometa --budget-s 25 --out "$WORK/nometa" \
    "${BENCH_X[@]}"
fi

if [[ -n "${SUITE_EXTRA:-}" ]]; then
  step extra 120 bash -c "$SUITE_EXTRA"
fi

# collect: one JSON, one markdown file, the PNG(s); then the compact summary (printed last)
"$PY" tools/suite_report.py collect "$WORK" "$OUT" >> "$LOG" 2>&1
{
  echo
  echo "## suite summary ($(date -u +%H:%M) UTC, ${SECONDS}s of ${BUDGET}s)"
  for k in "${!STATUS[@]}"; do echo "- $k: ${STATUS[$k]}"; done | sort
} | tee -a "$LOG"
"$PY" tools/suite_report.py summary "$WORK" "$OUT" 2>&1 | tee -a "$LOG"
echo "in OUT=$OUT: $(cd "$OUT" && ls -s1 --block-size=K | tail -n +2 | tr -s ' \n' ' ')"
