"""One line per committed iteration, for a person watching a run: where it is, the
reward, the pace and the time left. Direct runs and pipeline runs print the same line."""

from __future__ import annotations

import time
from dataclasses import dataclass

#: Iterations the "mean of the last N" rewards average over (progress, stopping rules).
REWARD_WINDOW = 5


def recent_mean(rewards: list[float], window: int = REWARD_WINDOW) -> float | None:
    """The mean of the last ``window`` rewards (fewer at the start); None without any."""
    recent = rewards[-window:]
    return sum(recent) / len(recent) if recent else None


def closing_lines(rows: list[dict], progress: "ProgressLine", outputs: dict[str, str],
                  training_s: float | None = None) -> list[str]:
    """What a run prints when it ends (direct and pipeline runs alike): the reward from
    first to last iteration, when the target was first held, the wall time, then where
    each output is (``outputs``: name -> path or URI)."""
    lines = []
    if rows:
        first, last = rows[0], rows[-1]
        lines.append(f"reward: {first['critic/score/mean']:.3f} (iteration {first['iteration']}) -> "
                     f"{last['critic/score/mean']:.3f} (iteration {last['iteration']})"
                     + (f", {training_s:.0f}s of training" if training_s is not None else ""))
    lines += progress.summary()
    lines += [f"{name}: {where}" for name, where in outputs.items() if where]
    return lines


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class ProgressLine:
    """``line(iteration, reward)`` after each committed iteration of ``total`` this command
    runs. The pace is that of the last ``window`` iterations (the first one carries the
    start-up, so it says little about the rest)."""

    def __init__(self, total: int, window: int = REWARD_WINDOW, clock=time.monotonic, started: float | None = None) -> None:
        self.total, self.window, self.clock = total, window, clock
        self.started = clock() if started is None else started
        self.ends: list[float] = []
        self.rewards: list[float] = []

    def line(self, iteration: int, reward: float) -> str:
        now = self.clock()
        self.ends.append(now)
        self.rewards.append(reward)
        done = len(self.ends)
        recent = self.ends[-(self.window + 1):]
        per_it = (recent[-1] - recent[0]) / (len(recent) - 1) if len(recent) > 1 else now - self.started
        shown = min(len(self.rewards), REWARD_WINDOW)
        left = (self.total - done) * per_it
        return (f"[rlhf] iteration {iteration} ({done}/{self.total}) reward {reward:.3f} "
                f"(mean of last {shown}: {recent_mean(self.rewards):.3f}) | "
                f"{60 / per_it if per_it > 0 else 0:.1f} it/min | elapsed {_clock(now - self.started)} | "
                f"left ~{_clock(left)}")

    def first_reached(self, target: float, window: int = REWARD_WINDOW) -> tuple[int, float] | None:
        """(iterations done, seconds since the start) when the mean reward of ``window``
        consecutive iterations first reached ``target``; None if it never did."""
        for end in range(window, len(self.rewards) + 1):
            if sum(self.rewards[end - window:end]) / window >= target:
                return end, self.ends[end - 1] - self.started
        return None

    def summary(self, target: float = 0.9) -> list[str]:
        """The closing lines: when the target was first held, and the wall time."""
        lines = []
        if self.rewards:
            reached = self.first_reached(target)
            lines.append(f"mean reward of {REWARD_WINDOW} consecutive iterations >= {target}: " + (
                f"first after iteration {reached[0]} of this command, {_clock(reached[1])} after its start"
                if reached else "not reached"))
        lines.append(f"wall time: {_clock(self.clock() - self.started)} (start-up included)")
        return lines


def validation_score(metrics: dict) -> float | None:
    """One number for a validation: the mean of its ``val-core/*`` means (None: no
    validation in ``metrics``). What ``--stop-at-val`` compares."""
    core = [v for k, v in metrics.items() if k.startswith("val-core/") and "/mean@" in k]
    return sum(core) / len(core) if core else None


@dataclass
class StopRule:
    """When a run ends before its count of iterations: the one rule of direct runs
    (benchmarks) and of the fine-tune driver (``rlhf submit``, ``rlhf run``'s pipeline runs).
    Each target is checked after a commit, against what the committed iterations say."""

    time_budget_s: float | None = None    # seconds since the run (the driver) started
    stop_at_reward: float | None = None   # mean critic/score/mean of the last REWARD_WINDOW iterations
    stop_at_val: float | None = None      # the newest validation's score (``validation_score``)
    min_rewards: int = 0                  # the reward target counts only once this many rewards exist

    @property
    def by_count_only(self) -> bool:
        """Whether nothing but the count ends the run (so an iteration may start before the
        one before it has committed: no target can end the run in between)."""
        return self.time_budget_s is None and self.stop_at_reward is None and self.stop_at_val is None

    def reason(self, rewards: list[float], validation: float | None, elapsed_s: float) -> str | None:
        """Why the run stops now, or None. ``rewards``: every committed iteration's
        critic/score/mean in order (the mean is over the last REWARD_WINDOW, all of them
        before there are that many, and none before ``min_rewards``); ``validation``: the
        newest validation's score."""
        reward = recent_mean(rewards) if len(rewards) >= self.min_rewards else None
        if self.stop_at_reward is not None and reward is not None and reward >= self.stop_at_reward:
            return f"mean reward {reward:.3f} of the last iterations reached {self.stop_at_reward}"
        if self.stop_at_val is not None and validation is not None and validation >= self.stop_at_val:
            return f"validation score {validation:.3f} reached {self.stop_at_val}"
        if self.time_budget_s is not None and elapsed_s >= self.time_budget_s:
            return f"wall-clock budget of {self.time_budget_s:.0f}s spent"
        return None
