"""Look inside a store: what is there (`rlhf snapshots ls`) and one sample decoded
(`rlhf snapshots show`), reading only what is shown."""

from __future__ import annotations

from rlhf_core.record import run_layout


class AuditError(ValueError):
    """Nothing to show at a URI; the message says what was expected."""


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def list_store(uri: str) -> str:
    """Every stage snapshot under ``uri`` (a store, run or iteration) with its commit
    state, rows and size, and whether each iteration is committed."""
    from rlhf_core.snapshot import fs as sfs
    from rlhf_core.snapshot import list_snapshots

    uri = uri.rstrip("/")
    infos = list_snapshots(uri, include_incomplete=True)
    if not infos:
        raise AuditError(f"no snapshots under {uri}")
    lines = [f"{'snapshot':<58}{'state':<12}{'rows':>6}{'size':>12}"]
    iterations: dict[str, bool] = {}
    for info in infos:
        rel = info.uri[len(uri):].strip("/") or "."
        lines.append(f"{rel:<58}{info.state:<12}{info.num_rows:>6}{_size(info.stored_bytes):>12}")
        loc = run_layout.parse(info.uri)
        it_uri = loc.iteration_uri if loc is not None else None
        if it_uri and "/replays/" not in it_uri and it_uri not in iterations:
            manifest = sfs.read_bytes(sfs.resolve(f"{it_uri}/{run_layout.MANIFEST}"))
            iterations[it_uri] = manifest is not None
    if iterations:
        lines.append("")
        for it, done in iterations.items():
            rel = it[len(uri):].strip("/") or "."
            lines.append(f"{rel:<58}{'committed' if done else 'in progress (no MANIFEST.json)'}")
    broken = [info for info in infos if info.state == "unreadable"]
    if broken:
        lines.append("")
        lines += [f"unreadable: {info.annotations['error']}" for info in broken]
    total = sum(i.stored_bytes for i in infos)
    lines.append(f"\n{len(infos)} snapshot(s), {_size(total)}")
    return "\n".join(lines)


def run_config_of(uri: str) -> dict | None:
    """The config of the run that wrote ``uri`` (from its iteration manifest), if any."""
    from rlhf_core.snapshot import fs as sfs

    loc = run_layout.parse(uri)
    if loc is None or loc.iteration is None:
        return None
    where = f"{loc.iteration_uri}/{run_layout.MANIFEST}"
    raw = sfs.read_bytes(sfs.resolve(where))
    if raw is None:
        return None
    from rlhf_core.record.manifest_schema import parse_manifest

    return parse_manifest(raw, where)["config"]


