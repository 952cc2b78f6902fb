"""Model families as plain nn.Modules, the registry, weight loading and the native layer loop
(the architecture they read is resolved in dabba/arch/)."""
