#!/usr/bin/env bash
# Launch uptrain.train on one or several machines: run it once on every machine, the same way.
#
#   scripts/launch_multinode.sh CONFIG.yaml [key=value ...]
#
# Environment (the same on every machine, except MACHINE_RANK):
#   NUM_MACHINES       number of machines (default: SLURM_NNODES, else 1)
#   MACHINE_RANK       this machine's index, 0 on the main one (default: SLURM_NODEID, else 0)
#   MAIN_PROCESS_IP    address of machine 0 (or MASTER_ADDR; on SLURM the job's first host; else 127.0.0.1)
#   MAIN_PROCESS_PORT  a free port on machine 0 (or MASTER_PORT; default 29500)
#   PROCS_PER_MACHINE  processes per machine (default: the visible GPUs; without a GPU: 1)
#   ACCEL_CONFIG       accelerate config file (default: configs/accelerate/fsdp2.yaml with GPUs;
#                      none without: plain CPU processes over gloo); "none" for none
#   PYTHON             the Python that runs accelerate (default: python)
#   STOP_GRACE_S       seconds the scheduler leaves between its stop signal and the kill (Kubernetes:
#                      terminationGracePeriodSeconds; Slurm: the --signal lead time). Set, it becomes
#                      torchrun's shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; else 30 s, after
#                      which torchrun SIGKILLs workers still writing their preemption checkpoint) and
#                      the trainer's deadline (UPTRAIN_STOP_GRACE_S); SIGUSR1 is forwarded too.
# run_dir must be one folder that every machine mounts (checkpoints, teacher samples, the final
# model and metrics are written there by several processes); caches need not be shared. The
# trainer checks it at start. SLURM: srun --nodes=N --ntasks-per-node=1 scripts/launch_multinode.sh ...
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,22p' "$0" >&2
  exit 2
fi
NUM_MACHINES=${NUM_MACHINES:-${SLURM_NNODES:-1}}
MACHINE_RANK=${MACHINE_RANK:-${SLURM_NODEID:-0}}
MAIN_PROCESS_IP=${MAIN_PROCESS_IP:-${MASTER_ADDR:-}}
if [[ -z "$MAIN_PROCESS_IP" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
  MAIN_PROCESS_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MAIN_PROCESS_IP=${MAIN_PROCESS_IP:-127.0.0.1}
MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-${MASTER_PORT:-29500}}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l || true)
PROCS_PER_MACHINE=${PROCS_PER_MACHINE:-$(( GPUS > 0 ? GPUS : 1 ))}
if [[ -z "${ACCEL_CONFIG:-}" ]]; then
  ACCEL_CONFIG=$([[ "$GPUS" -gt 0 ]] && echo configs/accelerate/fsdp2.yaml || echo none)
fi
if ! [[ "$NUM_MACHINES" =~ ^[1-9][0-9]*$ && "$PROCS_PER_MACHINE" =~ ^[1-9][0-9]*$ && "$MACHINE_RANK" =~ ^[0-9]+$ ]] \
    || (( MACHINE_RANK >= NUM_MACHINES )); then
  echo "error: NUM_MACHINES=$NUM_MACHINES, PROCS_PER_MACHINE=$PROCS_PER_MACHINE, MACHINE_RANK=$MACHINE_RANK:" \
       "need positive counts and 0 <= MACHINE_RANK < NUM_MACHINES" >&2
  exit 2
fi
if [[ -n "${STOP_GRACE_S:-}" ]]; then
  if ! [[ "$STOP_GRACE_S" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: STOP_GRACE_S=$STOP_GRACE_S: give whole seconds, e.g. STOP_GRACE_S=300" >&2
    exit 2
  fi
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$STOP_GRACE_S UPTRAIN_STOP_GRACE_S=$STOP_GRACE_S
  export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
fi
if [[ "$ACCEL_CONFIG" == none ]]; then
  # No config file: plain processes (DDP; on CPU gloo, as Accelerator(cpu=True) picks).
  CONFIG_ARGS=(--multi_gpu --mixed_precision no --dynamo_backend no)
else
  CONFIG_ARGS=(--config_file "$ACCEL_CONFIG")
fi
exec "${PYTHON:-python}" -m accelerate.commands.launch \
  "${CONFIG_ARGS[@]}" \
  --num_machines "$NUM_MACHINES" \
  --machine_rank "$MACHINE_RANK" \
  --num_processes $(( NUM_MACHINES * PROCS_PER_MACHINE )) \
  --main_process_ip "$MAIN_PROCESS_IP" \
  --main_process_port "$MAIN_PROCESS_PORT" \
  -m uptrain.train "$@"