def show(uri: str, uid: str | None = None, fields: list[str] | None = None, tokenizer_for=None) -> str:
    """The rows of one prompt (``uid``; default the first row's) of a stage snapshot:
    prompt and response text, reward, advantage and log-probs summarized. Token ids are
    decoded with ``tokenizer_for(config)`` of the run's config, when given."""
    from rlhf_core.snapshot import load_snapshot, snapshot_fields, snapshot_info

    info = snapshot_info(uri)
    catalog = snapshot_fields(uri)  # a delta's own fields and its bases
    if uid is None:
        first = load_snapshot(uri, fields=["uid"], rows=slice(0, 1))
        uid = str(first.non_tensor_batch["uid"][0])
    wanted = fields or [f for f in ("prompts", "responses", "response_mask", "token_level_scores", "advantages",
                                    "old_log_probs", "ref_log_prob", "values", "data_source", "ground_truth",
                                    # a reward model's training: a scored preference pair
                                    "row", "step", "chosen_text", "rejected_text", "chosen_score", "rejected_score",
                                    "uid", *CHAT_FIELDS)
                        if f in catalog]
    unknown = [f for f in wanted if f not in catalog]
    if unknown:
        raise AuditError(f"{uri} has no field(s) {unknown}; it has {sorted(catalog)}")
    needed = sorted(set(wanted) | ({"response_mask"} & set(catalog)) | {"uid"})
    dp = load_snapshot(uri, fields=needed, uids=[uid])
    if len(dp) == 0:
        raise AuditError(f"no row with uid {uid!r} in {uri}")
    config = run_config_of(uri) if tokenizer_for and {"prompts", "responses"} & set(wanted) else None
    tok = tokenizer_for(config) if config is not None else None
    tensors = dp.batch.keys() if dp.batch is not None else ()  # (--fields of object columns only: none)
    mask = dp.batch["response_mask"].bool() if "response_mask" in tensors else None
    lines = [f"{uri}: uid {uid}, {len(dp)} row(s) of {info.num_rows}, read {len(needed)} of {len(catalog)} fields"]
    for i in range(len(dp)):
        lines.append(f"--- row {i}")
        for name in wanted:
            if name in CHAT_FIELDS:
                continue
            if name in dp.non_tensor_batch:
                lines.append(f"  {name}: {dp.non_tensor_batch[name][i]}")
                continue
            value = dp.batch[name][i]
            if value.dim() == 0:
                lines.append(f"  {name}: {value.item():.6g}" if value.is_floating_point() else f"  {name}: {value.item()}")
                continue
            row_mask = mask[i] if mask is not None and value.shape == mask[i].shape else None
            if name in ("prompts", "responses") and tok is not None:
                ids = value[row_mask].tolist() if row_mask is not None else [t for t in value.tolist()
                                                                               if t != tok.pad_token_id]
                lines.append(f"  {name}: {tok.decode(ids)!r}")
            elif value.is_floating_point():
                v = value[row_mask] if row_mask is not None else value
                lines.append(f"  {name}: sum {float(v.sum()):.4f}, mean {float(v.mean()) if v.numel() else 0:.4f}, "
                             f"first {[round(x, 4) for x in v[:4].tolist()]}")
            else:
                lines.append(f"  {name}: {value.tolist()}")
        if "agent/turns" in wanted and "agent/turns" in dp.non_tensor_batch:
            calls = dp.non_tensor_batch["agent/tool_calls"][i] if "agent/tool_calls" in dp.non_tensor_batch else "[]"
            lines.extend(chat_lines(dp.non_tensor_batch["agent/turns"][i], calls))
    return "\n".join(lines)


#: an agent rollout's record of each trajectory (rlhf_core/agent/batch.py), shown as a chat
CHAT_FIELDS = ("agent/turns", "agent/tool_calls")


def chat_lines(turns_json: str, calls_json: str) -> list[str]:
    """A trajectory as a chat: each turn with its role and token span in the response
    (tool and user turns are not trained on), each assistant turn's tool calls under it
    with their status, time and answer as the model was given it. The record is data:
    JSON read and printed, nothing else."""
    import json

    try:
        turns, calls = json.loads(turns_json), json.loads(calls_json)
    except (TypeError, ValueError) as exc:
        return [f"  chat: unreadable record ({exc})"]
    if not isinstance(turns, list) or not isinstance(calls, list):
        return ["  chat: unreadable record (expected lists of turns and calls)"]
    assistant_turns = [k for k, turn in enumerate(turns) if isinstance(turn, dict) and turn.get("role") == "assistant"]
    lines = [f"  chat: {len(turns)} turn(s), {len(calls)} tool call(s)"]
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            continue
        role = str(turn.get("role"))
        trained = "" if role == "assistant" else ", not trained on"
        lines.append(f"    [{role}] tokens {turn.get('start')}-{turn.get('end')}{trained}: {str(turn.get('text'))!r}")
        if role != "assistant" or k not in assistant_turns:
            continue
        number = assistant_turns.index(k)
        for call in (c for c in calls if isinstance(c, dict) and c.get("turn") == number):
            took = (f", {float(call['ended']) - float(call['started']):.3f} s"
                    if isinstance(call.get("ended"), (int, float)) and isinstance(call.get("started"), (int, float))
                    else "")
            cut = ", truncated" if call.get("truncated") else ""
            lines.append(f"      -> {call.get('name')}({json.dumps(call.get('arguments'), ensure_ascii=False)}): "
                         f"{call.get('status')}{took}{cut}, reward {call.get('reward')}: {str(call.get('answer'))!r}")
    return lines
