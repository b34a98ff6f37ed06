#!/usr/bin/env bash
# What to run when a session is lent a GPU: the GPU tests and world-1 training runs of a >= 1B Llama config
# (bf16 full fine-tuning, LoRA on both backends, QLoRA, long context, the shipped 8B LoRA recipe), through the
# installed `shardtune` CLI as users run it. Each run's metrics.jsonl and log go to $OUT (or ./gpu_out); then
#     .venv/bin/python bench/gpu_summary.py gpu_out            # tokens/s, max_memory_allocated vs `plan`
# A lent machine has no package registry: `bash bench/gpu_wheels.sh` here writes the pinned wheels its image lacks
# to .whl; carry it (the device tool's `run`, carry [".whl"]) and this script installs them into /tmp/site first.
# One call took ~9.5 min on an H200 (bench/RESULTS.md, stop 54): give it timeout_s 600 and trim what it runs.
#
#     bash bench/gpu_session.sh                     # on the lent machine (the device tool's `run`)
#     MODEL=tiny-llama DEVICE=cpu bash bench/gpu_session.sh   # a dry run of every command here, on CPU
set -u
OUTD=${OUT:-$PWD/gpu_out}
mkdir -p "$OUTD"
MODEL=${MODEL:-llama-3.2-1b}
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-/tmp/gpu_runs}
rm -rf "$WORK" && mkdir -p "$WORK"
rm -f "$OUTD/runs.tsv"
LOG="$OUTD/session.log"
exec > >(tee -a "$LOG") 2>&1

if [ -d .whl ] && [ "$DEVICE" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
PY=${PY:-python3}
ST=$(dirname "$($PY -c 'import sys; print(sys.executable)')")/shardtune
echo "== env $(date -u +%T)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
$PY -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "peft", peft.__version__,
"gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'

COMMON=(launch.device=$DEVICE train.profile_memory=true train.eval_every=0 train.save_every=0 train.warmup_steps=1
        train.demo_eval=false model.config=configs/models/$MODEL.json hardware.gpu=h200-141gb)
[ "$DEVICE" = cpu ] && COMMON+=(launch.nproc_per_node=1)

# train NAME SECONDS RECIPE OVERRIDES...: one CLI run; its metrics land in $OUTD/NAME.jsonl
train() {
  local name=$1 secs=$2 recipe=$3; shift 3
  echo "== $name $(date -u +%T): $recipe $*"
  local t0=$SECONDS
  printf '%s\t%s\t%s\n' "$name" "$recipe" "${COMMON[*]} $*" >> "$OUTD/runs.tsv"
  timeout "$secs" "$ST" train "$recipe" "${COMMON[@]}" "train.output_dir=$WORK/$name" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "rc $rc, $((SECONDS - t0)) s"
  grep -iE "fits|plan|peak|error|Error" "$WORK/$name.log" | head -6
  [ $rc -ne 0 ] && tail -25 "$WORK/$name.log"
  cp "$WORK/$name/metrics.jsonl" "$OUTD/$name.jsonl" 2>/dev/null
  # one file back per run at most: the device tool returns 8 files, so the logs are appended to session.log above
}

LORA=llama-3.1-8b-lora-1x24gb
QLORA_LONG=llama-3.1-8b-qlora-128k-1x24gb
STEPS=(train.max_steps=8 train.grad_accum=4 data.seq_len=2048)
[ "$DEVICE" = cpu ] && STEPS=(train.max_steps=2 train.grad_accum=1 data.seq_len=128)

train lora 240 $LORA "${STEPS[@]}"
if [ "$DEVICE" = cuda ]; then
  echo "== pytest -m gpu $(date -u +%T)"
  timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_varlen_attention.py tests/integration/test_gpu_train.py \
    tests/distributed/test_engine_features.py 2>&1 | tail -30
fi
train lora_torch 240 $LORA "${STEPS[@]}" engine.backend=torch
train qlora 240 $LORA "${STEPS[@]}" lora.quantize_base=nf4 lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]
train full_bf16 240 $LORA "${STEPS[@]}" lora.enabled=false model.dtype=fp32 train.lr=1e-5
if [ "$DEVICE" = cuda ]; then
  train long_64k 300 $QLORA_LONG train.max_steps=3 data.seq_len=65536
  MODEL=llama-3.1-8b
  COMMON=("${COMMON[@]/model.config=configs\/models\/llama-3.2-1b.json/model.config=configs/models/llama-3.1-8b.json}")
  train lora_8b 300 $LORA train.max_steps=6 train.grad_accum=4 data.seq_len=2048
fi
echo "== done $(date -u +%T)"
