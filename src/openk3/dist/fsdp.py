"""FSDP2 on the single-device model: ``fully_shard`` per decoder layer and on the root.

The model is built on the meta device, sharded, then materialised on each rank: every rank allocates only
its shards, and the initial weights equal :func:`openk3.model.init.init_weights` on one device for the same
seed (the modules are initialised one at a time in the same order, each full parameter drawn on the CPU,
its shard kept, the rest dropped: the peak is one full parameter, never the model).

Mixed precision (``MixedPrecisionPolicy``): fp32 master parameters and optimizer state; compute in
``param_dtype`` (bf16 for training, fp32 for the exactness tests); gradients reduce-scattered in
``reduce_dtype`` (fp32). Gradients are averaged over the data ranks (FSDP's default), so a rank's loss is the
mean over its own tokens and the update equals one process on the concatenated batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from openk3.config import AnyConfig, text_config_of
from openk3.dist.mesh import Meshes
from openk3.model.decoder import KimiDecoderLayer
from openk3.model.init import init_module_
from openk3.model.modeling import build_model

LAYER_FORWARDS = ("forward_residual", "forward_attn_res")
"""Decoder-layer methods the backbone calls directly; FSDP's unshard/reshard hooks are registered on them."""


def decoder_layers(model: nn.Module) -> list[KimiDecoderLayer]:
    """The decoder layers of ``model`` in order (each one FSDP unit)."""
    return [m for m in model.modules() if isinstance(m, KimiDecoderLayer)]


def shard_model(
    model: nn.Module,
    meshes: Meshes,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Apply ``fully_shard`` to each decoder layer, then to the root (embedding, final norm, head), in place.

    Routed experts that an expert-parallel module holds (``ep > 1``) get their own FSDP unit on the
    ``efsdp`` mesh first. Returns ``model``.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        moe = getattr(layer, "block_sparse_moe", None)
        if meshes.expert is not None and moe is not None and hasattr(moe, "experts"):
            moe.experts.grad_scale = 1.0 / meshes.dims.ep  # FSDP averages experts over efsdp only
            fully_shard(moe.experts, mesh=meshes.expert_fsdp, mp_policy=mp)
        fully_shard(layer, mesh=meshes.fsdp, mp_policy=mp)
        for method in LAYER_FORWARDS:  # the model calls these, not ``layer(...)``
            register_fsdp_forward_method(layer, method)
    fully_shard(model, mesh=meshes.fsdp, mp_policy=mp)
    return model


@torch.no_grad()
def materialize(model: nn.Module, text_config, device: torch.device | str, seed: int | None) -> nn.Module:
    """Allocate the shards of a meta-device sharded ``model`` on ``device`` and initialise them.

    Each module's full parameters are drawn on the CPU in :func:`init_weights`' order and generator, and
    each rank keeps its own shard (``distribute_tensor`` with ``src_data_rank=None``: no communication).
    Returns ``model``.
    """
    model.to_empty(device=device)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for name, module in model.named_modules():
        sharded = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
        for n, p in sharded.items():
            module._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
        init_module_(name, module, text_config.initializer_range, gen)
        for n, p in sharded.items():
            full = module._parameters[n].detach().to(p.to_local().device)
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
            module._parameters[n] = p
    return model


def build_sharded_model(
    config: AnyConfig,
    meshes: Meshes,
    device: torch.device | str = "cpu",
    seed: int | None = 0,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    ep_dispatcher: str = "alltoall",
) -> nn.Module:
    """Build ``config`` on the meta device, apply expert parallelism (``ep > 1``, with ``ep_dispatcher``,
    one of :data:`openk3.dist.expert_parallel.DISPATCHERS`) and FSDP2, materialise.

    Raises ``ValueError`` (before any allocation) when the mesh does not divide the model.
    """
    text = text_config_of(config)
    meshes.dims.check_model(text)
    model = build_model(config, device="meta")
    if meshes.expert is not None:
        from openk3.dist.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, meshes, ep_dispatcher)
    shard_model(model, meshes, param_dtype, reduce_dtype)
    return materialize(model, text, device, seed)
