"""Enough of Kubernetes RBAC to check recorded API requests against a Role, in tests.

A request path and method become the attributes the API server authorizes (API group,
resource, subresource, verb, namespace, name), and a Role's rules allow them as the
RBAC authorizer does: the group, the resource and the verb must each be listed, and a
rule with ``resourceNames`` matches only a request naming one of them (so never a
create, nor a list). ``covers`` is the API server's escalation check: a Role may be
created, or bound, only by someone whose own rules allow everything it grants.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs

_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                   r"/namespaces/(?P<ns>[^/]+)/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update"}


def attributes(method: str, path: str) -> dict:
    route, _, query = path.partition("?")
    m = _PATH.match(route)
    if m is None:
        raise ValueError(f"not a namespaced resource request: {method} {path}")
    name = m["name"]
    if method == "GET":
        verb = "get" if name else ("watch" if parse_qs(query).get("watch") == ["true"] else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _VERBS[method]
    resource = m["resource"] + (f"/{m['sub']}" if m["sub"] else "")
    return {"group": "" if m["core"] else m["group"], "resource": resource, "verb": verb,
            "namespace": m["ns"], "name": name}


def allows(rules: list[dict], attrs: dict) -> bool:
    return any(rule_allows(rule, attrs) for rule in rules)


def rule_allows(rule: dict, attrs: dict) -> bool:
    names = rule.get("resourceNames")
    return (attrs["group"] in rule.get("apiGroups", []) and attrs["resource"] in rule.get("resources", [])
            and attrs["verb"] in rule.get("verbs", []) and (not names or attrs["name"] in names))


def grants(rules: list[dict]) -> set[tuple]:
    """(group, resource, verb, name or None) for every permission the rules grant."""
    return {(group, resource, verb, name) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]
            for name in (rule.get("resourceNames") or [None])}


def covers(holder: list[dict], granted: list[dict]) -> list[tuple]:
    """What ``granted`` allows that ``holder`` does not (empty: holder may create it). A
    permission on any name needs a rule without resourceNames; one on a name, either."""
    return sorted(p for p in grants(granted)
                  if not allows(holder, {"group": p[0], "resource": p[1], "verb": p[2], "name": p[3]}))
