"""deploy/ray: the launcher config and the `ray start` recipe use the same node-type
resources as the KubeRay manifests."""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "deploy" / "ray" / "cluster-aws.yaml"
START_NODE = REPO / "deploy" / "ray" / "start-node.sh"
ROLES = ("prefill", "decode")


def _launcher() -> dict:
    return yaml.safe_load(LAUNCHER.read_text())


def _role_node_types(config: dict) -> dict[str, dict]:
    """role -> the node type that advertises splitserve_<role>."""
    found = {}
    for name, node_type in config["available_node_types"].items():
        roles = [r for r in ROLES if f"splitserve_{r}" in node_type["resources"]]
        assert len(roles) <= 1, f"{name} advertises more than one role"
        if roles:
            assert roles[0] not in found, f"two node types for {roles[0]}"
            found[roles[0]] = node_type
    return found


def test_launcher_config_matches_rays_schema():
    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        pytest.skip("ray is not installed: its autoscaler schema is unavailable")
    schema_path = Path(spec.origin).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator_cls(schema).iter_errors(_launcher())]
    assert errors == []
    broken = _launcher()
    broken["available_node_types"]["prefill"]["min_worker"] = 1
    broken["docker"]["imagee"] = "x"
    assert len(list(validator_cls(schema).iter_errors(broken))) == 2, "the schema rejects misspelled fields"


def test_launcher_node_types_mirror_the_kuberay_groups():
    config = _launcher()
    head = config["available_node_types"][config["head_node_type"]]
    assert not [r for r in head["resources"] if r.startswith("splitserve_")]
    assert head["resources"].get("CPU") == 0, "nothing scheduled on the head, as in KubeRay"
    role_types = _role_node_types(config)
    assert sorted(role_types) == sorted(ROLES)
    for role, node_type in role_types.items():
        resources = node_type["resources"]
        assert set(k for k in resources if k.startswith("splitserve_")) == {f"splitserve_{role}"}
        assert resources[f"splitserve_{role}"] == resources["GPU"] >= 1, "one unit per GPU"
        assert node_type["min_workers"] == node_type["max_workers"]
    assert config["max_workers"] >= sum(t["max_workers"] for t in role_types.values())


def _dry_run(*args: str, tmp_path: Path, gpus: int = 0) -> list[str]:
    """argv that start-node.sh would run, on a machine with `gpus` (fake) GPUs."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: Fake (UUID: GPU-{i})'\n" for i in range(gpus)))
    fake.chmod(0o755)
    env = {**os.environ, "DRY_RUN": "1", "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(START_NODE), *args], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def _resources(argv: list[str]) -> dict:
    (flag,) = [a for a in argv if a.startswith("--resources=")]
    return json.loads(flag.partition("=")[2])


def test_start_node_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(START_NODE)], check=True, timeout=30)
    assert os.access(START_NODE, os.X_OK)


def test_start_node_head_advertises_nothing(tmp_path):
    argv = _dry_run("head", tmp_path=tmp_path, gpus=1)
    assert argv[:3] == ["ray", "start", "--head"]
    assert "--num-cpus=0" in argv and not [a for a in argv if a.startswith("--resources")]


@pytest.mark.parametrize("role", ROLES)
def test_start_node_worker_advertises_one_unit_per_gpu(role, tmp_path):
    argv = _dry_run(role, "10.0.0.1", tmp_path=tmp_path, gpus=4)
    assert argv[:3] == ["ray", "start", "--address=10.0.0.1:6379"]
    assert _resources(argv) == {f"splitserve_{role}": 4}
    assert "--num-gpus=4" in argv


@pytest.mark.parametrize("role", ROLES)
def test_start_node_worker_without_gpus_and_explicit_count(role, tmp_path):
    argv = _dry_run(role, "10.0.0.1", tmp_path=tmp_path)
    assert _resources(argv) == {f"splitserve_{role}": 1}
    assert not [a for a in argv if a.startswith("--num-gpus")]
    assert _resources(_dry_run(role, "10.0.0.1", "3", tmp_path=tmp_path)) == {f"splitserve_{role}": 3}


@pytest.mark.parametrize("args", [(), ("prefill",), ("router", "10.0.0.1"), ("decode", "10.0.0.1", "0")])
def test_start_node_rejects_bad_arguments(args):
    result = subprocess.run(["bash", str(START_NODE), *args], env={**os.environ, "DRY_RUN": "1"},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
