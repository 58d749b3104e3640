"""Parameter and cache accounting against the published numbers (``docs/references.md#parameter-counts``)."""

from __future__ import annotations

import json

import pytest

from openk3.accounting import accounting_report, closed_form_counts, count_parameters
from openk3.cli import main
from openk3.config import text_config_of
from openk3.presets import PRESETS, get_preset

MIB = 2**20


def test_kimi_k3_counts_are_exact():
    counts = count_parameters(get_preset("kimi-k3"))
    assert counts["total"] == 2_779_484_478_208
    assert counts["active"] == 104_189_614_848
    assert counts["kda_layer"] == 443_740_416
    assert counts["mla_layer"] == 232_196_096
    assert counts["moe_layer"] == 29_784_936_832
    assert counts["routed_expert"] == 33_030_144
    assert counts["dense_ffn"] == 726_663_168


def test_kimi_k3_cache_sizes():
    r = accounting_report(get_preset("kimi-k3"))
    assert r["kda_state_bytes_bf16"] / MIB == pytest.approx(221.55, abs=0.005)
    assert r["kda_state_bytes_bf16"] == 69 * (96 * 128 * 128 + 3 * 3 * 12288) * 2
    assert r["mla_bytes_per_token_bf16"] == 27_648
    assert r["mla_numbers_per_token_per_layer"] == 576
    assert r["crossover_tokens_vs_all_mla"] == 2_923


def test_kimi_linear_48b_counts():
    counts = count_parameters(get_preset("kimi-linear-48b"))
    assert round(counts["total"] / 1e9, 1) == 49.1 and round(counts["active"] / 1e9, 1) == 3.1


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_module_tree_agrees_with_closed_form(name):
    cfg = get_preset(name)
    tree, formula = count_parameters(cfg), closed_form_counts(text_config_of(cfg))
    for key in ("total", "active", "kda_layer", "mla_layer", "moe_layer", "routed_expert", "embed_tokens"):
        assert tree[key] == formula[key], key


def test_info_cli_json(capsys):
    assert main(["info", "--preset", "kimi-k3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total_params"] == 2_779_484_478_208
    assert report["active_params"] == 104_189_614_848
    assert report["kda_state_bytes_bf16"] == 232_316_928
    assert report["mla_bytes_per_token_bf16"] == 27_648


def test_info_cli_text_and_config_path(capsys, tmp_path):
    from openk3.config import save_config

    save_config(get_preset("k3-tiny"), tmp_path)
    assert main(["info", "--config", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "crossover" in out
    assert main(["info", "--config", str(tmp_path / "nope")]) == 2
