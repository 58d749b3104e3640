"""The speculative draft (EAGLE-3 / MTP head), its losses and its training-time-test unroll."""

from __future__ import annotations

import re

import pytest
import torch

import openk3
from openk3.config import KimiLinearConfig
from openk3.model.attn_res import attn_res_mix
from openk3.model.draft import (
    DraftConfig,
    build_draft,
    feature_layers,
    load_draft,
    save_draft,
)
from openk3.presets import k3_shaped
from openk3.train.draft_loss import acceptance_rate, kl_loss, lk_loss
from openk3.train.draft_trainer import (
    draft_loss,
    expected_accepted_length,
    train_draft,
    ttt_unroll,
)

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64


def _target(depth=4, dtype=torch.float32, seed=0, **kw):
    return openk3.build_model(k3_shaped(depth, vocab_size=VOCAB, **kw), dtype=dtype, seed=seed).eval()


def _draft(model, dtype=torch.float32, seed=1, **kw):
    lm = model.language_model
    cfg = lm.config
    dc = DraftConfig(
        feature_layers(cfg.num_hidden_layers), cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, **kw
    )
    return build_draft(cfg, dc, dtype=dtype, seed=seed), lm


# ---- losses -------------------------------------------------------------------------------------------
def test_acceptance_rate_is_one_minus_total_variation():
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = (
        torch.randn(5, 11, generator=g, dtype=torch.float64),
        torch.randn(5, 11, generator=g, dtype=torch.float64),
    )
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)  # an independent formula: α = 1 − TV
    torch.testing.assert_close(acceptance_rate(p_logits, q_logits), 1 - tv, rtol=0, atol=1e-15)
    torch.testing.assert_close(acceptance_rate(p_logits, p_logits + 3.0), torch.ones(5, dtype=torch.float64))
    assert float(lk_loss(p_logits, p_logits)) == pytest.approx(0.0, abs=1e-15)


def test_kl_loss_matches_torch_kl_div():
    g = torch.Generator().manual_seed(1)
    p_logits, q_logits = (
        torch.randn(7, 13, generator=g, dtype=torch.float64),
        torch.randn(7, 13, generator=g, dtype=torch.float64),
    )
    want = torch.nn.functional.kl_div(
        q_logits.log_softmax(-1), p_logits.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    torch.testing.assert_close(kl_loss(p_logits, q_logits), want, rtol=1e-13, atol=0)


def test_lk_loss_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(2)
    p_logits = torch.randn(3, 9, generator=g, dtype=torch.float64)
    q_logits = torch.randn(3, 9, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([True, False, True])
    lk_loss(p_logits, q_logits, mask).backward()
    eps = 1e-6
    fd = torch.zeros_like(q_logits)
    with torch.no_grad():
        for i in range(3):
            for j in range(9):
                hi, lo = q_logits.clone(), q_logits.clone()
                hi[i, j] += eps
                lo[i, j] -= eps
                fd[i, j] = (lk_loss(p_logits, hi, mask) - lk_loss(p_logits, lo, mask)) / (2 * eps)
    torch.testing.assert_close(q_logits.grad, fd, rtol=1e-6, atol=1e-9)
    assert q_logits.grad[1].abs().max() == 0  # a masked position gets no gradient
    # one gradient step on the LK loss raises the acceptance rate
    with torch.no_grad():
        before = acceptance_rate(p_logits, q_logits)[mask].mean()
        after = acceptance_rate(p_logits, q_logits - 0.1 * q_logits.grad)[mask].mean()
    assert after > before


def test_expected_accepted_length_closed_form():
    a = 0.7
    for k in range(1, 6):
        assert expected_accepted_length([a], k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))


# ---- the head -----------------------------------------------------------------------------------------
def test_feature_layers_are_eagle3_taps():
    assert feature_layers(93) == (1, 45, 89)  # [1, L//2 − 1, L − 4]
    assert feature_layers(32) == (1, 15, 28)
    assert feature_layers(4) == (1, 1, 0)
    with pytest.raises(ValueError, match="at least 2 layers"):
        feature_layers(1)


def test_draft_names_are_an_mtp_layer():
    model = _target()
    draft, _ = _draft(model)
    names = set(draft.state_dict())
    L = 4
    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "fc.weight", "shared_head.norm.weight",
              "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate_proj.weight", "input_layernorm.weight"):  # fmt: skip
        assert f"model.layers.{L}.{n}" in names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)  # shared with the target


