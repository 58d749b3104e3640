"""Post-training as Kimi K3 does it: rollouts from openk3's engine, partial rollout, the policy-gradient loss
family, rewards (effort budget, MOPD, GenRM, kernels) and the demo recipe (``openk3 posttrain``)."""
