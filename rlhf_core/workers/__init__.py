"""Role workers: actor/rollout/reference, critic, reward."""
