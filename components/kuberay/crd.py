"""Validate rendered objects against KubeRay's CustomResourceDefinitions, strictly.

The API server validates a custom object against the CRD's ``openAPIV3Schema`` with
Kubernetes semantics, which differ from plain JSON Schema in ways that matter here:
unknown fields are pruned (we treat them as errors: a misspelled field silently dropped
is a bug), ``x-kubernetes-int-or-string`` allows either type, and
``x-kubernetes-preserve-unknown-fields`` keeps anything. CEL rules
(``x-kubernetes-validations``) are not evaluated.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

from components.kuberay.names import is_dns1035_label

CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "RayCronJob": "ray.io_raycronjobs.yaml"}


class SchemaViolation(ValueError):
    """The object does not fit the CRD; the message lists each failing field path."""


def _strict(schema: dict) -> dict:
    """A JSON-schema version of a structural Kubernetes schema."""
    schema = dict(schema)
    schema.pop("x-kubernetes-validations", None)
    if schema.pop("x-kubernetes-int-or-string", False):
        schema.pop("type", None)
        schema["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    preserve = schema.pop("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in schema:
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if not preserve and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        schema["additionalProperties"] = _strict(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        schema["items"] = _strict(schema["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            schema[key] = [_strict(s) for s in schema[key]]
    return schema


@lru_cache(maxsize=None)
def _schema(crd_dir: str, kind: str, version: str) -> dict:
    import yaml

    path = Path(crd_dir) / CRD_FILES[kind]
    if not path.exists():
        raise FileNotFoundError(f"no CRD for {kind} at {path}")
    crd = yaml.safe_load(path.read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = copy.deepcopy(v["schema"]["openAPIV3Schema"])
            # metadata is checked by the API server's ObjectMeta rules, not the CRD schema
            schema["properties"]["metadata"] = {"type": "object"}
            return _strict(schema)
    raise ValueError(f"{path} has no version {version}")


def validate(obj: dict, crd_dir: str | Path) -> None:
    """Raise SchemaViolation listing every problem of ``obj`` (a RayCluster/RayJob/...)."""
    import jsonschema

    kind = obj.get("kind")
    if kind not in CRD_FILES:
        raise SchemaViolation(f"kind: expected one of {sorted(CRD_FILES)}, found {kind!r}")
    group, _, version = str(obj.get("apiVersion", "")).partition("/")
    if group != "ray.io":
        raise SchemaViolation(f"apiVersion: expected ray.io/<version>, found {obj.get('apiVersion')!r}")
    validator = jsonschema.Draft7Validator(_schema(str(crd_dir), kind, version))
    problems = [f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
                for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))]
    name = (obj.get("metadata") or {}).get("name", "")
    if not is_dns1035_label(name):
        problems.append(f"metadata.name: {name!r} is not a DNS-1035 label")
    if problems:
        raise SchemaViolation(f"{kind} {name!r} does not fit the ray.io/{version} CRD:\n  " + "\n  ".join(problems))
