#!/usr/bin/env bash
# Install FlashAttention-4 + CuTe DSL into /tmp/fa4site on a GPU machine without network, from the pieces
# tools/fa4_prepare.sh made: /tmp/tp holds .gpu/fa4a's files (an earlier call copied them), .gpu/fa4b is
# carried now. Prints the PYTHONPATH to use (nvidia-cutlass-dsl adds its dsl_packages folder through a .pth
# file, which a --target install does not run). Exit 1 when the pieces are missing or the import fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${FA4_SITE:-/tmp/fa4site}
[[ -f /tmp/tp/cu13name && -d .gpu/fa4b ]] || { echo "fa4_install.sh: need /tmp/tp/cu13name (.gpu/fa4a copied) and .gpu/fa4b" >&2; exit 1; }
BIG=$(cat /tmp/tp/cu13name)
cat /tmp/tp/cu13part.aa .gpu/fa4b/cu13part.a* > "/tmp/tp/$BIG"
(cd /tmp/tp && md5sum -c cu13.md5 2>/dev/null || md5sum "$BIG")
mkdir -p "$SITE"
# protobuf only where the machine has none: a second copy in --target shadows part of the namespace package
# `google` and breaks the machine's own users of it (seen 2026-11-30: megatron-core's import failed with
# "module 'google.protobuf.message' has no attribute 'FrozenInstanceError'")
WHEELS=(/tmp/tp/*.whl)
if "$PY" -c "import google.protobuf" 2>/dev/null; then
  WHEELS=($(printf '%s\n' "${WHEELS[@]}" | grep -v '/protobuf-'))
  rm -rf "$SITE/google/protobuf" "$SITE"/protobuf-*.dist-info
fi
"$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${WHEELS[@]}"
P="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages"
PYTHONPATH="$P${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import cutlass.cute, flash_attn.cute.interface; print('flash_attn.cute: importable')"
echo "export PYTHONPATH=$P:\$PYTHONPATH"
