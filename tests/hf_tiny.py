"""Tiny random Hugging Face ``KimiLinearForCausalLM`` used as the parity reference for openk3.

This is a helper module, not a test file. It needs ``transformers`` (>= 5.24, with the ``kimi_linear`` model);
flash-linear-attention is expected to be absent so that transformers runs its pure PyTorch KDA and short-conv
paths.

``build_tiny_hf_kimi_linear(path)`` builds the model in fp32 with every parameter and buffer randomised at
roughly unit activation scale, and saves it to ``path`` as safetensors. transformers' ``save_pretrained``
writes the dense (first_k_dense_replace) MLPs as ``model.layers.{i}.block_sparse_moe.{gate,up,down}_proj``;
the saved file is rewritten to the official Kimi-Linear names ``model.layers.{i}.mlp.{gate,up,down}_proj``.
All other tensors already carry the official names (per-expert ``experts.{j}.w1/w2/w3``, separate
``q_conv1d/k_conv1d/v_conv1d``, ``A_log``/``dt_bias``/``f_a_proj``/``f_b_proj`` directly under ``self_attn``).

Run ``python tests/hf_tiny.py`` for a self-check that prints logits statistics.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

# Tiny configuration, official Kimi-Linear field names. Layer 4 (1-based) is MLA, layers 1-3 are KDA;
# layer 1 has a dense MLP, layers 2-4 are MoE.
TINY_CONFIG: dict = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4],
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
    },
    # Special ids at the top of the vocabulary (like the official checkpoint), so that random test inputs
    # drawn from a lower range never contain them.
    "bos_token_id": 253,
    "eos_token_id": 254,
    "pad_token_id": 255,
}

# Std of the router's e_score_correction_bias. Sigmoid scores of the tiny router spread by ~0.2, so a
# bias of this size changes the selected experts for a large share of tokens (see ``routing_stats``).
ROUTER_BIAS_STD = 0.1


def tiny_config():
    from transformers import KimiLinearConfig

    return KimiLinearConfig(**TINY_CONFIG)


def _randomise_(model, seed: int) -> None:
    """Overwrite every parameter and buffer of ``model`` in place with seeded random values."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo

    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("embed_tokens.weight"):
                value = normal(shape, 1.0)
            elif name.endswith("norm.weight"):
                # input/post_attention/final norms, kv_a_layernorm, KDA o_norm
                value = normal(shape, 0.1, mean=1.0)
            elif name.endswith("A_log"):
                # [1, 1, H, 1]; decay rate exp(A_log) in [1, 16] as in the FLA init
                value = uniform(shape, 1.0, 16.0).log()
            elif name.endswith("dt_bias"):
                # inverse softplus of dt ~ logU(1e-3, 1e-1)
                dt = uniform(shape, math.log(1e-3), math.log(1e-1)).exp()
                value = dt + torch.log(-torch.expm1(-dt))
            elif name.endswith("conv1d.weight"):
                # [C, 1, K] depthwise causal conv
                value = normal(shape, 1.0 / math.sqrt(shape[-1]))
            elif p.dim() in (2, 3):
                # nn.Linear weights [out, in], router [E, hidden], fused experts [E, out, in]
                value = normal(shape, 1.0 / math.sqrt(shape[-1]))
            else:
                raise ValueError(f"no randomisation rule for parameter {name} {tuple(shape)}")
            p.copy_(value)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(b.shape, ROUTER_BIAS_STD))
            else:
                raise ValueError(f"no randomisation rule for buffer {name} {tuple(b.shape)}")


def _dense_layers(config) -> list[int]:
    return [i for i, t in enumerate(config.mlp_layer_types) if t == "dense"]


def _rename_dense_mlp_keys(path: Path, dense_layers: list[int]) -> None:
    """Rename ``layers.{i}.block_sparse_moe.*`` -> ``layers.{i}.mlp.*`` for the dense layers, in every
    safetensors file under ``path`` and in the shard index if there is one."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if not dense_layers:
        return
    layers = "|".join(str(i) for i in dense_layers)
    pattern = re.compile(rf"^(model\.layers\.(?:{layers}))\.block_sparse_moe\.")

    def rename(key: str) -> str:
        return pattern.sub(r"\1.mlp.", key)

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            tensors = {rename(k): f.get_tensor(k) for k in f.keys()}
        tmp = file.with_name(file.name + ".tmp")
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, file)

    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_tiny_hf_kimi_linear(path, seed: int = 0):
    """Build the tiny random fp32 ``KimiLinearForCausalLM``, save it to ``path`` (official tensor names) and
    return it in eval mode (eager attention and eager experts, the most literal reference paths)."""
    from transformers import KimiLinearForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    model = KimiLinearForCausalLM(config).to(torch.float32).eval()
    _randomise_(model, seed)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    model.save_pretrained(str(path), safe_serialization=True)
    _rename_dense_mlp_keys(path, _dense_layers(config))
    return model


def load_tiny_hf_kimi_linear(path):
    """Reload a saved tiny model with transformers (eager paths, fp32, eval)."""
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


@torch.no_grad()
def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits ``[B, T, V]`` (fp32), no cache, no attention mask."""
    return model(input_ids=input_ids, use_cache=False).logits.float()


