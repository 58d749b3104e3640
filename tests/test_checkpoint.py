"""HF-format checkpoints: official names, sharding, strict loading, atomic saves, meta builds."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import openk3
from openk3.checkpoint.io import official_state
from openk3.checkpoint.names import to_module
from openk3.presets import get_preset


def _tiny():
    return openk3.build_model(get_preset("k3-tiny"), seed=0)


def _names(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return index


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "k3-tiny"
    model = _tiny()
    openk3.save_pretrained(model, path, max_shard_size="20MB")
    return model, path


def test_official_names_and_shards(saved):
    model, path = saved
    index = _names(path)
    names = set(index["weight_map"])
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3  # ~84 MB in fp32 with a 20 MB limit
    for s in shards:
        assert (path / s).is_file()
    t = model.config.text_config
    assert "language_model.model.embed_tokens.weight" in names
    assert "language_model.lm_head.weight" in names
    assert "language_model.model.output_attn_res_proj.weight" in names
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names
    assert "language_model.model.layers.0.self_attention_res_proj.weight" in names  # unused but present
    assert "language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in names
    for j in (0, t.num_experts - 1):
        for w in ("w1", "w2", "w3"):
            assert f"language_model.model.layers.1.block_sparse_moe.experts.{j}.{w}.weight" in names
    assert "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight" in names
    assert "language_model.model.layers.0.self_attn.g_proj.weight" in names  # full-rank KDA gate
    assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in names
    assert not any(".experts.w1" in n for n in names)
    with safe_open(path / index["weight_map"]["language_model.model.layers.0.self_attn.A_log"], "pt") as f:
        assert list(f.get_slice("language_model.model.layers.0.self_attn.A_log").get_shape()) == [128]
    with safe_open(
        path / index["weight_map"]["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"], "pt"
    ) as f:
        shape = f.get_slice("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight").get_shape()
        assert list(shape) == [t.moe_intermediate_size, t.routed_expert_hidden_size]
    total = sum(v.numel() * v.element_size() for v in official_state(model).values())
    assert index["metadata"]["total_size"] == total


def test_round_trip_logits(saved):
    model, path = saved
    loaded = openk3.from_pretrained(path)
    ids = torch.randint(0, 8192, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    for (n1, t1), (n2, t2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1


def test_save_replaces_atomically(saved, tmp_path, monkeypatch):
    model, _ = saved
    path = tmp_path / "ckpt"
    openk3.save_pretrained(model, path)
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    calls = {"n": 0}
    real = save_file

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr("openk3.checkpoint.io.save_file", failing)
    time.sleep(0.01)
    with pytest.raises(OSError, match="disk full"):
        openk3.save_pretrained(model, path, max_shard_size="20MB")
    after = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert after == before  # the old checkpoint is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp folder left behind
    assert openk3.from_pretrained(path) is not None


def _copy_with(src, dst, edit):
    """Copy a checkpoint folder, merging shards into one edited model.safetensors."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")


def test_strict_loading_lists_every_problem(saved, tmp_path):
    _, path = saved
    p = "language_model.model.layers."

    def edit(t):
        del t[p + "2.input_layernorm.weight"]
        del t[p + "1.block_sparse_moe.experts.3.w2.weight"]
        t[p + "2.self_attn.not_a_tensor"] = torch.zeros(3)
        t[p + "5.self_attn.q_proj.weight"] = torch.zeros(7, 7)

    _copy_with(path, tmp_path / "bad", edit)
    with pytest.raises(openk3.CheckpointMismatchError) as err:
        openk3.from_pretrained(tmp_path / "bad")
    msg = str(err.value)
    assert "missing keys (2)" in msg and p + "2.input_layernorm.weight" in msg
    assert p + "1.block_sparse_moe.experts.3.w2.weight" in msg
    assert "unexpected keys (1)" in msg and "not_a_tensor" in msg
    assert "shape mismatches (1)" in msg and "[7, 7]" in msg


