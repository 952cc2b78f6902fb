"""Weight quantization: a method object per linear layer (create, process after loading, apply)."""
