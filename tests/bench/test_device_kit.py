"""bench/device_kit.sh on a throwaway git repo with a fake .devkit: it repacks the bundle once (the
same files but a CPython 3.10 extension, plus the extra wheels), packs the models, reports what a
device call would carry, and fails when that is over the 64 MiB limit or when there is no bundle."""
import os
import shutil
import subprocess
import tarfile

import pytest

from tests import ROOT

pytestmark = pytest.mark.skipif(not (shutil.which("git") and shutil.which("xz")), reason="needs git and xz")


def _repo(tmp_path, bundle=True):
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "device_kit.sh", repo / "bench" / "device_kit.sh")
    (repo / ".gitignore").write_text(".devkit/\n")
    (repo / "tracked.txt").write_text("x" * 1000)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    kit = repo / ".devkit"
    for m in ("smollm2-135m", "llama31-8b", "qwen3-8b"):
        (kit / "models" / m).mkdir(parents=True)
        (kit / "models" / m / "config.json").write_text('{"model": "%s"}' % m)
    if bundle:
        site = tmp_path / "site"
        site.mkdir()
        (site / "pkg.py").write_text("print('hello')\n" * 2000)
        (site / "sgl_kernel").mkdir()
        (site / "sgl_kernel" / "infllm_ops.cpython-310-x86_64-linux-gnu.so").write_bytes(b"elf" * 100)
        (site / "sgl_kernel" / "common_ops.abi3.so").write_bytes(b"elf" * 100)
        with tarfile.open(kit / "sgl_bundle.tar.xz", "w:xz", preset=0) as t:
            t.add(site, arcname="site")
        (kit / "device-env.sh").write_text("# env\n")
    return repo


def _run(repo):
    return subprocess.run(["bash", str(repo / "bench" / "device_kit.sh")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "LC_ALL": "C"})


def test_recompresses_once_packs_models_and_reports(tmp_path):
    repo = _repo(tmp_path)
    kit = repo / ".devkit"
    out = _run(repo)
    assert out.returncode == 0, out.stderr
    assert "recompressing" in out.stdout and "of the device's 64 MiB" in out.stdout
    with tarfile.open(kit / "sgl_bundle.tar.xz") as t:  # the same files after recompression
        assert t.extractfile("site/pkg.py").read() == b"print('hello')\n" * 2000
        names = set(t.getnames())
    assert "site/sgl_kernel/common_ops.abi3.so" in names
    assert "site/sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so" not in names
    with tarfile.open(kit / "smollm2_tok.tar.xz") as t:
        assert {"smollm2-135m/config.json", "llama31-8b/config.json", "qwen3-8b/config.json"} <= set(t.getnames())
    # what it counts: the tracked file + the three carried files
    carried = sum((kit / f).stat().st_size for f in ("sgl_bundle.tar.xz", "device-env.sh", "smollm2_tok.tar.xz"))
    total = (1000 + len(".devkit/\n") + carried) / (1 << 20)
    assert f"= {total:.1f} MiB" in out.stdout
    again = _run(repo)  # marked as done: not recompressed twice
    assert again.returncode == 0 and "recompressing" not in again.stdout

    # a wheel put in .devkit/extra later: repacked once more, with the wheel's files in site/
    import zipfile

    (kit / "extra").mkdir()
    with zipfile.ZipFile(kit / "extra" / "deep_gemm-0.1-py3-none-any.whl", "w") as z:
        z.writestr("deep_gemm/__init__.py", "X = 1\n")
        z.writestr("deep_gemm-0.1.dist-info/METADATA", "Name: deep_gemm\n")
    earlier = (kit / ".bundle-9e").stat().st_mtime - 10  # the mark older than the wheel, whatever the clock's grain
    os.utime(kit / ".bundle-9e", (earlier, earlier))
    os.utime(kit / "sgl_bundle.tar.xz", (earlier - 1, earlier - 1))
    third = _run(repo)
    assert third.returncode == 0 and "recompressing" in third.stdout and "deep_gemm-0.1" in third.stdout
    with tarfile.open(kit / "sgl_bundle.tar.xz") as t:
        assert t.extractfile("site/deep_gemm/__init__.py").read() == b"X = 1\n"
        assert t.extractfile("site/pkg.py").read() == b"print('hello')\n" * 2000
    assert "recompressing" not in _run(repo).stdout


def test_over_the_limit_fails(tmp_path):
    repo = _repo(tmp_path)
    with open(repo / "big.bin", "wb") as f:  # untracked, not ignored: it travels too
        f.truncate(65 << 20)
    out = _run(repo)
    assert out.returncode == 1 and "of the device's 64 MiB" in out.stdout


def test_no_bundle_is_a_clear_error(tmp_path):
    out = _run(_repo(tmp_path, bundle=False))
    assert out.returncode == 1 and "build-bundle.sh" in out.stderr