@pytest.mark.parametrize("layout", ["heads", "hf"])
def test_a_log_layouts(saved, tmp_path, layout):
    model, path = saved
    key = "language_model.model.layers.0.self_attn.A_log"
    H = model.config.text_config.linear_attn_config.num_heads

    def edit(t):
        values = torch.arange(1.0, H + 1)
        t[key] = values if layout == "heads" else values.view(1, 1, H, 1)

    _copy_with(path, tmp_path / layout, edit)
    loaded = openk3.from_pretrained(tmp_path / layout)
    a_log = loaded.language_model.model.layers[0].self_attn.A_log
    assert a_log.shape == (128,)
    assert torch.equal(a_log[:H], torch.arange(1.0, H + 1)) and not a_log[H:].any()


def test_vision_skipped_and_quantized_rejected(saved, tmp_path):
    _, path = saved
    _copy_with(
        path, tmp_path / "vis", lambda t: t.update({"vision_tower.patch_embed.proj.weight": torch.zeros(2)})
    )
    with pytest.warns(UserWarning, match="vision"):
        openk3.from_pretrained(tmp_path / "vis")
    key = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    _copy_with(path, tmp_path / "q", lambda t: t.update({key: torch.zeros(2, dtype=torch.uint8)}))
    with pytest.raises(ValueError, match="MXFP4-packed tensors .*quantization_config"):
        openk3.from_pretrained(tmp_path / "q")


def test_from_pretrained_resolves_a_run_folder(saved, tmp_path):
    """A training run folder (``checkpoints/latest`` naming the newest step folder, the layout
    ``openk3.train.state.save_checkpoint`` writes) loads its latest checkpoint, like the CLI."""
    model, path = saved
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(path, run / "checkpoints" / "step-000007")
    (run / "checkpoints" / "step-000003").mkdir()  # an older step, not named by `latest`
    (run / "checkpoints" / "latest").write_text("step-000007\n")
    ids = torch.randint(0, 8192, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        for folder in (run, run / "checkpoints"):
            assert torch.equal(openk3.from_pretrained(folder)(ids).logits, want)
    (run / "checkpoints" / "latest").write_text("step-000009\n")
    with pytest.raises(FileNotFoundError, match="step-000009"):
        openk3.from_pretrained(run)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        openk3.from_pretrained(tmp_path)


def test_name_table():
    slot = to_module("language_model.model.layers.7.block_sparse_moe.experts.12.w2.weight")
    assert (slot.name, slot.index, slot.shard_dim) == (
        "language_model.model.layers.7.block_sparse_moe.experts.w2",
        12,
        0,
    )
    assert to_module("model.norm.weight").name == "model.norm.weight"


def test_kimi_k3_builds_on_meta_without_memory():
    start = time.perf_counter()
    model = openk3.build_model(get_preset("kimi-k3"), device="meta")
    assert time.perf_counter() - start < 60
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    text = sum(p.numel() for p in model.language_model.parameters())
    assert text + 92 * 896 == 2_779_484_478_208
    assert sum(p.numel() for p in params) + 92 * 896 == 2_779_484_478_208 + 401_214_464 + 46_144_512


def test_unsupported_dtype(saved):
    _, path = saved
    with pytest.raises(ValueError, match="dtype"):
        openk3.from_pretrained(path, dtype=torch.int8)
    with pytest.raises(ValueError, match="dtype"):
        openk3.build_model(get_preset("k3-tiny"), dtype=torch.complex64)


def test_save_never_replaces_a_file_or_a_foreign_folder(saved, tmp_path):
    model, _ = saved
    victim = tmp_path / "notes.txt"
    victim.write_text("precious")
    with pytest.raises(FileExistsError, match="is a file"):
        openk3.save_pretrained(model, victim)
    assert victim.read_text() == "precious"
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "data.csv").write_text("1,2")
    with pytest.raises(FileExistsError, match="no checkpoint"):
        openk3.save_pretrained(model, folder)
    assert (folder / "data.csv").read_text() == "1,2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "work"]


def test_saved_files_follow_the_umask(saved, tmp_path):
    model, _ = saved
    umask = os.umask(0o022)
    try:
        openk3.save_pretrained(model, tmp_path / "ck")
    finally:
        os.umask(umask)
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "ck").iterdir()} == {0o644}


def _with_tokenizer(src, dst):
    """A copy of model folder ``src`` with a small trained tokenizer, as `openk3 generate` needs."""
    from openk3.data import Tokenizer

    shutil.copytree(src, dst)
    Tokenizer.train(["to be or not to be, that is the question"] * 4, 300).save(dst)
    return dst


