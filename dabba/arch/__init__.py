"""A model's architecture as dabba reads it, resolved once and free of torch: ArchConfig from a
checkpoint's config.json (config.py) and the checkpoint's JSON files (files.py). The bottom rung
of the model stack: everything above reads these facts, nothing here reads a tensor."""
