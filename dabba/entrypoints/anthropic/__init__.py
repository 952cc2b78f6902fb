"""Anthropic's Messages API (/v1/messages) on the same engine path as the OpenAI APIs."""
