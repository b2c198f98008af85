#!/usr/bin/env bash
# One-call GPU suite for nvidia-h200-x2 (issue 6): exactness, attention benchmarks, scaling simulation.
#
#   bash tools/run_gpu_suite.sh            # from the repository root; writes to $OUT (default out/suite)
#
# Steps, in this order of priority (each under `timeout`, clipped to what is left of SUITE_BUDGET_S,
# default 530 s, so one failure or hang cannot eat the call; a failed step is logged and the suite goes
# on; the benchmarks also stop starting rows at their --budget-s and still write their tables):
#   0. environment: GPUs, torch, NCCL env
#   a. torchrun 2 x tools/gpu_check.py dist: op exactness at CP=2 (bf16 vs float64) + timing table, 32K/128K
#   Megatron-Core from the carried wheel (.whl/*.whl -> /tmp/site; carry ".whl" in the device call)
#   e. tests/nightly/run.sh: op exactness over NCCL + Megatron DFlash block TP1xCP2 and TP2xCP1 in bf16
#   p. tools/run_pretrain_gpu.sh: pretrain_dflash.py 100 iterations at CP=2 and CP=1 + loss curves
#      (needs .gpu/feat, made by tools/make_gpu_features.sh; carry ".gpu")
#   b. torchrun 2 x tools/bench_attention.py: CP=1 and CP=2 (NVLink), 32K, 128K, then 16K, 64K while the
#      budget allows, LPT vs zigzag placement
#   c. bench_attention with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (socket transport, inter-node stand-in)
#      at 32K and 128K, CP=2, labelled --slow-path
#   d. torchrun 2 x tools/simulate_scaling.py: collectives measured on the 2 GPUs (alpha-beta fit), real
#      per-rank shards for CP 2..64 timed on the GPUs, weak-scaling table + PNG (+ model check vs b)
#   b2. splitkv without per-step metadata (CP=1, 2 at 32K): what the metadata reuse buys
#   any extra command in $SUITE_EXTRA
# SUITE_CPU=1 runs every step on CPU with tiny shapes (plumbing check; PYTHON=.venv/bin/python).
#
# What comes back in $OUT (<= 8 files): suite.log (everything), suite.json (every step's JSON merged),
# tables.md (every markdown table), simulate_scaling.png; the compact summary is printed last.
# Intermediate files live in $WORK (default /tmp/suite), not in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/suite_inductor}"  # shared by all steps
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/out/suite}
WORK=${WORK:-/tmp/suite}
BUDGET=${SUITE_BUDGET_S:-530}
NPROC=${SUITE_NPROC:-2}
CONTEXTS=${SUITE_CONTEXTS:-32768,131072,16384,65536}
# SUITE_CPU=1: dry run of every step on CPU (gloo, tiny shapes) to check the plumbing off the GPU
GC_X=(); BENCH_X=(); SLOW_CTX=32768,131072; SIM_X=(--cps 1,2,8,16,32,64)
if [[ "${SUITE_CPU:-0}" == 1 ]]; then
  GC_X=(--cpu); BENCH_X=(--cpu-smoke); CONTEXTS=512,1024; SLOW_CTX=512
  SIM_X=(--cpu --cps 1,2,4 --ctx-per-rank 256 --anchors 8 --B 4 --Hq 4 --Hkv 2 --D 16 --reps 2)
  export NIGHTLY_CPU=1
fi
mkdir -p "$OUT" "$WORK"
LOG="$OUT/suite.log"
: > "$LOG"
RUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
declare -A STATUS

left() { echo $(( BUDGET - SECONDS )); }

step() {  # step NAME MAX_SECONDS command...
  local name=$1 max=$2; shift 2
  local rem; rem=$(left)
  local lim=$(( max < rem - 5 ? max : rem - 5 ))
  if (( lim < 15 )); then
    echo "=== [$name] SKIPPED: ${rem}s left of ${BUDGET}s" | tee -a "$LOG"
    STATUS[$name]="skipped"
    return 0
  fi
  echo "=== [$name] start at ${SECONDS}s, limit ${lim}s: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$lim" "$@" > "$WORK/$name.out" 2>&1
  local rc=$?
  # keep the log readable: drop repeated warnings
  grep -v -E "UserWarning|warnings.warn|^\s*$" "$WORK/$name.out" >> "$LOG"
  echo "=== [$name] rc=$rc in $(( SECONDS - t0 ))s" | tee -a "$LOG"
  STATUS[$name]="rc=$rc $(( SECONDS - t0 ))s"
  tail -n 3 "$WORK/$name.out"
  return 0
}

