"""Training memory: an estimate per micro-batch, and the plan (micro-batch, accumulation, checkpointing) that fits.

The estimate, in bytes, for bf16 autocast with fp32 master weights (CUDA) or fp32 (CPU)::

    fixed       = params · (4 weights + 4 grads + 2 bf16 casts on CUDA) + optimizer + workspace
    optimizer   = 4 · Muon params (momentum)  +  8 · AdamW params (two moments)
    activations = micro_batch · seq_len · Σ_layers a_layer(mode)     (bytes per token of each layer)
    head        = min(tokens, CHUNK_TOKENS) · V · 12  +  tokens · D · 8          (chunked LM-head loss)

``a_layer`` counts what autograd keeps per token in a decoder layer (:func:`layer_bytes_per_token`): the
AttnRes sources and their normalised copies (fp32), the two pre-norm inputs, and per mixer/FFN kind the
projection outputs, the short-convolution and SiLU inputs, the KDA kernel's saved ``Aqk``/``T``, the MLA
attention inputs and output, the routed experts' gathered inputs, gate/up/hidden and outputs at ``k`` slots
per token, and the shared expert's. It is an estimate with a 25% margin, not a measurement:
``benchmarks/train_throughput.py`` prints it beside ``torch.cuda.max_memory_allocated``.

Checkpointing per decoder layer (:mod:`openk3.train.checkpointing`): ``full`` keeps each layer's input
(``D`` fp32 per token) and recomputes one layer at a time in the backward (one layer's activations on top);
``selective`` keeps the matmul and KDA outputs (:data:`SELECTIVE_FRACTION` of a layer's bytes) and
recomputes norms, activations and elementwise work. A compiled layer (``compiled``, the default on CUDA)
without checkpointing keeps about that same share: Inductor's partitioner saves the matmul and kernel outputs
for the backward and recomputes the pointwise work that its fused kernels produced from them, so its
``none`` is counted as :data:`SELECTIVE_FRACTION` of the eager bytes (on an H200, ``k3-1b`` at 4 and 8 ×
2048 tokens, this estimate is about 10% above ``torch.cuda.max_memory_allocated``).

Legend: ``D`` width, ``V`` vocabulary, ``P = H·K`` KDA width, ``E`` experts, ``k`` experts per token,
``F`` expert width, ``L`` expert input width.
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.config import text_config_of
from openk3.train.loss import CHUNK_TOKENS

MODES = ("none", "selective", "full")
"""Activation checkpointing modes, least recompute first."""
SELECTIVE_FRACTION = 0.5
"""Share of a layer's activation bytes the selective mode keeps (matmul and KDA outputs)."""
MARGIN = 1.25
"""Margin on the activation estimate (allocator rounding, fragmentation, temporaries of the backward)."""
WORKSPACE = 2 * 2**30
"""Bytes kept aside for the CUDA context's allocations, cuBLAS workspaces and the compiled kernels' buffers."""
MIN_MICRO_TOKENS = 8192
"""The planner prefers less checkpointing while a micro-batch still holds this many tokens (GPU-efficient)."""
GIB = 2**30


