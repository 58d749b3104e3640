"""Training: Per-Head Muon + AdamW optimizer (optim.py), and the pieces a training loop needs."""
