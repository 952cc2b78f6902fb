"""Tensor-parallel groups and their collectives (torch.distributed underneath)."""