# 0. environment
{
  echo "date: $(date -u)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -4
  nvidia-smi topo -m 2>&1 | head -6
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM)" | sort
} >> "$LOG" 2>&1

# a. exactness at CP=2 + gpu_check's own timing table (issue 2: 32K and 128K)
step a_gpu_check 110 "${RUN[@]}" tools/gpu_check.py dist --out "$WORK/a" \
  --contexts "$([[ ${SUITE_CPU:-0} == 1 ]] && echo 1024 || echo 32768,131072)" "${GC_X[@]}"

# Megatron-Core from the carried wheel (.whl is git-ignored: carry ".whl" in the device call)
if compgen -G ".whl/*.whl" > /dev/null && ! "$PY" -c "import megatron.core" 2>/dev/null; then
  step e_megatron_install 40 "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

# e. nightly NCCL suite: op exactness (flex, math) + Megatron DFlash block TP1xCP2 / TP2xCP1 in bf16
if [[ -f tests/nightly/run.sh ]]; then
  step e_nightly 100 bash tests/nightly/run.sh --nproc-per-node "$NPROC" -- -x
fi

# p. the main job: pretrain_dflash.py 100 iterations at CP=2 and at CP=1 (issue 5); needs .gpu/feat carried
if [[ -d .gpu/feat && "${SUITE_CPU:-0}" != 1 ]]; then
  step p_pretrain ${SUITE_PRETRAIN_S:-170} env OUT="$WORK/p" BUDGET_S=$(( ${SUITE_PRETRAIN_S:-170} - 10 )) \
    bash tools/run_pretrain_gpu.sh
  cp "$WORK"/p/pretrain_cp*.log "$OUT"/ 2>/dev/null
fi

# b. bench, NVLink, CP=1 and CP=2
step b_bench 120 "${RUN[@]}" tools/bench_attention.py --cp 1,2 --contexts "$CONTEXTS" \
  --placements lpt,zigzag --budget-s 90 --out "$WORK/b" "${BENCH_X[@]}"

# c. bench, socket transport (inter-node stand-in)
step c_bench_slow 70 env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "${RUN[@]}" tools/bench_attention.py \
  --cp 2 --contexts "$SLOW_CTX" --placements lpt --no-sdpa --slow-path --tag slow --budget-s 40 --out "$WORK/c" \
  "${BENCH_X[@]}"

# d. weak-scaling simulation with measured collectives and measured per-rank shards
step d_simulate 100 "${RUN[@]}" tools/simulate_scaling.py "${SIM_X[@]}" --budget-s 70 \
  --bench-json "$WORK/b/bench_attention.json" --out "$WORK/d"

# b2. the self-contained call (no per-step metadata: size/metadata gathers and BlockMask build per call),
#     to measure what the metadata reuse buys (docs/perf-notes.md, optimisation 5)
step b2_bench_nometa 45 "${RUN[@]}" tools/bench_attention.py --cp 1,2 --contexts "$(echo "$SLOW_CTX" | cut -d, -f1)" \
  --methods splitkv --placements lpt --no-metadata --no-sdpa --tag nometa --budget-s 25 --out "$WORK/b2" \
  "${BENCH_X[@]}"

if [[ -n "${SUITE_EXTRA:-}" ]]; then
  step e_extra 120 bash -c "$SUITE_EXTRA"
fi

# collect: one JSON, one markdown file, the PNG(s)
"$PY" - "$WORK" "$OUT" <<'EOF' >> "$LOG" 2>&1
import glob, json, os, sys
work, out = sys.argv[1], sys.argv[2]
merged = {}
for p in sorted(glob.glob(os.path.join(work, "*", "*.json"))):
    try:
        merged[os.path.relpath(p, work)] = json.load(open(p))
    except Exception as e:  # noqa: BLE001
        merged[os.path.relpath(p, work)] = {"unreadable": str(e)}
