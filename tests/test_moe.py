"""Mixture-of-experts blocks (jitllm.ir.moe): tiny random transformers Qwen3MoeForCausalLM and MixtralForCausalLM
(f32) converted from their save_pretrained directories and from GGUFs laid out as llama.cpp's
convert_hf_to_gguf.py writes them (tests/llama_cpp_gguf.py), run on the CPU's exact kernels against
transformers; the routed-experts kernel against the op's ONNX reference for quantized experts; the .jlm's
expert pages; and bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import tvm
from click.testing import CliRunner
from llama_cpp_gguf import write_llama_cpp_gguf
from reference import hf_greedy, paged_inputs
from test_convert import write_hf_tokenizer, write_safetensors
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from jitllm.cli import main
from jitllm.convert import convert
from jitllm.core.errors import JitllmError
from jitllm.core.jlm import ALIGN, JlmFile
from jitllm.core.quant import parts_from_float
from jitllm.ir.blocks import activation_inputs, block_kind, build_block_graph, linear_of_input, weight_inputs
from jitllm.ir.config import ModelConfig
from jitllm.lowering.cache import get_artifact
from jitllm.lowering.target import kind_for_target
from jitllm.lowering.targets.llvm import LlvmTarget
from jitllm.runtime.backends.tvm_tensors import load_program

LOGIT_TOL = 1e-3
VOCAB = 264
NEW_TOKENS = 32
STOPS = {0, 2}
"""The tiny tokenizer's stop tokens: generation ends at them, transformers' greedy run here does not."""
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=256, initializer_range=0.2, eos_token_id=2, bos_token_id=1)
MODELS = {
    "qwen3moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32,
                                                      intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                                                      norm_topk_prob=True)),
    # OLMoE's routing (top-k weights left unnormalised), and a dense block (mlp_only_layers) after the MoE one
    "qwen3moe unnormalised, dense block 1": (
        Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, intermediate_size=96,
                                            num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                                            mlp_only_layers=[1])),
    "mixtral": (MixtralForCausalLM, MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                                                  num_experts_per_tok=2)),
}
GGUF_ARCH = {"qwen3moe": "qwen3moe", "mixtral": "llama"}


def prompt_and_tokens(hf) -> tuple[list[int], list[int]]:
    """The first seeded prompt whose 32 greedy transformers tokens hold no stop token, and those tokens."""
    for seed in range(100):
        prompt = np.random.default_rng(seed).integers(3, VOCAB, 24).tolist()
        tokens = hf_greedy(hf, prompt, NEW_TOKENS)
        if not STOPS & set(tokens):
            return prompt, tokens
    raise AssertionError("every prompt's continuation hits a stop token")


def hf_model(name: str):
    cls, cfg = MODELS[name]
    torch.manual_seed(len(name))
    model = cls(cfg).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """case -> (transformers model, the .jlm converted from it)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for i, name in enumerate(MODELS):
        hf = hf_model(name)
        hf.save_pretrained(root / f"hf{i}")
        write_hf_tokenizer(root / f"hf{i}")
        convert(str(root / f"hf{i}"), str(root / f"hf{i}.jlm"), progress=False)
        out[f"hf {name}"] = hf, root / f"hf{i}.jlm"
        if name in GGUF_ARCH:
            write_llama_cpp_gguf(hf, root / f"{i}.gguf", GGUF_ARCH[name])
            convert(str(root / f"{i}.gguf"), str(root / f"gguf{i}.jlm"), progress=False)
            out[f"gguf {name}"] = hf, root / f"gguf{i}.jlm"
    return out


@pytest.mark.parametrize("case", ["hf qwen3moe", "gguf qwen3moe", "hf qwen3moe unnormalised, dense block 1",
                                  "hf mixtral", "gguf mixtral"])
def test_moe_matches_transformers(case, models, cache_dir):
    from jitllm.model import load

    hf, path = models[case]
    # f32 KV: decode-step logits at 1e-3 (f16 KV's rounding is ~1e-2, test_real_model.py)
    model = load(path, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir, kv_type="f32")
    prompt, theirs_tokens = prompt_and_tokens(hf)
    assert len(set(theirs_tokens)) > 4
    assert model.generate_ids(prompt, NEW_TOKENS) == theirs_tokens
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt + theirs_tokens])).logits[0].numpy()
    session = model.new_session()
    ours = {len(prompt) - 1: model.executor.forward(session, prompt)}
    for at, token in enumerate(theirs_tokens[:-1], start=len(prompt)):
        ours[at] = model.executor.forward(session, [token])
    for at, logits in ours.items():
        assert np.abs(logits - theirs[at]).max() < LOGIT_TOL, f"position {at}"


