"""Model folders that load in Hugging Face ``transformers`` with ``trust_remote_code=True``.

The official K3 release is loaded by ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``
from Python files shipped in the model folder and named by ``config.json``'s ``auto_map``. transformers has
no ``kimi_k3`` model type of its own, so :func:`write_remote_code` gives every folder that
:func:`openk3.save_pretrained` writes the same two files:

* ``configuration_kimi_k3.py``: a ``PretrainedConfig`` holding ``config.json`` as is;
* ``modeling_kimi_k3.py``: the openk3 model as one self-contained file (no ``import openk3``): the source of
  :data:`MODEL_SOURCES` (the config classes, the KDA reference recurrence, the model modules) with their
  ``openk3`` imports removed and the chunked/recurrent KDA ops bound to the per-token recurrence (the same
  function up to fp32 rounding; openk3's Triton training op is never taken), followed by ``KimiK3ForCausalLM``, a ``PreTrainedModel`` whose module tree
  gives the official tensor names (routed experts one module per expert, ``experts.{j}.w1``, stacked at run
  time for the grouped forward).

The file is written from the installed openk3 sources at each save, so it is the same model code as the
openk3 version that wrote the weights. ``KimiK3ForCausalLM.forward(input_ids, labels=None)`` returns
``CausalLMOutputWithPast`` with ``logits`` ``[B, T, V]`` (and the mean next-token loss with ``labels``); it
keeps no cache (``generate`` recomputes the prefix each step).
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

MODEL_SOURCES = (
    "config.py",
    "ops/kda/gate.py",
    "ops/kda/l2norm.py",
    "ops/kda/inputs.py",
    "ops/kda/naive.py",
    "ops/decay_only.py",
    "model/activations.py",
    "model/norm.py",
    "model/varlen.py",
    "model/short_conv.py",
    "model/cache.py",
    "model/packing.py",
    "model/kda.py",
    "model/mla.py",
    "model/mlp.py",
    "model/router.py",
    "model/moe.py",
    "model/attn_res.py",
    "model/decoder.py",
    "model/vision.py",
    "model/modeling.py",
)
"""openk3 source files (under ``src/openk3``) stitched into ``modeling_kimi_k3.py``, dependencies first."""

CONFIG_FILE, MODELING_FILE = "configuration_kimi_k3.py", "modeling_kimi_k3.py"
REMOTE_FILES = (CONFIG_FILE, MODELING_FILE)
AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3RemoteConfig",
    "AutoModel": "modeling_kimi_k3.KimiK3ForCausalLM",
    "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForCausalLM",
}
"""``config.json``'s ``auto_map``: the classes ``trust_remote_code`` loads from the folder."""

_CONFIG_CODE = '''"""Configuration of an openk3 model folder (written by openk3's save_pretrained): config.json as is."""

from transformers import PretrainedConfig


class KimiK3RemoteConfig(PretrainedConfig):
    model_type = {model_type!r}

    def __init__(self, tie_word_embeddings=False, text_config=None, **kwargs):
        if isinstance(text_config, dict):  # K3: the language model's config, as transformers expects it
            text_config = PretrainedConfig(**{{"tie_word_embeddings": False, **text_config}})
        if text_config is not None:
            kwargs["text_config"] = text_config
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
'''

_HEADER = '''"""Kimi K3 / Kimi-Linear for transformers (trust_remote_code), written by openk3's save_pretrained.

The openk3 model code in one file: config classes, the KDA per-token recurrence, KDA, gated NoPE MLA, Block
Attention Residuals, Stable LatentMoE, then KimiK3ForCausalLM (a PreTrainedModel) at the end.
"""

from __future__ import annotations

'''

