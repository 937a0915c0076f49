"""What a person watching a run sees: the progress line, and the per-iteration report
(reward curve, metrics, sampled responses) the Kubeflow UI shows, rendered to HTML."""

import numpy as np
import pytest
import torch
from markdown_it import MarkdownIt

from rlhf_core.protocol import DataProto, object_column
from rlhf_core.trainer.progress import ProgressLine
from rlhf_core.trainer.report import markdown_report
from rlhf_core.record.iteration_store import IterationStore
from rlhf_core.record.run_layout import RunRef

#: what a manifest that wrote checkpoint "x" says of its weights
OWN_CHECKPOINT = {"checkpoint": "x", "weights": {"checkpoint": "x", "checkpoint_step": 1, "redo": []}}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_line_says_reward_pace_and_time_left():
    clock = FakeClock()
    progress = ProgressLine(total=10, clock=clock)
    clock.now += 30  # the first iteration carries the start-up
    first = progress.line(0, 0.2)
    assert "iteration 0 (1/10) reward 0.200" in first and "2.0 it/min" in first and "left ~4:30" in first
    for k, reward in enumerate([0.5, 0.9, 0.95, 0.92, 0.91], start=1):
        clock.now += 6
        line = progress.line(k, reward)
    # the pace of the last five iterations (6 s each), not the start-up's
    assert "10.0 it/min" in line and "left ~0:24" in line and "elapsed 1:00" in line
    assert "mean of last 5: 0.836" in line
    assert progress.first_reached(0.9) is None
    clock.now += 6
    progress.line(6, 0.93)
    assert progress.first_reached(0.9) == (7, 66.0)
    summary = progress.summary()
    assert "first after iteration 7 of this command, 1:06 after its start" in summary[0]
    assert summary[1] == "wall time: 1:06 (start-up included)"


def _reward_stage(rows: int = 8, n: int = 4) -> DataProto:
    uids = [f"p{i // n}" for i in range(rows)]
    scores = torch.zeros(rows, 3)
    scores[:, -1] = torch.tensor([0.25, 1.0, 0.5, 0.0, 0.75, 0.75, 0.75, 0.75])  # outcome on the last token
    return DataProto.from_dict(
        {"token_level_scores": scores, "responses": torch.ones(rows, 3, dtype=torch.long)},
        {"uid": object_column(uids),
         "raw_prompt": object_column([f"<bos>{i // n}{i // n}12=" for i in range(rows)]),
         "ground_truth": object_column([f"21{i // n}{i // n}" for i in range(rows)]),
         "response_text": np.array(["2100", "2100 | best", "2111", "", "2111", "2111", "2111", "2111"],
                                   dtype=object)})


def test_report_shows_best_and_worst_responses_and_renders(tmp_path):
    store = f"file://{tmp_path}/store"
    istore = IterationStore(RunRef(store, "run-r"))
    istore.save(0, "reward", _reward_stage())
    istore.commit_iteration(0, {**OWN_CHECKPOINT, "metrics": {"critic/score/mean": 0.59, "actor/entropy": 1.5}})
    text = markdown_report(IterationStore(RunRef(store, "run-r")))
    html = MarkdownIt("commonmark").enable("table").render(text)
    assert "<img" in html and "data:image/png;base64," in html  # the reward curve
    assert html.count("<table>") == 2  # metrics, samples
    rows = html.split("<tbody>")[2].split("</tbody>")[0].split("<tr>")[1:]
    cells = [[c.split("</td>")[0] for c in row.split("<td>")[1:]] for row in rows]
    # prompt, expected, best, its reward, worst, its reward; text escaped (no stray tag, no cell split)
    assert cells[0] == ["&lt;bos&gt;0012=", "2100", "2100 | best", "1.00", "<em>(empty)</em>", "0.00"]
    assert cells[1][3] == cells[1][5] == "0.75"
    assert "2 prompts x 4 responses" in text


