#!/usr/bin/env python3
"""Strict, offline validation of the Kubernetes manifests under deploy/.

    python deploy/validate.py                      # every manifest under deploy/
    python deploy/validate.py FILE.yaml ...        # just these
    python deploy/validate.py --crds DIR --k8s-version 1.30 ...

"Strict" means what `kubectl apply --validate=strict` means: a field the schema does not
know is an error, not something silently dropped.

- KubeRay kinds (ray.io/v1 RayCluster, RayJob, RayService) are checked against the
  openAPIV3Schema of their CRD (default: ../shared/kuberay-crds next to the repository).
  The API server prunes any field a structural schema does not declare unless the node
  says x-kubernetes-preserve-unknown-fields, and strict field validation reports each
  pruned field; so every object node without that marker becomes
  additionalProperties: false here. The CRD's embedded PodTemplateSpecs are full
  schemas, so this reaches typos inside pod specs as well.
- The root metadata of a custom resource is an ObjectMeta (the CRD only says
  `type: object`); it is checked against the strict ObjectMeta of kubernetes-validate.
- Core kinds (Service, PersistentVolumeClaim, Pod, Secret, ...) go to kubernetes-validate
  in strict mode, which ships its schemas and needs no network.
- A kind with no known schema is an error, never a silent pass; so is a duplicate key.

Not checked: x-kubernetes-validations (CEL rules) and string formats; the API server
still enforces them.
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any
from collections.abc import Iterable

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CRD_DIR = REPO_ROOT.parent / "shared" / "kuberay-crds"
DEPLOY_DIR = REPO_ROOT / "deploy"
# Lowest Kubernetes the manifests target (gRPC probes are GA from 1.27).
DEFAULT_K8S_VERSION = "1.30"

_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
_INT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
# Value-validation keywords whose meaning is the same in OpenAPI v3 and JSON Schema.
_SAME_KEYWORDS = (
    "type", "enum", "pattern", "required", "maxLength", "minLength", "maximum", "minimum",
    "exclusiveMaximum", "exclusiveMinimum", "maxItems", "minItems", "uniqueItems",
    "maxProperties", "minProperties", "multipleOf",
)
_LIST_MAP_KEYWORD = "x-splitserve-list-map-keys"


# ---------------------------------------------------------------- YAML loading

class _StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader that refuses duplicate mapping keys (kubectl strict does too)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_documents(text: str) -> list[Any]:
    """All non-empty YAML documents of text; duplicate keys raise yaml.YAMLError."""
    return [doc for doc in yaml.load_all(text, Loader=_StrictLoader) if doc is not None]


# ------------------------------------------------- CRD schema -> JSON Schema

def crd_to_json_schema(node: dict, structural: bool = True) -> dict:
    """Translate one OpenAPI v3 (structural) schema node into JSON Schema 2020-12.

    structural is False inside allOf/anyOf/oneOf/not: in a structural schema those only
    validate values, they never declare fields, so they must not close objects.
    """
    out: dict[str, Any] = {k: node[k] for k in _SAME_KEYWORDS if k in node}
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    if node.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in node:
        out["type"] = ["integer", "string"]
    if node.get("type") == "integer" and node.get("format") in _INT_BOUNDS:
        low, high = _INT_BOUNDS[node["format"]]
        out.setdefault("minimum", low)
        out.setdefault("maximum", high)
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]

    properties = {k: crd_to_json_schema(v, structural) for k, v in node.get("properties", {}).items()}
    if node.get("x-kubernetes-embedded-resource"):
        properties.setdefault("apiVersion", {"type": "string"})
        properties.setdefault("kind", {"type": "string"})
        properties.setdefault("metadata", {"$ref": _object_meta_ref()})
    if properties:
        out["properties"] = properties
    if isinstance(node.get("items"), dict):
        out["items"] = crd_to_json_schema(node["items"], structural)

    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = crd_to_json_schema(extra, structural)
    elif isinstance(extra, bool):
        out["additionalProperties"] = extra
    elif structural and node.get("type") == "object" and not preserve:
        out["additionalProperties"] = False  # the API server would prune: unknown field

    for key in ("allOf", "anyOf", "oneOf"):
        if key in node:
            out[key] = [crd_to_json_schema(sub, structural=False) for sub in node[key]]
    if "not" in node:
        out["not"] = crd_to_json_schema(node["not"], structural=False)

    list_type = node.get("x-kubernetes-list-type")
    if list_type == "set":
        out["uniqueItems"] = True
    elif list_type == "map" and node.get("x-kubernetes-list-map-keys"):
        item_props = node.get("items", {}).get("properties", {})
        out[_LIST_MAP_KEYWORD] = {
            key: item_props.get(key, {}).get("default") for key in node["x-kubernetes-list-map-keys"]
        }
    return out


def _check_list_map_keys(validator, keys: dict, instance, schema):
    """A list-type=map list may not hold two items with the same key tuple (defaults applied)."""
    if not validator.is_type(instance, "array"):
        return
    seen: dict[tuple, int] = {}
    for index, item in enumerate(instance):
        if not isinstance(item, dict):
            continue
        identity = tuple(json.dumps(item.get(k, default), sort_keys=True) for k, default in keys.items())
        if identity in seen:
            yield jsonschema.ValidationError(
                f"items {seen[identity]} and {index} have the same key "
                f"({', '.join(keys)}): duplicate entries in a map-type list")
        else:
            seen[identity] = index


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {_LIST_MAP_KEYWORD: _check_list_map_keys})


# ----------------------------------------------- kubernetes-validate schemas

def _k8s_schema_dir(k8s_version: str) -> Any:
    base = resources.files("kubernetes_validate").joinpath("kubernetes-json-schema")
    prefix = f"v{k8s_version}."
    matches = [d for d in base.iterdir() if d.name.startswith(prefix) and d.name.endswith("-local-strict")]
    if not matches:
        raise ValueError(f"kubernetes-validate has no strict schemas for Kubernetes {k8s_version}")
    return matches[0]


@cache
def _k8s_definitions(k8s_version: str) -> dict:
    return json.loads(_k8s_schema_dir(k8s_version).joinpath("_definitions.json").read_text())


# The $id of kubernetes-validate's _definitions.json: its internal "#/$defs/..." refs
# resolve against it, so the resource is registered under this URI.
_K8S_DEFINITIONS_URI = "https://kubernetes.io/api/_definitions.json"


@cache
def _load_crd(path: Path) -> dict:
    with path.open() as handle:
        return yaml.load(handle, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _object_meta_ref() -> str:
    return f"{_K8S_DEFINITIONS_URI}#/$defs/{_OBJECT_META}"


# ------------------------------------------------------------------ validator

class ManifestValidator:
    """Validates Kubernetes objects; CRD schemas are loaded once, on first use."""

    def __init__(self, crd_dir: Path = DEFAULT_CRD_DIR, k8s_version: str = DEFAULT_K8S_VERSION):
        self.crd_dir = Path(crd_dir)
        self.k8s_version = k8s_version
        self._crd_validators: dict[tuple[str, str], Any] = {}
        self._crd_files: dict[tuple[str, str], Path] | None = None
        definitions = _k8s_definitions(k8s_version)
        if definitions.get("$id", _K8S_DEFINITIONS_URI) != _K8S_DEFINITIONS_URI:
            raise ValueError(f"unexpected $id in kubernetes-validate definitions: {definitions['$id']}")
        self._registry = Registry().with_resource(_K8S_DEFINITIONS_URI, Resource.from_contents(definitions))

    def _crd_file_index(self) -> dict[tuple[str, str], Path]:
        """(group, plural) -> CRD file; KubeRay names them `<group>_<plural>.yaml`."""
        if self._crd_files is None:
            if not self.crd_dir.is_dir():
                raise FileNotFoundError(f"CRD directory not found: {self.crd_dir}")
            self._crd_files = {}
            for path in sorted(self.crd_dir.glob("*.yaml")):
                group, _, plural = path.stem.partition("_")
                self._crd_files[(group, plural)] = path
        return self._crd_files

    def _crd_validator(self, api_version: str, kind: str):
        key = (api_version, kind)
        if key not in self._crd_validators:
            group, _, version = api_version.partition("/")
            path = self._crd_file_index().get((group, kind.lower() + "s"))
            if path is None:
                raise LookupError(f"no CRD for {kind} in {self.crd_dir}")
            crd = _load_crd(path)
            if crd["spec"]["names"]["kind"] != kind:
                raise LookupError(f"{path.name} defines {crd['spec']['names']['kind']}, not {kind}")
            versions = {v["name"]: v for v in crd["spec"]["versions"]}
            if version not in versions or not versions[version].get("served", False):
                raise LookupError(f"{kind}: version {version} is not served by {path.name}")
            schema = crd_to_json_schema(versions[version]["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = {"$ref": _object_meta_ref()}
            schema["properties"]["apiVersion"] = {"const": api_version}
            schema["properties"]["kind"] = {"const": kind}
            schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
            self._crd_validators[key] = _Validator(schema, registry=self._registry)
        return self._crd_validators[key]

    def validate(self, obj: Any) -> list[str]:
        """Every problem found in one object, as 'path: message' lines (empty: valid)."""
        if not isinstance(obj, dict):
            return [f"<root>: a manifest must be a mapping, got {type(obj).__name__}"]
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        if not isinstance(api_version, str) or not isinstance(kind, str):
            return ["<root>: apiVersion and kind are required strings"]
        group = api_version.partition("/")[0] if "/" in api_version else ""
        if group == "ray.io":
            try:
                validator = self._crd_validator(api_version, kind)
            except LookupError as err:
                return [f"<root>: {err}"]
            errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
            return [f"{_path(e.absolute_path)}: {e.message}" for e in errors]
        try:
            kubernetes_validate.validate(obj, self.k8s_version, strict=True)
        except kubernetes_validate.SchemaNotFoundError as err:
            return [f"<root>: {err.message}"]
        except kubernetes_validate.ValidationError as err:
            return [f"{_path(err.absolute_path)}: {err.message}"]
        return []

    def validate_file(self, path: Path) -> list[str]:
        """Every problem in every document of a YAML file, prefixed with where it is."""
        try:
            documents = load_documents(Path(path).read_text())
        except yaml.YAMLError as err:
            return [f"{path}: YAML: {err}"]
        if not documents:
            return [f"{path}: no documents"]
        problems = []
        for index, doc in enumerate(documents):
            name = doc.get("metadata", {}).get("name", "?") if isinstance(doc, dict) else "?"
            kind = doc.get("kind", "?") if isinstance(doc, dict) else "?"
            problems += [f"{path} [{index}] {kind}/{name}: {p}" for p in self.validate(doc)]
        return problems


def _path(parts: Iterable[Any]) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)
    return text.lstrip(".") or "<root>"


def is_kubernetes_manifest(path: Path) -> bool:
    """A YAML file whose documents all carry apiVersion and kind."""
    try:
        documents = load_documents(Path(path).read_text())
    except yaml.YAMLError:
        return True  # let validate_file report it
    return bool(documents) and all(
        isinstance(d, dict) and "apiVersion" in d and "kind" in d for d in documents)


def find_manifests(root: Path = DEPLOY_DIR) -> list[Path]:
    """Every Kubernetes manifest (YAML with apiVersion and kind) under root."""
    files = sorted(p for pattern in ("*.yaml", "*.yml") for p in Path(root).rglob(pattern))
    return [p for p in files if is_kubernetes_manifest(p)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="manifests (default: all under deploy/)")
    parser.add_argument("--crds", type=Path, default=DEFAULT_CRD_DIR, help="KubeRay CRD directory")
    parser.add_argument("--k8s-version", default=DEFAULT_K8S_VERSION)
    args = parser.parse_args(argv)
    validator = ManifestValidator(args.crds, args.k8s_version)
    files = args.files or find_manifests()
    problems = [p for f in files for p in validator.validate_file(f)]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(files)} file(s), {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
