"""An independent, loop-based float64 forward of a K3-family text model, for exactness tests.

Written directly from the model sections of ``docs/references.md``, not from openk3's model code:
``#checkpoint-names`` (official tensor names), ``#kda-layer`` (KDA layer with the K3 lower-bounded gate and
full-rank output gate), ``#gated-nope-mla`` (NoPE MLA with q LoRA and the sigmoid output gate), ``#router``
(sigmoid router, bias for selection only), ``#block-attention-residuals`` (K3 Block AttnRes data flow),
``#stable-latentmoe`` (Stable LatentMoE order) and ``#situ-glu`` (SiTU-GLU). Everything runs in
float64 with explicit per-token / per-head / per-expert loops, so each step can be read against the
formula it comes from. Sizes must be tiny (a few hundred hidden units, a few dozen tokens).

Shape legend
    B batch, T tokens, D hidden_size, H heads, K = V KDA head size, C conv channels (H·K),
    R MLA qk head size (nope + rope), E routed experts, k experts per token, L latent width.

Only ``torch`` is imported: the reference shares no code with ``openk3``.
"""

from __future__ import annotations

from typing import Any

import torch

F64 = torch.float64
MLA_LORA_NORM_EPS = 1e-6
"""Epsilon of ``q_a_layernorm`` and ``kv_a_layernorm`` (the MLA LoRA norms), the RMSNorm default of the
official code; architecture.md gives no value, so this is the project's recorded choice. All other
RMSNorms use ``rms_norm_eps``."""
L2NORM_EPS = 1e-6
"""KDA q/k normalisation x / sqrt(Σx² + 1e-6) (``docs/references.md#kda-layer``)."""


