"""What produced what: walk from a checkpoint, snapshot or iteration back to the run's start.

Every fact comes from the committed iteration manifests (the same ones the Kubeflow
artifacts' metadata is copied from, so KFP's lineage view and this agree): parent
iteration, config hash and the config itself, code version, data cursor, checkpoint,
metrics.
"""

from __future__ import annotations

import json

from rlhf_core.record import run_layout
from rlhf_core.record.run_layout import RunRef


class LineageError(ValueError):
    """A URI that names nothing committed; the message says what was expected."""


def locate(uri: str) -> tuple[RunRef, int | None]:
    """(run, iteration) of an iteration, stage snapshot or checkpoint URI; a run URI gives
    its last committed iteration (None here, resolved by the caller)."""
    uri = uri.rstrip("/")
    loc = run_layout.parse(uri)
    if loc is None:
        return RunRef.from_uri(uri), None
    if loc.iteration is not None:
        return loc.run, loc.iteration
    if loc.step == 0:
        raise LineageError(f"{uri} is the starting checkpoint of run {loc.run.run_id}: no iteration produced it")
    return loc.run, loc.step - 1  # step S is written by iteration S - 1


def chain(uri: str) -> list[dict]:
    """The iterations from the one ``uri`` names back to the first, newest first."""
    from rlhf_core.record.iteration_store import IterationStore

    run, n = locate(uri)
    istore, run_id, store = IterationStore(run), run.run_id, run.store
    committed = istore.committed_iterations()
    if not committed:
        raise LineageError(f"no committed iteration of run {run_id!r} under {store}")
    if n is None:
        n = committed[-1]
    if n not in committed:
        raise LineageError(f"iteration {n} of run {run_id} is not committed; committed: {committed}")
    out, seen = [], set()
    while n is not None:
        if n in seen or not isinstance(n, int) or n < 0:
            raise LineageError(f"run {run_id}: the parent chain loops or is malformed at iteration {n!r} "
                               f"(walked {sorted(seen)}); a manifest names itself or a later iteration as parent")
        seen.add(n)
        m = istore.read_manifest(n)
        out.append({"run_id": run_id, "iteration": n, "parent_iteration": m["parent_iteration"],
                    "config_hash": m["config_hash"], "code_version": m["code_version"],
                    "data_cursor": m["data_cursor"], "checkpoint": m["weights"]["checkpoint"],
                    "redo": list(m["weights"]["redo"]), "wrote_checkpoint": m["checkpoint"],
                    "global_step": m["global_step"], "kl_coef": m["kl_coef"],
                    "reward": m["metrics"].get("critic/score/mean"), "metrics": m["metrics"],
                    "config": m["config"], "snapshots": m["snapshots"], "manifest": istore.iteration_uri(n),
                    "reward_model": dict(m["reward_model"]) if m.get("reward_model") is not None else None})
        parent = m["parent_iteration"]
        if parent is not None and (not isinstance(parent, int) or parent >= n):
            raise LineageError(f"run {run_id}: iteration {n} names {parent!r} as its parent; a parent is an "
                               f"earlier iteration")
        n = parent
    return out


def format_lineage(rows: list[dict], fmt: str = "table") -> str:
    if fmt == "json":
        return json.dumps(rows, indent=1, sort_keys=True)
    if fmt == "dot":
        lines = ["digraph lineage {", "  rankdir=BT;", "  node [shape=box, fontname=monospace];"]
        for r in rows:
            it = f"it{r['iteration']}"
            lines.append(f'  {it} [label="iteration {r["iteration"]}\\nconfig {r["config_hash"][:12]}\\n'
                         f'code {r["code_version"].get("source_sha256", "")[:12]}\\nreward {r["reward"]:.3f}"];')
            ck = "ck" + r["checkpoint"].rstrip("/").rsplit("/", 1)[-1].replace("-", "_")
            lines.append(f'  {ck} [label="{r["checkpoint"].rsplit("/", 1)[-1]}", shape=cylinder];')
            lines.append(f"  {it} -> {ck} [label=wrote];" if r["wrote_checkpoint"] else
                         f"  {it} -> {ck} [label=\"weights from, redo {','.join(map(str, r['redo']))}\"];")
            if r["parent_iteration"] is not None:
                lines.append(f"  {it} -> it{r['parent_iteration']} [label=parent];")
            if r.get("reward_model"):
                rm = "rm" + r["reward_model"]["sha256"][:12]
                lines.append(f'  {rm} [label="reward model\\n{r["reward_model"]["path"]}\\n'
                             f'sha256 {r["reward_model"]["sha256"][:12]}", shape=component];')
                lines.append(f"  {it} -> {rm} [label=\"scored by\"];")
                origin = r["reward_model"].get("trained_from")
                if origin:
                    prefs = "prefs" + origin["data_sha256"][:12]
                    lines.append(f'  {prefs} [label="preferences\\n{origin["data"]}\\n'
                                 f'sha256 {origin["data_sha256"][:12]}", shape=note];')
                    lines.append(f"  {rm} -> {prefs} [label=\"trained on\"];")
        lines.append("}")
        return "\n".join(lines)
    header = f"{'iter':>5} {'parent':>6} {'config':<13} {'code':<13} {'cursor':<14} {'reward':>7}  checkpoint"
    lines = [header]
    for r in rows:
        cursor = f"e{r['data_cursor']['epoch']}:{r['data_cursor']['position']}"
        parent = "-" if r["parent_iteration"] is None else str(r["parent_iteration"])
        git = r["code_version"].get("git_commit") or ""
        lines.append(f"{r['iteration']:>5} {parent:>6} {r['config_hash'][:12]:<13} "
                     f"{r['code_version'].get('source_sha256', '')[:12]:<13} {cursor:<14} "
                     f"{r['reward'] if r['reward'] is not None else float('nan'):>7.3f}  {r['checkpoint']}"
                     + (f" + redo {','.join(map(str, r['redo']))}" if r["redo"] else "")
                     + (f"  (git {git[:10]})" if git else ""))
    scorers = {(r["reward_model"]["path"], r["reward_model"]["sha256"]): [] for r in rows if r.get("reward_model")}
    for r in rows:
        if r.get("reward_model"):
            scorers[r["reward_model"]["path"], r["reward_model"]["sha256"]].append(r["iteration"])
    origins = {(r["reward_model"]["path"], r["reward_model"]["sha256"]): r["reward_model"].get("trained_from")
               for r in rows if r.get("reward_model")}
    for (path, digest), iterations in scorers.items():
        lines.append(f"scored by reward model {path} (sha256 {digest[:16]}...): iterations "
                     f"{','.join(map(str, sorted(iterations)))}")
        origin = origins[path, digest]
        if origin:
            lines.append(f"  trained from preferences {origin['data']} (sha256 {origin['data_sha256'][:16]}...) "
                         f"on {origin['base']}" + (f" in run {origin['run']}" if origin.get("run") else ""))
    return "\n".join(lines)
