"""Dense GLU MLP: the layer-0 FFN and the fused shared experts.

``y = down_proj(act(gate_proj(x), up_proj(x)))`` with ``act`` SwiGLU or SiTU-GLU (``config.hidden_act``).
Shapes: ``x_*D -> y_*D``, hidden width I.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.activations import glu
from openk3.model.packing import PackedProjection, pack_linears, packed_or_none, project


class MLP(nn.Module):
    def __init__(self, config, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.packed: PackedProjection | None = None
        """``gate_proj`` and ``up_proj`` as one GEMM (:meth:`pack_projections`; a MoE block packs its shared
        experts with its own input projection and hands them a view)."""

    def pack_projections(self) -> None:
        """Pack ``gate_proj`` and ``up_proj`` into one matrix, read by forwards without gradient."""
        self.packed = pack_linears([self.gate_proj, self.up_proj])

    def gate_up(self, x_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_proj x, up_proj x)``: one GEMM when packed and without gradient."""
        packed = packed_or_none(self.packed)
        return packed(x_D) if packed is not None else (self.gate_proj(x_D), self.up_proj(x_D))

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``down_proj(act(gate, up))``: the rest of the MLP after :meth:`gate_up`."""
        return project(glu(self.config, gate, up), self.down_proj)

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        return self.down(*self.gate_up(x_D))
