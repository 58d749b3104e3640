"""openk3 model folders load in Hugging Face transformers with trust_remote_code and give openk3's logits.

The folder's modeling_kimi_k3.py must not import openk3: the transformers model is loaded with every
openk3 module blocked from import, then compared with the openk3 model in fp32 on the CPU."""

from __future__ import annotations

import ast
import json
import sys

import pytest
import torch

import openk3
from openk3.config import text_config_of

transformers = pytest.importorskip("transformers")


def _load_without_openk3(folder, monkeypatch):
    for name in [m for m in sys.modules if m == "openk3" or m.startswith("openk3.")]:
        monkeypatch.setitem(sys.modules, name, None)  # an `import openk3...` in the folder's code fails
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, trust_remote_code=True, dtype=torch.float32
        ).eval()
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("kind", ["kimi_k3", "kimi_linear"])
def test_trust_remote_code_gives_openk3_logits(kind, tmp_path, monkeypatch):
    config = openk3.presets.k3_shaped(4, vocab_size=256)  # K3 wrapper; its text config is Kimi-Linear
    if kind == "kimi_linear":
        config = text_config_of(config)
    model = openk3.build_model(config, seed=0).eval()
    folder = tmp_path / kind
    openk3.save_pretrained(model, folder)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == kind
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_k3.KimiK3ForCausalLM"
    code = (folder / "modeling_kimi_k3.py").read_text()
    imported = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(ast.parse(code))
        if isinstance(n, ast.Import) or (isinstance(n, ast.ImportFrom) and n.level == 0)
        for a in n.names
    }
    assert "openk3" not in imported and imported <= {"torch", "transformers", "dataclasses", "json", "math",
                                                      "os", "typing", "__future__", "configuration_kimi_k3"}  # fmt: skip
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    hf = _load_without_openk3(str(folder), monkeypatch)
    with torch.no_grad():
        got = hf(ids).logits
    assert got.dtype == torch.float32 and got.shape == want.shape == (2, 40, 256)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)  # chunked vs per-token KDA: fp32 rounding
    names = {k for k, _ in hf.named_parameters()} | {k for k, _ in hf.named_buffers()}
    prefix = "language_model." if kind == "kimi_k3" else ""
    assert f"{prefix}model.layers.1.block_sparse_moe.experts.0.w1.weight" in names  # official names
    # the folder still loads in openk3 (auto_map is not a model field) and resumes compare equal configs
    assert openk3.load_config(folder).to_dict() == config.to_dict()
