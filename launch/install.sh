#!/usr/bin/env bash
# One-step set-up on a fresh machine: the pinned runtime, bfcl-eval (--no-deps) and this package.
# `--test` adds the test-only packages (torch CPU, tiktoken, pytest, ruff).
# On a TPU VM pass `--tpu` to install jax[tpu] of the same version.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
reqs=(-r "$here/requirements.txt")
for arg in "$@"; do
  case "$arg" in
    --test) reqs+=(-r "$here/requirements-test.txt") ;;
    --tpu) reqs+=("jax[tpu]==$(sed -n 's/^jax==//p' "$here/requirements.txt")") ;;
    *) echo "install.sh: unknown option $arg (known: --test, --tpu)" >&2; exit 2 ;;
  esac
done
"$py" -m pip install -q "${reqs[@]}"
"$py" -m pip install -q --no-deps -r "$here/requirements-nodeps.txt"
# The package itself (editable: `import rcgrpo_jax` works from any directory; its dependencies
# are the pins above, declared again in pyproject.toml from the same files).
"$py" -m pip install -q --no-deps -e "$here"
