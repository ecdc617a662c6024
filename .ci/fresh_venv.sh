#!/usr/bin/env bash
# A user's first command on a fresh machine: a new virtual environment, the README's install
# (runtime only, no test extras), then a short version of the main job through the CLI, run from
# outside the repository. Fails on a missing runtime dependency, an import that only works from the
# repo root, or library log lines in the output.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
# a fresh machine has no compilation cache either
export JAX_COMPILATION_CACHE_DIR="$tmp/xla"
PYTHON="$tmp/venv/bin/python" bash "$repo/launch/install.sh"
# configs/tiny.py shrunk to a few steps per stage: the same code path as the demo, ~1-2 minutes.
short=(
  --config.env.synthetic.num_train=80 --config.env.synthetic.num_test=4
  --config.train.warm_start_steps=2 --config.train.steps=3 --config.rctp.train_steps=3
  --config.train.checkpoint_every=2 --config.rctp.eval_entries=4 --config.eval.max_entries=4
  --config.rl.steps=1 --config.rl.num_prompts=2 --config.rl.group_size=2 --config.rl.eval_every=1
  --config.rl.max_rollouts=0
  --config.rl.checkpoint_every=1
)
cd "$tmp"
start=$SECONDS
"$tmp/venv/bin/python" -m rcgrpo_jax.main --config="$repo/configs/tiny.py" \
  --config.workdir="$tmp/run" "${short[@]}" >"$tmp/out" 2>"$tmp/err" || {
  echo "fresh venv: the main job failed" >&2; tail -30 "$tmp/err" >&2; exit 1; }
test -s "$tmp/run/summary.json" || { echo "fresh venv: no summary.json" >&2; exit 1; }
# the run report (plotly from the runtime pins): stage all's page and each RL arm's
for page in "$tmp/run/report.html" "$tmp"/run/*_*grpo*/report.html; do
  test -s "$page" || { echo "fresh venv: no $page" >&2; exit 1; }
done
# absl-format lines (I1201 12:00:00.000 ...), transformers' notices, TFDS banners.
if grep -aE '^[IWE][0-9]{4} |^\[transformers\]|Downloading and preparing' "$tmp/out" "$tmp/err"; then
  echo "fresh venv: library log lines in the default output (above)" >&2; exit 1
fi
cat "$tmp/out"
echo "fresh venv: main job ok in $((SECONDS - start)) s"
