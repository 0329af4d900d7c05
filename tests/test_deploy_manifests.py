"""deploy/kuberay: strict schema validation (positive and negative) and the invariants that
tie the manifests to the placement code, the front door's flags and each other."""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KUBERAY = REPO / "deploy" / "kuberay"
CRD_DIR = Path(os.environ.get("SPLITSERVE_KUBERAY_CRDS", REPO.parent / "shared" / "kuberay-crds"))
# Keyed by image variant; ("gpu" as a test id would be skipped by conftest without CUDA.)
RAYCLUSTERS = {"cuda": KUBERAY / "raycluster-gpu.yaml", "cpu": KUBERAY / "raycluster-cpu.yaml"}
RAYSERVICES = {"cuda": KUBERAY / "rayservice-gpu.yaml", "cpu": KUBERAY / "rayservice-cpu.yaml"}
ROLES = ("prefill", "decode")


def _load_validate_module():
    spec = importlib.util.spec_from_file_location("splitserve_deploy_validate", REPO / "deploy" / "validate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


validate = _load_validate_module()


def crd_dir() -> Path:
    """The KubeRay v1 CRDs the strict checks validate against. A user's clone has none beside
    it: those checks skip, saying how to run them; CI sets SPLITSERVE_REQUIRE_CRDS=1 and fails."""
    if CRD_DIR.is_dir():
        return CRD_DIR
    message = (f"KubeRay CRDs not found at {CRD_DIR}: set SPLITSERVE_KUBERAY_CRDS to a folder holding the "
               "KubeRay v1 CRD YAMLs (ray.io_rayclusters.yaml, ray.io_rayservices.yaml, ray.io_rayjobs.yaml) "
               "to run the strict schema checks")
    if os.environ.get("SPLITSERVE_REQUIRE_CRDS", "") not in ("", "0"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def validator():
    return validate.ManifestValidator(crd_dir())


def _docs(path: Path) -> list[dict]:
    return validate.load_documents(path.read_text())


def _one(path: Path) -> dict:
    (doc,) = _docs(path)
    return doc


def _groups(cluster: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}


def _ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def _parse_resources_param(value: str) -> dict:
    """What `ray start` receives after the shell parses KubeRay's `--resources=<value>`."""
    (token,) = shlex.split(f"--resources={value}")
    return json.loads(token.partition("=")[2])


def _serve_args(cluster: dict) -> dict:
    """Flags of the `exec splitserve serve ...` line of the head container."""
    script = "\n".join(_ray_container(cluster["spec"]["headGroupSpec"])["args"])
    (line,) = [text.strip() for text in script.splitlines() if "splitserve serve" in text]
    argv = shlex.split(line)
    assert argv[:3] == ["exec", "splitserve", "serve"], line
    flags = {}
    for token in argv[3:]:
        if token.startswith("--"):
            flags[token[2:]] = None
            last = token[2:]
        else:
            assert flags.get(last) is None, f"two values for --{last}"
            flags[last] = token
    return flags


# ------------------------------------------------------------------ strict schemas

MANIFESTS = validate.find_manifests(REPO / "deploy")


def test_every_yaml_under_deploy_is_covered():
    """Each YAML file is a Kubernetes manifest (validated here) or the Ray launcher config
    (validated in test_deploy_ray.py): nothing escapes validation."""
    yamls = sorted(p for pat in ("*.yaml", "*.yml") for p in (REPO / "deploy").rglob(pat))
    launcher = sorted((REPO / "deploy" / "ray").glob("*.yaml"))
    assert set(yamls) == set(MANIFESTS) | set(launcher)
    assert {p.name for p in MANIFESTS} >= {
        "raycluster-gpu.yaml", "raycluster-cpu.yaml", "service.yaml", "model-pvc.yaml", "model-loader.yaml",
        "rayservice-gpu.yaml", "rayservice-cpu.yaml", "rayjob-bench.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(REPO)))
def test_manifest_is_valid_strictly(validator, path):
    assert validator.validate_file(path) == []


@pytest.fixture(scope="module")
def latest_validator():
    import kubernetes_validate

    latest = ".".join(kubernetes_validate.latest_version().split(".")[:2])
    return validate.ManifestValidator(crd_dir(), latest)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(REPO)))
def test_manifest_is_valid_on_latest_kubernetes_schemas(latest_validator, path):
    assert latest_validator.validate_file(path) == []


def _mutated(doc: dict, path: list, new_key: str | None = None, value=None) -> dict:
    """Copy of doc with the key at path renamed to new_key, or its value replaced."""
    doc = copy.deepcopy(doc)
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    if new_key is not None:
        parent[new_key] = parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return doc


RAYCLUSTER_TYPOS = {
    "workerGroupSpecs entry": (["spec", "workerGroupSpecs", 0, "replicas"], "replica"),
    "worker rayStartParams": (["spec", "workerGroupSpecs", 1, "rayStartParams"], "rayStartParam"),
    "worker pod spec": (["spec", "workerGroupSpecs", 0, "template", "spec", "tolerations"], "toleration"),
    "worker container": (["spec", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "imagePullPolicy"],
                         "imagePulPolicy"),
    "head probe": (["spec", "headGroupSpec", "template", "spec", "containers", 0, "readinessProbe"], "readynessProbe"),
    "head env secret ref": (["spec", "headGroupSpec", "template", "spec", "containers", 0, "env", 0, "valueFrom",
                             "secretKeyRef"], "secretRef"),
    "headGroupSpec": (["spec", "headGroupSpec"], "headGroupSpecs"),
    "root metadata": (["metadata", "labels"], "lables"),
    "pod template metadata": (["spec", "headGroupSpec", "template", "metadata", "labels"], "label"),
}


@pytest.mark.parametrize("case", sorted(RAYCLUSTER_TYPOS))
def test_misspelled_field_in_raycluster_fails(validator, case):
    path, typo = RAYCLUSTER_TYPOS[case]
    doc = _one(RAYCLUSTERS["cuda"])
    assert validator.validate(doc) == []
    problems = validator.validate(_mutated(doc, path, new_key=typo))
    assert any(repr(typo) in p for p in problems), problems


@pytest.mark.parametrize("path,typo", [
    (["spec", "selector"], "selecter"),
    (["spec", "ports", 0, "targetPort"], "targetport"),
    (["metadata", "name"], "nmae"),
])
def test_misspelled_field_in_service_fails(validator, path, typo):
    doc = _one(KUBERAY / "service.yaml")
    assert validator.validate(doc) == []
    problems = validator.validate(_mutated(doc, path, new_key=typo))
    assert any(repr(typo) in p for p in problems), problems


@pytest.mark.parametrize("file,path,value", [
    ("raycluster-gpu.yaml", ["spec", "workerGroupSpecs", 0, "replicas"], "1"),
    ("raycluster-gpu.yaml", ["spec", "workerGroupSpecs", 0, "rayStartParams", "num-gpus"], 1),
    ("raycluster-gpu.yaml", ["spec", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "resources",
                             "limits", "memory"], "64 GB"),
    ("raycluster-gpu.yaml", ["apiVersion"], "ray.io/v9"),
    ("service.yaml", ["spec", "ports", 0, "port"], "grpc"),
    ("model-pvc.yaml", ["spec", "accessModes"], "ReadWriteMany"),
])
def test_wrong_type_fails(validator, file, path, value):
    doc = _one(KUBERAY / file)
    assert validator.validate(_mutated(doc, path, value=value)) != []


def test_custom_resource_metadata_is_a_strict_object_meta(validator):
    """The CRD says only `metadata: {type: object}`; the API server checks ObjectMeta."""
    doc = _one(RAYCLUSTERS["cuda"])
    doc["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "a", "uid": "1"}]
    assert validator.validate(doc) == []
    doc["metadata"]["ownerReferences"][0]["uuid"] = "1"
    assert any("'uuid'" in p for p in validator.validate(doc))


def test_duplicate_map_list_key_fails(validator):
    doc = _one(RAYCLUSTERS["cuda"])
    ports = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    ports.append({"name": "grpc-again", "containerPort": 50051})
    assert any("same key" in p for p in validator.validate(doc))


def test_duplicate_yaml_key_fails(validator, tmp_path):
    text = RAYCLUSTERS["cpu"].read_text().replace("  rayVersion:", "  rayVersion: \"2.0.0\"\n  rayVersion:", 1)
    bad = tmp_path / "dup.yaml"
    bad.write_text(text)
    assert any("duplicate key" in p for p in validator.validate_file(bad))


def test_unknown_kind_is_an_error_not_a_pass(validator):
    assert validator.validate({"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
                               "metadata": {"name": "x"}, "spec": {}}) != []
    assert validator.validate({"apiVersion": "ray.io/v1", "kind": "RayThing", "metadata": {"name": "x"}}) != []


def test_validate_cli_passes_on_the_repository():
    result = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "validate.py"), "--crds", str(crd_dir())],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{len(MANIFESTS)} file(s), 0 problem(s)" in result.stdout


