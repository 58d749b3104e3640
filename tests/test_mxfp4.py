"""MXFP4 routed experts: the format against compressed-tensors (the library that defines the checkpoint layout),
packed experts in the forward, the official checkpoint layout round trip, corrupt scales, checkpoint size."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import openk3
from openk3.accounting import checkpoint_bytes
from openk3.checkpoint.io import CorruptCheckpointError, official_state
from openk3.model.modeling import FP32_TENSORS
from openk3.model.moe import RoutedExperts, experts_loop_reference
from openk3.presets import get_preset
from openk3.quant.experts import MXFP4RoutedExperts, pack_experts, unpack_experts
from openk3.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from openk3.quant.scheme import ExpertScheme, expert_scheme

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("compressed_tensors", reason="the format's library: pip install 'openk3[test]'")
pytest.importorskip("torchao", reason="torchao, a dependency of openk3: pip install 'torchao>=0.18'")

from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import MXFP4A16  # noqa: E402
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales  # noqa: E402

SCHEME = QuantizationScheme(targets=["Linear"], **MXFP4A16)
EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"


def _ct_pack(w_OI: torch.Tensor, scale_bytes: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' packing of ``w [O, I]`` with E8M0 scale bytes ``[O, I/32]``."""
    scale = 2.0 ** (scale_bytes.to(torch.int32) - 127).float()
    return MXFP4PackedCompressor.compress({"weight": w_OI, "weight_scale": scale}, SCHEME)


