"""Write a random-weight llama GGUF of one of jitllm's named shapes, for llama.cpp's llama-bench.

    python3 bench/llamacpp/random_gguf.py -preset llama-3.2-3b -wtype q4_0 -out /tmp/3b-q4_0.gguf [-jobs 16]

Shapes come from jitllm.random_model.PRESETS (same shapes jitllm benchmarks); weight types f16, q4_0, q4_1, q8_0
(every matrix, token_embd included, like jitllm's random models; norms f32), or q4_k_m: llama.cpp's Q4_K_M mix
(Q4_K, with Q6_K for the head and for attn_v and ffn_down in the layers llama.cpp's use_more_bits picks; the
K-quants by jitllm's encoder, gguf.quants has none). Weights ~ N(0, 1/fan_in), the embedding 8x that, norms
near 1. The tokenizer is a minimal "gpt2" BPE one made here: ids 0-3 are <s>, </s>,
<|im_end|>, <|im_start|>, then the 256 byte tokens (GPT-2's byte-to-unicode spelling), a few merged tokens
with their merges, and "<padN>" tokens up to the vocab size (no downloads; the GPU machine has none).

Fast: the header (metadata, tensor infos) is written with gguf.GGUFWriter, then worker processes generate
row chunks, convert them (numpy f16 or gguf.quants.quantize) and pwrite them at their offsets in parallel.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

try:
    import yaml  # noqa: F401  (gguf imports it for model cards only)
except ImportError:  # the GPU machine's image may lack PyYAML: gguf does not need it for writing
    import types

    sys.modules["yaml"] = types.ModuleType("yaml")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for jitllm

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from jitllm.core import kquant_encode  # noqa: E402
from jitllm.core.layouts import K_QUANTS  # noqa: E402
from jitllm.random_model import PRESETS  # noqa: E402

WTYPES = {"f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
          "q4_0": (QT.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
          "q4_1": (QT.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
          "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
          "q4_k_m": (QT.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M)}
SPECIALS = ["<s>", "</s>", "<|im_end|>", "<|im_start|>"]
MERGES = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r"]
CHUNK_ELEMS = 1 << 23  # elements generated per job (32 MiB of float32)


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable unicode character table, indexed by byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tokenizer(vocab: int) -> tuple[list[str], list[int], list[str]]:
    tokens = SPECIALS + bytes_to_unicode() + ["".join(m.split()) for m in MERGES]
    if vocab < len(tokens):
        raise SystemExit(f"vocab {vocab} is too small for the byte tokenizer (needs {len(tokens)})")
    tokens += [f"<pad{i}>" for i in range(vocab - len(tokens))]
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (vocab - len(SPECIALS))
    return tokens, [int(t) for t in types], MERGES


@dataclass(frozen=True)
class Tensor:
    name: str
    rows: int
    cols: int  # 0 for a 1-D tensor (norm) of `rows` elements
    qtype: QT
    scale: float  # std of the random values (norms: 1 + scale * N(0, 1))
    offset: int = 0  # from the start of the data section

    @property
    def row_bytes(self) -> int:
        block, nbytes = gguf.GGML_QUANT_SIZES[self.qtype]
        return (self.cols or self.rows) // block * nbytes

    @property
    def nbytes(self) -> int:
        return self.row_bytes * (self.rows if self.cols else 1)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice (src/llama-quant.cpp) of the layers whose attn_v and ffn_down Q4_K_M stores as Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def layout(cfg, qtype: QT, mix: bool = False) -> list[Tensor]:
    """The tensors, all linears of `qtype`; with `mix`, Q4_K_M's: Q6_K for the head (the embedding where it is
    tied) and for attn_v and ffn_down where use_more_bits says so."""
    h, kvd = cfg.hidden, cfg.kv_heads * cfg.head_dim
    head = QT.Q6_K if mix else qtype
    out = [Tensor("token_embd.weight", cfg.vocab, h, head if cfg.tied_head else qtype, 8 / np.sqrt(h)),
           Tensor("output_norm.weight", h, 0, QT.F32, 0.05)]
    if not cfg.tied_head:
        out.append(Tensor("output.weight", cfg.vocab, h, head, 1 / np.sqrt(h)))
    for i in range(cfg.num_blocks):
        b = f"blk.{i}."
        more = QT.Q6_K if mix and use_more_bits(i, cfg.num_blocks) else qtype
        out += [Tensor(b + "attn_norm.weight", h, 0, QT.F32, 0.05),
                Tensor(b + "attn_q.weight", cfg.heads * cfg.head_dim, h, qtype, 1 / np.sqrt(h)),
                Tensor(b + "attn_k.weight", kvd, h, qtype, 1 / np.sqrt(h)),
                Tensor(b + "attn_v.weight", kvd, h, more, 1 / np.sqrt(h)),
                Tensor(b + "attn_output.weight", h, cfg.heads * cfg.head_dim, qtype, 1 / np.sqrt(cfg.heads * cfg.head_dim)),
                Tensor(b + "ffn_norm.weight", h, 0, QT.F32, 0.05),
                Tensor(b + "ffn_gate.weight", cfg.ffn, h, qtype, 1 / np.sqrt(h)),
                Tensor(b + "ffn_up.weight", cfg.ffn, h, qtype, 1 / np.sqrt(h)),
                Tensor(b + "ffn_down.weight", h, cfg.ffn, more, 1 / np.sqrt(cfg.ffn))]
    return out


def write_header(path: Path, cfg, wtype: str, name: str) -> tuple[list[Tensor], int, int]:
    """Metadata and tensor infos; returns the tensors with offsets, the data start and the file size."""
    qtype, ftype = WTYPES[wtype]
    tensors = layout(cfg, qtype, mix=wtype == "q4_k_m")
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_file_type(int(ftype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(cfg.vocab)
    w.add_context_length(cfg.context)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.ffn)
    w.add_block_count(cfg.num_blocks)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    tokens, types, merges = tokenizer(cfg.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # a split rule jitllm convert knows too, so both run the same file
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    placed, offset = [], 0
    for t in tensors:
        shape = (t.rows, t.cols) if t.cols else (t.rows,)
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        placed.append(replace(t, offset=offset))
        offset += gguf.GGUFWriter.ggml_pad(t.nbytes, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    start = gguf.GGUFWriter.ggml_pad(fout.tell(), w.data_alignment)
    w.close()
    return placed, start, start + offset


_fd: dict[str, int] = {}


def _fast_rows(rng: np.random.Generator, t: Tensor, rows: int) -> np.ndarray:
    """Random rows made directly in the stored format from random bits (~10x faster than normal + quantize):
    f16: random sign and mantissa, exponent spread over 4 octaves, std within 1.4x of t.scale (no inf/nan);
    q4_0/q4_1/q8_0: random quants (uniform) with every block's scale set so the std is ~t.scale."""
    if t.qtype == QT.F16:
        r = np.frombuffer(rng.bytes(rows * t.cols * 2), dtype=np.uint16).copy()
        # keep sign, mantissa and the exponent's 2 low bits, then add e0: |x| = 2^(e - 15) * (1 + m / 1024)
        # with e uniform in [e0, e0 + 3], whose rms is ~0.44 * 2^(e0 - 11) (so the std is within 1.4x of t.scale)
        e0 = int(np.clip(np.round(np.log2(t.scale / 0.44)) + 11, 1, 27))
        r &= np.uint16(0x8FFF)
        r += np.uint16(e0 << 10)
        return r.reshape(rows, t.cols)
    block, nbytes = gguf.GGML_QUANT_SIZES[t.qtype]
    blocks = np.frombuffer(rng.bytes(rows * t.row_bytes), dtype=np.uint8).reshape(-1, nbytes).copy()
    q_std = 73.9 if t.qtype == QT.Q8_0 else 4.61  # std of uniform int8 / uniform nibbles
    d = np.float16(t.scale / q_std)
    blocks[:, :2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    if t.qtype == QT.Q4_1:  # x = d * q + m with q in 0..15: centre it
        blocks[:, 2:4] = np.frombuffer(np.float16(-7.5 * float(d)).tobytes(), dtype=np.uint8)
    return blocks


def _fill(job) -> int:
    """Generate and write rows [r0, r1) of one tensor; returns the bytes written."""
    path, data_start, t, r0, r1, seed, fast = job
    fd = _fd.get(path)
    if fd is None:
        fd = _fd[path] = os.open(path, os.O_WRONLY)
    rng = np.random.default_rng(seed)
    if not t.cols:  # a norm
        data = (1.0 + t.scale * rng.standard_normal(t.rows, dtype=np.float32)).astype(np.float32)
    elif fast:
        data = _fast_rows(rng, t, r1 - r0)
    else:
        x = rng.standard_normal((r1 - r0, t.cols), dtype=np.float32)
        x *= np.float32(t.scale)
        if t.qtype == QT.F16:
            data = x.astype(np.float16)
        elif t.qtype.name.lower() in K_QUANTS:
            data = kquant_encode.quantize(t.qtype.name.lower(), x)
        else:
            data = gguf.quants.quantize(x, t.qtype)
    buf = memoryview(np.ascontiguousarray(data)).cast("B")
    pos = data_start + t.offset + r0 * t.row_bytes
    while buf:
        n = os.pwrite(fd, buf, pos)
        buf, pos = buf[n:], pos + n
    return r1 - r0 if t.cols else 1


def write_random_gguf(path: str | Path, preset: str, wtype: str = "q4_0", seed: int = 0, jobs: int | None = None,
                      blocks: int | None = None, fast: bool = False, log=print) -> dict:
    cfg = PRESETS.get(preset)
    if cfg is None:
        raise SystemExit(f"unknown model shape {preset!r} (known: {', '.join(PRESETS)})")
    if blocks is not None:
        cfg = replace(cfg, num_blocks=blocks)
    if wtype not in WTYPES:
        raise SystemExit(f"unknown weight type {wtype!r} (known: {', '.join(WTYPES)})")
    if fast and wtype == "q4_k_m":
        raise SystemExit("-fast makes GGML 32-block formats only (not q4_k_m)")
    path = Path(path)
    start = time.perf_counter()
    tensors, data_start, size = write_header(path, cfg, wtype, f"random {preset} {wtype}")
    os.truncate(path, size)
    work = []
    for ti, t in enumerate(tensors):
        if not t.cols:
            work.append((str(path), data_start, t, 0, 1, (seed, ti, 0), fast))
            continue
        step = max(1, CHUNK_ELEMS // t.cols)
        for ci, r0 in enumerate(range(0, t.rows, step)):
            work.append((str(path), data_start, t, r0, min(t.rows, r0 + step), (seed, ti, ci), fast))
    work.sort(key=lambda j: -(j[4] - j[3]) * max(j[2].cols, 1))  # big chunks first
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        for j in work:
            _fill(j)
    else:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(jobs) as pool:
            for _ in pool.imap_unordered(_fill, work, chunksize=1):
                pass
    elapsed = time.perf_counter() - start
    n_params = sum(t.rows * max(t.cols, 1) for t in tensors)
    info = {"path": str(path), "preset": preset, "wtype": wtype, "blocks": cfg.num_blocks, "bytes": size,
            "tensor_bytes": sum(t.nbytes for t in tensors), "n_params": n_params, "fast": fast, "seconds": elapsed}
    if log:
        log(f"wrote {path}: random {preset} ({cfg.num_blocks} blocks) {wtype}, {n_params / 1e6:.1f} M params, "
            f"{size / 2**20:.1f} MiB in {elapsed:.1f}s ({size / 2**30 / elapsed:.2f} GiB/s, {jobs} jobs{', fast fill' if fast else ''})")
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-preset", default="smollm2-135m", help=f"one of {', '.join(PRESETS)}")
    ap.add_argument("-wtype", default="q4_0", choices=list(WTYPES))
    ap.add_argument("-out", required=True)
    ap.add_argument("-seed", type=int, default=0)
    ap.add_argument("-jobs", type=int, default=None, help="worker processes (default: all cores)")
    ap.add_argument("-blocks", type=int, default=None, help="override the number of blocks (for quick tests)")
    ap.add_argument("-fast", action="store_true",
                    help="make the stored values straight from random bits instead of N(0, s) + gguf.quants.quantize")
    args = ap.parse_args()
    write_random_gguf(args.out, args.preset, args.wtype, args.seed, args.jobs, args.blocks, args.fast)


if __name__ == "__main__":
    main()
