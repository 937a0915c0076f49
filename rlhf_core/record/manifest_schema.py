"""What an iteration manifest read from the store must look like.

A manifest is data someone else wrote (another build, a hand edit, a damaged object), so
it is checked when it is read, not trusted where it is used: every key a build of ours
writes has its type checked here, and a key that is absent raises, when a reader asks for
it, a ``ManifestError`` naming the key and the manifest instead of a ``KeyError``. Keys are
not all required up front: a reader needs only some (``rlhf gc`` reads the config and the
weights plan), and manifests written by hand in tests hold only those.
"""

from __future__ import annotations

import json
import numbers


class ManifestError(ValueError):
    """An iteration manifest that is not what this build reads; one line: the manifest,
    the key, what was expected and what was found."""


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _whole_list(value) -> bool:
    return isinstance(value, list) and all(_whole(v) for v in value)


# key: (check, what is expected); nested keys are dotted. A key listed under a parent is
# required when the parent is present (a weights plan without its step is no plan).
_TYPES = {
    "run_id": (lambda v: isinstance(v, str), "a string"),
    "iteration": (_whole, "a whole number >= 0"),
    "parent_iteration": (lambda v: v is None or _whole(v), "null or a whole number >= 0"),
    "committed_at": (lambda v: isinstance(v, str), "a string"),
    "config_hash": (lambda v: isinstance(v, str), "a string"),
    "config": (lambda v: isinstance(v, dict), "an object"),
    "code_version": (lambda v: isinstance(v, dict), "an object"),
    # the checkpoint this iteration wrote; null when it wrote none (``weights`` names the one
    # its model comes from, and the redo that completes it)
    "checkpoint": (lambda v: v is None or isinstance(v, str), "null or a string (a checkpoint URI)"),
    "checkpoint_sha256": (lambda v: v is None or (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
                          "null or an object of sha256 strings"),
    "data_cursor": (lambda v: isinstance(v, dict), "an object"),
    "data_cursor.epoch": (_whole, "a whole number >= 0"),
    "data_cursor.position": (_whole, "a whole number >= 0"),
    "kl_coef": (_number, "a number"),
    "global_step": (_whole, "a whole number >= 0"),
    "rng": (lambda v: isinstance(v, dict), "an object"),
    "stage_timings_s": (lambda v: isinstance(v, dict), "an object"),
    "metrics": (lambda v: isinstance(v, dict), "an object"),
    "snapshots": (lambda v: isinstance(v, dict), "an object"),
    "computed_ahead": (lambda v: isinstance(v, list), "a list"),
    "weights": (lambda v: isinstance(v, dict), "an object"),
    "lease": (lambda v: isinstance(v, dict), "an object"),
    # the model the policy started from: its configured path, content hash, weights file's sha256
    "model": (lambda v: isinstance(v, dict), "an object"),
    # what scored the responses, when a reward model did: its configured path, its content hash
    "reward_model": (lambda v: isinstance(v, dict), "an object"),
    # the tools that answered an agent rollout: their config file by content hash, each class
    "tools": (lambda v: isinstance(v, dict), "an object"),
    # on-policy distillation: the teacher's configured path and content hash
    "teacher": (lambda v: isinstance(v, dict), "an object"),
    # asynchronous training: the weight versions (trainer steps) that generated the iteration's rows
    "weight_versions": (_whole_list, "a list of whole numbers >= 0"),
    # a generative reward model served behind reward_router_address (verl's GenRM)
    "reward_model.served": (lambda v: v == "judge", "\"judge\""),
    "reward_model.trained_from": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                                  "an object of strings"),
}
_REQUIRED_IN = {"reward_model": {"path": (lambda v: isinstance(v, str), "a string"),
                                 "sha256": (lambda v: isinstance(v, str) and len(v) == 64, "a sha256 hex string")},
                "teacher": {"path": (lambda v: isinstance(v, str), "a string"),
                            "sha256": (lambda v: isinstance(v, str) and len(v) == 64, "a sha256 hex string")},
                "weights": {"checkpoint": (lambda v: isinstance(v, str), "a string (a checkpoint URI)"),
                            "checkpoint_step": (_whole, "a whole number >= 0"),
                            "redo": (_whole_list, "a list of whole numbers >= 0")}}


class Record(dict):
    """A manifest (or an object inside one) as read: a plain dict, except that a key it
    lacks raises ``ManifestError`` naming the key and the manifest (``.get`` is unchanged)."""

    def __init__(self, data: dict, where: str, prefix: str = "") -> None:
        super().__init__((k, Record(v, where, f"{prefix}{k}.") if isinstance(v, dict) else v)
                         for k, v in data.items())
        self.where, self.prefix = where, prefix

    def __missing__(self, key):
        raise ManifestError(f"{self.where}: no key {self.prefix}{key!s}, which this command reads (the manifest "
                            f"is damaged, or was not written by a run)")


def parse_manifest(raw: bytes, where: str) -> Record:
    """The manifest in ``raw`` (read from ``where``, named in errors), checked: JSON, an
    object, every known key of the right type. Format and version are the caller's check."""
    try:
        data = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError too
        raise ManifestError(f"{where}: expected a JSON object; found bytes that are not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: expected a JSON object; found {type(data).__name__}")
    for key, (ok, expected) in _TYPES.items():
        parent, _, leaf = key.rpartition(".")
        holder = data.get(parent) if parent else data
        if isinstance(holder, dict) and leaf in holder and not ok(holder[leaf]):
            raise ManifestError(f"{where}: {key}: expected {expected}; found {_shown(holder[leaf])}")
    for parent, keys in _REQUIRED_IN.items():
        if isinstance(data.get(parent), dict):
            for leaf, (ok, expected) in keys.items():
                value = data[parent].get(leaf, _ABSENT)
                if value is _ABSENT or not ok(value):
                    raise ManifestError(f"{where}: {parent}.{leaf}: expected {expected}; found "
                                        f"{'nothing' if value is _ABSENT else _shown(value)}")
    return Record(data, where)


_ABSENT = object()


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