def _ct_unpack(packed_OH: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dequantisation (bf16, exact for E2M1 · 2^k) as fp32."""
    out = MXFP4PackedCompressor.decompress({"weight_packed": packed_OH, "weight_scale": scale_bytes}, SCHEME)
    return out["weight"].float()


def _random_mxfp4(shape, seed=0):
    """Random packed bytes (every code, -0 included) and scale bytes near 2^0 for a weight ``[..., O, I]``."""
    g = torch.Generator().manual_seed(seed)
    *lead, O, I = shape
    packed = torch.randint(0, 256, (*lead, O, I // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(120, 131, (*lead, O, I // 32), generator=g, dtype=torch.uint8)
    return packed, scale


def test_quantize_matches_compressed_tensors_and_the_ocp_scale_rule():
    """Our quantiser (torchao, FLOOR scales) gives compressed-tensors' bytes for the same scales, and scales
    ``floor(log2 amax) − 2`` computed in fp64."""
    w = torch.randn(3, 64, 128, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.02
    w[0, 0, :32] = 0.0  # an all-zero block
    w[1, 1, 5] = 6.0 * 2.0**-3  # a block max on the E2M1 grid
    packed, scale = quantize_mxfp4(w.float())
    assert packed.shape == (3, 64, 64) and scale.shape == (3, 64, 4)
    amax = w.abs().reshape(3, 64, 4, 32).amax(-1)
    want = (torch.floor(torch.log2(amax)) - 2 + 127).clamp(0, 254)
    want[amax == 0] = 0
    assert torch.equal(scale.to(torch.float64), want)
    for e in range(3):
        ref = _ct_pack(w[e].float(), scale[e])
        assert torch.equal(ref["weight_packed"], packed[e])
        assert torch.equal(ref["weight_scale"], scale[e])


def test_unpack_pack_round_trip_bit_exact_against_compressed_tensors():
    packed, scale = _random_mxfp4((2, 32, 96))
    ours = dequantize_mxfp4(packed, scale, torch.float32)
    for e in range(2):
        ref = _ct_unpack(packed[e], scale[e])
        assert torch.equal(ours[e], ref) and torch.equal(torch.signbit(ours[e]), torch.signbit(ref))  # -0 too
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.bfloat16).float(), ours)  # exact in bf16
    # the library packs -0 (code 8) as +0 (code 0), so the round trip through its packer is bit-exact for
    # the other 255 byte values; openk3 never re-packs loaded weights (their bytes are kept)
    nibbles = torch.stack([packed & 0xF, packed >> 4], -1)
    nibbles[nibbles == 8] = 0
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    ours = dequantize_mxfp4(packed, scale, torch.float32)
    for e in range(2):
        again = _ct_pack(ours[e], scale[e])
        assert torch.equal(again["weight_packed"], packed[e]) and torch.equal(again["weight_scale"], scale[e])


def _experts_pair(dtype):
    config = get_preset("k3-tiny").text_config
    L = config.expert_input_size
    packed = MXFP4RoutedExperts(config, L)
    dense = RoutedExperts(config, L).to(dtype)
    for i, name in enumerate(("w1", "w3", "w2")):
        p, s = _random_mxfp4(getattr(dense, name).shape, seed=i)
        packed.packed(name)[0].copy_(p)
        packed.packed(name)[1].copy_(s)
        with torch.no_grad():  # the library's dequantisation, expert by expert
            getattr(dense, name).copy_(torch.stack([_ct_unpack(p[e], s[e]) for e in range(p.shape[0])]))
    return config, packed, dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_expert_gemm_equals_dense_gemm_on_dequantised_weights(dtype):
    config, packed, dense = _experts_pair(dtype)
    g = torch.Generator().manual_seed(3)
    N, k, E = 40, config.num_experts_per_token, config.num_experts
    z = torch.randn(N, config.expert_input_size, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    wts = torch.rand(N, k, generator=g)
    with torch.no_grad():
        got = packed(z, wts, idx)
        assert torch.equal(got, dense(z, wts, idx))  # same GEMMs on the same weights: bitwise
        ref = experts_loop_reference(dense.double(), z.double(), wts.double(), idx)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.double() - ref).abs().max() <= tol * ref.abs().max()


def _official_k3_folder(path, config=None, shards: int = 1):
    """A tiny random K3 (``k3-tiny`` unless ``config``) written as the release is: bf16 tensors, the F32 ones
    (the release's shard header, ``docs/checkpoint_names.md``) in fp32 with values bf16 cannot hold, routed
    experts packed by compressed-tensors with its own scale rule, and its own ``quantization_config``; one
    ``model.safetensors``, or ``shards`` files split by layer with an index. Returns the tensors."""
    model = openk3.build_model(config or get_preset("k3-tiny"), seed=0)
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for name, t in official_state(model).items():
        if ".block_sparse_moe.experts." in name:
            w = t.float()
            amax = w.abs().reshape(w.shape[0], -1, 32).amax(-1)
            scale = generate_mx_scales(amax, 4).to(torch.uint8)
            packed = _ct_pack(w, scale)
            tensors[name + "_packed"] = packed["weight_packed"]
            tensors[name + "_scale"] = packed["weight_scale"]
        elif name.endswith(FP32_TENSORS):
            tensors[name] = (t.float() + 1e-3 * torch.rand(t.shape, generator=g)).contiguous()
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    path.mkdir(parents=True)
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    else:  # shard i holds the tensors whose first number (a layer) is i mod shards, as a release splits
        weight_map = {}
        for name in tensors:
            layer = next((int(p) for p in name.split(".") if p.isdigit()), 0)
            weight_map[name] = f"model-{layer % shards + 1:05d}-of-{shards:05d}.safetensors"
        for fname in sorted(set(weight_map.values())):
            part = {n: t for n, t in tensors.items() if weight_map[n] == fname}
            save_file(part, path / fname, metadata={"format": "pt"})
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = model.config.to_dict()
    q = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **MXFP4A16)},
        format="mxfp4-pack-quantized",
        ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
        quantization_status="compressed",
    )
    config["text_config"]["quantization_config"] = q.model_dump(mode="json")
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def test_official_layout_loads_packed_and_saves_back_bit_identically(tmp_path):
    src = tmp_path / "official"
    tensors = _official_k3_folder(src)
    model = openk3.from_pretrained(src)
    experts = model.language_model.model.layers[1].block_sparse_moe.experts
    assert isinstance(experts, MXFP4RoutedExperts) and experts.w1_packed.dtype == torch.uint8
    assert expert_scheme(model.config) == ExpertScheme(activations=None)
    out = tmp_path / "saved"
    openk3.save_pretrained(model, out, tokenizer=None)
    saved = {}
    for shard in out.glob("*.safetensors"):
        saved.update(load_file(shard))
    assert set(saved) == set(tensors)
    for name, t in tensors.items():
        if name.endswith(("_packed", "_scale")):
            assert saved[name].dtype == torch.uint8 and torch.equal(saved[name], t), name  # the bytes
        else:
            assert torch.equal(saved[name], t.float()), name  # loaded in fp32: the same values
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    # a second round is byte-identical file for file
    again = tmp_path / "again"
    openk3.save_pretrained(openk3.from_pretrained(out), again, tokenizer=None)
    for f in out.glob("*.safetensors"):
        assert (again / f.name).read_bytes() == f.read_bytes()


@pytest.mark.parametrize("shards", [1, 3])
def test_official_layout_with_vision_round_trips_bit_identically_in_bf16(tmp_path, shards):
    """The issue's "done when": a tiny K3 with a vision tower and MXFP4 experts in the official layout, loaded in
    bf16 and saved, gives back every tensor with its dtype and bytes, the same shard files (and index, when the
    source has one) and the same config fields."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from vision_tiny import tiny_config

    src = tmp_path / "official"
    tensors = _official_k3_folder(src, tiny_config(), shards=shards)
    assert any(n.startswith("vision_tower.") for n in tensors) and any(n.endswith("_packed") for n in tensors)
    model = openk3.from_pretrained(src, dtype=torch.bfloat16)
    out = tmp_path / "saved"
    openk3.save_pretrained(model, out, tokenizer=None)
    src_files = sorted(p.name for p in src.glob("*.safetensors"))
    assert sorted(p.name for p in out.glob("*.safetensors")) == src_files
    assert (out / "model.safetensors.index.json").is_file() == (shards > 1)
    for fname in src_files:
        with safe_open(str(src / fname), "pt") as a, safe_open(str(out / fname), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys()), fname
            for name in a.keys():
                want, got = a.get_tensor(name), b.get_tensor(name)
                assert got.dtype == want.dtype and got.shape == want.shape, name
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name  # the bytes
    if shards > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        source_index = json.loads((src / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == source_index["weight_map"]
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    saved_config = json.loads((out / "config.json").read_text())
    saved_config.pop("auto_map")  # openk3 adds its remote-code entry point
    assert saved_config == json.loads((src / "config.json").read_text())
    openk3.save_pretrained(model, tmp_path / "resharded", max_shard_size="1MB", tokenizer=None)
    resharded = list((tmp_path / "resharded").glob("model-*-of-*.safetensors"))
    assert len(resharded) > 1  # an explicit size re-splits


def test_official_layout_logits_equal_the_dense_model_on_dequantised_weights(tmp_path):
    src = tmp_path / "official"
    tensors = _official_k3_folder(src)
    packed = openk3.from_pretrained(src)
    dense = openk3.build_model(get_preset("k3-tiny"), init=False)
    state = {}
    for name, t in tensors.items():
        if name.endswith("_packed"):
            base = name[: -len("_packed")]
            state[base] = _ct_unpack(t, tensors[base + "_scale"])
        elif not name.endswith("_scale"):
            state[name] = t.float()
    dense_dir = tmp_path / "dense"
    dense_dir.mkdir()
    save_file(state, dense_dir / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["quantization_config"]
    (dense_dir / "config.json").write_text(json.dumps(cfg))
    dense = openk3.from_pretrained(dense_dir)
    ids = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(packed(ids).logits, dense(ids).logits)
    unpack_experts(packed)  # back to trainable dense experts: the same model
    assert expert_scheme(packed.config) is None
    with torch.no_grad():
        assert torch.equal(packed(ids).logits, dense(ids).logits)


def test_corrupt_scale_tensor_is_named(tmp_path):
    src = tmp_path / "official"
    tensors = _official_k3_folder(src)
    name = EXPERT + ".weight_scale"
    bad = dict(tensors)
    bad[name] = tensors[name].clone()
    bad[name][3, 1] = 255  # the E8M0 NaN byte
    save_file(bad, src / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match=rf"{name} holds 1 E8M0 scale byte\(s\) 255"):
        openk3.from_pretrained(src)
    bad[name] = tensors[name].float()  # scales stored as floats instead of exponent bytes
    save_file(bad, src / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match=rf"{name} is torch.float32, expected uint8"):
        openk3.from_pretrained(src)


def test_unsupported_quantization_config_is_named(tmp_path):
    src = tmp_path / "official"
    _official_k3_folder(src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"quantization_config.config_groups.group_0.weights=.*group_size 32"
    ):
        openk3.from_pretrained(src)


def test_pack_experts_writes_a_config_compressed_tensors_reads(tmp_path):
    model = openk3.build_model(get_preset("k3-tiny"), seed=0)
    pack_experts(model, ExpertScheme(activations="mxfp8"))
    openk3.save_pretrained(model, tmp_path / "p", tokenizer=None)
    q = json.loads((tmp_path / "p" / "config.json").read_text())["text_config"]["quantization_config"]
    parsed = QuantizationConfig.model_validate(q)
    group = parsed.config_groups["group_0"]
    assert parsed.format == "mxfp4-pack-quantized" and group.weights.group_size == 32
    assert group.input_activations.num_bits == 8 and group.input_activations.dynamic is True
    with safe_open(str(next((tmp_path / "p").glob("*.safetensors"))), "pt") as f:
        assert f.get_slice(EXPERT + ".weight_scale").get_dtype() == "U8"


def test_checkpoint_size_of_kimi_k3():
    """Bytes from the published counts: 92 MoE layers × 896 experts × 3·3072·3584 routed numbers in MXFP4
    (4.25 bits), 11,122,432 numbers in F32 (69 KDA layers × (3·12288·4 + 128 + 12288 + 128), 92 × 896 router
    biases), the rest of the 2,779,484,478,208 text parameters and the vision tower's 401,214,464 + 46,144,512
    (encoder + projector) in bf16."""
    experts = 92 * 896 * 3 * 3072 * 3584
    f32 = 69 * (3 * 12288 * 4 + 128 + 12288 + 128) + 92 * 896
    total = 2_779_484_478_208 + 401_214_464 + 46_144_512
    got = checkpoint_bytes(get_preset("kimi-k3"))
    assert got["bf16"] == 2 * total + 2 * f32
    assert got["mxfp4"] == 2 * (total - experts) + 2 * f32 + math.ceil(experts * 17 / 32)
    assert 1.40 < got["mxfp4"] / 2**40 < 1.45  # "about 1.4 TB": 1.42 TiB (1.56e12 bytes)


def test_info_prints_the_checkpoint_size(capsys):
    from openk3.cli import main

    assert main(["info", "--preset", "kimi-k3"]) == 0
    out = capsys.readouterr().out
    assert "MXFP4 routed experts         1,560,860,324,864 B (1.56 TB, 1.42 TiB)" in out
