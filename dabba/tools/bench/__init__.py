"""`dabba bench`: offline throughput and latency, and an online serving client for any OpenAI-compatible URL."""
