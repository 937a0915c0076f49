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
    """The iterations from the one ``uri`` names back to the first, newest first; of a
    reward model's training run, its epochs (``epoch_row``)."""
    from rlhf_core.record.checkpoints import writer_iteration
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import REWARD_MODEL_TRAINING_FORMAT

    run, n = locate(uri)
    istore, run_id, store = IterationStore(run), run.run_id, run.store
    committed = istore.committed_iterations()
    if not committed:
        raise LineageError(f"no committed iteration of run {run_id!r} under {store}")
    run_format = istore.run_format()
    named = run_layout.parse(uri.rstrip("/"))
    if named is not None and named.step is not None:  # a checkpoint: the iteration (epoch) whose record commits it
        n = writer_iteration(named.step, run_format)
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
        if run_format == REWARD_MODEL_TRAINING_FORMAT:
            m = istore.read_manifest(n, format=run_format)
            out.append(epoch_row(m, run_id, n, istore.iteration_uri(n)))
            n = _parent(m, n, run_id)
            continue
        m = istore.read_manifest(n)
        out.append({"run_id": run_id, "iteration": n, "parent_iteration": m["parent_iteration"],
                    "config_hash": m["config_hash"], "code_version": m["code_version"],
                    "data_cursor": m["data_cursor"], "checkpoint": m["weights"]["checkpoint"],
                    "redo": list(m["weights"]["redo"]), "wrote_checkpoint": m["checkpoint"],
                    "global_step": m["global_step"], "kl_coef": m["kl_coef"],
                    "reward": m["metrics"].get("critic/score/mean"), "metrics": m["metrics"],
                    "config": m["config"], "snapshots": m["snapshots"], "manifest": istore.iteration_uri(n),
                    "reward_model": dict(m["reward_model"]) if m.get("reward_model") is not None else None,
                    "tools": dict(m["tools"]) if m.get("tools") is not None else None,
                    "model": dict(m["model"]) if m.get("model") is not None else None,
                    "weight_versions": list(m["weight_versions"]) if m.get("weight_versions") is not None else None,
                    "teacher": dict(m["teacher"]) if m.get("teacher") is not None else None})
        n = _parent(m, n, run_id)
    return out


def _parent(manifest: dict, n: int, run_id: str) -> int | None:
    parent = manifest["parent_iteration"]
    if parent is not None and (not isinstance(parent, int) or isinstance(parent, bool) or parent >= n):
        raise LineageError(f"run {run_id}: iteration {n} names {parent!r} as its parent; a parent is an "
                           f"earlier iteration")
    return parent


#: ``chain``'s rows of a reward model's training run say so (a PPO iteration's have no kind).
EPOCH = "reward_model_training"


def epoch_row(m: dict, run_id: str, epoch: int, manifest_uri: str) -> dict:
    """One epoch of a reward model's training (``rlhf reward-model train``), as ``chain``
    gives it: the preferences (URI and sha256), the base, the settings' hash, the code,
    the held-out metrics and the checkpoint it wrote (none for epoch 0, the evaluation
    before training). Read as data: each field checked before it is shown."""
    data, settings = m.get("data"), m.get("settings")
    if not isinstance(data, dict) or not isinstance(data.get("uri"), str) or not isinstance(data.get("sha256"), str):
        raise LineageError(f"{manifest_uri}/MANIFEST.json: data: expected {{uri, sha256}} strings; found "
                           f"{str(data)[:80]!r}")
    for key, kind in (("base", str), ("settings_hash", str), ("metrics", dict), ("code_version", dict)):
        if not isinstance(m.get(key), kind):
            raise LineageError(f"{manifest_uri}/MANIFEST.json: {key}: expected a {kind.__name__}; found "
                               f"{str(m.get(key))[:80]!r}")
    checkpoint = m.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise LineageError(f"{manifest_uri}/MANIFEST.json: checkpoint: expected a URI or null; found "
                           f"{str(checkpoint)[:80]!r}")
    return {"kind": EPOCH, "run_id": run_id, "iteration": epoch, "parent_iteration": m["parent_iteration"],
            "data": {"uri": data["uri"], "sha256": data["sha256"]}, "base": m["base"],
            "settings_hash": m["settings_hash"], "settings": settings if isinstance(settings, dict) else {},
            "code_version": m["code_version"], "metrics": m["metrics"], "wrote_checkpoint": checkpoint,
            "snapshots": m.get("snapshots") or {}, "manifest": manifest_uri}


#: A longer chain of runs started from runs' exports is refused as malformed.
MAX_RUNS = 1000