def layer_bytes_per_token(text, layer_idx: int, act: int) -> int:
    """Bytes autograd keeps per token for decoder layer ``layer_idx`` without checkpointing (no margin).

    ``act`` is the bytes of an activation (2 under bf16 autocast, 4 in fp32); norms, AttnRes and the
    router compute in fp32 (4 bytes)."""
    D = text.hidden_size
    sources = 1 + layer_idx // text.attn_res_block_size + 1 if text.uses_attn_res else 0
    n = 2 * 4 * D + 2 * sources * 2 * 4 * D  # two pre-norm inputs; two AttnRes mixes (stack + normalised)
    if text.is_kda_layer(layer_idx):
        la = text.linear_attn_config
        H, K = la.num_heads, la.head_dim
        P = H * K
        # x; q,k,v projections, conv taps and SiLU inputs, op inputs; g; Aqk + T; o, gate, normed o (fp32)
        n += act * (D + 12 * P + 2 * P + K) + 2 * 64 * H * act + 4 * 2 * P + act * P
    else:
        H = text.num_attention_heads
        qk, v = text.qk_nope_head_dim + text.qk_rope_head_dim, text.v_head_dim
        C, r = text.kv_lora_rank, text.qk_rope_head_dim
        q_in = text.q_lora_rank or 0
        n += act * (D + 2 * q_in + 2 * (C + r) + 2 * H * (text.qk_nope_head_dim + v) + 3 * H * qk + 4 * H * v)
    if text.is_moe_layer(layer_idx):
        E, k, F = text.num_experts, text.num_experts_per_token, text.moe_intermediate_size
        L = text.expert_input_size
        Fs = F * text.num_shared_experts
        n += 4 * (D + 3 * E) + act * (D + 3 * L + 3 * k * L + 5 * k * F + 5 * Fs)
        n += 4 * 2 * L if text.is_latent_moe else 0  # the latent norm in fp32
        n += 8 * k  # slot order, token ids, weights
    else:
        n += act * (D + 5 * text.intermediate_size)
    return n


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one training step's peak (see the module docstring); ``total`` sums the parts."""

    params: int
    state: int
    """Weights, gradients, optimizer moments and the bf16 weight casts."""
    activations: int
    head: int
    workspace: int

    @property
    def total(self) -> int:
        return self.state + self.activations + self.head + self.workspace

    def describe(self) -> str:
        return (
            f"{self.total / GIB:,.1f} GiB (parameters, gradients and optimizer state {self.state / GIB:,.1f} GiB; "
            f"activations {self.activations / GIB:,.1f} GiB; loss {self.head / GIB:,.1f} GiB)"
        )


def optimizer_params(config) -> tuple[int, int]:
    """``(Muon parameters, AdamW parameters)`` of the model of ``config`` as :func:`~openk3.train.optim.
    build_optimizer` splits them (a meta-device build): Muon keeps one momentum per weight, AdamW two."""
    from openk3.model import build_model
    from openk3.train.optim import partition_parameters

    model = build_model(config, device="meta")
    sizes = dict((n, p.numel()) for n, p in model.named_parameters())
    adamw = sum(sizes[r.name] for r in partition_parameters(model) if r.kind == "adamw")
    return sum(sizes.values()) - adamw, adamw


def estimate_memory(
    config,
    micro_batch: int,
    seq_len: int,
    checkpointing: str,
    device: str,
    params: tuple[int, int] | None = None,
    compiled: bool = False,
) -> MemoryEstimate:
    """:class:`MemoryEstimate` of one step at ``micro_batch × seq_len`` tokens per forward on ``device``
    (``"cuda"``: bf16 autocast; ``"cpu"``: fp32). ``checkpointing`` is one of :data:`MODES`; ``params`` is
    :func:`optimizer_params`' ``(Muon, AdamW)`` counts (computed when ``None``); ``compiled``: the decoder
    layers run through ``torch.compile`` (see the module docstring)."""
    if checkpointing not in MODES:
        raise ValueError(f"checkpointing={checkpointing!r}: use one of {', '.join(MODES)}")
    text = text_config_of(config)
    muon, adamw = optimizer_params(config) if params is None else params
    cuda = device == "cuda"
    act = 2 if cuda else 4
    per_layer = [layer_bytes_per_token(text, i, act) for i in range(text.num_hidden_layers)]
    if checkpointing == "none":
        per_token = (SELECTIVE_FRACTION if compiled else 1) * sum(per_layer)
    elif checkpointing == "selective":
        per_token = SELECTIVE_FRACTION * sum(per_layer) + max(per_layer)
    else:
        per_token = 4 * text.hidden_size * text.num_hidden_layers + max(per_layer)
    tokens = micro_batch * seq_len
    D, V = text.hidden_size, text.vocab_size
    return MemoryEstimate(
        params=muon + adamw,
        state=(muon + adamw) * (4 + 4 + (2 if cuda else 0)) + 4 * muon + 8 * adamw,
        activations=int(MARGIN * per_token * tokens) + tokens * 4 * D,  # + the embedding output
        head=min(tokens, CHUNK_TOKENS) * V * 12 + tokens * D * 8,
        workspace=WORKSPACE if cuda else 0,
    )


