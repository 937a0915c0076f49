"""A stage store that keeps the last batch in memory (tests and benchmarks that drive a
``PPOTrainer`` without a run's store and look at what an iteration produced)."""

from __future__ import annotations


class LastBatch:
    """Keeps the last training stage's whole batch (``batch``) and commits nothing:
    nothing is ever found committed, so every stage runs."""

    def __init__(self) -> None:
        self.batch = None

    def save(self, iteration: int, stage: str, batch, standalone: bool = False) -> None:
        if not standalone:  # (validation's batch is a side stage's, not the iteration's)
            self.batch = batch

    def has(self, iteration: int, stage: str) -> bool:
        return False

    def flush(self) -> None:
        pass
