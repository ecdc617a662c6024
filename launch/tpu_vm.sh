#!/usr/bin/env bash
# Run rcgrpo_jax on a (multi-host) Cloud TPU VM slice. Run from your workstation, in the repo root.
#
#   export PROJECT=my-project ZONE=us-east5-a TPU_NAME=rcgrpo ACCELERATOR=v5p-16 BUCKET=my-bucket
#   bash launch/tpu_vm.sh create      # queue the slice (queued resource) and wait until ACTIVE
#   bash launch/tpu_vm.sh setup       # copy this repo to every worker, install, fetch the model
#   bash launch/tpu_vm.sh run --config.stage=rcgrpo     # same command on all workers
#   bash launch/tpu_vm.sh tensorboard # TensorBoard of the run, forwarded to localhost:6006
#   bash launch/tpu_vm.sh delete
#
# Settings (environment; defaults in brackets):
#   PROJECT, ZONE, TPU_NAME [rcgrpo], ACCELERATOR [v5p-16], RUNTIME [from ACCELERATOR],
#   BUCKET (gs bucket name, no gs://; holds models/<MODEL>/ and runs/), MODEL [Qwen2.5-7B-Instruct],
#   CONFIG [configs/qwen7b.py], RUN [qwen7b] (run name under gs://$BUCKET/runs/),
#   SPOT [0] (1 = spot capacity), DIRECT [0] (1 = `tpu-vm create` instead of a queued resource).
# Every worker mounts gs://$BUCKET at /mnt/gcs (gcsfuse) so that all hosts see one workdir:
# orbax writes each host's shards of a checkpoint into the same directory.
set -euo pipefail

PROJECT="${PROJECT:?set PROJECT}"
ZONE="${ZONE:?set ZONE}"
TPU_NAME="${TPU_NAME:-rcgrpo}"
ACCELERATOR="${ACCELERATOR:-v5p-16}"
MODEL="${MODEL:-Qwen2.5-7B-Instruct}"
CONFIG="${CONFIG:-configs/qwen7b.py}"
RUN="${RUN:-qwen7b}"
REMOTE_DIR="rcgrpo_jax"  # on each worker, under the login user's home
WORKDIR="/mnt/gcs/runs/$RUN"

runtime_for() {  # TPU software version per generation (cloud.google.com/tpu/docs/runtimes)
  case "$1" in
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    v4-* | v3-* | v2-*) echo tpu-ubuntu2204-base ;;
    *) echo "unknown accelerator $1" >&2; return 1 ;;
  esac
}
RUNTIME="${RUNTIME:-$(runtime_for "$ACCELERATOR")}"
# gcloud names v5e slices v5litepod-N; accept v5e-N too.
GCLOUD_ACCELERATOR="${ACCELERATOR/#v5e-/v5litepod-}"

tpu() { gcloud compute tpus "$@" --project="$PROJECT" --zone="$ZONE"; }
on_all() { tpu tpu-vm ssh "$TPU_NAME" --worker=all --command="$1"; }

cmd_create() {
  local extra=()
  [[ "${SPOT:-0}" == 1 ]] && extra+=(--spot)
  if [[ "${DIRECT:-0}" == 1 ]]; then
    tpu tpu-vm create "$TPU_NAME" --accelerator-type="$GCLOUD_ACCELERATOR" \
      --version="$RUNTIME" "${extra[@]}"
    return
  fi
  tpu queued-resources create "$TPU_NAME-qr" --node-id="$TPU_NAME" \
    --accelerator-type="$GCLOUD_ACCELERATOR" --runtime-version="$RUNTIME" "${extra[@]}"
  echo "waiting for queued resource $TPU_NAME-qr to become ACTIVE (Ctrl-C is safe; re-run 'wait')"
  cmd_wait
}

cmd_wait() {
  local state
  while true; do
    state="$(tpu queued-resources describe "$TPU_NAME-qr" --format='value(state.state)')"
    echo "$(date +%T) $state"
    case "$state" in
      ACTIVE) return 0 ;;
      FAILED | SUSPENDED) echo "queued resource is $state" >&2; return 1 ;;
    esac
    sleep 60
  done
}

cmd_setup() {
  local bucket="${BUCKET:?set BUCKET}"
  # 1. the code: this checkout's HEAD (uncommitted changes are not shipped).
  local tarball
  tarball="$(mktemp -t rcgrpo_jax.XXXXXX).tar.gz"
  git archive --format=tar.gz -o "$tarball" HEAD
  tpu tpu-vm scp "$tarball" "$TPU_NAME":rcgrpo_jax.tar.gz --worker=all
  rm -f "$tarball"
  # 2. install (jax[tpu] of the pinned version + requirements), gcsfuse, mount the bucket,
  # 3. copy the HF checkpoint to local disk (fast, parallel reads at load time).
  on_all "set -e
    rm -rf ~/$REMOTE_DIR && mkdir -p ~/$REMOTE_DIR && tar -xzf ~/rcgrpo_jax.tar.gz -C ~/$REMOTE_DIR
    cd ~/$REMOTE_DIR && bash launch/install.sh --tpu
    if ! command -v gcsfuse >/dev/null; then
      echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -c -s) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list
      curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
      sudo apt-get update -q && sudo apt-get install -y -q gcsfuse
    fi
    sudo mkdir -p /mnt/gcs /mnt/models && sudo chown \$USER /mnt/gcs /mnt/models
    mountpoint -q /mnt/gcs || gcsfuse --implicit-dirs --rename-dir-limit=200000 $bucket /mnt/gcs
    gcloud storage cp -r gs://$bucket/models/$MODEL /mnt/models/"
}

cmd_run() {
  # RCGRPO_DISTRIBUTED=1: every worker joins jax.distributed (rcgrpo_jax/distributed.py).
  # Output of all workers streams here; process 0 writes metrics, TensorBoard and summaries.
  local args=""
  for a in "$@"; do args+=" $(printf '%q' "$a")"; done
  on_all "cd ~/$REMOTE_DIR && mkdir -p $WORKDIR && RCGRPO_DISTRIBUTED=1 python3 -m rcgrpo_jax.main \
    --config=$CONFIG --config.model.hf_path=/mnt/models/$MODEL --config.workdir=$WORKDIR$args \
    2>&1 | tee -a ~/rcgrpo_\$(hostname).log"
}

cmd_tensorboard() {
  # TensorBoard on worker 0 reading the shared workdir, forwarded to http://localhost:6006.
  tpu tpu-vm ssh "$TPU_NAME" --worker=0 \
    --command="python3 -m pip install -q tensorboard && python3 -m tensorboard.main --logdir=$WORKDIR/tb --port=6006" \
    -- -L 6006:localhost:6006
}

cmd_delete() {
  if [[ "${DIRECT:-0}" == 1 ]]; then
    tpu tpu-vm delete "$TPU_NAME" --quiet
  else
    tpu queued-resources delete "$TPU_NAME-qr" --force --quiet
  fi
}

case "${1:-}" in
  create | wait | setup | run | tensorboard | delete) c="$1"; shift; "cmd_$c" "$@" ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
