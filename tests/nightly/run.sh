#!/usr/bin/env bash
# Nightly multi-GPU tests (NCCL; NIGHTLY_CPU=1: gloo on CPU): bash tests/nightly/run.sh [--nnodes N] [--nproc-per-node P]
#   [--node-rank R] [--master-addr HOST] [--master-port PORT] [-- extra pytest args]
# Multi-node: run the same command on every node with its --node-rank and the same --master-addr.
# Then the CP=P benchmark table: add --bench (runs tools/gpu_check.py dist after the tests).
set -euo pipefail
cd "$(dirname "$0")/../.."
NNODES=1; NPROC=2; NODE_RANK=0; MASTER_ADDR=127.0.0.1; MASTER_PORT=29511; BENCH=0; EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes) NNODES="$2"; shift 2;;
    --nproc-per-node|--nproc_per_node) NPROC="$2"; shift 2;;
    --node-rank) NODE_RANK="$2"; shift 2;;
    --master-addr) MASTER_ADDR="$2"; shift 2;;
    --master-port) MASTER_PORT="$2"; shift 2;;
    --bench) BENCH=1; shift;;
    --) shift; EXTRA=("$@"); break;;
    -h|--help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; echo "Python: \$PYTHON (default python3); NIGHTLY_CPU=1: gloo on CPU"; exit 0;;
    *) echo "unknown argument: $1" >&2; exit 2;;
  esac
done
# never use NVLink multicast (shared hosts; see the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
RUN=("$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" --node-rank "$NODE_RANK"
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
"${RUN[@]}" -m pytest -q -p no:cacheprovider tests/nightly/test_cp_nccl.py "${EXTRA[@]}"
# the Megatron DFlash block (TP=1 x CP=2 and TP=2 x CP=1, needs megatron-core; skips without it);
# its own torchrun so the two files never share a process group. -s: rank 0 prints the errors.
"${RUN[@]}" -m pytest -q -s -p no:cacheprovider tests/nightly/test_megatron_nccl.py "${EXTRA[@]}"
if [[ "$BENCH" == 1 ]]; then
  "${RUN[@]}" tools/gpu_check.py dist
fi