def test_every_expert_is_an_aligned_page_of_its_block(models):
    f = JlmFile(models["hf qwen3moe unnormalised, dense block 1"][1])
    assert f.header["config"]["block_types"] == ["moe", "llama"]
    region = f.regions["block.0"]
    assert [p.name for p in region.pages] == [f"expert.{e}" for e in range(8)]
    for e, page in enumerate(region.pages):
        assert page.offset % ALIGN == 0 and page.offset + page.size <= region.size
        inside = sorted(n for n, t in f.tensors.items()
                        if t.region == "block.0" and page.offset <= t.offset < page.offset + page.size)
        assert inside == sorted(f"blk.0.{p}_exps.{e}.w" for p in ("ffn_gate", "ffn_up", "ffn_down"))
        last = max(f.tensors[n].offset + f.tensors[n].nbytes for n in inside)
        assert last == page.offset + page.size  # (the page is its tensors: one copy each expert)
    assert not f.regions["block.1"].pages  # the dense block


def test_fused_expert_layout_converts_as_the_hub_layout(models, tmp_path):
    """transformers' in-memory layout (mlp.experts.gate_up_proj [E, 2F, H], down_proj [E, H, F]) saved as
    is gives the same file as the per-expert hub layout."""
    hf, hub = models["hf qwen3moe"]
    tensors = {k: ("F32", v.detach().numpy()) for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors  # (transformers 5's own layout)
    (tmp_path / "m").mkdir()
    write_safetensors(tmp_path / "m" / "model.safetensors", tensors)
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf.config.to_dict()))
    write_hf_tokenizer(tmp_path / "m")
    convert(str(tmp_path / "m"), str(tmp_path / "m.jlm"), progress=False)
    ours, theirs = JlmFile(tmp_path / "m.jlm"), JlmFile(hub)
    assert set(ours.tensors) == set(theirs.tensors)
    for name in ours.tensors:
        np.testing.assert_array_equal(ours.tensor(name), theirs.tensor(name))


EXPERT_TYPES = {
    "q4_0, q8_0, q4_1": (64, 32, ("q4_0", "q8_0", "q4_1"), 0),
    "f16, bf16, f32, shared expert": (64, 32, ("f16", "bf16", "f32"), 64),
    "q4_k, q5_k, q6_k": (256, 256, ("q4_k", "q5_k", "q6_k"), 0),
    "q5_0, q5_1, q8_0": (64, 32, ("q5_0", "q5_1", "q8_0"), 0),
}


@pytest.mark.parametrize("types, decode", [(t, False) for t in EXPERT_TYPES] + [("q4_0, q8_0, q4_1", True)],
                         ids=[f"{t}-prefill" for t in EXPERT_TYPES] + ["q4_0, q8_0, q4_1-decode"])
def test_routed_expert_kernel_matches_the_reference(types, decode, cache_dir):
    """The llvm block (its MoeSwiGLU kernel reading the experts' parts directly) against ONNX Runtime
    running the same graph, whose MoeSwiGLU is the op's reference body (every expert dequantized); one
    case with a shared expert (no converter writes one yet). Every type combination in prefill, one in
    decode (each case is a compile: the suite's time)."""
    hidden, ffn, (gate, up, down), shared = EXPERT_TYPES[types]
    cfg = ModelConfig("qwen3moe", 1, hidden, 4, 2, 16, 96, 264, 256, 10000.0, 1e-6, qk_norm=True,
                      block_types=("moe",), experts=6, experts_used=2, expert_ffn=ffn, shared_ffn=shared)
    kind = block_kind(cfg, 0, {"attn_q": "q8_0", "attn_k": "q8_0", "attn_v": "q8_0", "attn_output": "f32",
                               "ffn_gate_exps": gate, "ffn_up_exps": up, "ffn_down_exps": down,
                               **dict.fromkeys(("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"), "q8_0")})
    assert len(kind.linears) == (10 if shared else 7)
    kind = kind_for_target(kind, LlvmTarget())
    kind = kind.decode_variant() if decode else kind
    rng = np.random.default_rng(3)
    weights, parts = {}, linear_of_input(kind)
    for spec in kind.linears:
        w = rng.standard_normal((spec.out_features, spec.in_features)).astype(np.float32) / np.sqrt(spec.in_features)
        weights |= {f"{spec.name}_{p}": arr for p, arr in parts_from_float(spec.wtype, w).items()}
    for name, shape, _ in weight_inputs(kind):
        if name not in parts:
            weights[name] = (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
    feeds = {**paged_inputs(kind, rng, 1, 1 if decode else 7, [5]), **weights}
    want = ort.InferenceSession(build_block_graph(kind).SerializeToString()).run(None, feeds)
    program = load_program(get_artifact(kind, LlvmTarget(), cache_dir).path, tvm.cpu(), True)
    names = [n for n, _, _ in activation_inputs(kind) + weight_inputs(kind)]
    got = [o.numpy() for o in program.main(*[tvm.runtime.tensor(feeds[n]) for n in names])]
    assert np.abs(got[0] - want[0]).max() < 1e-4 * max(1.0, np.abs(want[0]).max())
    assert np.abs(got[0] - feeds["x"]).max() > 1e-2  # (the experts add something)


def test_moe_gguf_missing_an_expert_tensor_is_one_line(tmp_path):
    hf = hf_model("qwen3moe")
    src = write_llama_cpp_gguf(hf, tmp_path / "m.gguf", "qwen3moe", drop=("blk.1.ffn_up_exps",))
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "m.jlm")])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == "jitllm: error: m.gguf: missing tensor blk.1.ffn_up_exps.weight"
    assert "Traceback" not in result.stderr and not (tmp_path / "m.jlm").exists()