json.dump(merged, open(os.path.join(out, "suite.json"), "w"), indent=1, default=str)
parts = []
for p in sorted(glob.glob(os.path.join(work, "*", "*.md"))):
    parts.append(f"<!-- {os.path.relpath(p, work)} -->\n" + open(p).read())
for p in sorted(glob.glob(os.path.join(work, "a", "*.log"))):  # gpu_check's tables are at the end of its log
    txt = open(p).read().splitlines()
    tab = [l for l in txt if l.startswith("|") or l == ""]
    parts.append(f"<!-- {os.path.relpath(p, work)} (tables) -->\n" + "\n".join(tab))
open(os.path.join(out, "tables.md"), "w").write("\n\n".join(parts) + "\n")
for p in sorted(glob.glob(os.path.join(work, "*", "*.png")))[:2]:
    import shutil
    shutil.copy(p, os.path.join(out, os.path.basename(p)))
print("collected", len(merged), "json,", len(parts), "tables")
EOF

# compact combined table, printed last
echo
echo "## suite summary ($(date -u +%H:%M) UTC, ${SECONDS}s)"
for k in "${!STATUS[@]}"; do echo "- $k: ${STATUS[$k]}"; done | sort
"$PY" - "$WORK" <<'EOF'
import json, os, sys
work = sys.argv[1]
def load(p):
    try:
        return json.load(open(os.path.join(work, p)))
    except Exception:
        return None
g = load("a/gpu_check_dist_w2.json")
if g:
    for r in g.get("op_exactness_cp2", []):
        errs = " ".join(f"{k}={r[k]:.1e}" for k in ("out", "q", "k_ctx", "v_ctx") if isinstance(r.get(k), float))
        print(f"exact CP=2 {r['op']}: ok={r['ok']} {errs}" + (" ERROR" if "error" in r else ""))
for tag, p in (("nvlink", "b/bench_attention.json"), ("socket", "c/bench_attention_slow.json"),
               ("no-metadata", "b2/bench_attention_nometa.json")):
    b = load(p)
    if not b:
        print(f"bench {tag}: no result"); continue
    print(f"\n| {tag} | CP | place | ctx | op ms | comm/rank MB | peak GiB | kern ms | kern TF/s | SDPA TF/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in b["rows"]:
        if "error" in r:
            print(f"| {r['method']} | {r['cp']} | {r.get('placement')} | {r['context']} | ERROR {r['error'].splitlines()[0][:50]} |")
            continue
        sd = r.get("sdpa_fwdbwd_tflops")
        print(f"| {r['method']} | {r['cp']} | {r['placement']} | {r['context'] // 1024}K | {r['op_ms']:.2f} | "
              f"{r['comm_bytes'] / 1e6:.0f} | {r['peak_mem_gib']:.1f} | {r['kernel_ms']:.2f} | {r['kernel_tflops']:.0f} | "
              f"{'-' if sd is None else f'{sd:.0f}'} |")
s = load("d/simulate_scaling.json")
if s:
    print(f"\nsimulated weak scaling ({s['link_source']}; overhead {s['overhead_ms']:.1f} ms {s['overhead_source']})")
    print("| P | method | place | T(P) ms | compute | comm (exposed) | eff. | src | measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in s["rows"]:
        m = r.get("bench_measured_ms")
        print(f"| {r['P']} | {r['method']} | {r['placement']} | {r['total_ms']:.1f} | {r['compute_ms']:.1f} | "
              f"{r['comm_ms']:.1f} ({r['exposed_comm_ms']:.1f}) | {100 * r['efficiency']:.0f}% | {r['compute_source']} | "
              f"{'-' if m is None else f'{m:.1f}'} |")
    print("link:", json.dumps({k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in s["link"]["intra"].items()}))
else:
    print("simulate: no result")
EOF
ls -la "$OUT"