@torch.no_grad()
def hf_greedy(model, input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding of ``n`` new tokens with the model's cache (KDA conv + recurrent states, MLA latents).

    Returns only the new tokens, ``[B, n]``. Written as an explicit prefill + one-token decode loop instead
    of ``model.generate``: generate infers an attention mask from ``pad_token_id`` and stops/pads at
    ``eos``, both of which would make the reference depend on the special ids. No eos handling here: always
    ``n`` tokens.
    """
    if n <= 0:
        return input_ids.new_empty(input_ids.shape[0], 0)
    out = model(input_ids=input_ids, use_cache=True)
    cache = out.cache
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    new = [tok]
    for _ in range(n - 1):
        out = model(input_ids=tok, cache=cache, use_cache=True)
        cache = out.cache
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        new.append(tok)
    return torch.cat(new, dim=1)


@torch.no_grad()
def hf_greedy_nocache(model, input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding that re-runs the whole prefix at every step (no cache); returns ``[B, n]``."""
    ids = input_ids
    for _ in range(n):
        tok = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, tok], dim=1)
    return ids[:, input_ids.shape[1] :]


@torch.no_grad()
def routing_stats(model, input_ids: torch.Tensor) -> list[float]:
    """Per MoE layer: fraction of tokens whose selected expert set differs from the unbiased top-k."""
    stats: list[float] = []
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "e_score_correction_bias"):
            continue
        hooks.append(
            layer.post_attention_layernorm.register_forward_hook(
                lambda _m, _i, out, i=i: captured.__setitem__(i, out.detach())
            )
        )
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    for i, x in sorted(captured.items()):
        gate = model.model.layers[i].mlp.gate
        scores = torch.sigmoid(x.reshape(-1, x.shape[-1]).float() @ gate.weight.float().t())
        k = gate.top_k
        plain = scores.topk(k, dim=-1).indices.sort(-1).values
        biased = (scores + gate.e_score_correction_bias).topk(k, dim=-1).indices.sort(-1).values
        stats.append((plain != biased).any(-1).float().mean().item())
    return stats


def tiny_input_ids(batch: int = 2, seq: int = 37, seed: int = 1234) -> torch.Tensor:
    """Random token ids that avoid the special ids (bos/eos/pad live at 253..255)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (batch, seq), generator=gen)


def _self_check() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_hf_kimi_linear(tmp, seed=0)
        from safetensors import safe_open

        with safe_open(os.path.join(tmp, "model.safetensors"), framework="pt") as f:
            keys = sorted(f.keys())
        print("saved tensors:", len(keys))
        print(
            "layer-0 mlp keys:", [k for k in keys if k.startswith("model.layers.0.") and "self_attn" not in k]
        )
        assert not any(k.startswith("model.layers.0.block_sparse_moe.") for k in keys)

        ids = tiny_input_ids()
        logits = hf_logits(model, ids)
        arg = logits.argmax(-1)
        print("logits shape", tuple(logits.shape), f"std {logits.std():.4f} mean {logits.mean():.4f}")
        print("distinct argmax per row:", [len(set(r.tolist())) for r in arg], "of", arg.shape[1])
        print("routing changed by bias (per MoE layer):", [f"{s:.2f}" for s in routing_stats(model, ids)])

        reloaded = load_tiny_hf_kimi_linear(tmp)
        d = (hf_logits(reloaded, ids) - logits).abs().max().item()
        print(f"reloaded-from-disk vs in-memory max|dlogits|: {d:.3g}")

        g_cache = hf_greedy(model, ids, 12)
        g_nocache = hf_greedy_nocache(model, ids, 12)
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[:, ids.shape[1] :]
        print("greedy (cache):", g_cache.tolist())
        print(
            "greedy cache == no-cache:",
            torch.equal(g_cache, g_nocache),
            " == generate():",
            torch.equal(g_cache, gen),
        )


if __name__ == "__main__":
    _self_check()
