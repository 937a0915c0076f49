"""Names users hand us: run ids (the one format new ids take and the one check every
entry point applies) and store URIs (the schemes a run may write to).

A run id names folders (``{output_dir}/{run_id}``), store prefixes (``{store}/{run_id}/``),
Ray namespaces (``rlhf-{run_id}``) and, normalized, Kubernetes objects; it travels as a
command-line argument to the session job. So it is checked before any of those is built:
1-128 ASCII letters, digits, ``.``, ``_``, ``-``, starting with a letter or digit.
"""

from __future__ import annotations

import re
import time
import uuid

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_LENGTH = 128


class RunIdError(ValueError):
    """A run id that would be unsafe as a path, namespace or argument."""


def run_id_problem(run_id) -> str | None:
    """What is wrong with ``run_id`` (one line: expected, found), or None when it is valid."""
    if isinstance(run_id, str) and _RUN_ID.fullmatch(run_id):
        return None
    shown = run_id if not isinstance(run_id, str) or len(run_id) <= 60 else run_id[:57] + "..."
    return (f"expected 1-{MAX_LENGTH} ASCII letters, digits, '.', '_' or '-', starting with a letter or digit; "
            f"found {shown!r}" + (f" ({len(run_id)} characters)" if isinstance(run_id, str)
                                 and len(run_id) > MAX_LENGTH else ""))


def validate_run_id(run_id, field: str = "run id") -> str:
    """``run_id`` itself when it is valid; else a one-line ``RunIdError`` naming ``field``
    and the rule."""
    problem = run_id_problem(run_id)
    if problem is not None:
        raise RunIdError(f"{field}: {problem}")
    return run_id


def new_run_id(kind: str = "run") -> str:
    """A fresh id: ``run-YYYYmmdd-HHMMSS-xxxxxx`` (sortable by start time, unique);
    ``kind`` names other runs (``rm`` for a reward model's training)."""
    return time.strftime(f"{kind}-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


#: Store URI schemes a run may write to (a plain path means the local disk).
STORE_SCHEMES = ("file", "s3", "gs", "gcs", "memory")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StoreUriError(ValueError):
    """A store URI with a scheme we do not write to, or characters no store needs."""


def store_uri_problem(uri) -> str | None:
    """What is wrong with ``uri`` as a store URI (one line: expected, found), or None when
    it is a plain path or one of ``STORE_SCHEMES``'s URIs with printable characters only.
    Only the text is looked at: nothing is resolved or contacted (an ``ftp://`` URI given
    to fsspec would be a network lookup before any error)."""
    if not isinstance(uri, str) or not uri.strip():
        return f"expected a path or a URI ({', '.join(s + '://' for s in STORE_SCHEMES)}); found {uri!r}"
    if any(ord(c) < 32 or ord(c) == 127 for c in uri):
        return f"expected printable characters only; found {uri!r}"
    if "::" in uri:  # fsspec would chain filesystems (zip::, reference::, http::...), each its own access
        return f"expected one filesystem's URI (no fsspec '::' chain); found {uri!r}"
    m = _SCHEME.match(uri)
    if m and m.group(1).lower() not in STORE_SCHEMES:
        return f"expected a scheme among {', '.join(STORE_SCHEMES)}; found {m.group(1)!r} in {uri!r}"
    if not m and "://" in uri:
        return f"expected a path or scheme://...; found {uri!r}"
    return None


def validate_store_uri(uri, field: str = "store") -> str:
    """``uri`` itself when ``store_uri_problem`` finds nothing wrong; else a one-line
    ``StoreUriError`` naming ``field``. Every entry point that takes a URI of a store, or
    of something in one, applies it before the URI is used."""
    problem = store_uri_problem(uri)
    if problem is not None:
        raise StoreUriError(f"{field}: {problem}")
    return uri