# ------------------------------------------------------------------ the RayClusters

@pytest.mark.parametrize("variant", sorted(RAYCLUSTERS))
def test_worker_groups_name_their_role_and_advertise_its_resource(variant):
    cluster = _one(RAYCLUSTERS[variant])
    groups = _groups(cluster)
    assert sorted(groups) == sorted(ROLES)
    for role, group in groups.items():
        params = group["rayStartParams"]
        advertised = _parse_resources_param(params["resources"])
        assert set(advertised) == {f"splitserve_{role}"}
        units = advertised[f"splitserve_{role}"]
        assert isinstance(units, int) and units >= 1
        # KubeRay itself parses the value after trimming quotes; a parse failure there
        # makes it skip GPU detection, so the trimmed value must be plain JSON too.
        assert json.loads(params["resources"].strip("'\"` ")) == advertised
        limits = _ray_container(group)["resources"]["limits"]
        gpus = int(limits.get("nvidia.com/gpu", 0))
        if variant == "cuda":
            assert gpus == units == int(params["num-gpus"]), "one splitserve unit per GPU"
            assert _ray_container(group)["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
        else:
            assert gpus == 0 and "num-gpus" not in params
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"], "fixed size, no autoscaling"


@pytest.mark.parametrize("variant", sorted(RAYCLUSTERS))
def test_head_advertises_no_worker_resource_and_schedules_nothing(variant):
    head = _one(RAYCLUSTERS[variant])["spec"]["headGroupSpec"]
    assert "resources" not in head["rayStartParams"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in _ray_container(head)["resources"].get("limits", {})


@pytest.mark.parametrize("variant", sorted(RAYCLUSTERS))
def test_serve_flags_match_the_worker_groups(variant):
    cluster = _one(RAYCLUSTERS[variant])
    flags = _serve_args(cluster)
    allowed = {"address", "model", "prefill", "decode", "transport", "grpc-port", "http-port", "host",
               "gpus-per-worker", "prefill-tp", "decode-tp", "dtype", "gpu-memory-utilization"}
    assert set(flags) <= allowed, set(flags) - allowed
    # GPU workers serve bf16 with the cache sized from each GPU's memory, not float32 in 1 GiB.
    assert (flags.get("dtype"), flags.get("gpu-memory-utilization")) == {"cuda": ("bfloat16", "0.9"),
                                                                         "cpu": (None, None)}[variant]
    assert flags["address"] == "auto" and flags["host"] == "0.0.0.0"
    assert flags["grpc-port"] == "50051" and flags["http-port"] == "8000"
    assert flags["transport"] == {"cuda": "nccl", "cpu": "gloo"}[variant]
    assert flags.get("gpus-per-worker") == {"cuda": "1", "cpu": None}[variant]
    # The GPU cluster shows the usual split: a TP=2 prefill worker, a TP=1 decode worker.
    assert (flags.get("prefill-tp"), flags.get("decode-tp")) == {"cuda": ("2", "1"), "cpu": (None, None)}[variant]
    for role, group in _groups(cluster).items():
        units = _parse_resources_param(group["rayStartParams"]["resources"])[f"splitserve_{role}"]
        ranks = int(flags[role]) * int(flags.get(f"{role}-tp", 1))
        assert ranks == group["replicas"] * units, f"--{role} x --{role}-tp must equal the {role} capacity"


def test_gpu_cluster_serves_the_model_from_the_volume():
    cluster = _one(RAYCLUSTERS["cuda"])
    claim = _one(KUBERAY / "model-pvc.yaml")["metadata"]["name"]
    model = _serve_args(cluster)["model"]
    assert model.startswith("/models/")
    pods = [cluster["spec"]["headGroupSpec"]] + list(_groups(cluster).values())
    for pod in pods:
        spec = pod["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = [m for m in _ray_container(pod)["volumeMounts"] if m["mountPath"] == "/models"]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim
    loader = _one(KUBERAY / "model-loader.yaml")
    assert [v["persistentVolumeClaim"]["claimName"] for v in loader["spec"]["volumes"]] == [claim]


def test_gpu_workers_have_node_selectors_and_tolerations():
    for role, group in _groups(_one(RAYCLUSTERS["cuda"])).items():
        spec = group["template"]["spec"]
        assert spec["nodeSelector"] == {"splitserve/pool": role}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


@pytest.mark.parametrize("variant", sorted(RAYCLUSTERS))
def test_head_probes_and_auth(variant):
    container = _ray_container(_one(RAYCLUSTERS[variant])["spec"]["headGroupSpec"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == 50051 and ports["http"] == 8000
    # KubeRay builds its head Service from these ports when any are given: keep Ray's own.
    assert {"gcs-server": 6379, "dashboard": 8265, "client": 10001}.items() <= ports.items()
    readiness = container["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/health" and ports.get(readiness["port"], readiness["port"]) == 8000
    assert container["livenessProbe"]["grpc"]["port"] == 50051
    assert "startupProbe" in container
    (token,) = [e for e in container["env"] if e["name"] == "SPLITSERVE_AUTH_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "splitserve-auth", "key": "token"}


def test_service_selects_the_head_and_only_the_head():
    service = _one(KUBERAY / "service.yaml")
    selector = service["spec"]["selector"]
    for variant, path in RAYCLUSTERS.items():
        cluster = _one(path)
        name = cluster["metadata"]["name"]

        def pod_labels(group_spec, node_type, group_name):
            # Labels KubeRay puts on the pods, over the template's own.
            return {**group_spec["template"]["metadata"].get("labels", {}),
                    "ray.io/cluster": name, "ray.io/node-type": node_type, "ray.io/group": group_name}

        head = pod_labels(cluster["spec"]["headGroupSpec"], "head", "headgroup")
        assert selector.items() <= head.items(), variant
        for group_name, group in _groups(cluster).items():
            assert not selector.items() <= pod_labels(group, "worker", group_name).items()
        head_ports = {p["name"]: p["containerPort"]
                      for p in _ray_container(cluster["spec"]["headGroupSpec"])["ports"]}
        for port in service["spec"]["ports"]:
            assert head_ports[port["targetPort"]] == port["port"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "http": 8000}


def test_manifests_leave_namespace_and_status_to_the_cluster():
    for path in MANIFESTS:
        for doc in _docs(path):
            assert "namespace" not in doc["metadata"], path
            assert "status" not in doc, path


# ----------------------------------------- the container commands, run in a shell

def _kuberay_generated_ray_start(params: dict, node_type: str, head_address: str) -> str:
    """The `ray start` line KubeRay hands over in KUBERAY_GEN_RAY_START_CMD: its defaults
    added, keys sorted, "true" values as bare flags."""
    params = dict(params)
    if node_type == "worker":
        params.setdefault("address", head_address)
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", "8080")
    params.setdefault("dashboard-agent-listen-port", "52365")
    params["block"] = "true"
    flags = [f"--{k}" if v.lower() == "true" else f"--{k}={v}" for k, v in sorted(params.items())]
    return " ".join(["ray", "start"] + (["--head"] if node_type == "head" else []) + flags)


def _run_container_script(tmp_path: Path, script: str, generated: str) -> list[list[str]]:
    """Run a container's bash script with stand-ins for `ray` and `splitserve` that log
    their argv; return the logged calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.jsonl"
    for tool in ("ray", "splitserve"):
        fake = bin_dir / tool
        fake.write_text(
            "#!/usr/bin/env python3\nimport json, os, sys\n"
            f"open({str(log)!r}, 'a').write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + '\\n')\n")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "KUBERAY_GEN_RAY_START_CMD": generated}
    result = subprocess.run(["/bin/bash", "-c", "--", script], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("variant", sorted(RAYCLUSTERS))
def test_head_script_starts_ray_then_hands_over_to_the_front_door(tmp_path, variant):
    cluster = _one(RAYCLUSTERS[variant])
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]
    container = _ray_container(head)
    assert container["command"] == ["/bin/bash", "-c", "--"]
    generated = _kuberay_generated_ray_start(head["rayStartParams"], "head", "")
    ray_call, serve_call = _run_container_script(tmp_path, container["args"][0], generated)
    assert ray_call[:3] == ["ray", "start", "--head"]
    assert "--block" not in ray_call, "ray start must return so the front door can start"
    assert "--num-cpus=0" in ray_call
    assert serve_call[:2] == ["splitserve", "serve"]


@pytest.mark.parametrize("variant", sorted(RAYCLUSTERS))
def test_worker_script_runs_the_generated_ray_start(tmp_path, variant):
    for role, group in _groups(_one(RAYCLUSTERS[variant])).items():
        container = _ray_container(group)
        assert container["command"] == ["/bin/bash", "-c", "--"]
        generated = _kuberay_generated_ray_start(group["rayStartParams"], "worker", "splitserve-head-svc:6379")
        workdir = tmp_path / role
        workdir.mkdir()
        (ray_call,) = _run_container_script(workdir, container["args"][0], generated)
        assert "--block" in ray_call
        (resources,) = [a for a in ray_call if a.startswith("--resources=")]
        advertised = _parse_resources_param(group["rayStartParams"]["resources"])
        assert json.loads(resources.partition("=")[2]) == advertised


# ------------------------------------------------------------------ the RayServices and the RayJob

RAYSERVICE_TYPOS = {
    "serveConfigV2": (["spec", "serveConfigV2"], "serveConfigv2"),
    "rayClusterConfig": (["spec", "rayClusterConfig"], "rayClusterConf"),
    "worker group": (["spec", "rayClusterConfig", "workerGroupSpecs", 0, "replicas"], "replica"),
    "worker container": (["spec", "rayClusterConfig", "workerGroupSpecs", 1, "template", "spec", "containers", 0,
                          "env"], "envs"),
    "serveService": (["spec", "serveService", "spec", "ports"], "port"),
    "upgradeStrategy": (["spec", "upgradeStrategy", "type"], "kind"),
}


@pytest.mark.parametrize("variant", sorted(RAYSERVICES))
@pytest.mark.parametrize("case", sorted(RAYSERVICE_TYPOS))
def test_misspelled_field_in_rayservice_fails(validator, variant, case):
    path, typo = RAYSERVICE_TYPOS[case]
    doc = _one(RAYSERVICES[variant])
    assert validator.validate(doc) == []
    problems = validator.validate(_mutated(doc, path, new_key=typo))
    assert any(repr(typo) in p for p in problems), problems


def test_misspelled_or_mistyped_field_in_rayjob_fails(validator):
    pvc, job = _docs(KUBERAY / "rayjob-bench.yaml")
    assert validator.validate(pvc) == [] and validator.validate(job) == []
    assert any("'entryPoint'" in p for p in validator.validate(_mutated(job, ["spec", "entrypoint"], "entryPoint")))
    assert validator.validate(_mutated(job, ["spec", "backoffLimit"], value="none")) != []


def _serve_config(service: dict) -> dict:
    import yaml

    return yaml.safe_load(service["spec"]["serveConfigV2"])


@pytest.mark.parametrize("variant", sorted(RAYSERVICES))
def test_rayservice_runs_the_serve_app_with_options_matching_the_worker_groups(variant):
    from router.serve_app import GRPC_SERVICER_FUNCTIONS, parse_options

    service = _one(RAYSERVICES[variant])
    config = _serve_config(service)
    (app,) = config["applications"]
    assert app["import_path"] == "router.serve_app:build" and app["route_prefix"] == "/"
    model, launch, _ = parse_options(app["args"])  # the builder's own parsing: the args are valid
    assert launch["transport"] == {"cuda": "nccl", "cpu": "gloo"}[variant]
    assert launch["gpus_per_worker"] == {"cuda": 1.0, "cpu": 0.0}[variant]
    assert (launch["dtype"], launch.get("gpu_memory_utilization")) == {"cuda": ("bfloat16", 0.9),
                                                                       "cpu": ("auto", None)}[variant]
    assert (model or "").startswith("/models/") if variant == "cuda" else model is None
    cluster = {"spec": service["spec"]["rayClusterConfig"]}
    assert (launch["prefill_tp"], launch["decode_tp"]) == {"cuda": (2, 1), "cpu": (1, 1)}[variant]
    for role, group in _groups(cluster).items():
        units = _parse_resources_param(group["rayStartParams"]["resources"])[f"splitserve_{role}"]
        ranks = launch[role] * launch[f"{role}_tp"]
        assert ranks == group["replicas"] * units, f"{role} x {role}_tp must equal the {role} capacity"
    head = cluster["spec"]["headGroupSpec"]
    assert "resources" not in head["rayStartParams"] and head["rayStartParams"]["num-cpus"] == "0"
    assert config["grpc_options"]["grpc_servicer_functions"] == GRPC_SERVICER_FUNCTIONS
    assert (config["http_options"]["port"], config["grpc_options"]["port"]) == (8000, 50051)
    ports = {p["name"]: p["port"] for p in service["spec"]["serveService"]["spec"]["ports"]}
    assert ports == {"http": 8000, "grpc": 50051}
    for pod in [head, *_groups(cluster).values()]:  # ingress replicas may land on any node
        container = _ray_container(pod)
        (token,) = [e for e in container["env"] if e["name"] == "SPLITSERVE_AUTH_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"] == {"name": "splitserve-auth", "key": "token"}
        assert "command" not in container, "KubeRay's own ray start: Serve needs nothing else"


def test_rayservice_worker_groups_are_the_rayclusters():
    for variant in RAYSERVICES:
        service_groups = _groups({"spec": _one(RAYSERVICES[variant])["spec"]["rayClusterConfig"]})
        cluster_groups = _groups(_one(RAYCLUSTERS[variant]))
        for role in ROLES:
            assert service_groups[role]["rayStartParams"] == cluster_groups[role]["rayStartParams"]
            assert (_ray_container(service_groups[role])["resources"]
                    == _ray_container(cluster_groups[role])["resources"])


def test_rayjob_benchmarks_the_service_and_keeps_the_json():
    pvc, job = _docs(KUBERAY / "rayjob-bench.yaml")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["splitserve", "bench", "serve"]
    server = argv[argv.index("--server") + 1]
    assert server == f"{_one(KUBERAY / 'service.yaml')['metadata']['name']}:50051"
    assert server.split(":")[0] == _one(RAYSERVICES["cpu"])["spec"]["serveService"]["metadata"]["name"]
    out = Path(argv[argv.index("--out") + 1])
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (mount,) = [m for m in _ray_container({"template": {"spec": head}})["volumeMounts"]
                if out.is_relative_to(m["mountPath"])]
    (volume,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
