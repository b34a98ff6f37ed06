#!/usr/bin/env bash
# The GPU benchmark of issue 58, one call of at most 8 minutes on a lent GPU (bench/RESULTS.md's GPU section has
# the exact `run` call and what each column means): random-init Llama configs at seq 4,096, packed from generated
# documents of hundreds of tokens (bench/gpu_data.py); LoRA, QLoRA and full fine-tuning; ours against
# engine.backend=torch (FSDP2); engine.compile=true against eager. Every run goes through the installed CLI.
# Most important first, each under its own timeout and all under one deadline, so a cut call still returns what
# ran: after every run $OUT/table.md (bench/gpu_summary.py) and $OUT/raw.tar.gz (metrics, plans) are rewritten.
# The plan columns (`plan --json`, `plan --simulate --json`) run on the GPU machine's CPU at nice 19, one at a time,
# beside the GPU runs; whatever is not done at the deadline reads "-".
#
#     bash bench/gpu_session.sh              # on the lent machine
#     bash bench/gpu_session.sh --dry-run    # the same code path on CPU: tiny-llama, seq 256, one worker
# Here, from what came back:  mkdir raw && tar xzf raw.tar.gz -C raw && .venv/bin/python bench/gpu_summary.py raw
set -u
DRY=0; [ "${1:-}" = --dry-run ] && DRY=1
OUTD=${OUT:-$PWD/gpu_out}
WORK=${WORK:-/tmp/gpu_runs}
RAW=$WORK/raw
# The runs' and plans' deadline; install, env and probe come on top: < 8 min in all. A dry run on 2 loaded cores
# reaches the first rows in 120 s; BUDGET_S=900 runs every row (~5 min).
if [ $DRY = 1 ]; then BUDGET_S=${BUDGET_S:-120}; else BUDGET_S=${BUDGET_S:-380}; fi
mkdir -p "$OUTD" && rm -rf "$WORK" && mkdir -p "$RAW"
exec > >(tee "$OUTD/session.log") 2>&1

if [ -d .whl ] && [ $DRY = 0 ]; then  # no package registry there: bench/gpu_wheels.sh's wheels, carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
PY=${PY:-python3}; [ $DRY = 1 ] && [ -x .venv/bin/python ] && PY=.venv/bin/python  # here: the project's venv
ST=$(dirname "$($PY -c 'import sys; print(sys.executable)')")/shardtune
echo "== env $(date -u +%T)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
$PY -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "peft", peft.__version__,
"gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'

if [ $DRY = 1 ]; then
  M8=tiny-llama; M3=tiny-llama; M1=tiny-llama; SEQ=256; DOCS=300; STEPS=3; GPU=cpu
  COMMON=(launch.device=cpu launch.nproc_per_node=1)
  # CPU's train.profile_memory is a dispatch mode that torch.compile refuses (CUDA reads max_memory_allocated)
  COMPILE=(engine.compile=true train.profile_memory=false)
else
  M8=llama-3.1-8b; M3=llama-3.2-3b; M1=llama-3.2-1b; SEQ=4096; DOCS=3000; STEPS=8; GPU=h200-141gb
  COMMON=(launch.device=cuda)
  COMPILE=(engine.compile=true)
fi
$PY bench/gpu_data.py "$WORK/docs.jsonl" --docs $DOCS
RECIPE=llama-3.1-8b-lora-1x24gb  # every run is this recipe plus overrides: the shipped 8B LoRA recipe at 8B first
# grad_accum 2: 2 x SEQ tokens per optimizer step; train.warmup_steps is the LR's. The summary leaves out 2 steps.
COMMON+=(hardware.gpu=$GPU train.profile_memory=true train.eval_every=0 train.save_every=0 train.warmup_steps=1
         train.demo_eval=false train.log_every=1 train.max_steps=$STEPS train.grad_accum=2 data.seq_len=$SEQ
         data.path=$WORK/docs.jsonl data.format=text data.eval_fraction=0 data.cache_dir=$WORK/cache)
LORA=()
QLORA=(lora.quantize_base=nf4)
FULL=(lora.enabled=false model.dtype=fp32 train.lr=1e-5)  # fp32 masters + AdamW, bf16 compute
EAGER=(engine.compile=false)
# engine.compile is newer than this script. Where the recipe refuses it on packed rows, the compiled rows run
# unpacked, each beside an eager row on the same unpacked data; where it is refused outright (an unknown key), the
# compiled rows are skipped with the reason printed, not failed.
probe() { $ST validate $RECIPE "${COMMON[@]}" "${COMPILE[@]}" "$@" > "$WORK/compile_probe.log" 2>&1; }
UNPACKED=()
if probe; then HAS_COMPILE=1
elif probe data.packing=false; then HAS_COMPILE=1; UNPACKED=(data.packing=false)
  echo "== engine.compile refuses packed rows here: the compiled rows and their eager pairs run data.packing=false"
