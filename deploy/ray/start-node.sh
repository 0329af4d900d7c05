#!/usr/bin/env bash
# Plain `ray start` recipe for splitserve on VMs (no cluster launcher, no Kubernetes).
# Run it on each machine, head first, with the splitserve package (or the image) installed:
#
#   deploy/ray/start-node.sh head
#   deploy/ray/start-node.sh prefill HEAD_IP [WORKERS]
#   deploy/ray/start-node.sh decode  HEAD_IP [WORKERS]
#
# then start the front door on the head:
#   splitserve serve --address auto --model /models/<name> --prefill N --decode M ...
#
# WORKERS is how many prefill (or decode) workers this machine hosts; it defaults to its
# GPU count (nvidia-smi), or 1 on a machine without GPUs (use --transport gloo then).
# The node advertises splitserve_<role>: WORKERS, the same resource names and per-GPU
# counts as deploy/kuberay/raycluster-gpu.yaml and deploy/ray/cluster-aws.yaml.
# The head advertises no CPU and no splitserve_* resource: nothing is scheduled there.
#
# DRY_RUN=1 prints the command instead of running it. RAY_PORT overrides 6379.
set -euo pipefail

usage() {
  sed -n '2,9p' "$0" >&2
  exit 2
}

role="${1:-}"
port="${RAY_PORT:-6379}"

count_gpus() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

case "$role" in
  head)
    cmd=(ray start --head "--port=${port}" --dashboard-host=0.0.0.0 --num-cpus=0)
    ;;
  prefill|decode)
    head_ip="${2:-}"
    [[ -n "$head_ip" ]] || usage
    gpus="$(count_gpus)"
    if [[ -n "${3:-}" ]]; then
      workers="$3"
    elif (( gpus > 0 )); then
      workers="$gpus"
    else
      workers=1
    fi
    [[ "$workers" =~ ^[1-9][0-9]*$ ]] || { echo "WORKERS must be a positive integer" >&2; exit 2; }
    cmd=(ray start "--address=${head_ip}:${port}" "--resources={\"splitserve_${role}\": ${workers}}")
    if (( gpus > 0 )); then
      cmd+=("--num-gpus=${gpus}")
    fi
    ;;
  *)
    usage
    ;;
esac

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
ulimit -n 65536 2>/dev/null || true
exec "${cmd[@]}"
