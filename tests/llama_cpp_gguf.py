"""A GGUF laid out as llama.cpp's convert_hf_to_gguf.py (llama-cpp-python 0.3.36's vendor/llama.cpp,
conversion/llama.py and conversion/qwen.py) writes one from a transformers model with --outtype f32:
the same tensor names, the same metadata keys, llama's Q/K rows permuted (LlamaModel.permute, also
Mixtral) and qwen3's left in Hugging Face order (llama.cpp rotates those NeoX-style), each block's experts
stacked into one [experts, rows, cols] tensor per projection (torch.stack over the expert index; the
state dict of transformers 5 holds them stacked already, gate and up in one gate_up_proj, which the script
splits the same way).

Written with the gguf package rather than by running the script: the script picks the pre-tokenizer by
hashing a real tokenizer's output, which the tests' 264-token vocabulary does not have. Checked once against
the script itself (its vocabulary readers patched to write this tiny vocabulary): for the Qwen3, Qwen3-MoE
and Mixtral models of tests/test_qwen3.py and tests/test_moe.py both give the same tensor names, shapes and
bytes and the same metadata keys and values outside tokenizer.* and general.*."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from test_tokenizer import tiny_tokenizer_metadata

ATTENTION = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}
"""Hugging Face module (after model.layers.N.) -> GGUF tensor (after blk.N.), as gguf's TensorNameMap has them."""
EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute of convert_hf_to_gguf.py (conversion/llama.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_cpp_gguf(model, path: Path, arch: str, types: dict[str, str] | None = None,
                         drop: tuple[str, ...] = (), changed: dict[str, np.ndarray] | None = None) -> Path:
    """`model` (a transformers causal LM) as convert_hf_to_gguf.py writes it for `arch` ("llama" for
    Llama and Mixtral, "qwen3", "qwen3moe"). `types`: GGUF tensor name -> GGML type other than F32
    (quantized with gguf's quantizers, as llama-quantize would); `drop`: tensors left out, `changed`: tensors
    replaced (bad inputs)."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if getattr(c, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if getattr(c, "head_dim", None):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch == "llama":  # (LlamaModel.set_gguf_parameters)
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    meta = tiny_tokenizer_metadata("qwen2" if arch.startswith("qwen") else "llama-bpe")
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(meta["tokenizer.chat_template"])

    tensors: dict[str, np.ndarray] = {"token_embd": sd.pop("model.embed_tokens.weight"),
                                      "output_norm": sd.pop("model.norm.weight")}
    if not c.tie_word_embeddings:
        tensors["output"] = sd.pop("lm_head.weight")
    sd.pop("lm_head.weight", None)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, arr in sd.items():
        _, _, block, rest = name.split(".", 3)
        module = rest.removesuffix(".weight")
        if module.endswith("experts.gate_up_proj"):  # (transformers' in-memory layout: the experts already stacked)
            half = arr.shape[1] // 2
            tensors[f"blk.{block}.ffn_gate_exps"], tensors[f"blk.{block}.ffn_up_exps"] = arr[:, :half], arr[:, half:]
            continue
        if module.endswith("experts.down_proj"):
            tensors[f"blk.{block}.ffn_down_exps"] = arr
            continue
        if ".experts." in module:
            head, index, proj = module.rsplit(".", 2)
            stacks.setdefault(f"blk.{block}.{EXPERTS[proj]}", {})[int(index)] = arr
            continue
        if arch == "llama" and module == "self_attn.q_proj":
            arr = llama_permute(arr, c.num_attention_heads)
        elif arch == "llama" and module == "self_attn.k_proj":
            arr = llama_permute(arr, c.num_key_value_heads)
        tensors[f"blk.{block}.{ATTENTION[module]}"] = arr
    for name, per_expert in stacks.items():
        tensors[name] = np.stack([per_expert[i] for i in range(len(per_expert))])
    tensors |= changed or {}
    for name, arr in tensors.items():
        if name in drop:
            continue
        qtype = gguf.GGMLQuantizationType[(types or {}).get(name, "F32")]
        data = arr if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(arr, qtype)
        w.add_tensor(f"{name}.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
