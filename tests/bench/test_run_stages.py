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
    assert [n for n, _ in hicache.load_jobs(args)] == list(hicache.DEFAULT_LOAD_CONFIGS) and args.gpu_list == ["0"] * 4
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


def test_pd_stage_parts_are_the_benchmarks():
    from bench import pd

    text = SCRIPT.read_text()
    parts = re.search(r"\$\{PD_PARTS:-([^}]*)\}", text).group(1)
    assert parts == pd.DEFAULT_PARTS == "engines,real,load,aborts"
    assert pd.parse_args(["--part", parts]).parts == ["engines", "real", "load", "aborts"]
    # the file the results name under MACHINE=h200; real needs the SmolLM2 wheel as paths does; the
    # wheels' folder the module's help names
    assert "pd_$MACHINE.json" in text and "pd)" in text and "pd-wheels)" in text and ".devkit/pd_wheels" in text
    assert re.search(r"pd\)\n.*?\*,real,\*\)\s*#.*?\n\s*smollm2 \|\|", text, flags=re.S)
    assert pd.DEFAULT_OUT.name == "pd_h200.json" and ".devkit/pd_wheels" in pd.__doc__


def test_pd_wheels_joins_halves_and_installs_each_wheel_once(tmp_path):
    """The stage's pd_wheels function, with a python3 that records its pip calls: a whole wheel and
    one carried in two halves over two calls, each installed once; a failing one is reported and
    the others go on."""
    fn = re.search(r"^pd_wheels\(\) \{.*?^\}", SCRIPT.read_text(), flags=re.S | re.M).group(0)
    work, keep, bin_ = tmp_path / "work", tmp_path / "keep", tmp_path / "bin"
    (work / ".devkit" / "pd_wheels").mkdir(parents=True)
    bin_.mkdir()
    (bin_ / "python3").write_text('#!/bin/sh\necho "$@" >> "$PIPLOG"\ncase "$*" in *bad-*) exit 1 ;; esac\n')
    (bin_ / "python3").chmod(0o755)
    wheels = work / ".devkit" / "pd_wheels"
    (wheels / "router-0.3.2-cp38-abi3-x.whl").write_text("router")
    (wheels / "bad-1-py3-none-any.whl").write_text("bad")
    (wheels / "nixl_cu13-1.5.1-cp312-x.whl.part-a").write_text("nixl-first-half;")
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(tmp_path), "PD_WHEELS_KEEP": str(keep),
           "PIPLOG": str(tmp_path / "pip.args")}

    def call():
        r = subprocess.run(["bash", "-c", f"{fn}\npd_wheels"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = call()  # first call: the router wheel, the failing one, half of nixl
    assert "installed router-0.3.2-cp38-abi3-x.whl" in out and "bad-1-py3-none-any.whl did not install" in out
    assert not (keep / "nixl_cu13-1.5.1-cp312-x.whl").exists()
    (wheels / "nixl_cu13-1.5.1-cp312-x.whl.part-a").unlink()  # the next call carries the second half only
    (wheels / "nixl_cu13-1.5.1-cp312-x.whl.part-b").write_text("second-half")
    out = call()
    assert (keep / "nixl_cu13-1.5.1-cp312-x.whl").read_text() == "nixl-first-half;second-half"
    assert "installed nixl_cu13-1.5.1-cp312-x.whl" in out and "router" not in out.split("installed so far")[0]
    pip = (tmp_path / "pip.args").read_text().splitlines()
    assert sum("router-0.3.2" in x for x in pip) == 1 and sum("nixl_cu13" in x for x in pip) == 1
    assert sum("bad-1" in x for x in pip) == 2  # tried again: it never installed
    assert all(x.startswith("-m pip install -q --no-deps --no-index --upgrade --target /tmp/sgl/site") for x in pip)


def test_rows_are_kept_for_the_next_call_on_a_warm_machine(tmp_path):
    """base_of / keep_rows: the first call reads the checkout's file; after it, its $OUT file is
    kept and the next call (a new $OUT) reads that one; another stage's base is untouched; every
    stage that merges rows uses them, and an explicit *_BASE still wins."""
    text = SCRIPT.read_text()
    fns = "\n".join(re.search(rf"^{name}\(\) \{{.*?^\}}", text, flags=re.S | re.M).group(0)
                    for name in ("base_of", "keep_rows"))
    kept = tmp_path / "kept"
    env = {**os.environ, "ROWS_KEPT": str(kept), "MACHINE": "h200"}

    def sh(cmd, out):
        r = subprocess.run(["bash", "-c", f"{fns}\n{cmd}"], env={**env, "OUT": str(out)}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    out1, out2 = tmp_path / "out1", tmp_path / "out2"
    out1.mkdir(), out2.mkdir()
    assert sh("base_of pd", out1) == "bench/results/pd_h200.json"
    assert sh("keep_rows pd", out1) == ""  # nothing written: nothing kept
    assert not kept.exists()
    (out1 / "pd_h200.json").write_text('{"rows": [1]}')
    assert "rows kept" in sh("keep_rows pd", out1)
    assert sh("base_of pd", out2) == str(kept / "pd_h200.json")
    assert (kept / "pd_h200.json").read_text() == '{"rows": [1]}'
    assert sh("base_of hicache", out2) == "bench/results/hicache_h200.json"
    for var, name in (("SPEC_BASE", "spec_decode"), ("PATHS_BASE", "path_invariance"), ("HICACHE_BASE", "hicache"),
                      ("MG_BASE", "multi_gpu"), ("PD_BASE", "pd")):
        assert f'--base "${{{var}:-$(base_of {name})}}"' in text, var
        assert re.search(rf"keep_rows {name} ;;", text), name
