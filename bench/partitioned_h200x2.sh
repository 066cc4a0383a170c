#!/usr/bin/env bash
# Partitioned training on 2 H200s (the device tool's nvidia-h200-x2; no Ray, NCCL), in
# under ~9 minutes of wall time:
#   (a) correctness: bench/partitioned.py --check, N=1 vs N=2 on the same global batches,
#       for a small LLaMA (hidden 512, 4 layers) and a small GPT, fp32 and bf16;
#   (b) scaling: the 1.345e9-parameter LLaMA (hidden 2048, 24 layers, 16 heads, MLP 5504,
#       vocab 32000), sequence 2048, global batch 16 (micro-batch 8 per GPU at N=2, the
#       whole 16 on one GPU at N=1), bf16, N=1 and N=2, in mode cpu (each rank's CPU pool
#       holds its share of the 19.4 GB of block state) and mode nvme (a 2 GiB pool per
#       rank: the state streams through /var/tmp, ~45 GB a step); each rank's per-phase
#       figures (forward, backward, all-gather / reduce-scatter / all-reduce seconds by CUDA
#       events, waits for its tiers, its daemon's AdamW) are in their JSON;
#   (c) DeepSpeed on the same two GPUs: bench/vs_deepspeed.py --ranks 2, the 1.3B LLaMA, the
#       same JSON for both sides (micro-batch 8 per GPU, global batch 16), one mode a run
#       (vs_deepspeed_cpu, vs_deepspeed_nvme): vs_deepspeed_2gpu_<mode> in the summary.
# All of it does not fit one 10-minute call: ONLY="name ..." runs just those runs, appending
# to an existing $OUT/partitioned_h200x2.json (so point OUT at a directory kept between
# calls of a warm machine, and copy it to the device tool's $OUT at the end); the summary
# line is made again from every run line in the file. Without ONLY: (a) and (b) as before.
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
if [[ -z ${ONLY:-} ]]; then
    : > "$json"
    : > "$log"
fi
wanted() {  # whether run $1 is to run in this call
    if [[ -z ${ONLY:-} ]]; then [[ $1 != vs_deepspeed_* ]]; else [[ " $ONLY " == *" $1 "* ]]; fi
}
export NCCL_NVLS_ENABLE=0 PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvme=/var/tmp/tierstack-bench-partitioned
deadline=$(( $(date +%s) + ${BUDGET_S:-530} ))

bench() {  # name, cap in seconds, bench/partitioned.py flags
    run_capped bench/partitioned.py "$1" "$2" --device "${DEVICE:-cuda}" --nvme-path "$nvme" "${@:3}"
}

vs_deepspeed() {  # name, cap in seconds, bench/vs_deepspeed.py flags
    run_capped bench/vs_deepspeed.py "$1" "$2" --ranks 2 --device "${DEVICE:-cuda}" --nvme-dir "$nvme" "${@:3}"
}

run_capped() {  # script, name, cap in seconds, flags: the script's run, its JSON line recorded
    local script=$1 name=$2 cap=$3
    shift 3
    wanted "$name" || return 0
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
    timeout -k 15 "$cap" "$py" "$script" "$@" > "$out/$name.out" 2>&1
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

vs_ds="--model 1.3b --seq 2048 --micro 8 --reps 1"
if [[ ${TINY:-0} == 1 ]]; then
    vs_ds="--model tiny --seq 64 --micro 2 --reps 1 --sides ts"  # no DeepSpeed on a CPU machine
fi
vs_deepspeed vs_deepspeed_cpu 560 $vs_ds --modes cpu --steps 4
vs_deepspeed vs_deepspeed_nvme 560 $vs_ds --modes nvme --steps 3

"$py" - "$json" >> "$json" <<'EOF'
import json, sys
runs = {r["run"]: r.get("result") or {} for r in map(json.loads, open(sys.argv[1]))
        if r.get("run") != "summary"}  # an earlier call's summary line is made again here
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
    summary[f"vs_deepspeed_2gpu_{mode}"] = runs.get(f"vs_deepspeed_{mode}", {}).get(f"vs_deepspeed_2gpu_{mode}")
print(json.dumps(summary))
EOF
tail -n 1 "$json"
