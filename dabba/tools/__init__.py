"""The offline tools, on top of everything they use: `dabba quantize` (quantize.py), `dabba plan`
(plan.py), `dabba eval` (evaluation.py) and `dabba bench` (bench/). Nothing below imports them."""