@dataclass(frozen=True)
class MemoryPlan:
    """How one optimizer step of ``global_batch`` sequences runs: ``grad_accum`` micro-batches of
    ``micro_batch`` sequences, with ``checkpointing``; ``estimate`` is the step's peak."""

    micro_batch: int
    grad_accum: int
    checkpointing: str
    estimate: MemoryEstimate


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_memory(
    config,
    global_batch: int,
    seq_len: int,
    budget: int,
    device: str,
    micro_batch: int | None = None,
    checkpointing: str = "auto",
    name: str = "the model",
    compiled: bool = False,
) -> MemoryPlan:
    """The micro-batch (a divisor of ``global_batch``) and checkpointing mode whose estimate fits ``budget``
    bytes (``compiled``: the decoder layers run through ``torch.compile``).

    ``micro_batch=None`` picks the largest that fits; ``checkpointing="auto"`` takes the first of
    :data:`MODES` whose largest fitting micro-batch holds at least :data:`MIN_MICRO_TOKENS` tokens (or the
    whole batch), else the mode with the largest fitting micro-batch.

    Raises ``ValueError`` when nothing fits (the message gives the estimate of the smallest step and the
    budget) or when the given ``micro_batch`` does not fit (the message gives its estimate and the largest
    micro-batch that fits, and with which checkpointing), or does not divide ``global_batch``.
    """
    if micro_batch is not None and global_batch % micro_batch:
        raise ValueError(
            f"micro-batch {micro_batch} does not divide the batch of {global_batch} sequences: use one of "
            f"{', '.join(map(str, _divisors(global_batch)))}"
        )
    modes = MODES if checkpointing == "auto" else (checkpointing,)
    params = optimizer_params(config)

    def est(mb: int, mode: str) -> MemoryEstimate:
        return estimate_memory(config, mb, seq_len, mode, device, params, compiled)

    def best(mode: str) -> int | None:
        fits = [d for d in _divisors(global_batch) if est(d, mode).total <= budget]
        return max(fits) if fits else None

    gib = f"{budget / GIB:,.1f} GiB"
    if micro_batch is not None:
        for mode in modes:
            if est(micro_batch, mode).total <= budget:
                return MemoryPlan(micro_batch, global_batch // micro_batch, mode, est(micro_batch, mode))
        hints = []
        same = max(((best(m) or 0, m) for m in modes), key=lambda o: o[0])
        if same[0]:
            hints.append(
                f"--micro-batch-size {same[0]} ({same[1]} checkpointing: {est(same[0], same[1]).describe()})"
            )
        other = max(((best(m) or 0, m) for m in MODES), key=lambda o: (o[0], -MODES.index(o[1])))
        if other[0] > same[0]:
            hints.append(
                f"--micro-batch-size {other[0]} --activation-checkpointing {other[1]} "
                f"({est(other[0], other[1]).describe()})"
            )
        hint = (
            "use " + " or ".join(hints)
            if hints
            else "no micro-batch fits: use a smaller --preset or a shorter context"
        )
        raise ValueError(
            f"training {name} with micro-batches of {micro_batch} × {seq_len} tokens needs about "
            f"{est(micro_batch, modes[-1]).describe()} with --activation-checkpointing {modes[-1]}, more than "
            f"the {gib} available on {device}: {hint}"
        )
    chosen = [(best(m), m) for m in modes]
    want = min(global_batch * seq_len, MIN_MICRO_TOKENS)
    for mb, mode in chosen:
        if mb is not None and mb * seq_len >= want:
            return MemoryPlan(mb, global_batch // mb, mode, est(mb, mode))
    fitting = [(mb, mode) for mb, mode in chosen if mb is not None]
    if fitting:
        mb, mode = max(fitting, key=lambda o: o[0])
        return MemoryPlan(mb, global_batch // mb, mode, est(mb, mode))
    raise ValueError(
        f"training {name} with micro-batches of 1 × {seq_len} tokens needs at least "
        f"{est(1, modes[-1]).describe()} (with --activation-checkpointing {modes[-1]}), more than the {gib} "
        f"available on {device}: use a smaller --preset or a shorter context"
    )


def device_memory_bytes(device: str) -> int | None:
    """Total memory of ``device`` in bytes: physical RAM for ``"cpu"``, the GPU's for ``"cuda"``; ``None``
    when it cannot be read."""
    import os

    import torch

    try:
        if device == "cuda":
            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None