_FOOTER = """

# ---- transformers wrapper ------------------------------------------------------------------------------
from transformers import GenerationMixin, PreTrainedModel  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

try:
    from .configuration_kimi_k3 import KimiK3RemoteConfig
except ImportError:  # loaded as a plain module, outside a package
    from configuration_kimi_k3 import KimiK3RemoteConfig

chunk_kda = fused_recurrent_kda = naive_recurrent_kda  # the exact per-token recurrence


def use_train_op(*args, **kwargs) -> bool:  # the Triton training op is openk3's own: never here
    return False


chunk_kda_train = None
_StackedExperts = RoutedExperts


class _Expert(nn.Module):
    def __init__(self, F_: int, L: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(L, F_, bias=False)
        self.w3 = nn.Linear(L, F_, bias=False)
        self.w2 = nn.Linear(F_, L, bias=False)


class RoutedExperts(nn.ModuleList):  # noqa: F811  (per-expert tensors, as the official checkpoints name them)
    def __init__(self, config, input_size: int) -> None:
        super().__init__(_Expert(config.moe_intermediate_size, input_size) for _ in range(config.num_experts))
        self.config = config
        self.qat = False  # the served forward: no fake quantisation (openk3 train --qat only)

    @property
    def w1(self):
        return torch.stack([e.w1.weight for e in self])

    @property
    def w3(self):
        return torch.stack([e.w3.weight for e in self])

    @property
    def w2(self):
        return torch.stack([e.w2.weight for e in self])

    forward = _StackedExperts.forward


class KimiK3ForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = KimiK3RemoteConfig
    base_model_prefix = ""
    _no_split_modules = ["KimiDecoderLayer"]

    def __init__(self, config) -> None:
        super().__init__(config)
        keys = {{"auto_map", "architectures", "transformers_version", "torch_dtype", "dtype"}}
        data = {{k: v for k, v in config.to_dict().items() if k not in keys}}
        if isinstance(data.get("text_config"), dict):  # a PretrainedConfig there writes model_type ""
            data["text_config"] = {{**data["text_config"], "model_type": "kimi_linear"}}
        own = config_from_dict(data)
        if isinstance(own, KimiK3Config):
            self.language_model = KimiLinearForCausalLM(own.text_config)
        else:
            self.model = KimiLinearModel(own)
            self.lm_head = nn.Linear(own.hidden_size, own.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module) -> None:
        pass  # every tensor comes from the checkpoint

    def _lm(self):
        return self.language_model if hasattr(self, "language_model") else self

    def get_input_embeddings(self):
        return self._lm().model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs) -> CausalLMOutputWithPast:
        lm = self._lm()
        logits = lm.lm_head(lm.model(input_ids))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {{"input_ids": input_ids}}
"""


def _strip_openk3_imports(source: str) -> str:
    """``source`` without ``from __future__`` and ``openk3`` imports (top-level statements, any line span)."""
    tree = ast.parse(source)
    drop: set[int] = set()
    for node in tree.body:
        module = node.module if isinstance(node, ast.ImportFrom) else None
        names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
        if (
            module == "__future__"
            or (module or "").startswith("openk3")
            or any(n.startswith("openk3") for n in names if isinstance(node, ast.Import))
        ):
            drop.update(range(node.lineno, node.end_lineno + 1))
    lines = source.splitlines()
    return "\n".join(line for i, line in enumerate(lines, start=1) if i not in drop) + "\n"


def modeling_source() -> str:
    """The text of ``modeling_kimi_k3.py`` (see the module docstring)."""
    root = Path(__file__).resolve().parents[1]
    parts = [_HEADER]
    for name in MODEL_SOURCES:
        parts.append(f"\n# ---- openk3/{name} " + "-" * (90 - len(name)) + "\n")
        parts.append(_strip_openk3_imports((root / name).read_text(encoding="utf-8")))
    parts.append(_FOOTER.format())
    return "".join(parts)


def write_remote_code(folder: str | os.PathLike) -> None:
    """Write :data:`REMOTE_FILES` into model folder ``folder`` and add :data:`AUTO_MAP` to its
    ``config.json`` (openk3's :func:`openk3.config.config_from_dict` ignores that key)."""
    folder = Path(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    (folder / CONFIG_FILE).write_text(_CONFIG_CODE.format(model_type=config["model_type"]), encoding="utf-8")
    (folder / MODELING_FILE).write_text(modeling_source(), encoding="utf-8")
    config["auto_map"] = AUTO_MAP
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
