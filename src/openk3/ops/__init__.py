"""Operators of the openk3 models: pure-PyTorch references beside their fast paths, one folder per op."""
