"""Per-GPU budget of a parallel layout, from the model's exact parameter counts (``openk3 plan``).

For ``world = dp_replicate·dp_shard`` GPUs and an EP degree ``ep`` (``efsdp = dp_shard/ep``):

* **parameters** (fp32 master): dense ``N_dense/dp_shard``, routed experts ``N_experts/(ep·efsdp)``;
* **gradients** (fp32, reduce-scattered): the same shares;
* **optimizer** (fp32): Muon momentum 1 value per Muon parameter, AdamW 2 per AdamW parameter
  (:func:`openk3.train.optim.partition_parameters`), same shares;
* **unsharded compute copies** (bf16): FSDP gathers one decoder layer at a time and prefetches the next,
  so 2 × the largest layer (its dense part whole, its experts ``/ep``);
* **EP buffers** per MoE layer (bf16 rows at the dispatch width ``L``): the MoonEP contract's fixed
  ``[S·K, L]`` receive buffer; the dropless all-to-all's buffer follows the routing (``S·K·(1 + maxvio)``
  rows on the most loaded rank);
* **communication per step and GPU** (bytes received): FSDP all-gathers of the bf16 parameters in the
  forward and again in the backward, ``(dp_shard−1)/dp_shard`` of each unit; the fp32 gradient
  reduce-scatter, the same fraction; the HSDP all-reduce of the gradient shard over ``dp_replicate``
  (``2(r−1)/r``); EP token exchanges, ``S·K·(ep−1)/ep`` rows each way per MoE layer, forward and backward.

* **activations** per micro-batch of ``S`` tokens, without and with full per-layer checkpointing: the
  single-device estimate of :func:`openk3.train.memory.estimate_memory` (bf16 autocast, its per-layer
  bytes per token, 25% margin, the chunked loss) for ``S`` tokens. Expert parallelism leaves it per GPU
  unchanged under the MoonEP contract (each GPU computes ``S·K`` expert rows, as one device does for its
  own ``S`` tokens); the all-to-all dispatcher's expert activations grow with the imbalance,
  ``S·K·(1 + maxvio)`` rows on the most loaded rank.

``S`` is tokens per GPU per micro-batch. Legend: ``N`` parameter counts, ``S`` tokens, ``K`` experts per
token, ``L`` dispatch width.
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.config import text_config_of
from openk3.dist.mesh import ParallelDims
from openk3.model.modeling import build_model
from openk3.model.moe import RoutedExperts
from openk3.train.memory import estimate_memory
from openk3.train.optim import partition_parameters

GIB = 2**30


@dataclass(frozen=True)
class Budget:
    """Bytes per GPU (``*_bytes``) and counts of one layout."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    unsharded_bytes: float
    ep_buffer_bytes: float
    fsdp_comm_bytes: float
    ep_comm_bytes: float
    activations_bytes: float
    """Activations of one micro-batch, no checkpointing (bf16, with the loss)."""
    activations_checkpointed_bytes: float
    """The same with full per-layer activation checkpointing."""
    experts_per_rank: int
    dense_params: int
    expert_params: int


def plan(config, dims: ParallelDims, tokens_per_gpu: int) -> Budget:
    """The per-GPU :class:`Budget` of ``config`` laid out as ``dims`` with ``tokens_per_gpu`` tokens per
    micro-batch. Raises ``ValueError`` (from :class:`ParallelDims`) when the layout does not divide the model."""
    text = text_config_of(config)
    dims.check_model(text)
    model = build_model(config, device="meta")
    expert_names = {
        f"{n}.{w}"
        for n, m in model.named_modules()
        if isinstance(m, RoutedExperts)
        for w in ("w1", "w3", "w2")
    }
    roles = partition_parameters(model)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    dense = sum(numel[r.name] for r in roles if r.name not in expert_names)
    experts = sum(numel[r.name] for r in roles if r.name in expert_names)
    opt_values = sum(numel[r.name] * (2 if r.kind == "adamw" else 1) for r in roles)
    opt_expert = sum(numel[r.name] for r in roles if r.name in expert_names)  # experts are Muon: 1 each
    expert_share = dims.ep * dims.efsdp
    params = dense / dims.dp_shard + experts / expert_share
    optimizer = (opt_values - opt_expert) / dims.dp_shard + opt_expert / expert_share
    backbone = model.language_model.model if hasattr(model, "language_model") else model.model
    layers = list(backbone.layers)
    largest = 0
    for layer in layers:
        own = sum(
            p.numel() for n, p in layer.named_parameters() if not n.startswith("block_sparse_moe.experts.")
        )
        mine = (
            sum(p.numel() for n, p in layer.named_parameters() if n.startswith("block_sparse_moe.experts."))
            / dims.ep
        )
        largest = max(largest, own + mine)
    moe_layers = sum(1 for layer in layers if hasattr(layer, "block_sparse_moe"))
    S, K, L = tokens_per_gpu, text.num_experts_per_token, text.expert_input_size
    rows = S * K
    dense_frac = (dims.dp_shard - 1) / dims.dp_shard
    expert_frac = (dims.efsdp - 1) / dims.efsdp
    gathered = dense * dense_frac + experts / dims.ep * expert_frac  # elements received per full gather
    fsdp_comm = 2 * 2 * gathered + 4 * gathered  # bf16 gathers in forward and backward, fp32 reduce-scatter
    if dims.dp_replicate > 1:
        fsdp_comm += 4 * params * 2 * (dims.dp_replicate - 1) / dims.dp_replicate
    ep_comm = moe_layers * 4 * rows * (dims.ep - 1) / dims.ep * L * 2
    return Budget(
        params_bytes=4 * params,
        grads_bytes=4 * params,
        optimizer_bytes=4 * optimizer,
        unsharded_bytes=2 * 2 * largest,
        ep_buffer_bytes=rows * L * 2,
        fsdp_comm_bytes=fsdp_comm,
        ep_comm_bytes=ep_comm,
        activations_bytes=_activations(config, S, "none"),
        activations_checkpointed_bytes=_activations(config, S, "full"),
        experts_per_rank=text.num_experts // dims.ep,
        dense_params=dense,
        expert_params=experts,
    )


def _activations(config, tokens: int, checkpointing: str) -> int:
    """Bytes of one micro-batch's activations and loss on a GPU (bf16 autocast) at ``tokens`` tokens."""
    est = estimate_memory(config, 1, tokens, checkpointing, "cuda", params=(0, 0))
    return est.activations + est.head