def _kimi_linear():
    """A 6-layer Kimi-Linear model (plain residual adds, no AttnRes), fp32."""
    cfg = KimiLinearConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=6, num_attention_heads=2,
                           intermediate_size=96, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip
    return openk3.build_model(cfg, seed=0).eval()


def _layer_inputs(lm, ids):
    """A forward run layer by layer here: ``(what each layer's input_layernorm reads, by layer index; the
    final hidden states)``. Kimi-Linear: the residual stream before the layer. K3 (Block AttnRes): the mix of the
    closed blocks and the partial sum by the layer's ``self_attention_res`` pair (the partial sum itself
    before the first block closes), one mix at a time."""
    m = lm.model
    h = m.embed_tokens(ids)
    inputs = {}
    if not m.config.uses_attn_res:
        for j, layer in enumerate(m.layers):
            inputs[j] = h
            h = layer.forward_residual(h)
        return inputs, m.norm(h)
    blocks, partial = [], h
    for j, layer in enumerate(m.layers):
        res_norm, res_proj = layer.self_attention_res_norm, layer.self_attention_res_proj
        inputs[j] = attn_res_mix(blocks, partial, res_norm, res_proj) if blocks else partial
        closed = partial if layer.opens_block else None
        partial = layer.forward_attn_res(blocks, partial)
        if closed is not None:
            blocks.append(closed)
    return inputs, m.norm(attn_res_mix(blocks, partial, m.output_attn_res_norm, m.output_attn_res_proj))


@pytest.mark.parametrize("wiring, two_phase", [("residual", False), ("attn-res", False), ("attn-res", True)])
def test_forward_with_features_taps_the_next_layers_inputs(wiring, two_phase):
    """The draft's features (``forward_with_features``) are the next layers' ``input_layernorm`` inputs of a
    forward run by hand (:func:`_layer_inputs`: the residual stream in Kimi-Linear, the AttnRes mix in K3),
    in the given order, a repeated layer included; its hidden states are :meth:`forward`'s. The two-phase
    AttnRes mix scores a block set's pseudo-queries in one pass, so it equals the one-at-a-time mix up to
    rounding (fp64 here)."""
    lm = _target(8, dtype=torch.float64).language_model if wiring == "attn-res" else _kimi_linear()
    layers = (4, 1, 4, 0)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        inputs, h_by_hand = _layer_inputs(lm, ids)
        want_h = lm.model(ids, two_phase_attn_res=two_phase)
        h, f = lm.model.forward_with_features(ids, layers, two_phase_attn_res=two_phase)
        assert lm.model.forward_with_features(ids, ())[1] is None
    torch.testing.assert_close(h_by_hand, lm.model(ids), rtol=0, atol=0)  # the hand run is the forward
    tol = 1e-12 if two_phase else 0.0
    torch.testing.assert_close(f, torch.cat([inputs[i + 1] for i in layers], -1), rtol=tol, atol=tol)
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)
    with pytest.raises(ValueError, match="feature layers"):
        lm.model.forward_with_features(ids, (len(lm.model.layers) - 1,))


