"""deploy/docker: the image the manifests name is the one the documented build produces."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCS = REPO / "docs" / "deploy.md"


def _package_version() -> str:
    project = (REPO / "pyproject.toml").read_text().partition("[project]")[2]
    return re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE).group(1)


def _dockerfile_stages() -> dict[str, str]:
    """stage name -> the text of that stage."""
    stages, name, lines = {}, None, []
    for line in DOCKERFILE.read_text().splitlines():
        match = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?\s*$", line, re.IGNORECASE)
        if match:
            if name:
                stages[name] = "\n".join(lines)
            name, lines = match.group(1), []
        lines.append(line)
    if name:
        stages[name] = "\n".join(lines)
    return stages


def _arg_default(text: str, arg: str) -> str:
    (value,) = re.findall(rf"^ARG\s+{arg}=(\S+)\s*$", text, re.MULTILINE)
    return value


def _documented_builds() -> list[dict]:
    """Every `docker build` command in docs/deploy.md, parsed."""
    builds = []
    for line in DOCS.read_text().splitlines():
        if line.strip().startswith("docker build "):
            argv = shlex.split(line)
            parsed = {"context": argv[-1]}
            for flag, key in (("-f", "file"), ("--target", "target"), ("-t", "tag")):
                parsed[key] = argv[argv.index(flag) + 1]
            builds.append(parsed)
    return builds


def _manifest_images() -> dict[str, set[str]]:
    """file -> images it names (containers, init containers, launcher docker.image)."""
    images: dict[str, set[str]] = {}

    def walk(node, found):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    found.update(c["image"] for c in value)
                walk(value, found)
        elif isinstance(node, list):
            for item in node:
                walk(item, found)

    for path in sorted((REPO / "deploy").rglob("*.yaml")):
        found: set[str] = set()
        for doc in yaml.safe_load_all(path.read_text()):
            walk(doc, found)
            if isinstance(doc, dict) and "docker" in doc:
                found.add(doc["docker"]["image"])
        images[str(path.relative_to(REPO))] = found
    return images


def test_dockerfile_has_a_cuda_and_a_slim_cpu_target():
    stages = _dockerfile_stages()
    assert {"base", "cpu", "cuda"} <= set(stages)
    assert "download.pytorch.org/whl/cpu" in stages["cpu"], "slim: the CPU-only torch build"
    for target in ("cpu", "cuda"):
        text = stages[target]
        assert re.search(r"^FROM base AS", text, re.MULTILINE | re.IGNORECASE)
        assert 'torch==${TORCH_VERSION}' in text
        assert re.search(r"pip install /tmp/splitserve-src", text), "installs the package from the repo root"
        assert re.search(r"^USER 1000", text, re.MULTILINE), "manifests run as uid 1000"
        assert _arg_default(text, "TORCH_VERSION") == "2.13.0"


def test_dockerignore_keeps_the_context_small_but_installable():
    lines = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    ignore = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert ".venv" in ignore and ".git" in ignore
    assert not {"README.md", "pyproject.toml", "engine", "router", "protos"} & set(ignore)


def test_docs_build_both_variants_from_the_repo_root_with_versioned_tags():
    builds = _documented_builds()
    assert {b["target"] for b in builds} == {"cpu", "cuda"}
    for build in builds:
        assert build["file"] == "deploy/docker/Dockerfile" and build["context"] == "."
        assert build["tag"] == f"splitserve:{_package_version()}-{build['target']}"
    # The Dockerfile's own header shows the same commands.
    header = DOCKERFILE.read_text()
    for build in builds:
        assert f"--target {build['target']}" in header and build["tag"] in header


def test_every_manifest_image_is_a_documented_build():
    built = {b["tag"] for b in _documented_builds()}
    images = _manifest_images()
    named = set().union(*images.values())
    assert named, "no images found"
    assert named <= built, named - built
    assert images["deploy/kuberay/raycluster-gpu.yaml"] == {f"splitserve:{_package_version()}-cuda"}
    assert images["deploy/kuberay/raycluster-cpu.yaml"] == {f"splitserve:{_package_version()}-cpu"}
    assert images["deploy/ray/cluster-aws.yaml"] == {f"splitserve:{_package_version()}-cuda"}


def test_ray_version_matches_the_image():
    ray_version = _arg_default(_dockerfile_stages()["base"], "RAY_VERSION")
    for name in ("raycluster-gpu.yaml", "raycluster-cpu.yaml"):
        cluster = yaml.safe_load((REPO / "deploy" / "kuberay" / name).read_text())
        assert cluster["spec"]["rayVersion"] == ray_version, name
