"""docs/deploy.md names only things that exist: repository files, the splitserve commands
and flags of the contract, and the names the manifests use."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "deploy.md"


def _cli_flags() -> dict[str, set[str]]:
    """The CLI surface the deploy docs may use: what `splitserve`'s own parser accepts."""
    import argparse

    from router.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {opt for action in parser._actions for opt in action.option_strings}
            for name, parser in sub.choices.items()}


SPLITSERVE_FLAGS = _cli_flags()


def _text() -> str:
    return DOCS.read_text()


def _code_blocks() -> list[str]:
    return re.findall(r"```(?:bash|sh)\n(.*?)```", _text(), re.DOTALL)


def _commands() -> list[list[str]]:
    """Shell commands of the shell code blocks, split into words (comments dropped)."""
    return [shlex.split(line, comments=True)
            for block in _code_blocks() for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _splitserve_calls(argv: list[str]) -> list[list[str]]:
    """The `splitserve ...` invocations in a command: in command position (first word,
    after env assignments, after `--` or `exec`), or inside a quoted command string."""
    calls = []
    for index, word in enumerate(argv):
        if " " in word:
            calls += _splitserve_calls(shlex.split(word))
        elif word == "splitserve":
            before = argv[:index]
            if not before or before[-1] in ("--", "exec") or all(re.match(r"^\w+=", w) for w in before):
                calls.append(argv[index:])
    return calls


def test_every_repository_path_in_the_docs_exists():
    paths = set(re.findall(r"(?<![\w/.-])((?:deploy|docs|tests)/[\w./-]*[\w])", _text()))
    assert paths, "expected the docs to name deploy files"
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert missing == []


def test_docs_cover_every_deploy_file():
    text = _text()
    for path in sorted((REPO / "deploy").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            assert str(path.relative_to(REPO)) in text, f"{path.relative_to(REPO)} is not documented"


def test_splitserve_commands_use_only_existing_subcommands_and_flags():
    seen = set()
    for argv in _commands():
        for call in _splitserve_calls(argv):
            assert len(call) > 1 and call[1] in SPLITSERVE_FLAGS, f"unknown: {' '.join(call)}"
            seen.add(call[1])
            flags = {w.split("=")[0] for w in call[2:] if w.startswith("--")}
            assert flags <= SPLITSERVE_FLAGS[call[1]], flags - SPLITSERVE_FLAGS[call[1]]
    assert seen == {"serve", "generate"}


def test_docs_walk_from_build_to_a_streaming_grpc_call():
    text = _text()
    steps = ["docker build", "docker push", "helm install kuberay-operator",
             "kubectl create secret generic splitserve-auth",
             "kubectl apply -f deploy/kuberay/model-pvc.yaml", "kubectl cp",
             "deploy/kuberay/raycluster-gpu.yaml | kubectl apply -f -",
             "kubectl apply -f deploy/kuberay/service.yaml",
             "kubectl port-forward svc/splitserve 50051:50051 8000:8000",
             "splitserve generate"]
    positions = [text.find(step) for step in steps]
    assert -1 not in positions, [s for s, p in zip(steps, positions) if p == -1]
    assert positions == sorted(positions), "steps out of order"
    assert "--stream" in text


def test_docs_use_the_names_the_manifests_use():
    text = _text()
    cluster = yaml.safe_load((REPO / "deploy" / "kuberay" / "raycluster-gpu.yaml").read_text())
    head_env = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    (token,) = [e for e in head_env if e["name"] == "SPLITSERVE_AUTH_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    assert f"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=" in text
    service = yaml.safe_load((REPO / "deploy" / "kuberay" / "service.yaml").read_text())
    assert f"svc/{service['metadata']['name']}" in text
    loader = yaml.safe_load((REPO / "deploy" / "kuberay" / "model-loader.yaml").read_text())
    model_dir = [w for w in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0].split()
                 if w.startswith("/models/")][0]
    assert f"kubectl cp ./path/to/your-model {loader['metadata']['name']}:{model_dir}" in text
    assert f"ray.io/cluster={cluster['metadata']['name']}" in text


def test_docs_explain_the_front_door_choice_and_sizing():
    text = _text()
    assert "RayJob" in text and "RayService" in text and "ray.io/overwrite-container-cmd" in text
    assert "## Sizing" in text and "splitserve bench" in text