def started_from(rows: list[dict]) -> dict | None:
    """Where a run's policy came from when it is another run's checkpoint: its
    ``model.path`` (as the oldest of ``rows`` recorded it) a local folder that ``rlhf
    export`` wrote, whose ``EXPORT.json`` names the checkpoint. Read as data; None for any
    other model (a hub name, an object-store URI, a folder without that record)."""
    from pathlib import Path

    path = ((rows[-1].get("config") or {}).get("model") or {}).get("path")
    if not isinstance(path, str) or "://" in path or ":" in path.split("/", 1)[0]:
        return None
    record = Path(path) / "EXPORT.json"
    try:
        data = json.loads(record.read_text()) if record.is_file() else None
    except (OSError, ValueError) as exc:
        raise LineageError(f"{record}: expected the JSON record `rlhf export` writes; found {exc}") from None
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("checkpoint_uri"), str):
        raise LineageError(f"{record}: expected a checkpoint_uri string; found {str(data)[:80]!r}")
    # the weights the run started from, as its manifest hashed them: a folder overwritten
    # since (another export, another model) is not traced as the export the run used
    loaded = (rows[-1].get("model") or {}).get("weights_sha256")
    if loaded is not None and data.get("weights_sha256") != loaded:
        raise LineageError(f"{path}: its EXPORT.json names weights {str(data.get('weights_sha256'))[:16]}... but run "
                           f"{rows[-1].get('run_id')} started from weights {loaded[:16]}... (the folder was "
                           f"overwritten after the run started): not traced further")
    return {"model": path, "checkpoint": data["checkpoint_uri"], "global_step": data.get("global_step"),
            "weights_sha256": data.get("weights_sha256")}


def chain_across_runs(uri: str) -> list[list[dict]]:
    """``chain(uri)``, then the chain of the checkpoint its run's policy was exported from
    (``started_from``), and so on: one list of rows per run, newest run first. The oldest
    row of a run that started from an export carries ``started_from``. An iterated RLHF
    run's policy is traced this way through every round's reward model and preferences."""
    segments = [chain(uri)]
    seen = {segments[0][0]["run_id"]}
    while (origin := started_from(segments[-1])) is not None:
        segments[-1][-1]["started_from"] = origin
        segment = chain(origin["checkpoint"])
        if segment[0]["run_id"] in seen or len(segments) >= MAX_RUNS:
            raise LineageError(f"{origin['model']}/EXPORT.json: names run {segment[0]['run_id']}, already on the "
                               f"chain (runs {sorted(seen)}); a run cannot start from its own later checkpoint")
        seen.add(segment[0]["run_id"])
        segments.append(segment)
    return segments


def format_runs(segments: list[list[dict]], fmt: str = "table") -> str:
    """``chain_across_runs``'s result: JSON as one list of rows (each names its run), a dot
    graph with each earlier run's nodes prefixed, or a table a run at a time."""
    if fmt == "json":
        return json.dumps([row for segment in segments for row in segment], indent=1, sort_keys=True)
    if fmt == "dot":
        bodies = [format_lineage(segment, "dot", prefix=f"r{k}_" if k else "").splitlines()[3:-1]
                  for k, segment in enumerate(segments)]
        lines = ["digraph lineage {", "  rankdir=BT;", "  node [shape=box, fontname=monospace];"]
        for k, (segment, body) in enumerate(zip(segments, bodies)):
            lines += body
            origin = segment[-1].get("started_from")
            if origin:
                first = f"{'r%d_' % k if k else ''}it{segment[-1]['iteration']}"
                ck = f"r{k + 1}_ck" + origin["checkpoint"].rstrip("/").rsplit("/", 1)[-1].replace("-", "_")
                lines.append(f'  {ck} [label="{origin["checkpoint"].rsplit("/", 1)[-1]}\\nof run '
                             f'{segments[k + 1][0]["run_id"]}", shape=cylinder];')
                lines.append(f"  {first} -> {ck} [label=\"policy started from\"];")
                lines.append(f"  {ck} -> r{k + 1}_it{segments[k + 1][0]['iteration']} [label=\"written by\"];")
        lines.append("}")
        return "\n".join(lines)
    parts = []
    for segment in segments:
        text = format_lineage(segment, fmt)
        if len(segments) > 1:
            text = f"run {segment[0]['run_id']}:\n{text}"
        origin = segment[-1].get("started_from")
        if origin:
            text += (f"\npolicy started from {origin['model']}: exported from {origin['checkpoint']} (step "
                     f"{origin['global_step']}, weights sha256 {str(origin['weights_sha256'])[:16]}...)")
        parts.append(text)
    return "\n".join(parts)


