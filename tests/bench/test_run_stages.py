"""bench/run_stages.sh: the staged device runner's settings are ones the benchmarks accept.

It runs on a GPU machine only, so what CI can check is what it would hand to the Python
benchmarks: the default NIAH configurations parse and each INT2 format resolves, the default
serving configurations exist, and an unknown stage or a bad machine tag stops it before any work."""
import os
import re
import subprocess

from tests import ROOT

SCRIPT = ROOT / "bench" / "run_stages.sh"


def _script_default(name: str) -> str:
    """The default of a variable the script sets as NAME=${NAME:-"..."}, as bash expands it."""
    text = SCRIPT.read_text()
    m = re.search(rf'^{name}=\$\{{{name}:-"(.*?)"\}}$', text, flags=re.S | re.M)
    assert m, name
    out = subprocess.run(["bash", "-c", f'v="{m.group(1)}"; printf %s "$v"'],
                         capture_output=True, text=True, check=True)
    return out.stdout


def test_niah_configurations_parse_and_every_format_resolves():
    from bench import niah_server
    from oscar_sglang.runtime.kv_format import DEFAULT_KV_FORMAT, resolve

    configs = niah_server.parse_configs(_script_default("NIAH_CONFIGS"))
    names = [c.name for c in configs]
    assert names[:3] == ["bf16", "fp8_e4m3", "int2"] and len(names) == len(set(names)) == 9
    assert [c.name for c in configs if c.default] == ["int2"]
    formats = {c.name: c.env.get("OSCAR_KV_FORMAT") for c in configs if c.kv == "int2"}
    assert formats["int2"] is None  # the served default, whatever it is
    assert "k3c64-v2t64-s4-w128" in formats.values()  # the previous default beside it
    assert "k4c64-v2h-s4-w64" in formats.values()  # the default with one key block of BF16 window
    served = {name: resolve(fmt or "", head_dim=64, v_head_dim=64, num_layers=30, group_size=64).name
              for name, fmt in formats.items()}  # on SmolLM2's geometry: 30 layers of 64-dim heads
    assert served["int2"] == resolve(DEFAULT_KV_FORMAT, head_dim=64, v_head_dim=64, num_layers=30,
                                     group_size=64).name
    assert len(set(served.values())) == len(served), served  # nine different caches


def test_serving_pair_configurations_exist():
    from bench._serving_server import CONFIGS

    text = SCRIPT.read_text()
    default = re.search(r"\$\{CONFIGS:-([^}]*)\}", text).group(1)
    assert default.split(",") == ["int2", "int2-token-splits64", "int2-k3c64-v2t64"]
    assert set(default.split(",")) <= set(CONFIGS)


def test_an_unknown_stage_stops_before_any_work(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", str(SCRIPT), "kernels", "warmup"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "unknown stage 'warmup'" in r.stdout
    assert not (tmp_path / "out").exists()  # not even the results folder: "kernels" did not start
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and r.stdout.startswith("usage:")
    r = subprocess.run(["bash", str(SCRIPT), "kernels"], capture_output=True, text=True,
                       env={**env, "MACHINE": "h200/../x"}, timeout=60)
    assert r.returncode == 2 and "MACHINE=" in r.stdout
    assert not (tmp_path / "out").exists()


def test_spec_stage_parts_are_the_benchmarks():
    from bench import spec_decode

    default = re.search(r"\$\{SPEC_PARTS:-([^}]*)\}", SCRIPT.read_text()).group(1)
    assert default.split(",") == ["real", "aborts"]
    assert spec_decode.parse_args(["--part", default]).parts == ["real", "aborts"]


def test_paths_stage_configurations_are_the_benchmarks():
    from bench import path_invariance

    text = SCRIPT.read_text()
    default = re.search(r"\$\{PATHS_CONFIGS:-([^}]*)\}", text).group(1)
    assert default == "int2,bf16"
    args = path_invariance.parse_args(["--configs", default, "--model-path", "/m"])
    assert [(c.name, c.kv) for c in args.config_list] == [("int2", "int2"), ("bf16", "bf16")]
    # the stage writes the file the renderer reads, under the machine's tag
    assert "path_invariance_$MACHINE.json" in text and "paths)" in text


def test_hicache_stage_parts_and_gpus_are_the_benchmarks():
    from bench import hicache

    text = SCRIPT.read_text()
    parts = re.search(r"\$\{HICACHE_PARTS:-([^}]*)\}", text).group(1)
    gpus = re.search(r"\$\{HICACHE_GPUS:-([^}]*)\}", text).group(1)
    assert parts == hicache.DEFAULT_PARTS == "load,file,aborts"
    args = hicache.parse_args(["--part", parts, "--gpus", gpus])
    assert args.parts == ["load", "file", "aborts"]
    # one slot per load server: the four start together on GPU 0
    assert [n for n, _ in hicache.load_jobs(args)] == list(hicache.LOAD_CONFIGS) and args.gpu_list == ["0"] * 4
    assert hicache.parse_args(["--part", "paths", "--gpus", gpus]).parts == ["paths"]
    # the stage writes the file the issue names, under the machine's tag; paths needs the wheel
    assert "hicache_$MACHINE.json" in text and "hicache)" in text and "*,paths,*)" in text


def test_multi_gpu_stage_parts_and_gpus_are_the_benchmarks():
    from bench import multi_gpu

    text = SCRIPT.read_text()
    parts = re.search(r"\$\{MG_PARTS:-([^}]*)\}", text).group(1)
    gpus = re.search(r"\$\{MG_GPUS:-([^}]*)\}", text).group(1)
    args = multi_gpu.parse_args(["--part", parts, "--gpus", gpus, "--only-missing", "--deadline-s", "520"])
    assert args.parts == ["tp", "dp"] and args.gpu_list == ["0", "1"] and args.only_missing
    # the file the issue names under MACHINE=h200x2, the router wheel's folder the script's help names
    assert "multi_gpu_$MACHINE.json" in text and "multi-gpu)" in text and ".devkit/router/*.whl" in text
    assert multi_gpu.DEFAULT_OUT.name == "multi_gpu_h200x2.json" and ".devkit/router" in multi_gpu.__doc__