def test_moe_gguf_with_fewer_experts_than_its_metadata_is_one_line(tmp_path):
    hf = hf_model("mixtral")
    hf.config.num_local_experts = 5  # (the metadata and the routers say 5, each expert tensor holds 4)
    routers = {f"blk.{i}.ffn_gate_inp": np.ones((5, 64), np.float32) for i in range(2)}
    src = write_llama_cpp_gguf(hf, tmp_path / "m.gguf", "llama", changed=routers)
    with pytest.raises(JitllmError, match=r"^blk.0.ffn_gate_exps.weight: shape \[4, 32, 64\], expected \[5, rows, cols\]"):
        convert(str(src), str(tmp_path / "m.jlm"), progress=False)
    assert not (tmp_path / "m.jlm").exists()


def test_top_k_above_the_expert_count_is_one_line(tmp_path):
    hf = hf_model("qwen3moe")
    hf.save_pretrained(tmp_path / "m")
    write_hf_tokenizer(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 9}))
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "m"), "-o", str(tmp_path / "m.jlm")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_experts_per_tok (9) is more than num_experts (8)" in lines[0], lines
    assert not (tmp_path / "m.jlm").exists()


def test_loader_checks_the_pages_a_region_nests():
    """Version 2 headers nest pages: typed, aligned, inside their region, every tensor wholly in one page or
    outside them all; version 1 headers have none."""
    from jitllm.core.jlm_validate import check_container

    def header(pages, tensor_offset=0):
        return {"regions": [{"name": "block.0", "offset": 4096, "size": 16384, "pages": pages}],
                "tensors": {"t": {"region": "block.0", "offset": tensor_offset, "shape": [64], "dtype": "float32"}}}

    good = [{"name": "expert.0", "offset": 4096, "size": 4096}, {"name": "expert.1", "offset": 8192, "size": 256}]
    check_container(header(good, 4096), 100, 4096 + 16384, 4096, 64)
    cases = {
        "is not a multiple of 4096": [{"name": "expert.0", "offset": 64, "size": 64}],
        "inside the page before it": [{"name": "a", "offset": 4096, "size": 8192}, {"name": "b", "offset": 8192, "size": 1}],
        "ends at byte 20480 of a region of 16384": [{"name": "a", "offset": 12288, "size": 8192}],
        "straddles the edge of page 'a'": [{"name": "a", "offset": 0, "size": 128}],
    }
    for message, pages in cases.items():
        with pytest.raises(JitllmError, match=message):
            check_container(header(pages, 64), 100, 4096 + 16384, 4096, 64)
    with pytest.raises(JitllmError, match="version 1 files do not have"):
        check_container(header(good), 100, 4096 + 16384, 4096, 64, pages=False)


def test_moe_blocks_stream_and_move_as_resident_ones(models, cache_dir, monkeypatch):
    """An MoE block (its experts' pages among its tensors) and a dense one streamed through a simulated
    device's two slots, the MoE block moved to the host and back streamed: the resident run's logits, bit
    for bit."""
    from jitllm.model import load

    monkeypatch.setenv("JITLLM_SIM_DEVICES", "1")
    _, path = models["hf qwen3moe unnormalised, dense block 1"]
    prompt = list(range(3, 27))

    def logits(model, moves=()):
        ex = model.executor
        session = ex.new_session()
        out = [ex.forward(session, prompt)]
        for step in range(6):
            for blocks, target in dict(moves).get(step, []):
                model.move(blocks, target)
            out.append(ex.forward(session, [int(np.argmax(out[-1]))]))
        return out

    resident = logits(load(path, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir))
    probe = load(path, devices="sim:0", placement="*=sim:0~", cpu_kernels="exact", cache_dir=cache_dir)
    budget = 2 * max(u.nbytes for u in probe.executor.blocks) + probe.executor.head.nbytes
    model = load(path, devices=f"sim:0={budget}", placement="*=sim:0~", cpu_kernels="exact", cache_dir=cache_dir)
    assert model.executor.blocks[0].kind.kind == "moe" and model.executor.blocks[0].stream is not None
    streamed = logits(model, {2: [("0", "host")], 4: [("0", "sim:0~")]})
    assert all(np.array_equal(a, b) for a, b in zip(streamed, resident, strict=True))
    # both once; the slots shrink to block 1 when block 0 leaves and grow again when it is back: both again
    assert model.executor.streams["sim:0"].uploads == 5
