"""Quantised routed experts: the MX formats (:mod:`~openk3.quant.mxfp4`), the checkpoint's
``quantization_config`` (:mod:`~openk3.quant.scheme`), packed experts and packing (:mod:`~openk3.quant.experts`)
and quantization-aware training (:mod:`~openk3.quant.qat`). See ``docs/quantization.md``."""
