"""Parallelism applied from outside the single-device model: meshes, FSDP2, expert and context parallelism.

* :mod:`openk3.dist.mesh` — the named device meshes and their validation (:class:`ParallelDims`).
* :mod:`openk3.dist.fsdp` — ``fully_shard`` per decoder layer and on the root, meta-device build and
  per-rank materialisation.
* :mod:`openk3.dist.dispatch` — the dropless all-to-all token dispatcher (the oracle).
* :mod:`openk3.dist.moonep_planner` — the MoonEP-contract planner (exactly ``S·K`` rows per rank).
* :mod:`openk3.dist.expert_parallel` — swaps a MoE block's routed experts for an expert-parallel module.
* :mod:`openk3.dist.context_parallel` — one sequence split across the ``cp`` ranks: KCP for KDA
  (:mod:`~openk3.dist.kcp`, :mod:`~openk3.dist.cp_conv`), the latent all-gather for MLA
  (:mod:`~openk3.dist.cp_mla`), over a :mod:`~openk3.dist.cp_plan` of fragments.
"""
