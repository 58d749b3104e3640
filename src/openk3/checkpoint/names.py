"""The one table that maps official checkpoint names to module state-dict names.

Official names are the Hugging Face layout of the releases (``docs/references.md#checkpoint-names``): K3
tensors sit
under ``language_model.`` (our K3 wrapper's attribute has that name, so the prefix needs no rule);
Kimi-Linear tensors have no prefix. Every name not matched by a rule below is the same on both sides.

=================================================================  ======================================  =========
official name                                                      module name                             shard dim
=================================================================  ======================================  =========
``…layers.{i}.block_sparse_moe.experts.{j}.w1.weight`` ``[F, L]``  ``…experts.w1`` ``[E, F, L]``, row j    0
``…layers.{i}.block_sparse_moe.experts.{j}.w3.weight`` ``[F, L]``  ``…experts.w3`` ``[E, F, L]``, row j    0
``…layers.{i}.block_sparse_moe.experts.{j}.w2.weight`` ``[L, F]``  ``…experts.w2`` ``[E, L, F]``, row j    0
``…experts.{j}.w1.weight_packed`` uint8 ``[F, L/2]``                ``…experts.w1_packed`` ``[E, F, L/2]``     0
``…experts.{j}.w1.weight_scale`` uint8 ``[F, L/32]``                ``…experts.w1_scale`` ``[E, F, L/32]``     0
``…layers.{i}.self_attn.A_log`` ``[128]``, ``[H]`` or ``[1,1,H,1]``  ``…self_attn.A_log`` ``[max(H,128)]``   —
=================================================================  ======================================  =========

``A_log`` is read in any of those layouts (the first H values are used; the rest are zero) and written
as the K3 layout ``[max(H, 128)]``. ``vision_tower.*`` and ``mm_projector.*`` (K3's MoonViT-V2,
:mod:`openk3.model.vision`) keep their official names on both sides; a model built without a vision tower
skips them (:data:`VISION_PREFIXES`). MXFP4-packed experts (``weight_packed``/``weight_scale``, the
compressed-tensors layout, the same rows for ``w3`` and ``w2``) stack like the dense ones
(:mod:`openk3.quant.experts`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class NameRule:
    official: str
    """Regex over official names; group ``j`` (if any) is the index along ``shard_dim``."""
    module: str
    """Replacement giving the module state-dict name (``re.sub`` syntax)."""
    shard_dim: int | None
    """Dim of the module tensor that stacks the official tensors, or ``None`` for a 1:1 name."""


NAME_TABLE: tuple[NameRule, ...] = (
    NameRule(r"^(.*\.block_sparse_moe\.experts)\.(?P<j>\d+)\.(w1|w2|w3)\.weight$", r"\1.\3", 0),
    NameRule(
        r"^(.*\.block_sparse_moe\.experts)\.(?P<j>\d+)\.(w1|w2|w3)\.weight_(packed|scale)$", r"\1.\3_\4", 0
    ),
)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
"""Official prefixes of the vision tower and projector: loaded into a model that has them, skipped (with a
warning) by a text-only model."""
QUANTIZED_SUFFIXES = (".weight_packed", ".weight_scale")
"""Official names of MXFP4 tensors (compressed-tensors ``mxfp4-pack-quantized``)."""
QUANTIZED_MODULE_SUFFIXES = ("_packed", "_scale")
"""Module names of stacked MXFP4 expert tensors (``experts.w1_packed`` …)."""


@dataclass(frozen=True)
class ModuleSlot:
    """Where one official tensor goes: module tensor ``name``, and row ``index`` along ``shard_dim``."""

    name: str
    index: int | None = None
    shard_dim: int | None = None


def to_module(official: str) -> ModuleSlot:
    """Module slot of an official tensor name (identity when no rule matches)."""
    for rule in NAME_TABLE:
        m = re.match(rule.official, official)
        if m:
            return ModuleSlot(m.expand(rule.module), int(m.group("j")), rule.shard_dim)
    return ModuleSlot(official)


def expert_name(stacked: str, j: int) -> str:
    """Official name of expert ``j`` of a stacked module tensor ``…experts.w1`` or ``…experts.w1_packed``
    (inverse of the table)."""
    head, w = stacked.rsplit(".", 1)
    w, _, part = w.partition("_")
    return f"{head}.{j}.{w}.weight" + (f"_{part}" if part else "")


def is_stacked(module_name: str) -> bool:
    return re.search(r"\.block_sparse_moe\.experts\.(w1|w2|w3)(_packed|_scale)?$", module_name) is not None