def test_ttt_unroll_equals_the_inference_chain():
    """Training-time test: unroll step s at row i computes what the inference chain computes after the draft
    read the target features of positions 0..i and then drafted s tokens on its own outputs."""
    model = _target(8, dtype=torch.float64)
    draft, lm = _draft(model, dtype=torch.float64)
    T, steps = 9, 3
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, taps = lm.model.forward_with_features(ids, draft.draft_config.feature_layers)
        unrolled = ttt_unroll(draft, lm, taps, ids, steps)
        embed = lm.model.embed_tokens
        for i in (0, 3, 5):
            cache = draft.new_cache()
            g, _ = draft(draft.fuse(taps[:, : i + 1]), ids[:, 1 : i + 2], embed, cache=cache)
            g = g[:, -1:]
            torch.testing.assert_close(
                draft.logits(g, lm.lm_head)[0, 0], unrolled[0][0, i], rtol=1e-10, atol=1e-10
            )
            for s in range(1, steps):
                g, _ = draft(g, ids[:, i + 1 + s : i + 2 + s], embed, cache=cache)
                torch.testing.assert_close(
                    draft.logits(g, lm.lm_head)[0, 0], unrolled[s][0, i], rtol=1e-10, atol=1e-10
                )


def test_save_load_roundtrip_and_refuses_another_target(tmp_path):
    model = _target()
    draft, _ = _draft(model)
    save_draft(draft, tmp_path / "d")
    loaded = load_draft(tmp_path / "d", model)
    for k, v in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    other_vocab = openk3.build_model(k3_shaped(4, vocab_size=VOCAB * 2), seed=0)
    with pytest.raises(ValueError, match="vocab_size=64.*vocab_size=128"):
        load_draft(tmp_path / "d", other_vocab)
    other_width = openk3.build_model(k3_shaped(8, vocab_size=VOCAB), seed=0)
    with pytest.raises(ValueError, match="hidden_size=128.*hidden_size=256"):
        load_draft(tmp_path / "d", other_width)
    with pytest.raises(FileNotFoundError, match="holds no draft"):
        load_draft(tmp_path, model)


def test_load_refuses_a_draft_for_another_architecture(tmp_path):
    """A dense baseline of the same vocabulary, width and depth is another target: its MLA has no output gate
    and its FFN another width, so the draft's weights would not fit; the saved config says so first."""
    from openk3.presets import dense_baseline

    draft, _ = _draft(_target())
    save_draft(draft, tmp_path / "d")
    dense = openk3.build_model(dense_baseline(k3_shaped(4, vocab_size=VOCAB)), seed=0)
    with pytest.raises(ValueError) as e:
        load_draft(tmp_path / "d", dense)
    assert str(e.value).startswith(
        f"the draft in {tmp_path / 'd'} was trained for a target with mla_use_output_gate=True, but this "
        "target has mla_use_output_gate=False; train a draft for it"
    )


def test_load_names_the_first_weight_that_does_not_fit(tmp_path):
    """The backstop behind the config check: a config that does not describe its weights (here one weight
    cut, one added) gives a ValueError naming the file and the tensor, not load_state_dict's RuntimeError."""
    from safetensors.torch import load_file, save_file

    model = _target()
    draft, _ = _draft(model)
    weights = save_draft(draft, tmp_path / "d") / "model.safetensors"
    state = load_file(weights)
    name = "model.layers.4.self_attn.kv_b_proj.weight"
    save_file({**state, name: state[name][:, :-1].contiguous()}, weights)
    with pytest.raises(ValueError) as e:
        load_draft(tmp_path / "d", model)
    shape = list(state[name].shape)
    assert str(e.value) == (
        f"{weights} does not fit this target: {name} has shape {[shape[0], shape[1] - 1]}, a draft for this "
        f"target needs {shape}"
    )
    save_file({**state, "model.layers.4.extra": torch.zeros(2)}, weights)
    with pytest.raises(ValueError, match=r"model\.layers\.4\.extra is no weight of a draft for this target"):
        load_draft(tmp_path / "d", model)
    del state[name]
    save_file(state, weights)
    with pytest.raises(ValueError, match=f"lacks the draft weight {re.escape(name)}"):
        load_draft(tmp_path / "d", model)


