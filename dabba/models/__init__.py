"""Model families as plain nn.Modules, their HF config normalisation and weight loading."""
