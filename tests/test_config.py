"""Config schema, presets and validation (facts: ``docs/references.md#configuration``,
``docs/references.md#parameter-counts``)."""

from __future__ import annotations

import json

import pytest

from openk3.accounting import count_parameters
from openk3.config import KimiK3Config, KimiLinearConfig, config_from_dict, load_config, save_config
from openk3.presets import PRESETS, get_preset, k3_shaped


def test_kimi_k3_official_values():
    cfg = get_preset("kimi-k3")
    assert isinstance(cfg, KimiK3Config) and cfg.model_type == "kimi_k3"
    t = cfg.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads) == (7168, 93, 96)
    assert (t.q_lora_rank, t.kv_lora_rank, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert (t.num_experts, t.num_experts_per_token, t.num_shared_experts) == (896, 16, 2)
    assert (t.moe_intermediate_size, t.routed_expert_hidden_size, t.intermediate_size) == (3072, 3584, 33792)
    assert (t.vocab_size, t.tie_word_embeddings, t.attn_res_block_size) == (163840, False, 12)
    assert (t.activation_situ_beta, t.activation_situ_linear_beta, t.hidden_act) == (4.0, 25.0, "situ")
    la = t.linear_attn_config
    assert (la.num_heads, la.head_dim, la.gate_lower_bound, la.use_full_rank_gate) == (96, 128, -5.0, True)
    assert la.full_attn_layers == [*range(4, 93, 4), 93]
    assert len(la.kda_layers) == 69 and set(la.kda_layers) | set(la.full_attn_layers) == set(range(1, 94))
    mla0 = [i for i, kind in enumerate(t.layer_types) if kind == "mla"]
    assert mla0 == [*range(3, 92, 4), 92]  # 0-based: a double global tail
    assert not t.is_moe_layer(0) and all(t.is_moe_layer(i) for i in range(1, 93))
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (163584, 163586, 163839)


def test_kimi_linear_48b_is_the_same_class():
    t = get_preset("kimi-linear-48b")
    assert isinstance(t, KimiLinearConfig) and t.model_type == "kimi_linear"
    assert t.linear_attn_config.gate_lower_bound is None and not t.linear_attn_config.use_full_rank_gate
    assert not t.uses_attn_res and not t.is_latent_moe and t.hidden_act == "silu"
    assert t.routed_scaling_factor == 2.446 and t.q_lora_rank is None
    assert t.linear_attn_config.full_attn_layers == [4, 8, 12, 16, 20, 24, 27]


@pytest.mark.parametrize(
    "name,lo,hi", [("k3-tiny", 5e6, 30e6), ("k3-small", 100e6, 300e6), ("k3-1b", 0.7e9, 1.5e9)]
)
def test_small_presets_are_k3_shaped(name, lo, hi):
    t = get_preset(name).text_config
    kinds = t.layer_types
    assert kinds[-1] == "mla" and kinds.count("kda") == 3 * kinds.count("mla")
    assert all(kinds[i] == "mla" for i in range(3, len(kinds), 4))
    assert t.uses_attn_res and t.is_latent_moe and t.latent_moe_use_norm and t.num_shared_experts == 2
    assert t.hidden_act == "situ" and (t.activation_situ_beta, t.activation_situ_linear_beta) == (4.0, 25.0)
    assert t.linear_attn_config.gate_lower_bound == -5.0 and t.mla_use_output_gate
    assert lo <= count_parameters(get_preset(name))["total"] <= hi


def test_size_dial_rejects_bad_depth():
    with pytest.raises(ValueError, match="depth"):
        k3_shaped(6)
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("k3-huge")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_json_round_trip_keeps_unknown_keys(tmp_path, name):
    data = get_preset(name).to_dict()
    data["my_extra_top"] = {"a": 1}
    text = data.get("text_config", data)
    text["my_extra_text"] = [1, 2]
    if text["linear_attn_config"] is not None:
        text["linear_attn_config"]["my_extra_la"] = "x"
    cfg = config_from_dict(json.loads(json.dumps(data)))
    save_config(cfg, tmp_path)
    again = load_config(tmp_path)
    assert again.to_dict() == cfg.to_dict() == data


def test_reads_transformers_style_config():
    data = get_preset("kimi-linear-48b").to_dict()
    data.pop("max_position_embeddings")
    data["model_max_length"] = 4096
    data["head_dim"] = 64  # transformers writes qk_rope_head_dim here; it must not be read as a head size
    cfg = config_from_dict(data)
    assert cfg.max_position_embeddings == 4096
    assert cfg.to_dict()["model_max_length"] == 4096


@pytest.mark.parametrize(
    "change,field",
    [
        ({"hidden_size": "7168"}, "hidden_size"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_experts_per_token": 1000}, "num_experts_per_token"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"num_expert_group": 8}, "num_expert_group"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"model_type": "llama"}, "model_type"),
        ({"eos_token_id": 10**9}, "eos_token_id"),
        ({"mla_use_nope": False}, "mla_use_nope"),
    ],
)
def test_validation_names_the_field(change, field):
    data = get_preset("k3-tiny").text_config.to_dict()
    data.update(change)
    with pytest.raises(ValueError, match=field):
        KimiLinearConfig.from_dict(data)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"gate_lower_bound": 1.0}, "gate_lower_bound"),
        ({"num_heads": -1}, "num_heads"),
        ({"kda_layers": [1, 2, 3, 4]}, "kda_layers"),  # layer 4 also in full_attn_layers
        ({"kda_layers": [1, 2]}, "full_attn_layers"),  # layer 3 in neither list
        ({"kda_layers": "1,2,3"}, "kda_layers"),
    ],
)
def test_linear_attn_validation_names_the_field(change, field):
    data = get_preset("k3-tiny").text_config.to_dict()
    data["num_hidden_layers"] = 4
    data["linear_attn_config"].update({"kda_layers": [1, 2, 3], "full_attn_layers": [4]})
    data["linear_attn_config"].update(change)
    with pytest.raises(ValueError, match=field):
        KimiLinearConfig.from_dict(data)