def test_save_refuses_to_replace_a_training_checkpoint(saved, tmp_path):
    model, path = saved
    ckpt = _with_tokenizer(path, tmp_path / "run" / "checkpoints" / "step-000020")
    torch.save({"step": 20, "train_config": {}}, ckpt / "trainer_state.pt")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(
        FileExistsError, match=r"step-000020 is a training checkpoint \(it holds trainer_state"
    ):
        openk3.save_pretrained(model, ckpt)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # tokenizer and state kept
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["step-000020"]  # no temporary folder left


def test_resume_names_a_missing_or_damaged_trainer_state(saved, tmp_path, capsys):
    from openk3.cli import main

    _, path = saved
    run = tmp_path / "run"
    shutil.copytree(path, run / "checkpoints" / "step-000005")  # a model-only folder (save_pretrained)
    (run / "checkpoints" / "latest").write_text("step-000005\n")
    assert main(["train", "--out", str(run), "--resume", "--no-sample"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'checkpoints' / 'step-000005' / 'trainer_state.pt'} is missing" in err
    assert "not a training checkpoint" in err and "Errno" not in err
    (run / "checkpoints" / "step-000005" / "trainer_state.pt").write_bytes(b"garbage")
    assert main(["train", "--out", str(run), "--resume", "--no-sample"]) == 2
    assert "trainer_state.pt is not a valid trainer state (truncated or corrupt?)" in capsys.readouterr().err


def test_corrupt_files_are_named_in_one_line(saved, tmp_path, capsys):
    from openk3.cli import main

    _, path = saved
    ckpt = _with_tokenizer(path, tmp_path / "ck")
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # an interrupted copy
    with pytest.raises(ValueError, match=r"safetensors file \(truncated or corrupt\?\)"):
        openk3.from_pretrained(ckpt)
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "to be"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"openk3: error: {shard} is not a valid safetensors file (truncated or corrupt?)")
    assert err.count("\n") == 1
    # a single model.safetensors without an index, truncated
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(path / "config.json", single)
    save_file({"x": torch.zeros(64)}, single / "model.safetensors")
    (single / "model.safetensors").write_bytes((single / "model.safetensors").read_bytes()[:5])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        openk3.from_pretrained(single)
    # an overwritten tokenizer.json (the weights are fine)
    ckpt2 = _with_tokenizer(path, tmp_path / "ck2")
    (ckpt2 / "tokenizer.json").write_text("garbage")
    assert main(["generate", "--ckpt", str(ckpt2), "--prompt", "to be"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"openk3: error: {ckpt2 / 'tokenizer.json'} is not a valid tokenizer.json")
    assert err.count("\n") == 1


def test_non_finite_weights_are_refused_in_one_line(saved, tmp_path, capsys):
    """A checkpoint whose tensors parse but hold a NaN (a run that diverged before its save) or an inf is not
    loaded: one line names the tensor and its file, for the library and for ``openk3 generate`` (eval and serve
    load through the same ``load_state``)."""
    from safetensors.torch import load_file

    from openk3.checkpoint import CorruptCheckpointError
    from openk3.cli import main

    _, path = saved
    for bad in (float("nan"), float("-inf")):
        ckpt = _with_tokenizer(path, tmp_path / f"ck-{bad}")
        index = _names(ckpt)["weight_map"]
        name = next(n for n in sorted(index) if n.endswith("mlp.up_proj.weight"))
        shard = ckpt / index[name]
        tensors = load_file(shard)
        tensors[name].view(-1)[7] = bad
        save_file(tensors, shard)
        message = f"{name} in {shard} holds NaN or inf values"
        with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
            openk3.from_pretrained(ckpt)
        assert main(["generate", "--ckpt", str(ckpt), "--prompt", "to be"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"openk3: error: {message}") and err.count("\n") == 1


def test_save_pretrained_carries_the_tokenizer(tmp_path):
    """A model loaded from a folder with a tokenizer is saved with it (so the CLI can use the copy); an
    explicit tokenizer is written, and ``tokenizer=None`` writes none."""
    from openk3.data import Tokenizer

    src = tmp_path / "src"
    openk3.save_pretrained(openk3.build_model(get_preset("k3-tiny"), seed=0), src, tokenizer=None)
    assert not (src / "tokenizer.json").exists()
    tok = Tokenizer.train(["to be or not to be, that is the question " * 20], 280)
    tok.save(src)
    model = openk3.from_pretrained(src)
    assert model.name_or_path == str(src)
    openk3.save_pretrained(model, tmp_path / "copy")
    assert Tokenizer.load(tmp_path / "copy").sha256 == tok.sha256
    openk3.save_pretrained(model, tmp_path / "bare", tokenizer=None)
    assert not (tmp_path / "bare" / "tokenizer.json").exists()
    fresh = openk3.build_model(get_preset("k3-tiny"), seed=0)
    openk3.save_pretrained(fresh, tmp_path / "given", tokenizer=src / "tokenizer.json")
    assert Tokenizer.load(tmp_path / "given").sha256 == tok.sha256


def test_save_refuses_a_run_folder(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(FileExistsError, match="is a training run folder"):
        openk3.save_pretrained(openk3.build_model(get_preset("k3-tiny"), seed=0), run)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_checkpoint_with_tokenizer_resolves_or_names_the_missing_tokenizer(tmp_path):
    from openk3.checkpoint import checkpoint_with_tokenizer
    from openk3.data import Tokenizer

    folder = tmp_path / "model"
    openk3.save_pretrained(openk3.build_model(get_preset("k3-tiny"), seed=0), folder, tokenizer=None)
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json or .tiktoken file"):
        checkpoint_with_tokenizer(folder)
    Tokenizer.train(["to be or not to be " * 20], 270).save(folder)
    assert checkpoint_with_tokenizer(folder) == folder


def test_save_into_a_model_folder_keeps_the_users_files(saved, tmp_path):
    """Saving over a model folder keeps what the user put there (README.md, notes/) and drops only the old
    save's model files: the shard set changes with max_shard_size and no stale shard stays behind. Old
    tokenizer files go only when the new save writes a tokenizer."""
    from openk3.data import Tokenizer

    model, _ = saved
    path = tmp_path / "ck"
    openk3.save_pretrained(model, path, max_shard_size="20MB", tokenizer=None)
    old_shards = set(_names(path)["weight_map"].values())
    (path / "README.md").write_text("# my model card\n")
    (path / "notes").mkdir()
    (path / "notes" / "run.txt").write_text("lr 3e-4, 20 steps\n")
    (path / "generation_config.json").write_text("{}")  # not written by openk3: kept
    tok_a = Tokenizer.train(["to be or not to be, that is the question " * 20], 280)
    tok_a.save(path)
    (path / "vocab.json").write_text("{}")  # a Hugging Face tokenizer file

    openk3.save_pretrained(model, path, max_shard_size="40MB", tokenizer=None)
    new_shards = set(_names(path)["weight_map"].values())
    assert len(old_shards) == 5 and len(new_shards) == 3  # 84 MB of fp32 tensors, 20 MB and 40 MB shards
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json", "vocab.json"}  # kept: no tokenizer written
    user_files = {"README.md", "notes", "generation_config.json"}
    assert {p.name for p in path.iterdir()} == {
        "config.json",
        "model.safetensors.index.json",
        "configuration_kimi_k3.py",  # transformers' trust_remote_code files (tests/test_hf_remote.py)
        "modeling_kimi_k3.py",
        *new_shards,
        *tokenizer_files,
        *user_files,
    }
    assert (path / "README.md").read_text() == "# my model card\n"
    assert (path / "notes" / "run.txt").read_text() == "lr 3e-4, 20 steps\n"
    assert Tokenizer.load(path).sha256 == tok_a.sha256
    loaded = openk3.from_pretrained(path)
    for (n1, t1), (n2, t2) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(t1, t2), n1

    tok_b = Tokenizer.train(["now is the winter of our discontent " * 20], 280)
    openk3.save_pretrained(model, path, max_shard_size="40MB", tokenizer=tok_b)
    names = {p.name for p in path.iterdir()}
    assert "vocab.json" not in names and user_files <= names  # the old tokenizer's extra file is gone
    assert Tokenizer.load(path).sha256 == tok_b.sha256 != tok_a.sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporary or old folder left
