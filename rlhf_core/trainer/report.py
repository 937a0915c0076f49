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


def curve_png(rows: list[dict]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot([r["iteration"] for r in rows], [r.get("critic/score/mean", 0.0) for r in rows], marker=".")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def markdown_report(store: str, run_id: str) -> str:
    rows = run_history(store, run_id)
    if not rows:
        return f"# Run `{run_id}`\n\nNo committed iteration yet.\n"
    last = rows[-1]
    image = base64.b64encode(curve_png(rows)).decode()
    keys = ["critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "response_length/mean"]
    table = "\n".join(f"| {k} | {last[k]:.4f} |" for k in keys if k in last)
    return (f"# Run `{run_id}`: {len(rows)} iteration(s)\n\n"
            f"Mean reward {rows[0].get('critic/score/mean', 0):.3f} (iteration {rows[0]['iteration']}) -> "
            f"{last.get('critic/score/mean', 0):.3f} (iteration {last['iteration']})\n\n"
            f"![reward curve](data:image/png;base64,{image})\n\n"
            f"| metric (iteration {last['iteration']}) | value |\n|---|---|\n{table}\n")
