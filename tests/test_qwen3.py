"""Qwen3 (per-head q/k RMS norms before RoPE): tiny random transformers Qwen3ForCausalLMs (f32), converted from
their save_pretrained directories and from GGUFs laid out as llama.cpp's convert_hf_to_gguf.py writes them
(tests/llama_cpp_gguf.py), run on the CPU's exact kernels against transformers.

heads * head_dim (128) differs from hidden (64), and every norm weight is drawn at random (transformers starts
them at 1), so a q/k norm applied in the wrong row order, or not at all, changes the logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp_gguf import write_llama_cpp_gguf
from reference import hf_greedy
from test_convert import jlm_weights, write_hf_tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

from jitllm.convert import convert
from jitllm.convert.rope_rows import permute_rows
from jitllm.core.jlm import JlmFile

LOGIT_TOL = 1e-3
VOCAB = 264
PROMPT = np.random.default_rng(5).integers(3, VOCAB, 24).tolist()
NEW_TOKENS = 32


def qwen3(tied: bool, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6,
                      initializer_range=0.2, tie_word_embeddings=tied, eos_token_id=2, bos_token_id=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Qwen3ForCausalLM, Path]]:
    """case -> (transformers model, the .jlm converted from it)."""
    root = tmp_path_factory.mktemp("qwen3")
    out = {}
    for tied in (False, True):
        hf = qwen3(tied, seed=int(tied))
        name = "tied" if tied else "untied"
        hf.save_pretrained(root / name)
        write_hf_tokenizer(root / name)
        convert(str(root / name), str(root / f"{name}.jlm"), progress=False)
        out[f"hf {name}"] = hf, root / f"{name}.jlm"
        write_llama_cpp_gguf(hf, root / f"{name}.gguf", "qwen3")
        convert(str(root / f"{name}.gguf"), str(root / f"{name}-gguf.jlm"), progress=False)
        out[f"gguf {name}"] = hf, root / f"{name}-gguf.jlm"
    return out


@pytest.mark.parametrize("case", ["hf untied", "hf tied", "gguf untied", "gguf tied"])
def test_qwen3_matches_transformers(case, models, cache_dir):
    from jitllm.model import load

    hf, path = models[case]
    header = JlmFile(path).header
    assert header["config"]["qk_norm"] is True and header["config"]["tied_head"] == hf.config.tie_word_embeddings
    # f32 KV: decode-step logits at 1e-3 (f16 KV's rounding is ~1e-2, test_real_model.py)
    model = load(path, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir, kv_type="f32")
    theirs_tokens = hf_greedy(hf, PROMPT, NEW_TOKENS)
    assert len(set(theirs_tokens)) > 4  # (a continuation that says something about the logits)
    assert model.generate_ids(PROMPT, NEW_TOKENS) == theirs_tokens
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT + theirs_tokens])).logits[0].numpy()
    session = model.new_session()
    ours = {len(PROMPT) - 1: model.executor.forward(session, PROMPT)}
    for at, token in enumerate(theirs_tokens[:-1], start=len(PROMPT)):
        ours[at] = model.executor.forward(session, [token])
    for at, logits in ours.items():
        assert np.abs(logits - theirs[at]).max() < LOGIT_TOL, f"position {at}"


def test_chat_templated_qwen3_matches_transformers(models, cache_dir):
    """The converted file's chat template, rendered and encoded by jitllm, gives transformers' own
    apply_chat_template ids for the same directory, and the same 32 greedy tokens after them."""
    import json

    from transformers import PreTrainedTokenizerFast

    from jitllm.model import load

    hf, path = models["hf untied"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the hello the"}]
    model = load(path, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir)
    ours = model.tokenizer.encode_chat(messages)
    directory = path.parent / "untied"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    tok.chat_template = json.loads((directory / "tokenizer_config.json").read_text())["chat_template"]
    theirs = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours == list(theirs) and len(ours) > 10
    with torch.no_grad():  # (an explicit mask: generate() would mask the prompt's <|im_end|>, id 2, as padding)
        ids = torch.tensor([ours])
        tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ours):].tolist()
    generated = model.generate_ids(ours, NEW_TOKENS)
    assert generated == tokens[:len(generated)]  # (ours ends early only at a stop token)
    assert len(generated) == NEW_TOKENS or tokens[len(generated)] in model.tokenizer.stop_token_ids


def test_quantized_qwen3_gguf_keeps_its_bytes_in_rope_order(models, tmp_path):
    """Q8_0 q/k projections of a qwen3 GGUF (NeoX row order) pass through as bytes, their rows moved into
    jitllm's interleaved order, as are the q/k norms: the same matrices as the HF conversion's, to Q8_0's
    rounding."""
    hf, _ = models["hf untied"]
    types = {f"blk.{i}.{n}": "Q8_0" for i in range(2) for n in ("attn_q", "attn_k", "ffn_down")}
    src = write_llama_cpp_gguf(hf, tmp_path / "q8.gguf", "qwen3", types)
    convert(str(src), str(tmp_path / "q8.jlm"), progress=False)
    header, ours = jlm_weights(tmp_path / "q8.jlm")
    assert header["weights"]["blocks"][0]["attn_q"] == "q8_0"
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    q = permute_rows(sd["model.layers.1.self_attn.q_proj.weight"], 4)
    np.testing.assert_allclose(ours["blk.1.attn_q"], q, atol=np.abs(q).max() / 100)
    assert np.abs(ours["blk.1.attn_q"] - q).max() < np.abs(q).max() / 100
    np.testing.assert_array_equal(ours["blk.1.attn_k_norm"], permute_rows(sd["model.layers.1.self_attn.k_norm.weight"], 1))


def test_qwen3_sliding_window_is_refused(tmp_path):
    from jitllm.core.errors import JitllmError

    hf = qwen3(False, 0)
    hf.config.use_sliding_window = True
    hf.save_pretrained(tmp_path / "m")
    write_hf_tokenizer(tmp_path / "m")
    with pytest.raises(JitllmError, match="use_sliding_window is not supported"):
        convert(str(tmp_path / "m"), str(tmp_path / "m.jlm"), progress=False)
    assert not (tmp_path / "m.jlm").exists()
