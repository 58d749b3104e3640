"""Kimi Delta Attention (KDA) ops; the derivation and the file map are in this folder's README.md."""

from openk3.ops.kda.chunk import chunk_kda
from openk3.ops.kda.fused_recurrent import fused_recurrent_kda
from openk3.ops.kda.gate import kda_gate
from openk3.ops.kda.l2norm import l2norm
from openk3.ops.kda.naive import naive_recurrent_kda
from openk3.ops.kda.pool_decode import fused_recurrent_kda_pool

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "fused_recurrent_kda_pool",
    "kda_gate",
    "l2norm",
    "naive_recurrent_kda",
]
