#!/usr/bin/env bash
# GPU check (issue 8, item 5): the benchmark suite (bench/suite.py) on one CUDA device with a
# Qwen2.5-0.5B-shaped random model (hidden 896, 24 layers, 14/2 heads, intermediate 4864,
# vocab 151936, tied embeddings), bf16 compute, printing absolute tokens/s and MFU against a bf16
# matmul peak measured in the same run. Budget: <= 8 minutes on an H200 including compiles.
#
#   bash bench/gpu.sh               # on the GPU machine (JAX with CUDA preinstalled)
#   bash bench/gpu.sh --cpu-check   # this script's logic end to end on the CPU, micro shape
#   bash bench/gpu.sh [extra bench/suite.py flags, e.g. --no-torch]
#
# The PyTorch/transformers columns need torch with CUDA and transformers; when either is missing
# the suite prints why and fills those columns with "—". Output: the table on stdout, and
# suite.log + suite.json under $OUT when that is set (the device runner's return folder).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-450}  # the suite's own limit, inside the 8-minute budget

args=(--device gpu --shape qwen0.5b --dtype bf16)
if [[ "${1:-}" == "--cpu-check" ]]; then
  shift
  args=(--device cpu --smoke --dtype bf16)
  echo "== cpu-check: running the GPU script's path on the CPU with the micro shape"
else
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
  export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch allocates on the same GPU
fi

echo "== $(date -u +%FT%TZ) $(uname -n)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader

# Preflight: our package's imports, and the device JAX sees.
if ! $PY - "${args[1]}" <<'EOF'; then
import importlib, sys
missing = [m for m in ("jax", "flax", "optax", "numpy")
           if importlib.util.find_spec(m) is None]
if missing:
    print(f"== missing Python packages: {', '.join(missing)} (bash launch/install.sh)")
    sys.exit(1)
import jax
want = sys.argv[1]
d = jax.devices()[0]
print(f"== jax {jax.__version__}: {len(jax.devices())} x {d.device_kind} ({d.platform})")
if want == "gpu" and d.platform != "gpu":
    print("== no CUDA device visible to JAX: no GPU figure from this machine")
    sys.exit(1)
EOF
  exit 2
fi
$PY - <<'EOF'
try:
    import torch, transformers
    cuda = torch.cuda.is_available()
    print(f"== torch {torch.__version__} (CUDA: {cuda}), transformers {transformers.__version__}"
          + ("" if cuda else "; the suite will skip the PyTorch columns on the GPU"))
except ImportError as e:
    print(f"== {e.name} not installed: the suite will skip the PyTorch columns")
EOF

out_args=()
if [[ -n "${OUT:-}" ]]; then out_args=(--json "$OUT/suite.json"); fi
start=$(date +%s)
timeout "$BUDGET_S" $PY bench/suite.py "${args[@]}" "${out_args[@]}" "$@" 2>&1 \
  | tee "${OUT:-/tmp}/suite.log"
rc=${PIPESTATUS[0]}
echo "== bench/suite.py exit $rc after $(( $(date +%s) - start )) s (124 = ran past ${BUDGET_S} s)"
exit "$rc"