def test_load_names_a_truncated_or_corrupt_file(tmp_path):
    """A truncated model.safetensors (an interrupted copy) or a corrupt config.json: a ValueError naming the
    file, as a truncated model checkpoint gets (``CorruptCheckpointError``)."""
    model = _target()
    draft, _ = _draft(model)
    folder = save_draft(draft, tmp_path / "d")
    weights, config = folder / "model.safetensors", folder / "config.json"
    good = weights.read_bytes()
    for cut in (len(good) // 2, 5):  # the data, then the header's length itself
        weights.write_bytes(good[:cut])
        with pytest.raises(ValueError, match=f"^{re.escape(str(weights))} is not a valid safetensors file "
                           r"\(truncated or corrupt\?\): "):  # fmt: skip
            load_draft(folder, model)
    weights.write_bytes(good)
    text = config.read_text()
    config.write_text('{"vocab\x01')
    with pytest.raises(
        ValueError, match=f"^{re.escape(str(config))} is not valid JSON \\(truncated or corrupt"
    ):
        load_draft(folder, model)
    config.write_text(text.replace('"feature_layers"', '"layers"'))
    with pytest.raises(ValueError, match=f"^{re.escape(str(config))} is not a draft config"):
        load_draft(folder, model)


def test_draft_config_errors_name_the_field():
    with pytest.raises(ValueError, match="DraftConfig.loss"):
        DraftConfig((1,), 64, 64, 4, loss="ce")
    with pytest.raises(ValueError, match="DraftConfig.feature_layers"):
        DraftConfig((3,), 64, 64, 4)
    with pytest.raises(ValueError, match="DraftConfig.ttt_steps"):
        DraftConfig((1,), 64, 64, 4, ttt_steps=0)


@pytest.mark.parametrize("loss", ["lk", "kl"])
def test_training_raises_acceptance(loss):
    """A few steps on a fixed batch raise the draft's acceptance rate (the target is frozen)."""
    model = _target()
    draft, lm = _draft(model, loss=loss, ttt_steps=2)
    ids = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(4))
    target_before = {k: v.clone() for k, v in lm.state_dict().items()}
    with torch.no_grad():
        before = float(draft_loss(draft, lm, ids, "lk", 2))
    train_draft(draft, lm, iter([ids] * 30), 30, lr=3e-3)
    with torch.no_grad():
        after = float(draft_loss(draft, lm, ids, "lk", 2))
    assert after < before - 0.05, (before, after)
    for k, v in lm.state_dict().items():
        assert torch.equal(v, target_before[k]), k


def test_bf16_training_follows_fp32_with_the_current_weights_in_every_forward():
    """With ``amp_dtype=bf16`` each step's forward runs under autocast alone (without autocast's weight-cast
    cache), so its losses follow fp32 training step by step. The earlier pattern, the whole loop inside one
    autocast context, kept the casts of the first step's weights in every forward (a k3-small draft stayed
    untrained on an H200): it is refused, and an outer disabled autocast level (which also keeps the cache
    alive) changes nothing."""
    import copy

    model = _target()
    draft, lm = _draft(model)
    batches = [torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def losses(amp_dtype=None):
        return train_draft(copy.deepcopy(draft), lm, iter(batches), 6, lr=1e-2, amp_dtype=amp_dtype).losses

    fp32 = losses()
    descent = fp32[0] - fp32[-1]
    assert descent > 0.005, fp32
    bf16 = losses(torch.bfloat16)
    with torch.autocast("cpu", enabled=False):
        nested = losses(torch.bfloat16)
    for got in (bf16, nested):
        assert max(abs(a - b) for a, b in zip(got, fp32)) < 0.1 * descent, (got, fp32)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(ValueError, match="inside torch.autocast"),
    ):
        losses()


# ---- command line ---------------------------------------------------------------------------------------
def _run_folder(root, vocab_model: int = 320, dense: bool = False, seed: int = 0):
    """A run folder as `openk3 train` leaves it: a checkpoint with its tokenizer and the data splits; the
    target is ``k3_shaped(4)`` or, ``dense``, its dense baseline, initialised from ``seed``."""
    from openk3.checkpoint import save_pretrained
    from openk3.data import Tokenizer
    from openk3.data.text_split import write_text_split
    from openk3.presets import dense_baseline

    text = "".join(
        f"Line {i}: the quick brown fox jumps over the lazy dog, then sleeps.\n" for i in range(300)
    )
    (root / "corpus.txt").write_text(text)
    tokenizer = Tokenizer.train([text], 300)
    run = root / "run"
    ckpt = run / "checkpoints" / "step-000001"
    config = k3_shaped(4, vocab_size=vocab_model)
    save_pretrained(openk3.build_model(dense_baseline(config) if dense else config, seed=seed), ckpt)
    tokenizer.save(ckpt)
    (run / "checkpoints" / "latest").write_text("step-000001\n")
    (run / "data").mkdir(parents=True)
    for split in ("train", "val"):
        write_text_split(root / "corpus.txt", tokenizer, run / "data" / f"{split}.bin")
    return run


