"""A human report of a run so far: reward curve and the latest metrics, from the store."""

from __future__ import annotations

import base64
import io


def run_history(store: str, run_id: str) -> list[dict]:
    """One row per committed iteration: its number and checkpoint plus the metrics in its
    manifest."""
    from rlhf_core.trainer.iteration_store import IterationStore

    istore = IterationStore(store, run_id)
    rows = []
    for n in istore.committed_iterations():
        manifest = istore.read_manifest(n)
        rows.append({"iteration": n, "checkpoint": manifest["checkpoint"], **manifest["metrics"]})
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
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


def write_curve(rows: list[dict], path) -> None:
    """The run's reward curve as ``reward_curve.png``."""
    with open(path, "wb") as f:
        f.write(curve_png(rows, size=(7, 4), dpi=110))


def sample_table(store: str, run_id: str, iteration: int, prompts: int = 4) -> str:
    """A few of the iteration's prompts with their best and worst sampled response and
    its reward, decoded from the iteration's ``reward`` snapshot (what TRL logs as
    completions). Empty when the iteration kept no reward snapshot."""
    from rlhf_core.snapshot import load_snapshot
    from rlhf_core.snapshot.errors import SnapshotError
    from rlhf_core.trainer import stages as stage_table
    from rlhf_core.trainer.iteration_store import IterationStore

    try:
        batch = load_snapshot(IterationStore(store, run_id).stage_uri(iteration, stage_table.SCORED),
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


def _cell(text, limit: int = 160) -> str:
    """Text as one Markdown table cell: one line, escaped, shortened."""
    import html

    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return html.escape(text).replace("|", "\\|") if text else "<em>(empty)</em>"


def markdown_report(store: str, run_id: str, samples: int = 4) -> str:
    """The run so far: reward curve, the latest metrics and (``samples`` > 0) sampled
    prompts of the latest iteration with their best and worst responses."""
    rows = run_history(store, run_id)
    if not rows:
        return f"# Run `{run_id}`\n\nNo committed iteration yet.\n"
    last = rows[-1]
    image = base64.b64encode(curve_png(rows)).decode()
    keys = ["critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "response_length/mean"]
    table = "\n".join(f"| {k} | {last[k]:.4f} |" for k in keys if k in last)
    validated = [r for r in rows if any(k.startswith("val-core/") for k in r)]
    if validated:  # the latest validation, wherever it was
        table += "\n" + "\n".join(f"| {k} (iteration {validated[-1]['iteration']}) | {v:.4f} |"
                                   for k, v in validated[-1].items() if k.startswith("val-core/"))
    text = (f"# Run `{run_id}`: {len(rows)} iteration(s)\n\n"
            f"Mean reward {rows[0].get('critic/score/mean', 0):.3f} (iteration {rows[0]['iteration']}) -> "
            f"{last.get('critic/score/mean', 0):.3f} (iteration {last['iteration']})\n\n"
            f"![reward curve](data:image/png;base64,{image})\n\n"
            f"| metric (iteration {last['iteration']}) | value |\n|---|---|\n{table}\n")
    table = sample_table(store, run_id, last["iteration"], samples) if samples > 0 else ""
    return text + ("\n" + table if table else "")
