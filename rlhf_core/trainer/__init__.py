"""The controller's control flow: one PPO/GRPO iteration, stage by stage."""
