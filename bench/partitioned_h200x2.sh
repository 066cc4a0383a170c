#!/usr/bin/env bash
# Partitioned training on 2 H200s (the device tool's nvidia-h200-x2; no Ray, NCCL), in
# under ~9 minutes of wall time:
#   (a) correctness: bench/partitioned.py --check, N=1 vs N=2 on the same global batches,
#       for a small LLaMA (hidden 512, 4 layers) and a small GPT, fp32 and bf16;
#   (b) scaling: the 1.345e9-parameter LLaMA (hidden 2048, 24 layers, 16 heads, MLP 5504,
#       vocab 32000), sequence 2048, global batch 16 (micro-batch 8 per GPU at N=2, the
#       whole 16 on one GPU at N=1), bf16, N=1 and N=2, in mode cpu (each rank's CPU pool
#       holds its share of the 19.4 GB of block state) and mode nvme (a 2 GiB pool per
#       rank: the state streams through /var/tmp, ~45 GB a step).
# Every run's last-line JSON goes, one line each as {"run", "rc", "wall_s", "result"}, to
# $OUT/partitioned_h200x2.json, then one {"run": "summary"} line with the figures the
# issue asks for; everything printed goes to $OUT/partitioned_h200x2.log. Runs are capped
# so the whole fits BUDGET_S seconds (default 530); a run past its cap is killed with its
# ranks and reported with rc 124, and the later ones still run while time is left.
#
# From the repository root:  source deploy/device_env.sh && bash bench/partitioned_h200x2.sh
# A smoke test of this script on a CPU-only machine (tiny models, gloo):
#   DEVICE=cpu TINY=1 OUT=/tmp/out bash bench/partitioned_h200x2.sh
set -u
out=${OUT:-/tmp/partitioned_h200x2}
mkdir -p "$out"
json=$out/partitioned_h200x2.json
log=$out/partitioned_h200x2.log
: > "$json"
: > "$log"
export NCCL_NVLS_ENABLE=0 PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvme=/var/tmp/tierstack-bench-partitioned
deadline=$(( $(date +%s) + ${BUDGET_S:-530} ))

bench() {  # name, cap in seconds, bench/partitioned.py flags
    local name=$1 cap=$2
    shift 2
    local left=$(( deadline - $(date +%s) ))
    (( left < cap )) && cap=$left
    if (( cap < 30 )); then
        echo "{\"run\": \"$name\", \"skipped\": \"out of time\"}" >> "$json"
        return
    fi
    echo "=== $name (at most $cap s): $*" | tee -a "$log"
    local start
    start=$(date +%s)
    # timeout signals its whole process group: the spawned ranks and their daemons too.
    timeout -k 15 "$cap" "$py" bench/partitioned.py --device "${DEVICE:-cuda}" --nvme-path "$nvme" "$@" \
        > "$out/$name.out" 2>&1
    local rc=$?
    cat "$out/$name.out" >> "$log"
    rm -rf "$nvme"
    tail -n 3 "$out/$name.out"
    "$py" - "$name" "$rc" "$(( $(date +%s) - start ))" "$out/$name.out" >> "$json" <<'EOF'
import json, sys
name, rc, seconds, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lines = [l for l in open(path, errors="replace").read().splitlines() if l.startswith("{")]
try:
    result = json.loads(lines[-1]) if lines else None
except ValueError:
    result = None
print(json.dumps({"run": name, "rc": rc, "wall_s": seconds, "result": result}))
EOF
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$log" 2>&1
df -h /var/tmp /dev/shm >> "$log" 2>&1
"$py" -c "import torch, transformers as t; print(torch.__version__, t.__version__)" >> "$log" 2>&1

llama_small="--model llama --layers 4 --dim 512 --heads 8 --kv-heads 4 --intermediate 1376 --vocab 32000"
gpt_small="--model gpt --layers 4 --dim 512 --heads 8 --vocab 256"
check="--check --steps 4 --seq-len 512 --global-batch 8 --cpu-pool-size 64MiB"
llama_1b="--model llama --layers 24 --dim 2048 --heads 16 --kv-heads 16 --intermediate 5504 --vocab 32000
          --seq-len 2048 --global-batch 16 --precision bf16 --repeats 1"
if [[ ${TINY:-0} == 1 ]]; then
    llama_small="--model llama --layers 2 --dim 64 --heads 4 --kv-heads 2 --vocab 256"
    gpt_small="--model gpt --layers 2 --dim 64 --heads 4 --vocab 256"
    check="--check --steps 3 --seq-len 32 --global-batch 4 --cpu-pool-size 1MiB"
    llama_1b="--model llama --layers 2 --dim 64 --heads 4 --vocab 256 --seq-len 32 --global-batch 4
              --precision bf16 --repeats 1"
fi
bench check_llama_fp32 75 $check $llama_small --precision fp32
bench check_llama_bf16 75 $check $llama_small --precision bf16
bench check_gpt_fp32 75 $check $gpt_small --precision fp32
bench check_gpt_bf16 75 $check $gpt_small --precision bf16

bench scale_llama1b_cpu 180 $llama_1b --modes cpu --steps 4
bench scale_llama1b_nvme 300 $llama_1b --modes nvme --steps 2 --cpu-pool-size 2GiB

"$py" - "$json" >> "$json" <<'EOF'
import json, sys
runs = {r["run"]: r.get("result") or {} for r in map(json.loads, open(sys.argv[1]))}
summary = {"run": "summary", "max_rel_loss_diff_2v1": {}, "check_ok": {}, "per_rank_bytes_2v1": {}}
for name, result in runs.items():
    if name.startswith("check_"):
        summary["max_rel_loss_diff_2v1"][name[6:]] = result.get("max_rel_loss_diff_2v1")
        summary["check_ok"][name[6:]] = result.get("ok")
for mode in ("cpu", "nvme"):
    result = runs.get(f"scale_llama1b_{mode}", {})
    summary[f"tokens_per_s_2v1_{mode}"] = result.get(f"tokens_per_s_2v1_{mode}")
    summary["per_rank_bytes_2v1"][mode] = (result.get("per_rank_bytes_2v1") or {}).get(mode)
    for n in (1, 2):
        summary[f"tokens_per_s_{mode}_N{n}"] = (result.get(f"N={n}") or {}).get("tokens_per_s")
print(json.dumps(summary))
EOF
tail -n 1 "$json"
