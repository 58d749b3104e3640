"""Rewards: effort budget, multi-teacher on-policy distillation, GenRM tournaments, kernels."""