def test_load_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="model_type"):
        load_config(tmp_path)


def _k3_tiny_text() -> dict:
    return get_preset("k3-tiny").text_config.to_dict()


def test_config_without_model_type_is_refused(tmp_path):
    data = _k3_tiny_text()
    del data["model_type"]  # before: read as Kimi-Linear with defaults for anything else missing
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        load_config(tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "config.json") in msg and "no model_type" in msg
    assert "'kimi_k3', 'kimi_linear'" in msg
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(
        ValueError, match=r"model_type='llama' is not supported; known model types: 'kimi_k3'"
    ):
        load_config(tmp_path)


@pytest.mark.parametrize("dropped", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"])
def test_config_missing_an_essential_field_is_refused(tmp_path, dropped):
    data = _k3_tiny_text()
    del data[dropped]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"config.json: the kimi_linear config is missing {dropped}\b"):
        load_config(tmp_path)
    k3 = get_preset("k3-tiny").to_dict()
    del k3["text_config"][dropped]
    with pytest.raises(ValueError, match=f"missing {dropped}"):
        config_from_dict(k3)


@pytest.mark.parametrize(
    "field,value",
    [
        ("mla_use_output_gate", "false"),
        ("use_cache", "true"),
        ("moe_renormalize", 1),
        ("latent_moe_use_norm", 0),
        ("tie_word_embeddings", "false"),
        ("use_grouped_topk", None),
        ("linear_attn_config.use_full_rank_gate", "false"),
    ],
)
def test_bool_fields_take_json_booleans_only(field, value):
    data = _k3_tiny_text()
    target = data["linear_attn_config"] if field.startswith("linear_attn_config.") else data
    name = field.rsplit(".", 1)[-1]
    target[name] = value
    with pytest.raises(ValueError, match=rf"\.{name}={value!r} is invalid: expected true or false"):
        KimiLinearConfig.from_dict(data)


def test_engine_defaults_by_device():
    """``openk3 serve``'s sizes: on CUDA large blocks and chunks (a prefill step's host cost is fixed, so a
    32K prompt in 8192-token chunks took 0.37 s on an H200 where 16384-token chunks took 0.19 s), a KDA
    checkpoint every chunk (the scheduler ends a chunk at a checkpoint), a budget of two chunks; given values
    are kept and the derived ones follow them."""
    from openk3.serve.config import engine_defaults

    cuda = engine_defaults("cuda:1", {}, 64)
    assert cuda == {
        "block_size": 512,
        "pool_mib": 8192.0,
        "long_prefill_token_threshold": 16384,
        "checkpoint_interval": 32,
        "max_num_batched_tokens": 32768,
    }
    cpu = engine_defaults("cpu", {"block_size": None, "pool_mib": None}, 64)
    assert (cpu["block_size"], cpu["long_prefill_token_threshold"], cpu["checkpoint_interval"]) == (
        16,
        256,
        16,
    )
    assert cpu["max_num_batched_tokens"] == 512  # the engine's own default (SchedulerConfig)
    given = engine_defaults("cuda", {"block_size": 64, "long_prefill_token_threshold": 1024}, 2000)
    assert (given["checkpoint_interval"], given["max_num_batched_tokens"]) == (16, 3024)
    assert engine_defaults("cuda", {"checkpoint_interval": 0}, 64)["checkpoint_interval"] == 0


def test_openk3_serve_sizes_follow_the_device():
    """``openk3 serve --device cuda`` gets the GPU's sizes, ``--device cpu`` the CPU's, a given flag wins."""
    import argparse

    from openk3.serve.cli import add_serve_parser, serve_sizes

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    cuda = serve_sizes(p.parse_args(["serve", "--ckpt", "run", "--device", "cuda"]))
    assert (cuda["block_size"], cuda["long_prefill_token_threshold"], cuda["checkpoint_interval"]) == (
        512,
        16384,
        32,
    )
    cpu = serve_sizes(p.parse_args(["serve", "--ckpt", "run", "--max-num-batched-tokens", "700"]))
    assert (cpu["block_size"], cpu["pool_mib"], cpu["max_num_batched_tokens"]) == (16, 256.0, 700)


def test_serve_help_gives_the_device_defaults_the_engine_takes():
    """The help of ``openk3 serve`` is formatted from the same sizes :func:`engine_defaults` fills in: the
    numbers it prints are those a run gets with the default ``--max-num-seqs``."""
    import argparse

    from openk3.serve.cli import add_serve_parser
    from openk3.serve.config import default_by_device, engine_defaults

    assert default_by_device("checkpoint_interval") == "16 on CPU, 32 on CUDA"
    assert default_by_device("max_num_batched_tokens") == "512 on CPU, 32768 on CUDA"
    assert default_by_device("max_num_batched_tokens", 1000) == "1256 on CPU, 32768 on CUDA"
    for name in ("block_size", "pool_mib", "long_prefill_token_threshold"):
        cpu, cuda = engine_defaults("cpu", {}, 64)[name], engine_defaults("cuda", {}, 64)[name]
        assert default_by_device(name) == f"{cpu:g} on CPU, {cuda:g} on CUDA"
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    text = " ".join(add_serve_parser(sub).format_help().split())
    assert "checkpoints would cut the chunks: 16 on CPU, 32 on CUDA" in text
    assert "seqs: 512 on CPU, 32768 on CUDA" in text.replace("num- seqs", "num-seqs")
