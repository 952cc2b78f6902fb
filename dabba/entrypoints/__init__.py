"""Ways in: the Python LLM class and the command line."""
