"""dabba's logger: INFO to stderr out of the box (users should see the KV-cache plan), without
touching the root logger of the application that imports dabba."""
from __future__ import annotations

import logging


def init_logger() -> logging.Logger:
    logger = logging.getLogger("dabba")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
