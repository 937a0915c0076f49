"""Kubernetes names for runs.

A RayCluster name must be a DNS-1035 label, and KubeRay derives longer names from it
(``{name}-head-svc``, ``{name}-{group}-worker-{5 chars}``), each of which must stay within
63 characters. Run ids are free text chosen by users (and by schedules, at run time), so
they are normalized: lowercase, runs of other characters become ``-``; when that changed
anything, or the name had to be cut, a short hash of the original run id is appended so
that two different run ids never share a cluster.
"""

from __future__ import annotations

import hashlib
import re

from rlhf_core.record.run_ids import RunIdError, validate_run_id

#: Room left for KubeRay's suffixes ("-head-svc", "-<group>-worker-xxxxx").
MAX_CLUSTER_NAME = 40
PREFIX = "rlhf-"
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class KubeNameError(ValueError):
    """A name that cannot become a valid Kubernetes name; the message gives the rule."""


def is_dns1035_label(name: str, limit: int = 63) -> bool:
    return len(name) <= limit and bool(_DNS1035.match(name))


def is_dns1123_label(name) -> bool:
    """A namespace's (and most objects') name: at most 63 of [a-z0-9-], alphanumeric at both ends."""
    return isinstance(name, str) and bool(_DNS1123_LABEL.match(name))


def cluster_name(run_id: str) -> str:
    """The RayCluster (and RayJob) name of a run: ``rlhf-<normalized run id>``."""
    try:
        validate_run_id(run_id)
    except RunIdError as exc:
        raise KubeNameError(str(exc)) from None
    body = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")
    name = PREFIX + body
    if name == PREFIX + run_id and len(name) <= MAX_CLUSTER_NAME:
        return name
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:6]
    return f"{name[:MAX_CLUSTER_NAME - 7].rstrip('-')}-{digest}"


def label_value(text: str) -> str:
    """A label value (at most 63 of [A-Za-z0-9_.-], alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63].strip("-_.")
    return value or "none"


def head_account_name(cluster: str) -> str:
    """The service account of a cluster's head pod: one per run (at most 45 characters)."""
    return f"{cluster}-head"


def ray_token_secret_name(cluster: str, owner_namespace: str) -> str:
    """The Secret holding a cluster's own Ray token (key ``auth_token``), of the same name in
    the Ray namespace (the cluster's pods) and in the owner's profile namespace (the
    pipeline's controllers). The owner is part of the name, between dots (neither a cluster
    nor a namespace name has one): another profile, which may create only names carrying
    its own namespace (the admission policy), can never create or replace this one."""
    return f"{cluster}.{owner_namespace}.ray-token"


def ingress_policy_name(cluster: str, owner_namespace: str) -> str:
    """The NetworkPolicy that admits traffic to a cluster's pods, owner-bound as the token."""
    return f"{cluster}.{owner_namespace}.ingress"
