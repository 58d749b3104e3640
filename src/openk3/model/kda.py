"""Kimi Delta Attention layer (``self_attn`` of a KDA layer), as in Kimi-Linear and K3.

``docs/references.md#kda-layer`` (official names and shapes: ``docs/references.md#checkpoint-names``)::

    q, k, v = SiLU(ShortConv(W_{q,k,v} x))                  # [B, T, H, K]
    g_raw   = f_b_proj(f_a_proj(x))                          # low-rank decay input, rank K
    g       = lb·σ(e^{A_log_h}·(g_raw + dt_bias))            # K3, lb = gate_lower_bound = −5
            | −e^{A_log_h}·softplus(g_raw + dt_bias)         # Kimi-Linear
    β       = σ(b_proj x)                                    # [B, T, H]
    o       = KDA(l2norm(q), l2norm(k), v, g, β)             # openk3.ops.kda, scale K^-½
    y       = o_proj(RMSNorm_head(o) ⊙ σ(G))                 # G = g_proj x (K3) | g_b_proj(g_a_proj x)

Two controls of the synthetic tasks are configs of this layer (``linear_attn_config``): with
``decay_per_channel=False`` the decay input has one entry per head, broadcast over the K channels (Gated
DeltaNet, the same ops); with ``delta_rule=False`` too, the state update drops the delta rule
(:mod:`openk3.ops.decay_only`).

``A_log`` is stored ``max(H, 128)`` long (the official K3 tensor is ``[128]`` with the first 96 used).
With a server's :class:`~openk3.model.cache.KDAStateSlots` the layer updates the states in place: up to
``DECODE_MAX_TOKENS`` tokens per request as one conv step over the stacked q/k/v projections and the
state-pool decode op (:func:`~openk3.ops.kda.fused_recurrent_kda_pool`), more tokens through the path below,
the new states copied in. The chunked op runs for training and prefill (on CUDA, training takes it as the custom op
:func:`~openk3.ops.kda.triton.train_op.chunk_kda_train`, which ``torch.compile`` traces); with a cache and few new tokens outside training the
recurrent decode op runs instead. In a speculative verification the layer keeps the state after every
token: on a :class:`~openk3.model.cache.KDACache` (its ``steps`` a list, set by
:meth:`~openk3.model.cache.KimiCache.begin_verify`) it runs one decode step per token; on
:class:`~openk3.model.cache.KDAStateSlots` with ``verify`` set (the server's verifying forward) it runs the
tokens in one call, the decode op storing the state after each token and the conv windows read off the
stacked inputs, with no host data (a CUDA graph captures it).

Legend: ``B`` batch, ``T`` tokens, ``D`` width, ``H`` KDA heads, ``K`` head size (= V), ``P = H·K``, ``G`` decay
inputs per head (K, or 1 with one decay per head).
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.cache import KDACache, KDAStateSlots
from openk3.model.norm import GatedRMSNorm
from openk3.model.packing import PackedProjection, pack_linears, packed_or_none, project
from openk3.model.short_conv import ShortConvolution, short_conv, short_conv_step_
from openk3.ops.decay_only import parallel_decay_only
from openk3.ops.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_pool, kda_gate, l2norm
from openk3.ops.kda.triton.train_op import chunk_kda_train, use_train_op

A_LOG_STORED = 128
"""Length of the stored ``A_log`` (official K3 layout); the layer uses the first H entries."""
DECODE_MAX_TOKENS = 16
"""With a cache and at most this many new tokens (and no grad), the recurrent op is used."""


class KimiDeltaAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        la = config.linear_attn_config
        D, H, K = config.hidden_size, la.num_heads, la.head_dim
        P = H * K
        self.num_heads, self.head_dim = H, K
        self.lower_bound = la.gate_lower_bound
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = ShortConvolution(P, la.short_conv_kernel_size)
        self.k_conv1d = ShortConvolution(P, la.short_conv_kernel_size)
        self.v_conv1d = ShortConvolution(P, la.short_conv_kernel_size)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        gate_width = P if la.decay_per_channel else H
        self.f_b_proj = nn.Linear(K, gate_width, bias=False)
        self.A_log = nn.Parameter(torch.empty(max(H, A_LOG_STORED), dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(gate_width, dtype=torch.float32))
        self.decay_per_channel, self.delta_rule = la.decay_per_channel, la.delta_rule
        self.b_proj = nn.Linear(D, H, bias=False)
        if la.use_full_rank_gate:
            self.g_proj = nn.Linear(D, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.o_norm = GatedRMSNorm(K, config.rms_norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False)
        self.full_rank_gate = la.use_full_rank_gate
        self.packed: PackedProjection | None = None
        """The six input projections as one GEMM (:meth:`pack_projections`, the server's decode step)."""

    def pack_projections(self) -> None:
        """Pack ``q, k, v, f_a, b`` and the output gate's input projection (``g_proj`` or ``g_a_proj``) into
        one matrix (:func:`~openk3.model.packing.pack_linears`); :meth:`input_projections` then runs one GEMM
        in forwards without gradient."""
        self.packed = pack_linears(self._input_linears())

    def input_projections(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(qkv, f_a x, b x, gate input)`` of the normed input, before the convolutions; ``qkv`` ``[B, T, 3P]``
        holds the q, k and v projections side by side. One GEMM when packed and without gradient (``qkv`` a
        view of its output), else six linears and a ``cat``."""
        packed = packed_or_none(self.packed)
        if packed is not None:
            s = packed.sizes
            return project(x_BTD, packed.weight).split((s[0] + s[1] + s[2], *s[3:]), -1)
        q_BTP, k_BTP, v_BTP, *rest = (lin(x_BTD) for lin in self._input_linears())
        return torch.cat([q_BTP, k_BTP, v_BTP], -1), *rest

    def _input_linears(self) -> list[nn.Linear]:
        gate = self.g_proj if self.full_rank_gate else self.g_a_proj
        return [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, gate]

    def output_gate(self, gate_in_BTX: torch.Tensor) -> torch.Tensor:
        """``G [B, T, P]`` from the gate's input projection (``g_proj x``, or ``g_a_proj x`` through ``g_b_proj``)."""
        return gate_in_BTX if self.full_rank_gate else project(gate_in_BTX, self.g_b_proj)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cache: KDACache | KDAStateSlots | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args: ``x_BTD`` normed input; ``cache`` updated in place; ``cu_seqlens`` int64 ``[N+1]`` (B = 1).

        Returns ``[B, T, D]``. With ``cu_seqlens`` and a cache, the cache receives one state per document.
        """
        if isinstance(cache, KDACache) and cache.steps is not None:
            return self._verify(x_BTD, cache)
        if isinstance(cache, KDAStateSlots):
            return self._forward_slots(x_BTD, cache)
        conv_B3PW = None
        if cache is not None and cache.conv_states is not None:
            conv_B3PW = torch.stack(cache.conv_states, 1)
        y_BTD, conv_B3PW = self._forward_chunked(x_BTD, cache, conv_B3PW, cu_seqlens)
        if cache is not None:
            cache.conv_states = conv_B3PW.unbind(1)
        return y_BTD

    def conv_weight(self) -> torch.Tensor:
        """The q, k and v convolutions' weights stacked, ``[3, P, 1, W]``."""
        return torch.stack([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])

    def _forward_chunked(
        self,
        x_BTD: torch.Tensor,
        cache: KDACache | None,
        conv_B3PW: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer by the chunked op (or the recurrent one for a few new tokens over a cache): ``(y_BTD, the
        new conv caches [B, 3, P, W−1] or None)``; ``cache`` (``None``, or a cache whose ``recurrent_state`` is
        the initial state) receives the final recurrent state; ``conv_B3PW`` the q, k, v conv caches stacked
        (``None``: zeros)."""
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        keep = cache is not None
        qkv_BT3P, f_a_BTK, b_BTH, gate_in = self.input_projections(x_BTD)
        q_BTP, k_BTP, v_BTP, conv_B3PW = self.short_convolutions(qkv_BT3P, conv_B3PW, cu_seqlens, keep)
        g_raw_BTHG = project(f_a_BTK, self.f_b_proj).view(B, T, H, -1)
        # β's logits in fp32; the op applies σ (in the Triton kernels on CUDA: use_beta_sigmoid_in_kernel)
        beta_logits_BTH = b_BTH.to(torch.promote_types(x_BTD.dtype, torch.float32))
        if not self.delta_rule:
            if keep or cu_seqlens is not None:
                raise NotImplementedError("the decay-only mixer supports neither a cache nor cu_seqlens")
            g_BTH = kda_gate(g_raw_BTHG, self.A_log, self.dt_bias, self.lower_bound).squeeze(-1)
            q_BTHK, k_BTHK = l2norm(q_BTP.view(B, T, H, K)), l2norm(k_BTP.view(B, T, H, K))
            o_BTHK = parallel_decay_only(
                q_BTHK, k_BTHK, v_BTP.view(B, T, H, K), g_BTH, beta_logits_BTH.sigmoid()
            )
            return self._output(self.output_gate(gate_in), o_BTHK), None
        dt_bias = self.dt_bias if self.decay_per_channel else self.dt_bias.repeat_interleave(K)
        q_BTHK, k_BTHK, v_BTHK = (t.view(B, T, H, K) for t in (q_BTP, k_BTP, v_BTP))
        g_raw_BTHK = g_raw_BTHG.expand(B, T, H, K)
        gate = dict(A_log=self.A_log[:H], dt_bias=dt_bias, lower_bound=self.lower_bound)
        o_BTHK, state = self.kda_core(
            q_BTHK, k_BTHK, v_BTHK, g_raw_BTHK, beta_logits_BTH, gate, cache, cu_seqlens
        )
        if keep:
            cache.recurrent_state = state
        return self._output(self.output_gate(gate_in), o_BTHK), conv_B3PW

    def short_convolutions(
        self,
        qkv_BT3P: torch.Tensor,
        conv_B3PW: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        keep: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q_BTP, k_BTP, v_BTP, conv_B3PW)``: the q, k, v projections (side by side in ``qkv_BT3P``) through
        their short convolutions, run as one (:func:`~openk3.model.short_conv.short_conv`; each output
        contiguous); the new conv caches ``[B, 3, P, W−1]`` (``[N, 3, P, W−1]`` with ``cu_seqlens``) when
        ``keep``, else ``None``. The seam context parallelism overrides (:mod:`openk3.dist.context_parallel`)."""
        B, T, P3 = qkv_BT3P.shape
        x_B3TP = qkv_BT3P.view(B, T, 3, P3 // 3).transpose(1, 2)
        y_B3TP, conv_B3PW = short_conv(x_B3TP, self.conv_weight(), conv_B3PW, cu_seqlens, keep)
        return *y_B3TP.unbind(1), conv_B3PW

    def kda_core(self, q_BTHK, k_BTHK, v_BTHK, g_raw_BTHK, beta_logits_BTH, gate: dict, cache, cu_seqlens):
        """``(o_BTHK, state or None)``: the KDA op on the convolved q, k, v, the raw gate and β's logits
        (the other seam context parallelism overrides); ``gate`` holds ``A_log``, ``dt_bias``, ``lower_bound``."""
        keep = cache is not None
        if use_train_op(q_BTHK, k_BTHK, v_BTHK, g_raw_BTHK, beta_logits_BTH, **gate, cache=cache,
                        cu_seqlens=cu_seqlens):  # fmt: skip
            return chunk_kda_train(q_BTHK, k_BTHK, v_BTHK, g_raw_BTHK, beta_logits_BTH, **gate), None
        T = q_BTHK.shape[1]
        use_decode = keep and T <= DECODE_MAX_TOKENS and not torch.is_grad_enabled() and cu_seqlens is None
        kda = fused_recurrent_kda if use_decode else chunk_kda
        return kda(
            q_BTHK,
            k_BTHK,
            v_BTHK,
            g_raw_BTHK,
            beta_logits_BTH,
            initial_state=cache.recurrent_state if keep else None,
            output_final_state=keep,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            **gate,
        )

    def _verify(self, x_BTD: torch.Tensor, cache: KDACache | KDAStateSlots) -> torch.Tensor:
        """``[B, T, D]``: one decode step per token, each exactly a one-token decode of this cache, appending
        the state before the chunk and after each token to ``cache.steps`` (its ``rollback`` then selects
        one)."""
        steps, cache.steps = cache.steps, None
        steps.append(cache.snapshot())
        outs = []
        for t in range(x_BTD.shape[1]):
            outs.append(self.forward(x_BTD[:, t : t + 1], cache))
            steps.append(cache.snapshot())
        cache.steps = steps
        return torch.cat(outs, 1)

    def _forward_slots(self, x_BTD: torch.Tensor, slots: KDAStateSlots) -> torch.Tensor:
        """The layer on a server's states, overwritten in place (``docs/references.md#kda-layer``): up to
        :data:`DECODE_MAX_TOKENS` tokens (or a verification of any length) by the stacked conv step and the
        state-pool decode op, more through :meth:`forward` with the new states copied in. A verification sets
        ``slots.steps`` (see :class:`~openk3.model.cache.KDAStateSlots`)."""
        B, T, _ = x_BTD.shape
        if (T > DECODE_MAX_TOKENS and not slots.verify) or not self.delta_rule:
            cache = KDACache(None, slots.recurrent)
            y_BTD, conv_B3PW = self._forward_chunked(x_BTD, cache, slots.conv, None)
            slots.recurrent.copy_(cache.recurrent_state)
            slots.conv.copy_(conv_B3PW)
            return y_BTD
        H, K = self.num_heads, self.head_dim
        weight_3PW = self.conv_weight()[:, :, 0].to(x_BTD.dtype)
        qkv_BT3P, f_a_BTK, b_BTH, gate_in = self.input_projections(x_BTD)
        proj_B3PT = qkv_BT3P.view(B, T, 3, -1).permute(0, 2, 3, 1)
        if slots.verify:  # the conv window after token t: the last W − 1 inputs up to it
            W1 = slots.conv.shape[-1]
            xp_B3PS = torch.cat([slots.conv.to(proj_B3PT.dtype), proj_B3PT], -1)
            conv_steps = xp_B3PS.unfold(-1, W1, 1).permute(0, 3, 1, 2, 4)  # a view; the rollback casts
            rec0 = slots.recurrent.clone()
            rec_steps = slots.recurrent.new_empty(B, T, *slots.recurrent.shape[1:])
        qkv_BT3P = short_conv_step_(proj_B3PT, slots.conv, weight_3PW).permute(0, 3, 1, 2)
        q_BTHK, k_BTHK, v_BTHK = (qkv_BT3P[:, :, i].reshape(B, T, H, K) for i in range(3))
        g_raw_BTHK = project(f_a_BTK, self.f_b_proj).view(B, T, H, -1).expand(B, T, H, K)
        dt_bias = self.dt_bias if self.decay_per_channel else self.dt_bias.repeat_interleave(K)
        beta_BTH = b_BTH.to(torch.promote_types(x_BTD.dtype, torch.float32))
        o_BTHK = fused_recurrent_kda_pool(
            q_BTHK, k_BTHK, v_BTHK, g_raw_BTHK, beta_BTH, slots.recurrent, A_log=self.A_log[:H],
            dt_bias=dt_bias, lower_bound=self.lower_bound, use_beta_sigmoid_in_kernel=True,
            step_states=rec_steps if slots.verify else None,
        )  # fmt: skip
        if slots.verify:
            slots.steps = (rec0, rec_steps, conv_steps)
        return self._output(self.output_gate(gate_in), o_BTHK)

    def _output(self, gate_BTP: torch.Tensor, o_BTHK: torch.Tensor) -> torch.Tensor:
        """``o_proj(RMSNorm_head(o) ⊙ σ(G))`` ``[B, T, D]`` for the op's output ``o_BTHK`` and ``G = gate_BTP``."""
        B, T, H, K = o_BTHK.shape
        o_BTHK = self.o_norm(o_BTHK.to(gate_BTP.dtype), gate_BTP.view(B, T, H, K))
        return project(o_BTHK.reshape(B, T, H * K), self.o_proj)
