"""Agent loops, one module each, registered by module name (``single_turn_agent``,
``tool_agent``); a user's loop is a class in a file named by ``agent_loop_config_path``."""