def test_train_draft_and_eval_draft_commands(tmp_path, capsys):
    from openk3.cli import main

    run = _run_folder(tmp_path)
    small = ["--steps", "2", "--batch-size", "2", "--seq-len", "24", "--ttt-steps", "2"]
    assert main(["train-draft", "--target", str(run), *small]) == 0
    assert "draft saved to" in capsys.readouterr().out
    assert (run / "draft-lk" / "model.safetensors").is_file()
    out_kl = tmp_path / "kl"
    assert main(["train-draft", "--target", str(run), "--loss", "kl", "--data", "generations", "--gen-windows", "2", "--out", str(out_kl), *small]) == 0  # fmt: skip
    assert '"loss": "kl"' in (out_kl / "config.json").read_text()
    assert main(["eval", "--ckpt", str(run), "--draft", str(run / "draft-lk"), "--seq-len", "24", "--max-batches", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    alphas = [float(a) for a in re.findall(r"\d: (0\.\d+|1\.000)", out.split("depth: ")[1].split("\n")[0])]
    assert len(alphas) == 5 and all(0 <= a <= 1 for a in alphas), out
    assert "k=5:" in out
    gen = [
        "generate",
        "--ckpt",
        str(run),
        "--prompt",
        "Line 7: the",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    ]
    assert main(gen) == 0
    plain = capsys.readouterr().out
    assert main([*gen, "--draft", str(run / "draft-lk"), "--speculative-tokens", "4"]) == 0
    assert capsys.readouterr().out == plain  # greedy: the same text
    assert main([*gen, "--draft", str(run / "draft-lk")]) == 0  # DEFAULT_SPECULATIVE_TOKENS
    assert capsys.readouterr().out == plain
    # a draft for another target: one line, exit code 2
    (tmp_path / "o").mkdir()
    other = _run_folder(tmp_path / "o", vocab_model=384)
    assert main(["eval", "--ckpt", str(other), "--draft", str(run / "draft-lk"), "--max-batches", "1"]) == 2
    assert "trained for a target with vocab_size=320" in capsys.readouterr().err


def test_eval_and_generate_refuse_a_draft_for_another_architecture(tmp_path, capsys):
    """`eval`/`generate --draft` on a dense target with a draft of a K3-shaped target of the same vocabulary,
    width and depth: one line naming the field, exit 2 (was a load_state_dict traceback, exit 1)."""
    from openk3.checkpoint import from_pretrained
    from openk3.cli import main
    from openk3.train.state import latest_checkpoint

    (tmp_path / "k3").mkdir()
    run = _run_folder(tmp_path / "k3")
    draft, _ = _draft(from_pretrained(latest_checkpoint(str(run))))
    save_draft(draft, tmp_path / "draft")
    (tmp_path / "dense").mkdir()
    dense = _run_folder(tmp_path / "dense", dense=True)
    want = (
        f"openk3: error: the draft in {tmp_path / 'draft'} was trained for a target with "
        "mla_use_output_gate=True, but this target has mla_use_output_gate=False; train a draft for it with "
        "`openk3 train-draft --target RUN`\n"
    )
    assert main(["eval", "--ckpt", str(dense), "--draft", str(tmp_path / "draft"), "--max-batches", "1"]) == 2
    assert capsys.readouterr().err == want
    gen = ["generate", "--ckpt", str(dense), "--prompt", "Line 7", "--max-new-tokens", "2", "--draft"]
    assert main([*gen, str(tmp_path / "draft")]) == 2
    assert capsys.readouterr().err == want


def test_resume_refuses_another_target(tmp_path, capsys, monkeypatch):
    """A draft stopped while training against one run, resumed with `--target` another run (same shapes, other
    weights): refused naming the target it was trained against; with that target it resumes."""
    from openk3.cli import main
    from openk3.train import draft_trainer

    real = draft_trainer.train_draft

    def stopped_after_one_step(*args, stop=None, **kwargs):  # Ctrl-C during the first step
        asked = []
        return real(*args, stop=lambda: asked.append(1) or len(asked) > 1, **kwargs)

    (tmp_path / "t1").mkdir()
    (tmp_path / "t2").mkdir()
    t1, t2 = _run_folder(tmp_path / "t1"), _run_folder(tmp_path / "t2", seed=1)
    out = tmp_path / "draft"
    small = ["--out", str(out), "--steps", "3", "--batch-size", "2", "--seq-len", "24", "--ttt-steps", "2"]
    monkeypatch.setattr(draft_trainer, "train_draft", stopped_after_one_step)
    assert main(["train-draft", "--target", str(t2), *small]) == 130
    assert "stopped at step 1/3" in capsys.readouterr().out
    monkeypatch.setattr(draft_trainer, "train_draft", real)
    assert main(["train-draft", "--target", str(t1), *small, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"openk3: error: --resume: {out} was trained against --target {t2} (checkpoint "
        f"{t2 / 'checkpoints' / 'step-000001'}), but --target {t1} loads {t1 / 'checkpoints' / 'step-000001'}, "
        f"whose weights differ: resume with --target {t2}, or train a new draft with another --out\n"
    )
    assert (out / "train_state.pt").is_file()  # nothing was touched
    assert main(["train-draft", "--target", str(t2), *small]) == 2  # the line to continue names t2
    assert f"continue it with `openk3 train-draft --target {t2} --out {out}" in capsys.readouterr().err
    assert main(["train-draft", "--target", str(t2), *small, "--resume"]) == 0
    assert f"resuming {out} at step 1/3" in capsys.readouterr().out


def test_interrupted_training_resumes_exactly():
    """Stopping after 2 of 5 steps and resuming with the saved optimizer state gives the weights of 5 steps
    run in one go (the schedule, the AdamW moments and the batch position all carry over)."""
    model = _target()
    ids = [torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(i)) for i in range(5)]
    whole, lm = _draft(model, ttt_steps=2)
    done = train_draft(whole, lm, iter(ids), 5, lr=3e-3)
    assert done.step == 5 and len(done.losses) == 5
    parts, _ = _draft(model, ttt_steps=2)
    calls = []
    first = train_draft(parts, lm, iter(ids), 5, lr=3e-3, stop=lambda: calls.append(1) or len(calls) > 2)
    assert first.step == 2
    rest = train_draft(
        parts, lm, iter(ids[2:]), 5, lr=3e-3, start_step=2, optimizer_state=first.optimizer_state
    )
    assert rest.step == 5 and first.losses + rest.losses == done.losses
    for (name, a), b in zip(whole.state_dict().items(), parts.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow  # a subprocess that imports torch and loads a model: ~15 s on 2 busy cores
def test_ctrl_c_saves_the_draft_and_prints_how_to_resume(tmp_path, capsys):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from openk3.cli import main

    run = _run_folder(tmp_path)
    out = tmp_path / "draft"
    small = ["--batch-size", "2", "--seq-len", "24", "--ttt-steps", "2", "--data", "generations", "--gen-windows", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(openk3.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "openk3.cli", "train-draft", "--target", str(run), "--out", str(out)]
    proc = subprocess.Popen(
        [*cmd, "--steps", "100000", *small],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in proc.stdout:  # the target's windows are sampled: the steps have begun
            lines.append(line)
            if line.startswith("sampled 2 target windows"):
                break
        proc.send_signal(signal.SIGINT)
        text = "".join(lines) + proc.stdout.read()
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert code == 130, text
    assert "Ctrl-C: finishing this step and saving the draft" in text and "Traceback" not in text
    step = int(re.search(r"stopped at step (\d+)/100000; draft saved to ", text).group(1))
    resume = re.search(r"continue with: (openk3 train-draft .* --resume)\n", text).group(1).split()[1:]
    assert (out / "model.safetensors").is_file() and (out / "train_state.pt").is_file()
    steps_at = resume.index("--steps") + 1
    resume[steps_at] = str(step + 2)  # the printed command, run to two more steps
    assert main(resume) == 0
    printed = capsys.readouterr().out
    assert f"resuming {out} at step {step}/{step + 2}" in printed and "sampled" not in printed  # windows kept
    assert not (out / "train_state.pt").exists()
    resume[steps_at] = str(step + 1)
    assert main(resume) == 2  # nothing left to resume
    assert "holds no interrupted train-draft" in capsys.readouterr().err


def test_ctrl_c_while_sampling_the_target_stops_at_once_and_writes_nothing(tmp_path):
    """``--data generations`` samples the target before the first step; Ctrl-C there stops within a second or
    so (not after the sampling), says that nothing was written, and leaves no folder, torn or temporary."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    run = _run_folder(tmp_path)
    out = tmp_path / "drafts" / "gen"
    env = {**os.environ, "PYTHONPATH": str(Path(openk3.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "openk3.cli", "train-draft", "--target", str(run), "--out", str(out),
           "--data", "generations", "--gen-windows", "100000", "--seq-len", "64", "--steps", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # printed just before the sampling (many minutes of it) begins
            if "draft taps layers" in line:
                break
        time.sleep(1.0)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        seconds = time.monotonic() - sent
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert code == 130, err
    # the sampling alone takes minutes; the exit (interpreter teardown included) took 2.5-4.1 s on the 2 cores
    # under a load of 9-22 from other jobs
    assert seconds < 10, f"stopped {seconds:.1f} s after Ctrl-C"
    assert err == (
        f"openk3: Ctrl-C: stopped while sampling the target; nothing was written ({out} was not created): run "
        "the same command again to start over\n"
    ), err
    assert not (tmp_path / "drafts").exists()  # neither the draft folder nor a temporary one


def test_an_interrupted_draft_save_leaves_no_torn_folder(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the draft's weights are written (after its config.json): ``--out`` does not appear, so a
    later run sees no half-written draft, and no temporary folder is left."""
    import safetensors.torch

    from openk3.cli import main

    run = _run_folder(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("interrupted")

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    small = ["--steps", "1", "--batch-size", "2", "--seq-len", "24", "--ttt-steps", "2"]
    assert main(["train-draft", "--target", str(run), "--out", str(tmp_path / "d"), *small]) == 130
    assert "openk3: interrupted" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "run"]


def test_train_draft_refuses_an_out_holding_a_checkpoint(tmp_path, capsys):
    """``--out RUN/final`` or a checkpoint folder: the draft's config.json would replace the model's."""
    from openk3.cli import main

    run = _run_folder(tmp_path)
    ckpt = run / "checkpoints" / "step-000001"
    before = (ckpt / "config.json").read_bytes()
    assert main(["train-draft", "--target", str(run), "--out", str(ckpt), "--steps", "1"]) == 2
    assert capsys.readouterr().err == (
        f"openk3: error: --out {ckpt} already exists and holds a checkpoint (config.json); refusing to overwrite "
        f"it: choose a new folder (or delete {ckpt} first)\n"
    )
    assert (ckpt / "config.json").read_bytes() == before


def test_resume_refuses_other_settings(tmp_path, capsys):
    from openk3.cli import main

    run = _run_folder(tmp_path)
    out = tmp_path / "draft"
    out.mkdir()
    settings = {"loss": "lk", "data": "corpus", "steps": 9, "batch_size": 2, "seq_len": 24, "ttt_steps": 2,
                "lr": 1e-3, "gen_windows": 64, "seed": 0}  # fmt: skip
    torch.save({"step": 3, "optimizer": {}, "settings": settings}, out / "train_state.pt")
    args = ["train-draft", "--target", str(run), "--out", str(out), "--resume", "--batch-size", "2", "--seq-len", "24", "--ttt-steps", "2"]  # fmt: skip
    assert main([*args, "--steps", "9", "--loss", "kl"]) == 2
    assert "--loss kl differs from the interrupted run's --loss lk" in capsys.readouterr().err
    assert main([*args, "--steps", "3"]) == 2
    assert "is already at step 3; pass --steps above it" in capsys.readouterr().err


def test_train_draft_on_a_vision_run_says_why_not(tmp_path, capsys):
    """An image-text run has checkpoints but no token splits: the error names that, not a missing run."""
    from openk3.checkpoint import save_pretrained
    from openk3.cli import main
    from openk3.presets import get_preset

    run = tmp_path / "vision"
    ckpt = run / "checkpoints" / "step-000012"
    save_pretrained(openk3.build_model(get_preset("k3-vision-tiny"), seed=0), ckpt)
    (run / "checkpoints" / "latest").write_text("step-000012\n")
    assert main(["train-draft", "--target", str(run), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"openk3: error: {ckpt} is a vision model from an image-text run")
        and err.count("\n") == 1
    )
    assert "speculative decoding drafts text only" in err and not (run / "draft-lk").exists()


def test_train_draft_refuses_an_out_holding_a_draft_without_resume(tmp_path, capsys):
    """A fresh run into a folder with a stopped draft (train_state.pt) or a finished one (model.safetensors)
    would overwrite it: one line says how to continue it or to pick another --out, and nothing is touched."""
    from openk3.cli import main

    run = _run_folder(tmp_path)
    out = tmp_path / "draft"
    out.mkdir()
    settings = {"loss": "lk", "data": "corpus", "steps": 300, "batch_size": 2, "seq_len": 24, "ttt_steps": 2,
                "lr": 1e-3, "gen_windows": 64, "seed": 0}  # fmt: skip
    torch.save({"step": 33, "optimizer": {}, "settings": settings}, out / "train_state.pt")
    (out / "model.safetensors").write_bytes(b"stopped draft")
    args = ["train-draft", "--target", str(run), "--out", str(out), "--steps", "2", "--batch-size", "4", "--seq-len", "64"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"--out {out} holds a train-draft stopped at step 33: continue it with `openk3 train-draft" in err
    assert "--steps 300 --batch-size 2 --seq-len 24" in err and "--resume`, or pick another --out" in err
    assert (out / "train_state.pt").is_file() and (out / "model.safetensors").read_bytes() == b"stopped draft"
    (out / "train_state.pt").unlink()  # a finished draft
    assert main(args) == 2
    assert f"--out {out} already holds a trained draft: pick another --out" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == b"stopped draft"


def test_eval_and_train_draft_read_a_distributed_run(tmp_path, capsys):
    """A torchrun run leaves DCP checkpoints, ``data/{train,val}.bin`` and the export ``final``: ``eval`` and
    ``train-draft`` given the run folder (or ``RUN/final``) read that run's splits."""
    from openk3.cli import main

    run = _run_folder(tmp_path)
    (run / "checkpoints" / "step-000001").rename(run / "final")
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "step-000005").mkdir()
    (run / "checkpoints" / "step-000005" / "__0_0.distcp").write_bytes(b"")
    assert main(["eval", "--ckpt", str(run), "--seq-len", "24", "--max-batches", "1"]) == 0
    assert f"{run / 'data' / 'val.bin'})" in capsys.readouterr().out
    small = ["--steps", "1", "--batch-size", "2", "--seq-len", "24", "--ttt-steps", "2"]
    assert main(["train-draft", "--target", str(run / "final"), *small]) == 0
    assert f"draft saved to {run / 'draft-lk'}" in capsys.readouterr().out
    assert main(["eval", "--ckpt", str(run), "--draft", str(run / "draft-lk"), "--seq-len", "24", "--max-batches", "1"]) == 0  # fmt: skip
    assert "acceptance rate by draft depth: 1: " in capsys.readouterr().out
