#!/usr/bin/env bash
# Make .devkit small enough to travel with the working tree to the GPU machine, whose `device`
# tool carries at most 64 MiB in all (tracked files + untracked unignored files + what `carry`
# names). Run once after `bash ../shared/devkit/build-bundle.sh`, from anywhere:
#
#   bash bench/device_kit.sh
#
# 1. Repacks .devkit/sgl_bundle.tar.xz with `xz -9e` (build-bundle.sh writes -6 in threads: 58.5 MB
#    -> 53.7 MB on 2026-11-29), once per bundle and set of extra wheels (.devkit/.bundle-9e marks
#    it): without site/sgl_kernel/infllm_ops.cpython-310-*.so (a CPython 3.10 extension the
#    device's Python 3.12 never imports: 29 MB unpacked) and with every wheel of .devkit/extra/
#    unpacked into site/ (wheels SGLang needs that the bundle lacks; `pip download --no-deps`:
#    sgl-deep-gemm==0.1.5.post1, which the draft model's CUDA graphs import). 53.1 MB with
#    deep-gemm on 2026-12-02, so one call carries the bundle and the tree together.
# 2. Packs the dummy models' configs and SmolLM2's tokenizer as .devkit/smollm2_tok.tar.xz
#    (~0.45 MB, instead of .devkit/models: 3.5 MB); unpack it on the device with
#    `mkdir -p .devkit/models && tar -C .devkit/models -xJf .devkit/smollm2_tok.tar.xz`.
# 3. Prints what a call carrying .devkit/sgl_bundle.tar.xz, .devkit/device-env.sh and
#    .devkit/smollm2_tok.tar.xz sends, against the limit; exits 1 when it is over.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.devkit
if [ ! -f "$KIT/sgl_bundle.tar.xz" ] || [ ! -f "$KIT/device-env.sh" ]; then
  echo "no $KIT/sgl_bundle.tar.xz / device-env.sh: run 'bash ../shared/devkit/build-bundle.sh' first" >&2
  exit 1
fi
newer_extra=""
if [ -f "$KIT/.bundle-9e" ] && [ -d "$KIT/extra" ]; then
  newer_extra=$(find "$KIT/extra" -name '*.whl' -newer "$KIT/.bundle-9e" | head -1)
fi
if [ ! -f "$KIT/.bundle-9e" ] || [ "$KIT/sgl_bundle.tar.xz" -nt "$KIT/.bundle-9e" ] || [ -n "$newer_extra" ]; then
  echo "recompressing $KIT/sgl_bundle.tar.xz with xz -9e (about two minutes on two cores)..."
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  xz -dc "$KIT/sgl_bundle.tar.xz" | tar -C "$tmp" -xf -
  rm -f "$tmp"/site/sgl_kernel/infllm_ops.cpython-310-*.so
  for whl in "$KIT"/extra/*.whl; do
    [ -f "$whl" ] || continue
    echo "  + $(basename "$whl")"
    python3 -m zipfile -e "$whl" "$tmp/site"
  done
  (cd "$tmp" && tar -cf - $(ls -A)) | xz -9e -T2 > "$KIT/sgl_bundle.tar.xz.tmp"
  mv -f "$KIT/sgl_bundle.tar.xz.tmp" "$KIT/sgl_bundle.tar.xz"
  touch "$KIT/.bundle-9e"
fi
tar -C "$KIT/models" -cJf "$KIT/smollm2_tok.tar.xz" smollm2-135m llama31-8b qwen3-8b
python3 - "$KIT" <<'EOF'
import os, subprocess, sys
kit = sys.argv[1]
out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                     capture_output=True, check=True).stdout
tree = sum(os.path.getsize(p) for p in out.decode().split("\0") if p and os.path.isfile(p))
carry = [f"{kit}/sgl_bundle.tar.xz", f"{kit}/device-env.sh", f"{kit}/smollm2_tok.tar.xz"]
sent = tree + sum(os.path.getsize(p) for p in carry)
limit = 64 << 20
mib = 1 << 20
print(f"working tree {tree / mib:.1f} MiB + carry {(sent - tree) / mib:.1f} MiB "
      f"({', '.join(carry)}) = {sent / mib:.1f} MiB of the device's {limit / mib:.0f} MiB")
sys.exit(0 if sent <= limit else 1)
EOF
