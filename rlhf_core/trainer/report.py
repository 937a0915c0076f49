"""A human report of a run so far: reward curve and the latest metrics, from the store."""

from __future__ import annotations

import base64
import io


def run_history(istore) -> list[dict]:
    """One row per committed iteration of the run ``istore`` records: its number, the
    checkpoint its weights come from (and the iterations redone after it to complete
    them), plus the metrics in its manifest."""
    rows = []
    for n in istore.committed_iterations():
        manifest = istore.read_manifest(n)
        weights = manifest["weights"]
        rows.append({"iteration": n, "checkpoint": weights["checkpoint"], "redo": list(weights["redo"]),
                     **manifest["metrics"]})
    return rows


def validation_curve(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each ``val-core/*`` metric as (iteration, value) points, at the iterations that
    validated (data.val_files, every trainer.test_freq)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("val-core/"):
                curves.setdefault(key, []).append((row["iteration"], float(value)))
    return curves


def curve_png(rows: list[dict], size: tuple[float, float] = (6, 3.2), dpi: int = 100) -> bytes:
    """The reward curve (mean reward per iteration, and exact match where the reward
    reports it) as PNG bytes; with validations, their curve beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [r["iteration"] for r in rows]
    validation = validation_curve(rows)
    if validation:
        fig, (ax, val_ax) = plt.subplots(1, 2, figsize=(size[0] * 1.8, size[1]))
        for key, points in validation.items():
            val_ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key[len("val-core/"):])
        val_ax.set_title("validation", fontsize=9)
        val_ax.set_xlabel("iteration (weights it starts from)")
        val_ax.grid(alpha=0.3)
        val_ax.legend(loc="lower right", fontsize=7)
    else:
        fig, ax = plt.subplots(figsize=size)
    ax.plot(it, [r.get("critic/score/mean", 0.0) for r in rows], marker=".", label="mean reward (critic/score/mean)")
    if rows and "critic/reward_extra/exact/mean" in rows[0]:
        ax.plot(it, [r.get("critic/reward_extra/exact/mean", 0) for r in rows], label="exact match", alpha=0.7)
    if rows and "critic/reward_extra/function_score/mean" in rows[0]:  # a reward model's run, the task's own score
        ax.plot(it, [r.get("critic/reward_extra/function_score/mean", 0) for r in rows],
                label="reward function's score (not trained on)", alpha=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    low, high = _reward_range(rows)
    ax.set_ylim(low, high + 0.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


#: The per-run report's curve: (metric, label, RGB). Validation scores are drawn as dots.
_SERIES = (("critic/score/mean", "mean reward", (31, 119, 180)),
           ("critic/reward_extra/exact/mean", "exact match", (255, 127, 14)),
           ("critic/reward_extra/function_score/mean", "reward function's score", (148, 103, 189)))
_VALIDATION_RGB = (44, 160, 44)


def _reward_range(rows: list[dict]) -> tuple[float, float]:
    """The quick curve's vertical range: 0 to 1, wider for rewards outside it."""
    values = [float(r[key]) for r in rows for key, _, _ in _SERIES if key in r]
    return min([0.0, *values]), max([1.0, *values])


def quick_curve_png(rows: list[dict], width: int = 480, height: int = 200) -> bytes:
    """The reward curve drawn straight into PNG bytes (zlib, no plotting library): what
    each pipeline run's report shows in the Kubeflow UI. Importing matplotlib and drawing
    with it cost ~0.8 s of every run; the full figure (``curve_png``) is drawn once, at
    the end of a run. Rewards 0 to 1 bottom to top with grid lines every 0.25, iterations
    left to right; the caption says which colour is which."""
    import struct
    import zlib

    pixels = bytearray(b"\xff" * (width * height * 3))
    pad = 6
    iterations = [r["iteration"] for r in rows]
    lo, hi = min(iterations), max(max(iterations), min(iterations) + 1)
    bottom, top = _reward_range(rows)
    to_x = lambda it: pad + round((it - lo) / (hi - lo) * (width - 2 * pad - 1))
    to_y = lambda v: pad + round((top - max(bottom, min(top, v))) / (top - bottom) * (height - 2 * pad - 1))

    def dot(x: int, y: int, rgb) -> None:
        if 0 <= x < width and 0 <= y < height:
            pixels[3 * (y * width + x):3 * (y * width + x) + 3] = bytes(rgb)

    def line(x0: int, y0: int, x1: int, y1: int, rgb, thick: int = 1) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            x, y = round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps)
            for d in range(thick):
                dot(x, y + d, rgb)

    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        line(pad, to_y(tick), width - pad - 1, to_y(tick), (150, 150, 150) if tick in (0.0, 1.0) else (225, 225, 225))
    for key, _, rgb in _SERIES:
        points = [(to_x(r["iteration"]), to_y(float(r[key]))) for r in rows if key in r]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            line(x0, y0, x1, y1, rgb, thick=2)
        if len(points) == 1:
            line(points[0][0] - 1, points[0][1], points[0][0] + 1, points[0][1], rgb, thick=2)
    for points in validation_curve(rows).values():
        for it, value in points:
            for dx in range(-2, 3):
                line(to_x(it) + dx, to_y(value) - 2, to_x(it) + dx, to_y(value) + 2, _VALIDATION_RGB)
    raw = b"".join(b"\x00" + bytes(pixels[3 * width * y:3 * width * (y + 1)]) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def quick_curve_caption(rows: list[dict]) -> str:
    """What ``quick_curve_png`` shows, in words (it draws no text)."""
    shown = [f"{label} ({'blue' if rgb[2] > 150 else 'orange'})" for key, label, rgb in _SERIES
             if any(key in r for r in rows)]
    if validation_curve(rows):
        shown.append("validation (green dots)")
    bottom, top = _reward_range(rows)
    scale = "0-1 (grid every 0.25)" if (bottom, top) == (0.0, 1.0) else f"{bottom:.3g} to {top:.3g} (grid at 0-1 every 0.25)"
    return (f"Reward {scale} over iterations {rows[0]['iteration']}-{rows[-1]['iteration']}: "
            + ", ".join(shown) + ".")


def write_curve(rows: list[dict], path) -> None:
    """The run's reward curve as ``reward_curve.png``."""
    with open(path, "wb") as f:
        f.write(curve_png(rows, size=(7, 4), dpi=110))


def sample_table(istore, iteration: int, prompts: int = 4) -> str:
    """A few of the iteration's prompts with their best and worst sampled response and
    its reward, decoded from the iteration's ``reward`` snapshot (what TRL logs as
    completions). Empty when the iteration kept no reward snapshot."""
    from rlhf_core.snapshot import load_snapshot
    from rlhf_core.snapshot.errors import SnapshotError
    from rlhf_core.trainer import stages as stage_table

    try:
        batch = load_snapshot(istore.stage_uri(iteration, stage_table.SCORED),
                              fields=["raw_prompt", "ground_truth", "response_text", "uid", "token_level_scores"])
    except (SnapshotError, FileNotFoundError):
        return ""
    scores = batch.batch["token_level_scores"].sum(dim=-1).tolist()
    groups: dict = {}
    for row, uid in enumerate(batch.non_tensor_batch["uid"].tolist()):
        groups.setdefault(uid, []).append(row)
    lines = [f"Sampled responses, iteration {iteration} ({len(groups)} prompts x "
             f"{len(batch) // max(len(groups), 1)} responses; {prompts} shown):", "",
             "| prompt | expected | best response | reward | worst response | reward |", "|---|---|---|---|---|---|"]
    column = batch.non_tensor_batch
    for rows in list(groups.values())[:prompts]:
        best, worst = max(rows, key=lambda r: scores[r]), min(rows, key=lambda r: scores[r])
        lines.append(f"| {_cell(column['raw_prompt'][best])} | {_cell(column['ground_truth'][best])} | "
                     f"{_cell(column['response_text'][best])} | {scores[best]:.2f} | "
                     f"{_cell(column['response_text'][worst])} | {scores[worst]:.2f} |")
    return "\n".join(lines) + "\n"


def validation_samples(istore, iteration: int, count: int) -> list[dict]:
    """``count`` of the iteration's validation samples as verl's ``log_val_generations``
    picks them (sorted by prompt, shuffled by a RandomState(42), the first ``count``): the
    same prompts at every validation. Empty when the iteration did not validate."""
    import numpy as np

    from rlhf_core.snapshot import load_snapshot
    from rlhf_core.snapshot.errors import SnapshotError
    from rlhf_core.trainer import stages as stage_table

    if count <= 0:
        return []
    try:
        batch = load_snapshot(istore.stage_uri(iteration, stage_table.VALIDATE),
                              fields=["raw_prompt", "response_text", "token_level_scores"])
    except (SnapshotError, FileNotFoundError):
        return []
    scores = batch.batch["token_level_scores"].sum(dim=-1).tolist()
    column = batch.non_tensor_batch
    samples = sorted(zip((str(p) for p in column["raw_prompt"]), (str(r) for r in column["response_text"]), scores),
                     key=lambda sample: sample[0])
    np.random.RandomState(42).shuffle(samples)
    return [{"input": prompt, "output": response, "score": score} for prompt, response, score in samples[:count]]


def validation_sample_table(samples: list[dict], iteration: int) -> str:
    if not samples:
        return ""
    lines = [f"Validation samples, iteration {iteration} ({len(samples)}, trainer.log_val_generations):", "",
             "| prompt | response | score |", "|---|---|---|"]
    lines += [f"| {_cell(s['input'])} | {_cell(s['output'])} | {s['score']:.2f} |" for s in samples]
    return "\n".join(lines) + "\n"


def _cell(text, limit: int = 160) -> str:
    """Text as one Markdown table cell: one line, escaped, shortened."""
    import html

    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return html.escape(text).replace("|", "\\|") if text else "<em>(empty)</em>"


def markdown_report(istore, samples: int = 4) -> str:
    """The run ``istore`` records so far: reward curve, the latest metrics and
    (``samples`` > 0) sampled prompts of the latest iteration with their best and worst
    responses."""
    run_id = istore.run_id
    rows = run_history(istore)
    if not rows:
        return f"# Run `{run_id}`\n\nNo committed iteration yet.\n"
    last = rows[-1]
    image = base64.b64encode(quick_curve_png(rows)).decode()
    keys = ["critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "response_length/mean",
            # generation as a service (docs/rollout.md): what the replicas held and served
            "training/weight_version", "timing_s/gen", "rollout/load_imbalance", "rollout/replicas_lost",
            *sorted(k for k in last if k.startswith("rollout/replica_")),
            # asynchronous training (docs/async.md) and distillation (docs/distillation.md)
            *sorted(k for k in last if k.startswith(("fully_async/", "distillation/")))]
    table = "\n".join(f"| {k} | {last[k]:.4f} |" for k in keys if k in last)
    validated = [r for r in rows if any(k.startswith("val-core/") for k in r)]
    if validated:  # the latest validation, wherever it was
        table += "\n" + "\n".join(f"| {k} (iteration {validated[-1]['iteration']}) | {v:.4f} |"
                                   for k, v in validated[-1].items() if k.startswith("val-core/"))
    text = (f"# Run `{run_id}`: {len(rows)} iteration(s)\n\n"
            f"Mean reward {rows[0].get('critic/score/mean', 0):.3f} (iteration {rows[0]['iteration']}) -> "
            f"{last.get('critic/score/mean', 0):.3f} (iteration {last['iteration']})\n\n"
            f"![reward curve](data:image/png;base64,{image})\n\n{quick_curve_caption(rows)}\n\n"
            f"| metric (iteration {last['iteration']}) | value |\n|---|---|\n{table}\n")
    table = sample_table(istore, last["iteration"], samples) if samples > 0 else ""
    if validated:
        shown = int(((istore.read_manifest(validated[-1]["iteration"]).get("config") or {}).get("trainer") or {})
                    .get("log_val_generations") or 0)
        table += validation_sample_table(validation_samples(istore, validated[-1]["iteration"], shown),
                                         validated[-1]["iteration"])
    return text + ("\n" + table if table else "")
