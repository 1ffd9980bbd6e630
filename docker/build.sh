#!/usr/bin/env bash
# Build the oscar-sglang image and smoke-test it without a GPU; write bench/results/docker_image.json.
# Run from anywhere: paths are taken relative to this file. `docker/build.sh --help` for options.
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"

DEFAULT_BASE="nvidia/cuda:13.0.2-devel-ubuntu24.04"
DEFAULT_PYTHON="python3.12"
DEFAULT_CUDA_HOME="/usr/local/cuda"
# The fallback base: Debian 12 (bookworm), made here with debootstrap. Its python3 is 3.11, and it
# has no CUDA toolkit, so CUDA_HOME points at the toolkit wheels pip installs into the venv
# (nvidia-cuda-nvcc, -crt, -runtime, nvidia-nvvm: all under site-packages/nvidia/cu13).
DEBIAN_BASE="oscar-sglang-base:debian-bookworm"
DEBIAN_PYTHON="python3"
DEBIAN_CUDA_HOME="/opt/venv/lib/python3.11/site-packages/nvidia/cu13"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
HOST_CA_BUNDLE="${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

TAG="oscar-sglang:0.1.0"
BASE=""
PULL=1
SMOKE=1
NO_CACHE=()
RESULTS="$ROOT/bench/results/docker_image.json"
DOCKERD_ARGS="${DOCKERD_ARGS:---storage-driver=overlay2 --iptables=false --ip6tables=false --bridge=none}"
# versions of the test tools installed for the pytest smoke check only (not part of the image)
SMOKE_PYTEST_PINS="pytest==9.2.0 pytest-timeout==2.4.0"
SMOKE_TESTS="tests/runtime/test_kv_format.py tests/kernels/test_format_reference.py tests/tools/test_plan.py"
PLAN_CONFIG="/opt/oscar-sglang/launch/models/llama31-8b/config.json"

