"""Dense GLU MLP: the layer-0 FFN and the fused shared experts.

``y = down_proj(act(gate_proj(x), up_proj(x)))`` with ``act`` SwiGLU or SiTU-GLU (``config.hidden_act``).
Shapes: ``x_*D -> y_*D``, hidden width I.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.activations import glu


class MLP(nn.Module):
    def __init__(self, config, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.config, self.gate_proj(x_D), self.up_proj(x_D)))