def format_lineage(rows: list[dict], fmt: str = "table", prefix: str = "") -> str:
    if fmt == "json":
        return json.dumps(rows, indent=1, sort_keys=True)
    if rows and rows[0].get("kind") == EPOCH:
        return _format_epochs(rows, fmt, prefix)
    if fmt == "dot":
        lines = ["digraph lineage {", "  rankdir=BT;", "  node [shape=box, fontname=monospace];"]
        for r in rows:
            it = f"{prefix}it{r['iteration']}"
            lines.append(f'  {it} [label="iteration {r["iteration"]}\\nconfig {r["config_hash"][:12]}\\n'
                         f'code {r["code_version"].get("source_sha256", "")[:12]}\\nreward {r["reward"]:.3f}"];')
            ck = f"{prefix}ck" + r["checkpoint"].rstrip("/").rsplit("/", 1)[-1].replace("-", "_")
            lines.append(f'  {ck} [label="{r["checkpoint"].rsplit("/", 1)[-1]}", shape=cylinder];')
            lines.append(f"  {it} -> {ck} [label=wrote];" if r["wrote_checkpoint"] else
                         f"  {it} -> {ck} [label=\"weights from, redo {','.join(map(str, r['redo']))}\"];")
            if r["parent_iteration"] is not None:
                lines.append(f"  {it} -> {prefix}it{r['parent_iteration']} [label=parent];")
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
                     + (f"  rollout on weights of step {','.join(map(str, r['weight_versions']))}"
                        if r.get("weight_versions") is not None else "")
                     + (f"  (git {git[:10]})" if git else ""))
    scorers = {(r["reward_model"]["path"], r["reward_model"]["sha256"]): [] for r in rows if r.get("reward_model")}
    for r in rows:
        if r.get("reward_model"):
            scorers[r["reward_model"]["path"], r["reward_model"]["sha256"]].append(r["iteration"])
    origins = {(r["reward_model"]["path"], r["reward_model"]["sha256"]): r["reward_model"].get("trained_from")
               for r in rows if r.get("reward_model")}
    teachers: dict = {}
    for r in rows:
        if r.get("teacher"):
            teachers.setdefault((r["teacher"]["path"], r["teacher"]["sha256"]), []).append(r["iteration"])
    for (path, digest), iterations in teachers.items():
        lines.append(f"distilled from teacher {path} (sha256 {digest[:16]}...): iterations "
                     f"{','.join(map(str, sorted(iterations)))}")
    judges = {(r["reward_model"]["path"], r["reward_model"]["sha256"]) for r in rows
              if r.get("reward_model") and r["reward_model"].get("served") == "judge"}
    for (path, digest), iterations in scorers.items():
        kind = "judged by judge" if (path, digest) in judges else "scored by reward model"
        lines.append(f"{kind} {path} (sha256 {digest[:16]}...): iterations "
                     f"{','.join(map(str, sorted(iterations)))}")
        origin = origins[path, digest]
        if origin:
            lines.append(f"  trained from preferences {origin['data']} (sha256 {origin['data_sha256'][:16]}...) "
                         f"on {origin['base']}" + (f" in run {origin['run']}" if origin.get("run") else ""))
    return "\n".join(lines)


def _format_epochs(rows: list[dict], fmt: str, prefix: str = "") -> str:
    """A reward model's training epochs (``epoch_row``), newest first, over their preferences."""
    data, base = rows[-1]["data"], rows[-1]["base"]
    if fmt == "dot":
        prefs = f"{prefix}prefs" + data["sha256"][:12]
        lines = ["digraph lineage {", "  rankdir=BT;", "  node [shape=box, fontname=monospace];",
                 f'  {prefs} [label="preferences\\n{data["uri"]}\\nsha256 {data["sha256"][:12]}", shape=note];']
        for r in rows:
            it = f"{prefix}it{r['iteration']}"
            accuracy = r["metrics"].get("accuracy")
            lines.append(f'  {it} [label="epoch {r["iteration"]}\\nsettings {r["settings_hash"][:12]}\\n'
                         f'code {r["code_version"].get("source_sha256", "")[:12]}'
                         + (f'\\nheld-out accuracy {accuracy:.3f}' if isinstance(accuracy, float) else "") + '"];')
            if r["wrote_checkpoint"]:
                name = r["wrote_checkpoint"].rstrip("/").rsplit("/", 1)[-1]
                lines.append(f'  {prefix}ck{name.replace("-", "_")} [label="{name}", shape=cylinder];')
                lines.append(f"  {it} -> {prefix}ck{name.replace('-', '_')} [label=wrote];")
            lines.append(f"  {it} -> {prefs} [label=\"trained on\"];")
            if r["parent_iteration"] is not None:
                lines.append(f"  {it} -> {prefix}it{r['parent_iteration']} [label=parent];")
        lines.append("}")
        return "\n".join(lines)
    lines = [f"reward model training on preferences {data['uri']} (sha256 {data['sha256'][:16]}...) from {base}",
             f"{'epoch':>5} {'parent':>6} {'settings':<13} {'code':<13} {'loss':>7} {'accuracy':>8}  checkpoint"]
    for r in rows:
        metrics, git = r["metrics"], r["code_version"].get("git_commit") or ""
        number = [metrics.get(k) if isinstance(metrics.get(k), (int, float)) else float("nan")
                  for k in ("train_loss", "accuracy")]
        parent = "-" if r["parent_iteration"] is None else str(r["parent_iteration"])
        lines.append(f"{r['iteration']:>5} {parent:>6} {r['settings_hash'][:12]:<13} "
                     f"{r['code_version'].get('source_sha256', '')[:12]:<13} {number[0]:>7.4f} {number[1]:>8.3f}  "
                     f"{r['wrote_checkpoint'] or '(evaluation before training)'}"
                     + (f"  (git {git[:10]})" if git else ""))
    return "\n".join(lines)
