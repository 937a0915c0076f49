"""One module per generation engine (``rollout.name``); see ``rlhf_core.rollout.registry``."""