usage() {
    cat <<EOF
Usage: docker/build.sh [options]

Builds the oscar-sglang image from docker/Dockerfile, smoke-tests it on the CPU (no GPU needed)
and writes the record to bench/results/docker_image.json (built, base, image size, build
seconds, each check with its command, exit code and result). Exits non-zero if the build or
any check fails. Re-runs reuse Docker's layer cache.

Base image: $DEFAULT_BASE (python3.12, CUDA_HOME=$DEFAULT_CUDA_HOME) if it is
present or can be pulled; otherwise a local Debian 12 base, $DEBIAN_BASE, made once with
debootstrap (root, debootstrap and access to a Debian mirror needed), with python3 (3.11) and
CUDA_HOME at the pip-installed CUDA toolkit wheels.

Docker daemon: used if one answers; otherwise dockerd is started with
  $DOCKERD_ARGS
(DOCKERD_ARGS overrides) and stopped when the script exits. Builds use --network host.

Options:
  --tag TAG         image tag (default: $TAG)
  --base IMAGE      use this base image, do not try the CUDA one; with --python/--cuda-home
  --python NAME     Python package of the base (python3.12 on Ubuntu 24.04, python3 on Debian 12)
  --cuda-home PATH  CUDA toolkit in the image (must hold bin/nvcc and include/cuda.h)
  --debian          skip the pull, use the Debian 12 fallback base
  --no-smoke        build only (the record then says built, with no checks)
  --no-cache        rebuild every layer (the record's build_seconds is then a cold build)
  --results PATH    where to write the JSON record (default: bench/results/docker_image.json)
  -h, --help        this help
EOF
}

PYTHON=""
CUDA_HOME_ARG=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --tag) TAG="$2"; shift 2 ;;
        --base) BASE="$2"; PULL=0; shift 2 ;;
        --python) PYTHON="$2"; shift 2 ;;
        --cuda-home) CUDA_HOME_ARG="$2"; shift 2 ;;
        --debian) BASE="$DEBIAN_BASE"; PULL=0; shift ;;
        --no-smoke) SMOKE=0; shift ;;
        --no-cache) NO_CACHE=(--no-cache); shift ;;
        --results) RESULTS="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "build.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { printf '[build.sh %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() { printf '[build.sh] error: %s\n' "$*" >&2; exit 1; }

command -v docker >/dev/null || die "no docker CLI (Debian: apt-get install docker.io)"
command -v python3 >/dev/null || die "python3 is needed to write the JSON record"

# the commit the context is copied from, taken before anything runs (a commit made during a long
# build must not be recorded as the one built)
COMMIT="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
DIRTY="$(git -C "$ROOT" status --porcelain 2>/dev/null | grep -q . && echo true || echo false)"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/oscar-sglang-build.XXXXXX")"
STARTED_DOCKERD_PID=""
cleanup() {
    local rc=$?
    if [[ -n "$STARTED_DOCKERD_PID" ]]; then
        log "stopping the dockerd this script started (pid $STARTED_DOCKERD_PID)"
        kill "$STARTED_DOCKERD_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$STARTED_DOCKERD_PID" 2>/dev/null || break; sleep 1; done
    fi
    rm -rf "$WORK/context" "$WORK/rootfs"
    log "logs kept in $WORK"
    exit "$rc"
}
trap cleanup EXIT

# ------------------------------------------------------------------ daemon
if docker info >/dev/null 2>&1; then
    log "using the running Docker daemon"
else
    command -v dockerd >/dev/null || die "no Docker daemon answers and dockerd is not installed"
    [[ $EUID -eq 0 ]] || die "no Docker daemon answers; starting dockerd needs root"
    log "no Docker daemon answers: starting dockerd $DOCKERD_ARGS (log: $WORK/dockerd.log)"
    # shellcheck disable=SC2086  # DOCKERD_ARGS is a list of flags
    dockerd $DOCKERD_ARGS >"$WORK/dockerd.log" 2>&1 &
    STARTED_DOCKERD_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || die "dockerd did not come up; see $WORK/dockerd.log"
fi
DOCKER_SERVER="$(docker version --format '{{.Server.Version}}')"

# ------------------------------------------------------------------ base image
make_debian_base() {
    if docker image inspect "$DEBIAN_BASE" >/dev/null 2>&1; then
        log "Debian base $DEBIAN_BASE exists, reusing it (docker rmi it to make a fresh one)"
        return
    fi
    command -v debootstrap >/dev/null || die "no base image: install debootstrap (apt-get install debootstrap) or pass --base"
    [[ $EUID -eq 0 ]] || die "debootstrap needs root"
    log "making $DEBIAN_BASE with debootstrap (bookworm, minbase + ca-certificates, $DEBIAN_MIRROR)"
    debootstrap --variant=minbase --include=ca-certificates bookworm "$WORK/rootfs" "$DEBIAN_MIRROR" \
        >"$WORK/debootstrap.log" 2>&1 || die "debootstrap failed; see $WORK/debootstrap.log"
    # TLS to PyPI inside the image needs the CAs the host trusts: behind a TLS-inspecting proxy
    # (as on this project's machines) the proxy's CA is only in the host's bundle, so it is
    # appended to Debian's (duplicates are harmless). The Dockerfile points pip at this bundle.
    if [[ -s "$HOST_CA_BUNDLE" ]]; then
        log "adding the host's CA bundle ($HOST_CA_BUNDLE) to the base's"
        mkdir -p "$WORK/rootfs/etc/ssl/certs"
        cat "$HOST_CA_BUNDLE" >>"$WORK/rootfs/etc/ssl/certs/ca-certificates.crt"
    fi
    rm -f "$WORK"/rootfs/var/cache/apt/archives/*.deb
    tar -C "$WORK/rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' \
        -m "debootstrap bookworm minbase + ca-certificates" - "$DEBIAN_BASE" >/dev/null
    log "imported $DEBIAN_BASE"
}

BASE_SOURCE=""
if [[ $PULL -eq 1 ]]; then
    if docker image inspect "$DEFAULT_BASE" >/dev/null 2>&1; then
        BASE="$DEFAULT_BASE"; BASE_SOURCE="present locally"
    else
        log "pulling $DEFAULT_BASE"
        if docker pull "$DEFAULT_BASE" >"$WORK/pull.log" 2>&1; then
            BASE="$DEFAULT_BASE"; BASE_SOURCE="pulled"
        else
            log "cannot pull $DEFAULT_BASE ($(tail -1 "$WORK/pull.log")); falling back to Debian 12"
            BASE="$DEBIAN_BASE"
        fi
    fi
fi
if [[ "$BASE" == "$DEFAULT_BASE" ]]; then
    PYTHON="${PYTHON:-$DEFAULT_PYTHON}"; CUDA_HOME_ARG="${CUDA_HOME_ARG:-$DEFAULT_CUDA_HOME}"
elif [[ "$BASE" == "$DEBIAN_BASE" ]]; then
    make_debian_base
    BASE_SOURCE="${BASE_SOURCE:-debootstrap (Debian 12 bookworm, local)}"
    PYTHON="${PYTHON:-$DEBIAN_PYTHON}"; CUDA_HOME_ARG="${CUDA_HOME_ARG:-$DEBIAN_CUDA_HOME}"
else
    docker image inspect "$BASE" >/dev/null 2>&1 || docker pull "$BASE" || die "base $BASE: not present and cannot be pulled"
    BASE_SOURCE="given (--base)"
    [[ -n "$PYTHON" && -n "$CUDA_HOME_ARG" ]] || die "--base needs --python and --cuda-home"
fi
BASE_ID="$(docker image inspect -f '{{.Id}}' "$BASE")"
log "base: $BASE ($BASE_SOURCE), PYTHON=$PYTHON, CUDA_HOME=$CUDA_HOME_ARG"

# ------------------------------------------------------------------ build
# The context is exactly what docker/Dockerfile.dockerignore lets through (its `!path` lines),
# copied to a scratch folder: the classic builder (used when the buildx plugin is missing) only
# reads a .dockerignore at the context root, so the file next to the Dockerfile would be ignored.
mkdir -p "$WORK/context"
mapfile -t KEEP < <(sed -n 's#^!\(.*\)$#\1#p' "$HERE/Dockerfile.dockerignore" | sed 's#/$##')
(cd "$ROOT" && tar --exclude=__pycache__ --exclude='*.pyc' -c docker/Dockerfile "${KEEP[@]}") \
    | tar -x -C "$WORK/context"

if docker buildx version >/dev/null 2>&1; then
    BUILDER="buildkit"; export DOCKER_BUILDKIT=1
else
    BUILDER="classic (no buildx plugin)"; export DOCKER_BUILDKIT=0
fi
log "building $TAG with the $BUILDER builder (output: $WORK/build.log)"
BUILD_START=$(date +%s)
BUILD_RC=0
(cd "$WORK/context" && docker build --network host "${NO_CACHE[@]}" -f docker/Dockerfile \
    --build-arg "BASE_IMAGE=$BASE" --build-arg "PYTHON=$PYTHON" --build-arg "CUDA_HOME=$CUDA_HOME_ARG" \
    -t "$TAG" . 2>&1) | tee "$WORK/build.log" || BUILD_RC=$?
BUILD_SECONDS=$(( $(date +%s) - BUILD_START ))
CACHED_STEPS=$(grep -c 'Using cache' "$WORK/build.log" || true)
log "build exit code $BUILD_RC after ${BUILD_SECONDS}s ($CACHED_STEPS steps from the layer cache)"

# ------------------------------------------------------------------ smoke checks
: >"$WORK/checks.tsv"
check() {  # check NAME EXPECTED_TEXT -- docker run args...
    local name="$1" expect="$2"; shift 3
    local rc=0 start end
    log "check $name: docker run $*"
    start=$(date +%s)
    docker run --rm "$@" >"$WORK/check-$name.log" 2>&1 || rc=$?
    end=$(date +%s)
    local ok=1
    [[ $rc -eq 0 ]] || ok=0
    if [[ -n "$expect" ]] && ! grep -qF -- "$expect" "$WORK/check-$name.log"; then ok=0; fi
    local cmd="docker run --rm $*"
    cmd="${cmd//$'\n'/\\n}"  # one line per check in the TSV: inline code keeps \n escaped
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$ok" "$((end - start))" "$expect" "$cmd" >>"$WORK/checks.tsv"
    tail -n 5 "$WORK/check-$name.log" | sed 's/^/    /'
    log "check $name: $([[ $ok -eq 1 ]] && echo passed || echo FAILED) (exit $rc)"
}

if [[ $BUILD_RC -eq 0 && $SMOKE -eq 1 ]]; then
    EP_CODE='from importlib.metadata import entry_points
eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "oscar_int2"]
assert len(eps) == 1, eps
assert eps[0].value == "oscar_sglang.runtime.plugin:register", eps[0].value
assert callable(eps[0].load())
print("entry point ok:", eps[0].name, "=", eps[0].value)'
    FREEZE_CODE='import re, subprocess
norm = lambda s: re.sub(r"[-_.]+", "-", s.split("==")[0]).lower() + "==" + s.split("==")[1]
pinned = {norm(ln.strip()) for ln in open("/opt/constraints.txt") if "==" in ln and not ln.startswith("#")}
frozen = {norm(ln) for ln in subprocess.run(["pip", "freeze", "--all", "--exclude-editable"],
          check=True, capture_output=True, text=True).stdout.split() if "==" in ln}
print(len(frozen), "installed,", len(pinned), "pinned")
print("installed, not as pinned:", sorted(frozen - pinned))
print("pinned, not installed:", sorted(pinned - frozen))
assert frozen == pinned
print("pip freeze matches docker/constraints.txt")'
    # The `pd` extra: SGLang's own Mooncake wrapper starts the transfer engine as the servers of
    # compose.yaml's pd profile do by default (MOONCAKE_PROTOCOL=tcp, MC_FORCE_TCP=1; here on the
    # loopback), and sglang-router's launcher answers --help. Mooncake's engine links the CUDA
    # driver (libcuda.so.1), which the NVIDIA Container Toolkit mounts only on a GPU node: here a
    # stub of the driver calls it names (each returns an error) is built with the image's gcc.
    PD_CODE='import torch  # loads the CUDA 13 runtime, as SGLang does before Mooncake
from importlib.metadata import version
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine
import sglang_router
te = MooncakeTransferEngine(hostname="127.0.0.1")
print("mooncake", version("mooncake-transfer-engine-cuda13"), "engine up over tcp:", te.session_id)
print("sglang-router", version("sglang-router"), sglang_router.__file__)'
    # shellcheck disable=SC2016  # the $ names are expanded inside the container
    PD_SH='set -e; stub=$(mktemp -d)
so=$(echo /opt/venv/lib/python3*/site-packages/mooncake/engine.so)
nm -D --undefined-only "$so" | awk '"'"'$2 ~ /^cu[A-Z]/ {print "int " $2 "(void) { return 100; }"}'"'"' >"$stub/cuda.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so.1" "$stub/cuda.c"
LD_LIBRARY_PATH="$stub" MOONCAKE_PROTOCOL=tcp MC_FORCE_TCP=1 python -c "$PD_CODE"
python -m sglang_router.launch_router --help >"$stub/help.txt"
grep -q -- --pd-disaggregation "$stub/help.txt" && echo "launch_router --help ok"'
    PYTEST_SH="pip install -q --target /tmp/smoke-deps $SMOKE_PYTEST_PINS \
&& cd /opt/oscar-sglang && PYTHONPATH=/tmp/smoke-deps python -m pytest -q -p no:cacheprovider $SMOKE_TESTS"

    check help "plan" -- "$TAG" --help
    check serve_print_command "--kv-cache-dtype int2" -- "$TAG" serve --print-command
    check plan "| bf16 |" -- --network none "$TAG" plan --model-path "$PLAN_CONFIG" --kv-budget-gib 51.6
    check plugin_entry_point "entry point ok" -- --network none --entrypoint python "$TAG" -c "$EP_CODE"
    check constraints_match_freeze "matches" -- --network none --entrypoint python "$TAG" -c "$FREEZE_CODE"
    # shellcheck disable=SC2016  # $CUDA_HOME is the image's, expanded inside the container
    check toolchain "Cuda compilation tools" -- --network none --entrypoint bash "$TAG" \
        -c 'gcc --version | head -1 && "$CUDA_HOME/bin/nvcc" --version'
    check pd_extra "launch_router --help ok" -- --network none -e PD_CODE="$PD_CODE" \
        --entrypoint bash "$TAG" -c "$PD_SH"
    check pytest " passed" -- --network host -e PYTHONDONTWRITEBYTECODE=1 \
        -v "$ROOT/tests:/opt/oscar-sglang/tests:ro" -v "$ROOT/bench:/opt/oscar-sglang/bench:ro" \
        -v "$ROOT/docs:/opt/oscar-sglang/docs:ro" --entrypoint bash "$TAG" -c "$PYTEST_SH"
fi

# ------------------------------------------------------------------ record
BUILT=0
IMAGE_ID=""; IMAGE_SIZE=0; IMAGE_PYTHON=""
if [[ $BUILD_RC -eq 0 ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
    BUILT=1
    IMAGE_ID="$(docker image inspect -f '{{.Id}}' "$TAG")"
    IMAGE_SIZE="$(docker image inspect -f '{{.Size}}' "$TAG")"
    IMAGE_PYTHON="$(docker run --rm --network none --entrypoint python "$TAG" -c 'import sys; print(sys.version.split()[0])')"
fi
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | paste -sd, - || true)"
mkdir -p "$(dirname "$RESULTS")"
RESULTS="$RESULTS" TAG="$TAG" BASE="$BASE" BASE_ID="$BASE_ID" BASE_SOURCE="$BASE_SOURCE" \
PYTHON_PKG="$PYTHON" IMAGE_PYTHON="$IMAGE_PYTHON" CUDA_HOME_ARG="$CUDA_HOME_ARG" BUILT="$BUILT" \
BUILD_RC="$BUILD_RC" BUILD_SECONDS="$BUILD_SECONDS" CACHED_STEPS="$CACHED_STEPS" BUILDER="$BUILDER" \
IMAGE_ID="$IMAGE_ID" IMAGE_SIZE="$IMAGE_SIZE" COMMIT="$COMMIT" DIRTY="$DIRTY" GPU="$GPU" \
DOCKER_SERVER="$DOCKER_SERVER" SMOKE="$SMOKE" CHECKS="$WORK/checks.tsv" python3 - <<'EOF'
import datetime, json, os, platform

e = os.environ
checks = []
for line in open(e["CHECKS"]):
    name, rc, ok, secs, expect, cmd = line.rstrip("\n").split("\t", 5)
    cmd = cmd.replace("\\n", "\n")
    checks.append({"name": name, "command": cmd, "exit_code": int(rc), "expected_output": expect,
                   "seconds": int(secs), "passed": ok == "1"})
cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
size = int(e["IMAGE_SIZE"])
record = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": e["COMMIT"], "worktree_dirty": e["DIRTY"] == "true",
    "host": {"os": f"{platform.system()} {platform.release()}", "machine": platform.machine(),
             "cpu": cpu, "cpus": os.cpu_count(), "gpu": e["GPU"] or None,
             "docker_server": e["DOCKER_SERVER"], "builder": e["BUILDER"]},
    "built": e["BUILT"] == "1", "build_exit_code": int(e["BUILD_RC"]),
    "build_seconds": int(e["BUILD_SECONDS"]), "build_steps_from_cache": int(e["CACHED_STEPS"]),
    "image": {"tag": e["TAG"], "id": e["IMAGE_ID"] or None, "size_bytes": size,
              "size_gb": round(size / 1e9, 2)},
    "base_image": {"name": e["BASE"], "id": e["BASE_ID"], "source": e["BASE_SOURCE"]},
    "python": {"package": e["PYTHON_PKG"], "version": e["IMAGE_PYTHON"] or None},
    "cuda_home": e["CUDA_HOME_ARG"],
    "smoke_run": e["SMOKE"] == "1",
    "checks": checks,
    "all_checks_passed": bool(checks) and all(c["passed"] for c in checks),
    "gpu_in_container_verified": False,
}
with open(e["RESULTS"], "w") as f:
    json.dump(record, f, indent=2)
    f.write("\n")
print(f"wrote {e['RESULTS']}: built={record['built']}, "
      f"{sum(c['passed'] for c in checks)}/{len(checks)} checks passed")
EOF

[[ $BUILT -eq 1 ]] || die "the image did not build (exit $BUILD_RC); see $WORK/build.log"
if [[ $SMOKE -eq 1 ]] && awk -F'\t' '$3 != 1' "$WORK/checks.tsv" | grep -q .; then
    die "a smoke check failed; see $WORK/check-*.log and $RESULTS"
fi
log "done: $TAG ($(python3 -c "print(round($IMAGE_SIZE/1e9, 2))") GB), record in $RESULTS"