else HAS_COMPILE=0; EAGER=(); echo "== compiled rows skipped: $(tail -1 "$WORK/compile_probe.log")"; fi

T0=$SECONDS
NAMES=()
# queue NAME METHOD SECONDS OVERRIDES...: one row of the table, run in this order
queue() { NAMES+=("$1"); declare -g "Q_$1=$2 $3"; shift 3; eval "O_${NAMES[-1]}=(\"\$@\")"; }
queue lora_8b       lora  100 model.config=configs/models/$M8.json "${LORA[@]}" "${EAGER[@]}"
queue lora_8b_torch lora  100 model.config=configs/models/$M8.json "${LORA[@]}" engine.backend=torch
queue lora_1b       lora   60 model.config=configs/models/$M1.json "${LORA[@]}" "${EAGER[@]}"
queue full_1b       full   70 model.config=configs/models/$M1.json "${FULL[@]}" "${EAGER[@]}"
queue qlora_8b      qlora 100 model.config=configs/models/$M8.json "${QLORA[@]}" "${EAGER[@]}"
queue lora_8b_compile lora 150 model.config=configs/models/$M8.json "${LORA[@]}" "${COMPILE[@]}" "${UNPACKED[@]}"
[ ${#UNPACKED[@]} -gt 0 ] && queue lora_8b_unpacked lora 90 model.config=configs/models/$M8.json "${LORA[@]}" "${EAGER[@]}" "${UNPACKED[@]}"
queue full_1b_compile full 110 model.config=configs/models/$M1.json "${FULL[@]}" "${COMPILE[@]}" "${UNPACKED[@]}"
[ ${#UNPACKED[@]} -gt 0 ] && queue full_1b_unpacked full 60 model.config=configs/models/$M1.json "${FULL[@]}" "${EAGER[@]}" "${UNPACKED[@]}"
queue full_1b_torch full   70 model.config=configs/models/$M1.json "${FULL[@]}" engine.backend=torch
# Full fine-tuning of 8B does not fit one H200 with fp32 masters and AdamW (plan: 149.6 GiB of 132.4 usable):
# the largest full run is the 3B config (~16 bytes a parameter, ~52 GiB).
queue full_3b       full  110 model.config=configs/models/$M3.json "${FULL[@]}" "${EAGER[@]}"

# The plan columns, beside the GPU runs: one plan process at a time, lowest priority (the runs are host-bound).
(for n in "${NAMES[@]}"; do
   eval "o=(\"\${O_$n[@]}\")"
   for kind in plan sim; do
     left=$((BUDGET_S - (SECONDS - T0))); [ $left -lt 5 ] && exit
     flags=(--json); [ $kind = sim ] && flags=(--simulate --json)
     timeout $left nice -n 19 "$ST" plan $RECIPE "${COMMON[@]}" "${o[@]}" "${flags[@]}" > "$RAW/$n.$kind.json" \
       2> "$WORK/$n.$kind.err"
   done
 done) &
PLANS=$!

publish() {
  $PY bench/gpu_summary.py "$RAW" > "$OUTD/table.md" && tar czf "$OUTD/raw.tar.gz" -C "$RAW" .
}
for n in "${NAMES[@]}"; do
  read -r method secs <<< "$(eval echo "\$Q_$n")"
  eval "o=(\"\${O_$n[@]}\")"
  left=$((BUDGET_S - (SECONDS - T0)))
  if [ $HAS_COMPILE = 0 ] && [[ " ${o[*]} " == *" engine.compile=true "* ]]; then status="skipped: engine.compile refused (session.log)"
  elif [ $left -lt 30 ]; then status="skipped: ${left} s left"
  else
    [ $secs -gt $left ] && secs=$left
    echo "== $n $(date -u +%T) (${secs} s): ${o[*]}"
    t=$SECONDS
    # SIGTERM stops a run as Ctrl-C does (its workers with it); SIGKILL 20 s later if that hangs
    timeout -k 20 "$secs" "$ST" train $RECIPE "${COMMON[@]}" "${o[@]}" "train.output_dir=$WORK/$n" > "$WORK/$n.log" 2>&1
    rc=$?
    status="rc $rc, $((SECONDS - t)) s"; [ $rc = 124 ] && status="timed out at $secs s"
    echo "$status"; [ $rc != 0 ] && tail -15 "$WORK/$n.log"
    cp "$WORK/$n/metrics.jsonl" "$RAW/$n.jsonl" 2>/dev/null
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$n" "$method" "$status" "$RECIPE" "${COMMON[*]} ${o[*]}" >> "$RAW/runs.tsv"
  publish
done
wait $PLANS  # each plan process is under a timeout that ends at the deadline
publish
echo "== done $(date -u +%T), $((SECONDS - T0)) s"
cat "$OUTD/table.md"
