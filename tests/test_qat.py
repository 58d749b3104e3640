"""Quantization-aware training (``--qat mxfp4``): straight-through gradients, the fp64 reference, and a QAT model
exported packed computing in the server what it computed in training."""

from __future__ import annotations

import pytest
import torch

import openk3
from openk3.generate import greedy
from openk3.model.activations import glu
from openk3.model.moe import RoutedExperts
from openk3.presets import k3_shaped
from openk3.quant.experts import MXFP4RoutedExperts, pack_experts
from openk3.quant.mxfp4 import (
    dequantize_mxfp4,
    fake_quantize_mxfp4,
    fake_quantize_mxfp8,
    mxfp4_ste,
    mxfp8_ste,
)
from openk3.quant.qat import enable_qat
from openk3.quant.scheme import ExpertScheme, expert_scheme

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("torchao", reason="torchao, a dependency of openk3: pip install 'torchao>=0.18'")

VOCAB = 512


def _on_mxfp4_grid(shape, seed):
    """A weight whose every value is an MXFP4 number (random codes, scales near 2^-4)."""
    g = torch.Generator().manual_seed(seed)
    *lead, O, I = shape
    packed = torch.randint(0, 256, (*lead, O, I // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(118, 126, (*lead, O, I // 32), generator=g, dtype=torch.uint8)
    return dequantize_mxfp4(packed, scale, torch.float32)


def test_quantisers_are_the_identity_on_their_grids():
    w = _on_mxfp4_grid((3, 16, 64), 0)
    assert torch.equal(fake_quantize_mxfp4(w), w)
    x = fake_quantize_mxfp8(torch.randn(20, 64, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(fake_quantize_mxfp8(x), x)
    y = torch.randn(20, 64, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(fake_quantize_mxfp8(y), y)  # off the grid it rounds


def test_qat_gemm_gradients_equal_unquantised_where_the_quantiser_is_the_identity():
    """``mxfp8(x) @ mxfp4(w)ᵀ`` with ``x``, ``w`` already on their grids: the same output and the same
    gradients, bit for bit, as ``x @ wᵀ``."""
    w0 = _on_mxfp4_grid((48, 64), 3)
    x0 = fake_quantize_mxfp8(torch.randn(20, 64, generator=torch.Generator().manual_seed(4)))
    g = torch.randn(20, 48, generator=torch.Generator().manual_seed(5))
    grads = []
    for quant in (True, False):
        w, x = w0.clone().requires_grad_(), x0.clone().requires_grad_()
        y = (mxfp8_ste(x) @ mxfp4_ste(w).t()) if quant else x @ w.t()
        y.backward(g)
        grads.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _ste64(t: torch.Tensor, fq) -> torch.Tensor:
    """Straight-through in fp64, written as ``t + (q − t)`` with ``q`` computed in fp32."""
    return t + (fq(t.detach().float()).double() - t).detach()


def test_qat_experts_match_an_fp64_straight_through_reference():
    """The QAT experts' output and gradients (weights on the MXFP4 grid, inputs anywhere) against a per-expert
    fp64 loop that applies the straight-through rule to each GEMM input."""
    config = k3_shaped(4, vocab_size=VOCAB).text_config
    L, E, k, N = config.expert_input_size, config.num_experts, config.num_experts_per_token, 24
    experts = RoutedExperts(config, L)
    with torch.no_grad():
        for i, name in enumerate(("w1", "w3", "w2")):
            getattr(experts, name).copy_(_on_mxfp4_grid(getattr(experts, name).shape, 10 + i))
    enable_qat(experts)
    gen = torch.Generator().manual_seed(6)
    z = torch.randn(N, L, generator=gen).requires_grad_()
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    wts = torch.rand(N, k, generator=gen)
    upstream = torch.randn(N, L, generator=gen)
    experts(z, wts, idx).backward(upstream)
    z64 = z.detach().double().requires_grad_()
    w64 = {n: getattr(experts, n).detach().double().requires_grad_() for n in ("w1", "w3", "w2")}
    out = torch.zeros(N, L, dtype=torch.float64)
    for e in range(E):
        token, slot = torch.nonzero(idx == e, as_tuple=True)
        if token.numel():
            x = _ste64(z64[token], fake_quantize_mxfp8)
            h = _ste64(glu(config, x @ w64["w1"][e].t(), x @ w64["w3"][e].t()), fake_quantize_mxfp8)
            out = out.index_add(0, token, (h @ w64["w2"][e].t()) * wts[token, slot, None].double())
    out.backward(upstream.double())
    for got, want in [(z.grad, z64.grad)] + [(getattr(experts, n).grad, w64[n].grad) for n in w64]:
        err = (got.double() - want).norm() / want.norm()
        assert err < 1e-4, err  # fp32 vs fp64 rounding; a rounding flip of one MXFP8 input would be ~1e-2


def _qat_trained(steps=3):
    torch.manual_seed(0)
    model = openk3.build_model(k3_shaped(4, vocab_size=VOCAB), seed=0)
    assert enable_qat(model) == 3  # the MoE layers 1..3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (4, 33), generator=torch.Generator().manual_seed(7))
    for _ in range(steps):
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_qat_model_exported_packed_serves_the_training_forward(tmp_path):
    from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig

    model = _qat_trained()
    prompt = torch.randint(4, VOCAB, (1, 21), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        trained = model(prompt).logits
    want_tokens = greedy(model, prompt, 6)[0].tolist()
    assert len(set(want_tokens)) > 1
    pack_experts(model, ExpertScheme(activations="mxfp8"))
    openk3.save_pretrained(model, tmp_path / "packed", tokenizer=None)
    served = openk3.from_pretrained(tmp_path / "packed")
    assert isinstance(served.language_model.model.layers[1].block_sparse_moe.experts, MXFP4RoutedExperts)
    assert expert_scheme(served.config) == ExpertScheme(activations="mxfp8")
    with torch.no_grad():
        assert torch.equal(served(prompt).logits, trained)  # the same numbers, bit for bit
    eng = LLMEngine(
        served,
        EngineConfig(
            CacheConfig(block_size=8, num_blocks=200, checkpoint_interval=2),
            SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, long_prefill_token_threshold=32),
        ),
    )
    req = Request("q", prompt[0].tolist(), SamplingParams(max_tokens=6))
    assert eng.generate([req])["q"] == want_tokens


def test_without_qat_the_export_differs():
    """The check above can fail: a model trained without QAT does not keep its logits when packed."""
    model = openk3.build_model(k3_shaped(4, vocab_size=VOCAB), seed=0).eval()
    prompt = torch.randint(4, VOCAB, (1, 21), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        dense = model(prompt).logits
        pack_experts(model, ExpertScheme(activations="mxfp8"))
        assert not torch.allclose(model(prompt).logits, dense, rtol=1e-3, atol=1e-3)


def test_enable_qat_refuses_what_it_cannot_quantise():
    with pytest.raises(ValueError, match="qat='nvfp4' is not supported"):
        enable_qat(torch.nn.Linear(2, 2), "nvfp4")
    with pytest.raises(ValueError, match="no routed experts"):
        enable_qat(openk3.build_model(openk3.presets.get_preset("k3-tiny-dense"), device="meta"))
    config = k3_shaped(4, vocab_size=VOCAB).text_config
    with pytest.raises(ValueError, match="the expert input width 48 is not a multiple of 32"):
        enable_qat(RoutedExperts(config, 48))


@pytest.mark.slow  # a 2-step k3-tiny run, its tokenizer and three checkpoint loads: ~35 s on a 2-core CPU
def test_train_qat_then_quantize_cli(tmp_path, capsys):
    """``openk3 train --qat mxfp4`` trains on CPU with QAT experts; ``openk3 quantize`` packs its checkpoint into
    a folder that loads packed and gives the QAT forward's logits."""
    from openk3.cli import main
    from openk3.train.trainer import TrainConfig, Trainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("ROMEO. But soft, what light through yonder window breaks?\n" * 300)
    config = TrainConfig(
        preset="k3-tiny",
        data=str(corpus),
        out=str(tmp_path / "run"),
        steps=2,
        batch_size=2,
        context_schedule=[(0, 32)],
        warmup_steps=0,
        eval_batches=1,
        final_eval_batches=1,
        sample_prompt=None,
        val_fraction=0.2,
        qat="mxfp4",
    )
    trainer = Trainer(config, progress=False)
    experts = [m for m in trainer.model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(m.qat for m in experts)
    summary = trainer.fit()
    assert summary["step"] == 2
    assert main(["quantize", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "packed")]) == 0
    assert "routed experts in MXFP4 (expert inputs mxfp8)" in capsys.readouterr().out
    served = openk3.from_pretrained(tmp_path / "packed")
    dense = openk3.from_pretrained(tmp_path / "run")
    enable_qat(dense)
    ids = torch.randint(0, 8192, (1, 17), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert torch.equal(served(ids).logits, dense(ids).logits)
    assert (tmp_path / "packed" / "tokenizer.json").is_file()
    assert main(["quantize", "--ckpt", str(tmp_path / "packed"), "--out", str(tmp_path / "again")]) == 2
    assert "packed already holds MXFP4 experts: nothing to pack" in capsys.readouterr().err


def test_train_config_and_flag_name_the_qat_scheme():
    from openk3.cli import build_parser
    from openk3.train.trainer import TrainConfig

    with pytest.raises(ValueError, match=r"TrainConfig.qat='int4': use 'mxfp4' or null"):
        TrainConfig(qat="int4")
    args = build_parser().parse_args(["train", "--qat", "mxfp4"])
    assert TrainConfig(qat=args.qat).qat == "mxfp4"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--qat", "int4"])


def test_chat_request_through_the_server_answers_as_the_qat_model(tmp_path):
    """The packed export of a QAT model behind ``openk3 serve``'s app: a greedy chat reply equals the QAT
    training model's greedy continuation of the same ChatML ids."""
    openai = pytest.importorskip("openai")
    from openk3.data import Tokenizer
    from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig
    from openk3.serve.server import BackgroundServer, load_server

    text = "ROMEO. But soft, what light through yonder window breaks? It is the east.\n"
    tok = Tokenizer.train([text] * 30, vocab_size=VOCAB)
    model = _qat_trained()
    messages = [{"role": "user", "content": "But soft, what light"}]
    ids = [1] + tok.encode(f"user\n{messages[0]['content']}") + [2] + tok.encode("\n") + [1]
    ids += tok.encode("assistant\n")
    out, seq = [], list(ids)
    with torch.no_grad():  # greedy over the tokenizer's ids, as the server samples
        for _ in range(8):
            out.append(int(model(torch.tensor([seq])).logits[0, -1, : tok.vocab_size].argmax()))
            seq.append(out[-1])
    cut = next((i for i, t in enumerate(out) if t in {tok.eos_id, 2}), len(out))
    want = tok.decode([t for t in out[:cut] if t not in tok.special_tokens.values()])
    pack_experts(model, ExpertScheme(activations="mxfp8"))
    folder = tmp_path / "packed"
    openk3.save_pretrained(model, folder, tokenizer=tok)
    config = EngineConfig(
        CacheConfig(block_size=8, num_blocks=500, checkpoint_interval=2),
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256),
    )
    app, _ = load_server(folder, config, model_name="qat")
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="qat", messages=messages, max_tokens=8, temperature=0)
    assert want and reply.choices[0].message.content == want


def _compiled_qat_step_and_export(device: str, compile: bool):
    """One QAT training step of compiled (or eager) decoder layers under the device's training precision, then
    the QAT forward's logits against the packed export's."""
    from openk3.train.checkpointing import wrap_decoder_layers

    model = openk3.build_model(k3_shaped(4, vocab_size=VOCAB), device=device, seed=0)
    enable_qat(model)
    wrap_decoder_layers(model, "none", compile)
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(7)).to(device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    with autocast:
        logits = model(ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    experts = model.language_model.model.layers[1].block_sparse_moe.experts
    assert (
        torch.isfinite(loss) and experts.w1.grad is not None and bool(torch.isfinite(experts.w1.grad).all())
    )
    model.eval()
    with torch.no_grad(), autocast:
        qat = model(ids).logits.float()
    pack_experts(model, ExpertScheme(activations="mxfp8"))
    with torch.no_grad(), autocast:
        packed = model(ids).logits.float()
    return qat, packed


def test_qat_step_and_export_eager_cpu():
    qat, packed = _compiled_qat_step_and_export("cpu", compile=False)
    assert torch.equal(qat, packed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled QAT layers under bf16)")
def test_gpu_qat_compiled_step_and_export():
    """On CUDA the trainer compiles each decoder layer and runs under bf16 autocast: the QAT quantisers trace
    through ``torch.compile``, the step's gradients are finite, and the packed export (the layers recompiled
    around the packed experts) matches the QAT forward to bf16 rounding of a differently fused graph."""
    qat, packed = _compiled_qat_step_and_export("cuda", compile=True)
    torch.testing.assert_close(packed, qat, rtol=2e-2, atol=2e-2)


def test_quantize_prints_the_bytes_it_wrote(tmp_path, capsys):
    """``openk3 quantize`` reports the safetensors bytes on disk and their parts, read back here from the files
    (the tensors by dtype, the 8-byte length and JSON header of each file), and, for an fp32 checkpoint, the
    size the same tensors take in the release's dtypes."""
    import struct

    from safetensors.torch import load_file

    from openk3.cli import main
    from openk3.model.modeling import FP32_TENSORS

    src = tmp_path / "dense"
    openk3.save_pretrained(openk3.build_model(k3_shaped(4, vocab_size=VOCAB), seed=0), src, tokenizer=None)
    assert main(["quantize", "--ckpt", str(src), "--out", str(tmp_path / "packed")]) == 0
    printed = capsys.readouterr().out
    files = sorted((tmp_path / "packed").glob("*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files)
    headers = sum(8 + struct.unpack("<Q", f.read_bytes()[:8])[0] for f in files)
    codes = scales = release_other = 0
    other: dict[str, int] = {}
    for f in files:
        for name, t in load_file(f).items():
            n = t.numel() * t.element_size()
            if name.endswith(".weight_packed"):
                codes += n
            elif name.endswith(".weight_scale"):
                scales += n
            else:
                key = str(t.dtype).removeprefix("torch.")
                other[key] = other.get(key, 0) + n
                release_other += t.numel() * (4 if name.endswith(FP32_TENSORS) else 2)
    assert list(other) == ["float32"] and codes == 16 * scales  # 32 four-bit codes per scale byte
    assert codes + scales + other["float32"] + headers == on_disk
    mb = lambda n: f"{n / 1e6:,.1f} MB"  # noqa: E731
    assert (
        f"{mb(on_disk)} of safetensors = routed experts in MXFP4 (expert inputs mxfp8) {mb(codes + scales)} "
        f"(E2M1 codes {mb(codes)}, E8M0 scales {mb(scales)}) + other tensors {mb(other['float32'])} (float32 "
        f"{mb(other['float32'])}) + headers {mb(headers)}"
    ) in printed, printed
    assert f"the tensors would take {mb(codes + scales + release_other)}" in printed


def _qat_dist_world(rank: int, world: int) -> dict:
    """Two SGD steps of a QAT k3-shaped model (plain residuals) under FSDP2 over ``world`` ranks, alone and
    with EP (both dispatchers), each rank on its share of the batch; rank 0 also runs the one-process QAT
    oracle (the batch as ``world`` micro-batches of ``1/world`` weight) and the same steps without QAT."""
    import dataclasses

    import torch.nn.functional as F

    from openk3.dist.fsdp import build_sharded_model
    from openk3.dist.mesh import ParallelDims, build_meshes

    config = k3_shaped(4, vocab_size=256)
    config = dataclasses.replace(
        config, text_config=dataclasses.replace(config.text_config, attn_res_block_size=None)
    )
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (world * 2, 17), generator=g) for _ in range(2)]

    def ce(model, ids):
        return F.cross_entropy(model(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())

    def steps(model, chunks):
        opt, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
        for ids in batches:
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for chunk in chunks(ids):
                loss = ce(model, chunk) / (world if chunks is reference_chunks else 1)
                loss.backward()
                total += loss.item()
            opt.step()
            losses.append(total)
        return losses

    reference_chunks = lambda ids: ids.chunk(world)  # noqa: E731
    out = {}
    for case, dims, dispatcher in (
        ("fsdp", dict(), "alltoall"),
        ("fsdp+ep alltoall", dict(ep=world), "alltoall"),
        ("fsdp+ep moonep", dict(ep=world), "moonep"),
    ):
        meshes = build_meshes(ParallelDims(world_size=world, **dims))
        model = build_sharded_model(
            config, meshes, seed=0, param_dtype=torch.float32, ep_dispatcher=dispatcher
        )
        assert enable_qat(model) == 3  # k3_shaped(4): three MoE layers
        local = steps(model, lambda ids: [ids.chunk(world)[rank]])
        per_rank = torch.zeros(world, 2)
        per_rank[rank] = torch.tensor(local) / world
        torch.distributed.all_reduce(per_rank)
        params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        out[case] = {
            "losses": [sum(v) for v in zip(*per_rank.tolist())],
            "params": params,
        }  # as the oracle sums
    if rank:
        return {}
    ref = {}  # plain numbers go back (tensors through the queue would outlive their process)
    for qat in (True, False):
        model = openk3.build_model(config, seed=0)
        if qat:
            enable_qat(model)
        ref[qat] = (steps(model, reference_chunks), {n: p.detach() for n, p in model.named_parameters()})
    qat_effect = max((ref[False][1][n] - p).abs().max().item() for n, p in ref[True][1].items())
    result = {"reference": ref[True][0], "qat effect": qat_effect}
    for case, got in out.items():
        result[case] = {
            "losses": got["losses"],
            "diff": max((got["params"][n] - p).abs().max().item() for n, p in ref[True][1].items()),
        }
    return result


@pytest.mark.slow  # 2 spawned ranks, three sharded models and two one-process oracles: ~55 s on 2 cores
def test_qat_under_fsdp_and_expert_parallel_equals_one_process():
    """``--qat mxfp4`` with ``--dp-shard``/``--ep`` (gloo, 2 ranks, fp32): FSDP2 alone gives the one-process
    QAT losses and weights bit for bit (the same arithmetic, as without QAT); with EP an expert's gradient sums
    every rank's tokens in one grouped GEMM, so within 1e-6 (as without QAT). QAT is on: the steps without it
    end elsewhere."""
    from dist_utils import run_world

    out = run_world(_qat_dist_world, 2, timeout=240)[0]
    assert out["fsdp"]["losses"] == out["reference"] and out["fsdp"]["diff"] == 0.0
    for case in ("fsdp+ep alltoall", "fsdp+ep moonep"):
        assert out[case]["losses"] == pytest.approx(out["reference"], rel=1e-6), case
        assert out[case]["diff"] < 1e-6, (case, out[case]["diff"])
    assert out["qat effect"] > 1e-4  # the weights without QAT end far outside those bounds
