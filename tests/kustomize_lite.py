"""Enough of `kubectl kustomize` to build manifests/ in tests, where no kubectl exists.

Implements exactly what our kustomizations use, and refuses anything else (so a new
feature in manifests/ cannot be silently ignored here): ``resources`` (files, and folders
holding a kustomization), ``namespace`` (set on namespaced objects; a Namespace object is
renamed and ServiceAccount subjects of role bindings follow, as kustomize does),
``labels`` (``pairs`` added to metadata.labels) and ``patches`` (``path`` to a strategic
merge patch matched by kind and name; maps merge, lists of named items merge by name,
other lists are replaced).
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "labels", "resources", "patches"}
CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def build(folder: str | Path) -> list[dict]:
    folder = Path(folder)
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise ValueError(f"{folder}/kustomization.yaml uses {sorted(unknown)}, which kustomize_lite does not implement")
    objects: list[dict] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        objects += build(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"patch {patch} in {folder}: only `path:` patches are implemented")
        for doc in yaml.safe_load_all((folder / patch["path"]).read_text()):
            targets = [o for o in objects if o["kind"] == doc["kind"] and o["metadata"]["name"] == doc["metadata"]["name"]]
            if len(targets) != 1:
                raise ValueError(f"patch {patch['path']} matches {len(targets)} objects, expected 1")
            merged = _merge(targets[0], doc)
            targets[0].clear()
            targets[0].update(merged)
    if "namespace" in spec:
        _set_namespace(objects, spec["namespace"])
    for group in spec.get("labels", []):
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(group["pairs"])
    return objects


def _set_namespace(objects: list[dict], namespace: str) -> None:
    renamed = {}
    for obj in objects:
        if obj["kind"] == "Namespace":
            renamed[obj["metadata"]["name"]] = namespace
            obj["metadata"]["name"] = namespace
        elif obj["kind"] not in CLUSTER_SCOPED:
            renamed.setdefault(obj["metadata"].get("namespace"), namespace)
            obj["metadata"]["namespace"] = namespace
    for obj in objects:
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for subject in obj.get("subjects", []):
                if subject.get("kind") == "ServiceAccount" and subject.get("namespace") in renamed:
                    subject["namespace"] = namespace


def _merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = _merge(out[key], value) if key in out else copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and base and patch
            and all(isinstance(i, dict) and "name" in i for i in base + patch)):
        out = copy.deepcopy(base)
        for item in patch:
            match = [i for i, b in enumerate(out) if b["name"] == item["name"]]
            if match:
                out[match[0]] = _merge(out[match[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)
