"""MLA ops for serving: absorbed latent attention that reads the paged block pool in place
(:mod:`openk3.ops.mla.paged`)."""

from openk3.ops.mla.paged import latent_pool_splits, paged_latent_attention

__all__ = ["latent_pool_splits", "paged_latent_attention"]
