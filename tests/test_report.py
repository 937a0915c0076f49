"""What a person watching a run sees: the progress line, and the per-iteration report
(reward curve, metrics, sampled responses) the Kubeflow UI shows, rendered to HTML."""

import numpy as np
import pytest
import torch
from markdown_it import MarkdownIt

from rlhf_core.protocol import DataProto, object_column
from rlhf_core.trainer.iteration_store import IterationStore
from rlhf_core.trainer.progress import ProgressLine
from rlhf_core.trainer.report import markdown_report


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
    istore = IterationStore(store, "run-r")
    istore.save(0, "reward", _reward_stage())
    istore.commit_iteration(0, {"checkpoint": "x", "metrics": {"critic/score/mean": 0.59, "actor/entropy": 1.5}})
    text = markdown_report(store, "run-r")
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
    IterationStore(store, "run-s").commit_iteration(0, {"checkpoint": "x", "metrics": {"critic/score/mean": 0.1}})
    text = markdown_report(store, "run-s")
    assert "reward curve" in text and "Sampled responses" not in text


@pytest.mark.parametrize("total", [1, 3])
def test_progress_line_for_short_runs(total):
    clock = FakeClock()
    progress = ProgressLine(total=total, clock=clock)
    clock.now += 12
    assert f"(1/{total})" in progress.line(0, 0.5)
