#!/bin/bash
# Same-machine A/B of the trainer's tokens/s with each training attention, at the demo's two block shapes
# (results/quality-curve.md, round two, eighth part): SDPA in float32, `bf16_attention=true` as it is now, and
# (OLD_REV set) `bf16_attention=true` with the grouped_causal_attention of commit OLD_REV. Two rounds, the
# variants interleaved, so that the machine's drift falls on all of them alike; one process at a time, one thread.
#
#     OLD_REV=4d5c1a0 bash scripts/studies/attention_ab.sh runs/demo-chunk   # a no-data demo's --out folder
set -euo pipefail
cd "$(dirname "$0")/../.."
DEMO=${1:?give a no-data demo\'s --out folder (its samples and converted start are trained on)}
WORK=$(mktemp -d)
common=(configs/demo-cpu.yaml "model=$DEMO/stories260K-gqa2" overwrite=true threads=1 log.progress_bar=false
        "log.log_with=[]" "data.train.files=[$DEMO/data/samples.jsonl]"
        "data.val.files=[examples/data/tinystories-valid-sample.txt]" distill.teacher=examples/stories260K-mha8
        distill.alpha_kd=1.0 optim.lr=5e-4 eval.every=100000 eval.at_start=false distill.teacher_cache_gb=0
        "run_dir=$WORK/run")
variants=(sdpa now)
if [ -n "${OLD_REV:-}" ]; then
  git show "$OLD_REV:uptrain/train/model/cpu_attention.py" > "$WORK/old_cpu_attention.py"
  variants+=(old)
fi
OLD_TRAINER="import importlib.util, sys
spec = importlib.util.spec_from_file_location('old', '$WORK/old_cpu_attention.py')
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
import uptrain.train.model.cpu_attention as m
m.grouped_causal_attention = old.grouped_causal_attention
from uptrain.train.__main__ import main
sys.exit(main(sys.argv[1:]))"
for round in 1 2; do
  for seq in 128 512; do
    if [ "$seq" = 128 ]; then shape=(data.seq_len=128 batch.micro_batch=8 batch.grad_accum=2 budget.tokens=409600)
    else shape=(data.seq_len=512 batch.micro_batch=2 batch.grad_accum=2 budget.tokens=307200); fi
    for v in "${variants[@]}"; do
      case $v in
        sdpa) cmd=(python -m uptrain.train "${common[@]}" "${shape[@]}" bf16_attention=false) ;;
        now) cmd=(python -m uptrain.train "${common[@]}" "${shape[@]}" bf16_attention=true) ;;
        old) cmd=(python -c "$OLD_TRAINER" "${common[@]}" "${shape[@]}" bf16_attention=true) ;;
      esac
      /usr/bin/time -f "%U %S" -o "$WORK/time" "${cmd[@]}" > "$WORK/log" 2>&1
      tok=$(grep tok_per_s "$WORK/run/metrics.jsonl" | tail -1 | python -c "import json,sys; print(round(json.load(sys.stdin)['tok_per_s']))")
      echo "round=$round seq=$seq variant=$v tok_per_s=$tok cpu_user_system_s=$(cat "$WORK/time")"
    done
  done
done
rm -rf "$WORK"
