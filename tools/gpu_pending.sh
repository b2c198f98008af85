#!/usr/bin/env bash
# The GPU runs this tree still needs (docs/benchmarks.md "Pending"), for the device tool's one-GPU machine, in
# two calls after FA4's two-part install (tools/fa4_prepare.sh; the machine warm between the calls):
#   here:   bash tools/fa4_prepare.sh                           # .gpu/fa4a, .gpu/fa4b
#           git archive OLD megatron_splitkv | tar -x -C .old   # the tree before (e.g. a6d37d5), for splitkv-old
#           pip download --no-deps turbo-dllm==0.1.6 -d .whlsmall   # (manylinux, py3.12: see the device README)
#           python -c "import sys; sys.path[:0] = ['tools', '.']; import bench_attention as b; \
#             [b.cached_pack_workload('.old/packs.json', 'sharegpt', t, 512, seed=0) for t in (16384, 32768, 65536, 131072)]"
#   call 1: carry .gpu/fa4a;                        mkdir -p /tmp/tp && cp .gpu/fa4a/* /tmp/tp/
#   call 2: carry .gpu/fa4b .old .whlsmall;         bash tools/gpu_pending.sh A      (~450 s)
#   call 3: the same carry;                         bash tools/gpu_pending.sh B      (~350 s)
# A: the packs (fold off / on / the old tree / Turbo-dLLM / flex, profile by kernel at 16K and 128K), the fa4 GPU
# tests, tools/window_scaling.py. B: fa4 vs flex on a windowed layer, the other GPU test files. Everything
# under $OUT/r, tarred into $OUT/all<stage>.tgz.
set -x
STAGE=${1:?stage A or B}
export PYTHONUNBUFFERED=1
if [ ! -f /tmp/fa4site/.done ]; then bash tools/fa4_install.sh > /tmp/fa4.log 2>&1 && touch /tmp/fa4site/.done; tail -3 /tmp/fa4.log; fi
if [ ! -d /tmp/site/dllm_parallel ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlsmall/*.whl; fi
export PYTHONPATH=$PWD:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
R=${OUT:-out/pending}/r
mkdir -p "$R"
if [ "$STAGE" = A ]; then
  nvidia-smi -L; python3 -c "import torch, flash_attn.cute, dllm_parallel; print(torch.__version__, torch.cuda.get_device_name())"
  timeout 190 python3 tools/bench_attention.py --peers-only --check --cp 1 --backend fa4 --old-tree .old \
    --pack-cache .old/packs.json --packs 16384,131072,65536,32768 --pack-kinds sharegpt,one \
    --pack-methods splitkv,splitkv-fold,splitkv-old,turbo,flex --pack-reps 5 --budget-s 115 \
    --pack-profile splitkv,splitkv-fold --pack-profile-packs 16384,131072 --tag packs --out "$R" > "$R/packs.log" 2>&1
  echo "packs rc=$?"; grep -v "^\[profile\]" "$R/packs.log" | tail -30
  timeout 70 python3 -m pytest -q tests/test_fa4_kernel.py -k "key_tiles or sliding or splitkv_op or empty or native" \
    > "$R/fa4tests1.log" 2>&1; echo "fa4tests1 rc=$?"; tail -5 "$R/fa4tests1.log"
  timeout 70 python3 -m pytest -q tests/test_fa4_kernel.py -k "gpu_exact or key_split or determin" \
    > "$R/fa4tests2.log" 2>&1; echo "fa4tests2 rc=$?"; tail -5 "$R/fa4tests2.log"
  timeout 75 python3 tools/window_scaling.py --backend fa4 --sample-ranks --reps 3 --warmup 1 --budget-s 35 \
    --out "$R" > "$R/winscale.log" 2>&1; echo "winscale rc=$?"; tail -25 "$R/winscale.log"
else
  for be in fa4 flex; do
    timeout 90 python3 tools/bench_attention.py --cp 1 --contexts 65536 --methods splitkv --backend $be --window 2048 \
      --causal --no-sdpa --reps 5 --kernel-reps 3 --tag w2048_$be --out "$R" > "$R/w_$be.log" 2>&1
    echo "w $be rc=$?"; tail -8 "$R/w_$be.log"
  done
  timeout 240 python3 -m pytest -q tests/test_fused_merge.py tests/test_gpu_kernels.py tests/test_mask_cache.py \
    tests/test_splitkv_head_chunks_gpu.py tests/test_splitkv_two_level_relay.py tests/test_staircase_kernel.py \
    tests/test_metadata_from_plan.py > "$R/gputests.log" 2>&1; echo "gputests rc=$?"; tail -8 "$R/gputests.log"
fi
tar czf "$(dirname "$R")/all$STAGE.tgz" -C "$(dirname "$R")" r; ls -la "$R"
