"""Agent loops: multi-turn rollouts with tools and simulated users (verl's AgentLoop).

A loop turns one prompt row into one trajectory: it asks the rollout for a turn, parses
the tool calls in it (``tool_calls``), runs the tools (``tools/``) or the interaction,
appends their answers as the chat template renders them, and asks again, until the model
answers without a call or a limit is reached. Tokens the policy generated are trained on
(``response_mask`` 1); tokens anyone else inserted are not (0). Every turn, call and answer
is kept with the row (``trajectory``), so a rollout replays without calling a tool again.

A new loop is one module under ``loops/``, a new tool one module under ``tools/``.
"""
