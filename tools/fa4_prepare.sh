#!/usr/bin/env bash
# Fetch FlashAttention-4 (CuTe DSL) and its wheels for a GPU machine without network (the `fa4` kernel,
# docs/kernels.md "FA4 kernel"), split to fit two transfers of < 64 MiB each:
#   .gpu/fa4a/  small wheels + the first 40 MB of nvidia-cutlass-dsl-libs-cu13 (+ its file name)
#   .gpu/fa4b/  the rest of that wheel
# On the GPU machine (warm between the calls): carry .gpu/fa4a and `mkdir -p /tmp/tp && cp .gpu/fa4a/* /tmp/tp/`,
# then carry .gpu/fa4b and run `bash tools/fa4_install.sh` (installs into /tmp/fa4site; tools/run_gpu_suite.sh
# does that itself when /tmp/tp holds the first part). Versions: the ones measured (2026-11-30, H200, torch
# 2.11.0+cu130); a machine with network needs only `pip install 'megatron-splitkv[fa4]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DL=$(mktemp -d /tmp/fa4dl.XXXXXX)
"$PY" -m pip download -q --no-deps --pre -d "$DL" --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 \
  'flash-attn-4==4.0.0b36' 'nvidia-cutlass-dsl==4.8.1' 'nvidia-cutlass-dsl-libs-base==4.8.1' \
  'nvidia-cutlass-dsl-libs-core==4.8.1' 'nvidia-cutlass-dsl-libs-cu13==4.8.1' 'quack-kernels==0.6.5' \
  'apache-tvm-ffi==0.1.15.post2' 'torch-c-dlpack-ext==0.1.5' 'cuda-bindings==13.5.0' 'cuda-pathfinder==1.9.1' \
  'einops==0.8.1' 'protobuf==6.33.0'
rm -rf .gpu/fa4a .gpu/fa4b && mkdir -p .gpu/fa4a .gpu/fa4b
BIG=$(cd "$DL" && ls nvidia_cutlass_dsl_libs_cu13-*.whl)
echo "$BIG" > .gpu/fa4a/cu13name
(cd "$DL" && md5sum "$BIG") > .gpu/fa4a/cu13.md5
split -b 40000000 "$DL/$BIG" "$DL/cu13part."
mv "$DL/cu13part.aa" .gpu/fa4a/ && mv "$DL"/cu13part.a[b-z] .gpu/fa4b/
find "$DL" -name '*.whl' ! -name "$BIG" -exec mv {} .gpu/fa4a/ \;
rm -rf "$DL"
du -sh .gpu/fa4a .gpu/fa4b