def test_report_without_a_reward_snapshot_has_no_sample_table(tmp_path):
    store = f"file://{tmp_path}/store"
    IterationStore(RunRef(store, "run-s")).commit_iteration(0, {**OWN_CHECKPOINT, "metrics": {"critic/score/mean": 0.1}})
    text = markdown_report(IterationStore(RunRef(store, "run-s")))
    assert "reward curve" in text and "Sampled responses" not in text


@pytest.mark.parametrize("total", [1, 3])
def test_progress_line_for_short_runs(total):
    clock = FakeClock()
    progress = ProgressLine(total=total, clock=clock)
    clock.now += 12
    assert f"(1/{total})" in progress.line(0, 0.5)


def test_the_per_run_report_draws_its_curve_without_matplotlib(tmp_path):
    """Every pipeline run writes the report: its curve is a PNG drawn directly (the import
    of matplotlib cost ~0.8 s a run). The PNG decodes; the reward line rises where the
    reward does; the validation dot and the caption are there."""
    import base64
    import io
    import re
    import subprocess
    import sys

    from PIL import Image

    store = f"file://{tmp_path}/store"
    istore = IterationStore(RunRef(store, "run-v"))
    for n, reward in enumerate([0.1, 0.4, 0.8]):
        metrics = {"critic/score/mean": reward, "critic/reward_extra/exact/mean": reward / 2}
        if n == 2:
            metrics["val-core/digits/reward/mean@1"] = 0.3
        istore.commit_iteration(n, {**OWN_CHECKPOINT, "metrics": metrics})
    code = ("import sys; from rlhf_core.trainer.report import markdown_report; "
            "from rlhf_core.record.iteration_store import IterationStore; from rlhf_core.record.run_layout import RunRef; "
            f"text = markdown_report(IterationStore(RunRef({store!r}, 'run-v'))); print(text); "
            "print('MATPLOTLIB', 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "MATPLOTLIB False" in out
    assert "mean reward (blue), exact match (orange), validation (green dots)" in out
    png = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", out).group(1))
    image = Image.open(io.BytesIO(png)).convert("RGB")
    width, height = image.size

    def rows_of(rgb, x):
        return [y for y in range(height) if image.getpixel((x, y)) == rgb]

    blue = (31, 119, 180)
    first, middle, last = rows_of(blue, 7), rows_of(blue, width // 2), rows_of(blue, width - 8)
    assert first and middle and last and min(first) > min(middle) > min(last)  # higher reward: higher up
    assert any(image.getpixel((x, y)) == (44, 160, 44) for x in range(width - 10, width) for y in range(height))


def test_the_report_shows_what_the_rollout_replicas_held_and_served(tmp_path):
    store = f"file://{tmp_path}/store"
    istore = IterationStore(RunRef(store, "run-g"))
    istore.commit_iteration(0, {**OWN_CHECKPOINT, "metrics": {
        "critic/score/mean": 0.5, "training/weight_version": 1.0, "rollout/load_imbalance": 1.25,
        "rollout/replica_0/requests": 40.0, "rollout/replica_1/requests": 24.0}})
    text = markdown_report(IterationStore(RunRef(store, "run-g")))
    for row in ("| training/weight_version | 1.0000 |", "| rollout/load_imbalance | 1.2500 |",
                "| rollout/replica_0/requests | 40.0000 |", "| rollout/replica_1/requests | 24.0000 |"):
        assert row in text


def test_the_report_shows_staleness_and_the_teachers_kl(tmp_path):
    store = f"file://{tmp_path}/store"
    IterationStore(RunRef(store, "run-a")).commit_iteration(0, {**OWN_CHECKPOINT, "metrics": {
        "critic/score/mean": 0.5, "fully_async/staleness/max": 1.0, "fully_async/trainer/wait_s": 0.25,
        "distillation/loss": 0.125}})
    text = markdown_report(IterationStore(RunRef(store, "run-a")))
    for row in ("| fully_async/staleness/max | 1.0000 |", "| fully_async/trainer/wait_s | 0.2500 |",
                "| distillation/loss | 0.1250 |"):
        assert row in text
