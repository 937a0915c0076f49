"""The long-lived training session: the run's worker groups as a Ray job, the iterations attached to it, and what it computes ahead."""