def rms_norm(x_D: torch.Tensor, w_D: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x · (mean(x²) + eps)^(−1/2) · w (w = None: no gain)."""
    y = x_D / torch.sqrt((x_D * x_D).mean(-1, keepdim=True) + eps)
    return y if w_D is None else y * w_D


def linear(x: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """``nn.Linear`` without bias: x · Wᵀ."""
    return x @ w_OI.T


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU gate product: β₁·tanh(g/β₁) · σ(g) · β₂·tanh(u/β₂) (uncapped u if β₂ is None)."""
    capped_u = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * capped_u


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate product: SiLU(g) · u."""
    return g * torch.sigmoid(g) * u


class K3Reference:
    """Float64 reference forward of a ``kimi_k3`` text model.

    ``tensors``: ``{official name: tensor}`` with the ``language_model.`` prefix (as written by
    ``openk3.checkpoint.io.official_state``; routed experts as ``experts.{j}.w1/w2/w3``); any dtype, cast to
    float64 here. ``config``: ``KimiK3Config.to_dict()`` (or the ``text_config`` dict itself).
    Raises ``KeyError`` for a missing tensor and ``ValueError`` for a config without the K3 features
    (lower-bounded gate, full-rank KDA output gate, AttnRes).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self.cfg = config.get("text_config", config)
        self.t = {name: t.detach().to("cpu", F64) for name, t in tensors.items()}
        self.eps = float(self.cfg["rms_norm_eps"])
        la = self.cfg["linear_attn_config"]
        self.kda_layers = set(la["kda_layers"])  # 1-based
        self.kda_heads = la["num_heads"]
        self.kda_head_dim = la["head_dim"]
        self.gate_lower_bound = la["gate_lower_bound"]
        k3_features = (self.gate_lower_bound, la["use_full_rank_gate"], self.cfg["attn_res_block_size"])
        if any(f is None or f is False for f in k3_features):
            raise ValueError("K3Reference covers K3 configs only (gate_lower_bound, full-rank gate, AttnRes)")

    def w(self, name: str) -> torch.Tensor:
        return self.t["language_model." + name]

    # --- KDA (#kda-layer) ---------------------------------------------------------------------------
    @staticmethod
    def short_conv_silu(x_TC: torch.Tensor, w_C1W: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv, no bias, then SiLU; w[:, 0, W−1] multiplies the current token."""
        T, C = x_TC.shape
        W = w_C1W.shape[-1]
        y_TC = torch.zeros(T, C, dtype=F64)
        for t in range(T):
            for j in range(W):
                s = t - (W - 1) + j  # source token of tap j
                if s >= 0:
                    y_TC[t] += w_C1W[:, 0, j] * x_TC[s]
        return y_TC * torch.sigmoid(y_TC)

    def kda(self, p: str, x_TD: torch.Tensor) -> torch.Tensor:
        """One KDA sublayer on the normed input x (one sequence)."""
        T = x_TD.shape[0]
        H, K = self.kda_heads, self.kda_head_dim
        q_THK = self.short_conv_silu(linear(x_TD, self.w(p + "q_proj.weight")), self.w(p + "q_conv1d.weight"))
        k_THK = self.short_conv_silu(linear(x_TD, self.w(p + "k_proj.weight")), self.w(p + "k_conv1d.weight"))
        v_THK = self.short_conv_silu(linear(x_TD, self.w(p + "v_proj.weight")), self.w(p + "v_conv1d.weight"))
        q_THK, k_THK, v_THK = (a.reshape(T, H, K) for a in (q_THK, k_THK, v_THK))
        f_THK = linear(linear(x_TD, self.w(p + "f_a_proj.weight")), self.w(p + "f_b_proj.weight"))
        f_THK = (f_THK + self.w(p + "dt_bias")).reshape(T, H, K)
        A_log_H = self.w(p + "A_log")[:H]  # only the first H entries are used (#checkpoint-names)
        beta_TH = torch.sigmoid(linear(x_TD, self.w(p + "b_proj.weight")))
        gout_THK = torch.sigmoid(linear(x_TD, self.w(p + "g_proj.weight"))).reshape(T, H, K)
        o_THK = torch.zeros(T, H, K, dtype=F64)
        for h in range(H):
            S_KV = torch.zeros(K, K, dtype=F64)
            for t in range(T):
                # K3 lower-bounded gate, natural log: g = lb·σ(exp(A_log_h)·(f + dt_bias)) ∈ (lb, 0)
                g_K = self.gate_lower_bound * torch.sigmoid(torch.exp(A_log_H[h]) * f_THK[t, h])
                q_K = q_THK[t, h] / torch.sqrt((q_THK[t, h] ** 2).sum() + L2NORM_EPS) * K**-0.5
                k_K = k_THK[t, h] / torch.sqrt((k_THK[t, h] ** 2).sum() + L2NORM_EPS)
                # S_t = (I − β k kᵀ) Diag(e^g) S_{t−1} + β k vᵀ
                S_KV = torch.exp(g_K)[:, None] * S_KV
                S_KV = S_KV + beta_TH[t, h] * torch.outer(k_K, v_THK[t, h] - k_K @ S_KV)
                o_THK[t, h] = q_K @ S_KV  # o_t = S_tᵀ q
        o_THK = rms_norm(o_THK, self.w(p + "o_norm.weight"), self.eps) * gout_THK
        return linear(o_THK.reshape(T, H * K), self.w(p + "o_proj.weight"))

    # --- gated NoPE MLA (#gated-nope-mla) ------------------------------------------------------------
    def mla(self, p: str, x_TD: torch.Tensor) -> torch.Tensor:
        """One gated MLA sublayer (NoPE, q LoRA, shared unrotated k_pe, causal) on the normed input x."""
        c = self.cfg
        T = x_TD.shape[0]
        H, nope, rope, vd, r_kv = (
            c["num_attention_heads"],
            c["qk_nope_head_dim"],
            c["qk_rope_head_dim"],
            c["v_head_dim"],
            c["kv_lora_rank"],
        )
        if c["q_lora_rank"] is None:
            q_THR = linear(x_TD, self.w(p + "q_proj.weight"))
        else:
            cq = rms_norm(
                linear(x_TD, self.w(p + "q_a_proj.weight")),
                self.w(p + "q_a_layernorm.weight"),
                MLA_LORA_NORM_EPS,
            )
            q_THR = linear(cq, self.w(p + "q_b_proj.weight"))
        q_THR = q_THR.reshape(T, H, nope + rope)
        ckv = linear(x_TD, self.w(p + "kv_a_proj_with_mqa.weight"))
        c_TL, k_pe_T = ckv[:, :r_kv], ckv[:, r_kv:]
        kv = linear(
            rms_norm(c_TL, self.w(p + "kv_a_layernorm.weight"), MLA_LORA_NORM_EPS),
            self.w(p + "kv_b_proj.weight"),
        ).reshape(T, H, nope + vd)
        scale = (nope + rope) ** -0.5
        out_THV = torch.zeros(T, H, vd, dtype=F64)
        for h in range(H):
            for t in range(T):
                scores = torch.empty(t + 1, dtype=F64)
                for s in range(t + 1):  # causal: keys 0..t
                    key_R = torch.cat([kv[s, h, :nope], k_pe_T[s]])  # k_pe shared by every head
                    scores[s] = (q_THR[t, h] @ key_R) * scale
                p_S = torch.softmax(scores, dim=0)
                out_THV[t, h] = sum(p_S[s] * kv[s, h, nope:] for s in range(t + 1))
        out = out_THV.reshape(T, H * vd)
        if c.get("mla_use_output_gate"):
            out = out * torch.sigmoid(linear(x_TD, self.w(p + "g_proj.weight")))
        return linear(out, self.w(p + "o_proj.weight"))

    # --- feed-forward (#situ-glu, #router, #stable-latentmoe) -----------------------------------------
    def act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if c["hidden_act"] == "situ":
            return situ_glu(g, u, c["activation_situ_beta"], c["activation_situ_linear_beta"])
        return swiglu(g, u)

    def glu(
        self, x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor
    ) -> torch.Tensor:
        """GLU MLP without biases: down(act(gate x, up x))."""
        return linear(self.act(linear(x, gate_w), linear(x, up_w)), down_w)

    def route(self, p: str, x_D: torch.Tensor) -> tuple[list[int], list[float]]:
        """Router for one token: (expert ids, weights). Selection on s + bias, weights from s."""
        c = self.cfg
        k = c["num_experts_per_token"]
        s_E = torch.sigmoid(linear(x_D, self.w(p + "gate.weight")))
        bias = self.t.get("language_model." + p + "gate.e_score_correction_bias")
        choice_E = s_E if bias is None else s_E + bias
        idx = sorted(range(s_E.numel()), key=lambda e: -float(choice_E[e]))[:k]
        w = [float(s_E[e]) for e in idx]
        if c["moe_renormalize"] and k > 1:
            total = sum(w) + 1e-20
            w = [x / total for x in w]
        return idx, [x * c["routed_scaling_factor"] for x in w]

    def moe(self, p: str, x_TD: torch.Tensor) -> torch.Tensor:
        """Stable LatentMoE on the normed input, token by token and expert by expert."""
        p = p + "block_sparse_moe."
        out_TD = torch.zeros_like(x_TD)
        for t in range(x_TD.shape[0]):
            x_D = x_TD[t]
            idx, weights = self.route(p, x_D)
            z_L = linear(x_D, self.w(p + "routed_expert_down_proj.weight"))
            r_L = torch.zeros_like(z_L)
            for e, we in zip(idx, weights, strict=True):
                ep = f"{p}experts.{e}."
                r_L = r_L + we * self.glu(
                    z_L, self.w(ep + "w1.weight"), self.w(ep + "w3.weight"), self.w(ep + "w2.weight")
                )
            if self.cfg.get("latent_moe_use_norm"):
                r_L = rms_norm(r_L, self.w(p + "routed_expert_norm.weight"), self.eps)
            routed_D = linear(r_L, self.w(p + "routed_expert_up_proj.weight"))
            sp = p + "shared_experts."
            shared_D = self.glu(
                x_D,
                self.w(sp + "gate_proj.weight"),
                self.w(sp + "up_proj.weight"),
                self.w(sp + "down_proj.weight"),
            )
            out_TD[t] = routed_D + shared_D
        return out_TD

    # --- Block AttnRes (#block-attention-residuals) --------------------------------------------------
    def attn_res(self, prefix: str, sources: list[torch.Tensor]) -> torch.Tensor:
        """Mix of the sources (completed blocks, then the partial sum), each [T, D], per token.

        K = RMSNorm_nogain(V); score = K · (norm.weight ⊙ proj.weight); p = softmax over sources; out = Σ p V.
        """
        q_D = self.w(prefix + "_norm.weight") * self.w(prefix + "_proj.weight")[0]
        T = sources[0].shape[0]
        out_TD = torch.zeros_like(sources[0])
        for t in range(T):
            scores = torch.stack([rms_norm(v[t], None, self.eps) @ q_D for v in sources])
            p_N = torch.softmax(scores, dim=0)
            out_TD[t] = sum(p_N[n] * sources[n][t] for n in range(len(sources)))
        return out_TD

    # --- whole model ----------------------------------------------------------------------------
    def forward_one(self, ids_T: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] (float64) of one sequence, following the K3 data flow of
        #block-attention-residuals."""
        c = self.cfg
        bs = c["attn_res_block_size"]
        prefix_TD = self.w("model.embed_tokens.weight")[ids_T]
        blocks: list[torch.Tensor] = []
        for i in range(c["num_hidden_layers"]):
            lp = f"model.layers.{i}."
            h_TD = self.attn_res(lp + "self_attention_res", blocks + [prefix_TD]) if blocks else prefix_TD
            if i % bs == 0:
                blocks.append(prefix_TD)  # i = 0: the embedding is b_0
                prefix_TD = None
            x_TD = rms_norm(h_TD, self.w(lp + "input_layernorm.weight"), self.eps)
            if (i + 1) in self.kda_layers:
                a_TD = self.kda(lp + "self_attn.", x_TD)
            else:
                a_TD = self.mla(lp + "self_attn.", x_TD)
            prefix_TD = a_TD if prefix_TD is None else prefix_TD + a_TD
            h_TD = self.attn_res(lp + "mlp_res", blocks + [prefix_TD])
            x_TD = rms_norm(h_TD, self.w(lp + "post_attention_layernorm.weight"), self.eps)
            is_moe = (
                c["num_experts"] is not None
                and i >= c["first_k_dense_replace"]
                and i % c["moe_layer_freq"] == 0
            )
            if is_moe:
                f_TD = self.moe(lp, x_TD)
            else:
                f_TD = self.glu(
                    x_TD,
                    self.w(lp + "mlp.gate_proj.weight"),
                    self.w(lp + "mlp.up_proj.weight"),
                    self.w(lp + "mlp.down_proj.weight"),
                )
            prefix_TD = prefix_TD + f_TD
        h_TD = self.attn_res("model.output_attn_res", blocks + [prefix_TD])
        h_TD = rms_norm(h_TD, self.w("model.norm.weight"), self.eps)
        return linear(h_TD, self.w("lm_head.weight"))

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] in float64; sequences are independent (no packing)."""
        return torch.stack([self.forward_one(ids) for ids in input_ids_BT])


def reference_logits(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], input_ids_BT: torch.Tensor
) -> torch.Tensor:
    """Float64 logits [B, T, vocab] of the K3 text model given by official-name ``tensors`` and ``config``."""
    return K3Reference(tensors, config).forward(input_ids_BT)
