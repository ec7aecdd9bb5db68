#!/usr/bin/env bash
# Launch uptrain.train on one or several machines with accelerate.
#
#   scripts/launch_multinode.sh CONFIG.yaml [key=value ...]
#
# Environment (set the same on every machine, except MACHINE_RANK):
#   NUM_MACHINES   number of machines (default 1)
#   MACHINE_RANK   this machine's index, 0 on the main one (default 0)
#   MAIN_ADDR      address of machine 0 (default 127.0.0.1)
#   MAIN_PORT      a free port on machine 0 (default 29500)
#   GPUS_PER_NODE  processes per machine (default: all visible GPUs)
#   ACCEL_CONFIG   accelerate config (default configs/accelerate/fsdp2.yaml)
# On SLURM, run it once per node (srun --ntasks-per-node=1) and it reads SLURM_NNODES,
# SLURM_NODEID and the first host of SLURM_JOB_NODELIST. run_dir must be on a filesystem that
# all machines share: checkpoints are written by all processes into one folder.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,16p' "$0" >&2
  exit 2
fi
NUM_MACHINES=${NUM_MACHINES:-${SLURM_NNODES:-1}}
MACHINE_RANK=${MACHINE_RANK:-${SLURM_NODEID:-0}}
if [[ -z "${MAIN_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
  MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MAIN_ADDR=${MAIN_ADDR:-127.0.0.1}
MAIN_PORT=${MAIN_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
ACCEL_CONFIG=${ACCEL_CONFIG:-configs/accelerate/fsdp2.yaml}
if [[ "$GPUS_PER_NODE" -lt 1 ]]; then
  echo "error: no GPU visible; for CPU processes use accelerate launch --multi_gpu ... (see configs/demo-cpu.yaml)" >&2
  exit 2
fi
exec accelerate launch \
  --config_file "$ACCEL_CONFIG" \
  --num_machines "$NUM_MACHINES" \
  --machine_rank "$MACHINE_RANK" \
  --num_processes $((NUM_MACHINES * GPUS_PER_NODE)) \
  --main_process_ip "$MAIN_ADDR" \
  --main_process_port "$MAIN_PORT" \
  -m uptrain.train "$@"
