"""Issue 27, class 3: a .jlm header that is valid JSON with a wrong value is one JitllmError line when the model
is opened (jitllm.checked_model.open_checked, which jitllm.load and the CLI go through), before anything
compiles; a bounded fuzz of header mutations raises nothing else; files of every writer in the tree open."""

from __future__ import annotations

import copy
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from jlm_headers import edited, read_header, write_with_header
from test_cli import assert_one_line_error
from test_convert import QUANT_TYPES, WIDE, float_weights, write_gguf, write_hf

from jitllm.checked_model import open_checked
from jitllm.convert import convert
from jitllm.core.errors import JitllmError
from jitllm.random_model import byte_tokenizer_json, write_random_model


def _set(path: str, value):
    """An edit setting header[a][b]... (path "a/b", list indices as numbers) to `value`."""
    *parents, last = [int(k) if k.isdigit() else k for k in path.split("/")]

    def edit(h: dict) -> None:
        for key in parents:
            h = h[key]
        h[last] = value
    return edit


def _add_tensor(h: dict) -> None:
    h["tensors"]["rogue"] = {"region": "globals", "offset": 0, "shape": [0], "dtype": "uint8"}


BAD_HEADERS = {
    "config missing": (lambda h: h.pop("config"), r"config must be an object \(got None\)"),
    "config number as a string": (_set("config/heads", "4"), r"config.heads must be an integer \(got '4'\)"),
    "config float for an integer": (_set("config/hidden", 64.0), r"config.hidden must be an integer \(got 64.0\)"),
    "zero heads": (_set("config/heads", 0), r"config.heads must be a positive integer \(got 0\)"),
    "negative blocks": (_set("config/num_blocks", -1), r"config.num_blocks must be a positive integer \(got -1\)"),
    "zero context": (_set("config/context", 0), r"config.context must be a positive integer \(got 0\)"),
    "heads not a multiple of kv heads": (_set("config/kv_heads", 3), r"config.heads \(4\) is not a multiple of "
                                                                     r"config.kv_heads \(3\)"),
    "odd head_dim": (_set("config/head_dim", 15), "config.head_dim must be even"),
    "nan eps": (_set("config/rms_eps", float("nan")), "config.rms_eps must be a non-negative number"),
    "tied as a number": (_set("config/tied_head", 1), "config.tied_head must be true or false"),
    "config field missing": (lambda h: h["config"].pop("ffn"), "config.ffn is missing"),
    "unknown config field": (_set("config/sliding_window", 8), "unknown config fields sliding_window"),
    "rope scaling not an object": (_set("config/rope_scaling", "yarn"), r"rope_scaling must be an object"),
    "rope factor as a string": (_set("config/rope_scaling", {"type": "linear", "factor": "2"}),
                                r"config.rope_scaling.factor must be a number \(got '2'\)"),
    "block types miscounted": (_set("config/block_types", ["llama"]), "config lists 1 block types for 4 blocks"),
    "unknown block type": (_set("config/block_types", ["llama", "mamba", "llama", "gla"]),
                           "block 1 has unknown type 'mamba'"),
    "weights missing": (lambda h: h.pop("weights"), r"weights must be an object \(got None\)"),
    "unknown weight type": (_set("weights/blocks/0/attn_q", "q3_k"), r"weights.blocks\[0\].attn_q is 'q3_k', not a "
                                                                     "weight type"),
    "block weights lack a linear": (lambda h: h["weights"]["blocks"][1].pop("ffn_up"),
                                    r"weights.blocks\[1\] must give the type of attn_q, attn_k"),
    "blocks miscounted": (lambda h: h["weights"]["blocks"].pop(), "header lists 1 blocks, config says 2"),
    "tied head of another type": (_set("weights/output", "q8_0"), "weights.output is 'q8_0' but the head is tied"),
    "matrix off its layout": (_set("config/hidden", 60), r"blk\.0\.attn_q: 60 inputs is not a multiple of 32 \(q4_1\)"),
    "tensor deleted": (lambda h: h["tensors"].pop("blk.1.ffn_down.qs"), "tensor blk.1.ffn_down.qs is missing"),
    "tensor shape off the config": (_set("tensors/blk.0.attn_norm/shape", [32]),
                                    r"tensor blk.0.attn_norm is \[32\] float32, the config needs \[64\] float32"),
    "tensor dtype off the layout": (_set("tensors/blk.0.attn_norm/dtype", "float16"),
                                    r"tensor blk.0.attn_norm is \[64\] float16, the config needs \[64\] float32"),
    "tensor no weight reads": (_add_tensor, "tensor 'rogue' is no weight of this model"),
    "vocabulary above the embedding": (_set("tokenizer", byte_tokenizer_json(400)),
                                       "the tokenizer has 400 tokens but the embedding only 320 rows"),
    "tokenizer not a string": (_set("tokenizer", {"model": {}}), "tokenizer must be a tokenizers JSON string"),
    "tokenizer not loadable": (_set("tokenizer", "{}"), "model tokenizer cannot be loaded"),
    "eos out of range": (_set("eos_token_id", 320), "eos_token_id 320 is not a token of the 320-token vocabulary"),
    "negative bos": (_set("bos_token_id", -1), "bos_token_id -1 is not a token"),
    "stop id as a string": (_set("stop_token_ids", ["1"]), r"stop_token_ids must be a list of token ids \(got \['1'\]\)"),
    "stop id out of range": (_set("stop_token_ids", [1, 4096]), r"stop_token_ids\[1\] 4096 is not a token"),
    "eos missing": (lambda h: h.pop("eos_token_id"), "eos_token_id is missing"),
    "add_bos as a string": (_set("add_bos", "yes"), "add_bos must be true or false"),
    "chat template not a string": (_set("chat_template", ["{{ x }}"]), "chat_template must be a string or null"),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_bad_header_values_are_one_line_at_open(tiny_model, tiny_hybrid_model, tmp_path, case):
    edit, message = BAD_HEADERS[case]
    model = tiny_hybrid_model if "block type" in case else tiny_model
    bad = edited(model, tmp_path / "bad.jlm", edit)
    with pytest.raises(JitllmError, match=message) as e:
        open_checked(bad)
    assert str(e.value).startswith(f"{bad}: ") and "\n" not in str(e.value)


# --- the fuzz: a few hundred seeded mutations of valid headers, only JitllmError may come out ---

ODD_VALUES = [-4096, -1, 0, 1, 3, 63, 4097, 2 ** 31, 2 ** 64, 10 ** 30, 0.5, -0.0, 1e308, float("nan"),
              float("inf"), "", "7", "abc", "float32", None, True, False, [], {}, [1, 2], {"a": 1}, [[0]]]


def _places(node, path=()):
    """(container, key, path) of every value in a header, the tokenizer's JSON text as one value."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield node, key, (*path, key)
        yield from _places(value, (*path, key))


def _mutate(header: dict, rng: random.Random) -> str:
    """One random change in place, in a top-level entry picked first (so the many tensor entries do not
    crowd out the config and the token fields); what it did, for the failure message."""
    section = rng.choice(list(header))
    container, key, path = rng.choice([(header, section, (section,)), *_places(header[section], (section,))])
    value, where = container[key], ".".join(map(str, path))
    op = rng.randrange(5)
    if op == 0:
        del container[key]
        return f"deleted {where}"
    if op == 1 and type(value) is int:
        container[key] = value + rng.choice([-4096, -64, -1, 1, 64, 4096, -value, value])
    elif op == 2 and isinstance(container, list) and len(container) > 1:
        other = rng.randrange(len(container))
        container[key], container[other] = container[other], container[key]
        return f"swapped {where} with [{other}]"
    elif op == 3 and isinstance(container, list):
        container.insert(key, copy.deepcopy(value))
        return f"duplicated {where}"
    else:
        container[key] = copy.deepcopy(rng.choice(ODD_VALUES))
    return f"{where}: {value!r:.40} -> {container[key]!r:.40}"


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_fuzzed_headers_raise_only_jitllm_errors(tiny_model, tiny_hybrid_model, tmp_path, preset):
    """150 cases per preset of 1-3 mutations each (~2 s); an accepted file must have every tensor the
    model reads inside the file."""
    model = tiny_model if preset == "tiny" else tiny_hybrid_model
    base, rng = read_header(model), random.Random(27)
    rejected = 0
    for case in range(150):
        header = copy.deepcopy(base)
        changes = [_mutate(header, rng) for _ in range(rng.randint(1, 3))]
        path = write_with_header(model, tmp_path / "fuzz.jlm", header)
        try:
            checked = open_checked(path)
        except JitllmError as e:
            assert "\n" not in str(e), (case, changes)
            rejected += 1
            continue
        except Exception as e:  # noqa: BLE001 (anything else is what the test is for)
            pytest.fail(f"case {case} {changes}: {type(e).__name__}: {e}")
        for name in checked.layout.file_tensors():
            checked.file.tensor(name)  # inside the map (numpy raises where a view would leave it)
    assert rejected > 100  # the mutations do reach the checks (most of them break something)


# --- every writer's files still open ---

def test_files_of_every_writer_open(tmp_path):
    paths = []
    for preset, wtype in [("tiny", "q4_1"), ("tiny", "f16"), ("tiny", "bf16"), ("tiny", "q5_1"),
                          ("tiny-hybrid", "q8_0")]:
        paths.append(tmp_path / f"{preset}-{wtype}.jlm")
        write_random_model(paths[-1], preset, wtype)
    for tied in (True, False):
        weights = float_weights(tied)
        paths.append(tmp_path / f"g{tied}.jlm")
        convert(str(write_gguf(tmp_path / f"m{tied}.gguf", weights, QUANT_TYPES)), str(paths[-1]), progress=False)
        paths.append(tmp_path / f"h{tied}.jlm")
        convert(str(write_hf(tmp_path / f"hf{tied}", weights)), str(paths[-1]), progress=False)
    kquants = {"token_embd": "Q6_K", "blk.0.attn_q": "Q4_K", "blk.1.ffn_down": "Q5_K", "blk.1.ffn_up": "Q5_0"}
    paths.append(tmp_path / "k.jlm")
    convert(str(write_gguf(tmp_path / "k.gguf", float_weights(True, dims=WIDE), kquants, dims=WIDE)),
            str(paths[-1]), progress=False)
    for path in paths:
        open_checked(path)


# --- the CLI: one line, exit 2, and neither TVM nor a compile started ---

PROBE = ("import atexit, runpy, sys; "
         "atexit.register(lambda: print(sorted(m for m in ('tvm', 'jitllm.lowering') if m in sys.modules))); "
         "sys.argv[0] = 'jitllm'; runpy.run_module('jitllm', run_name='__main__')")
"""`python -m jitllm` that says at exit which of TVM and the lowering part (what compiles) were imported."""


@pytest.mark.parametrize("case", ["negative tensor offset", "zero heads", "vocabulary above the embedding",
                                  "tensor deleted"])
def test_cli_refuses_a_bad_header_before_tvm_is_imported(tiny_model, tmp_path, case):
    edit, message = {**BAD_HEADERS, "negative tensor offset": (
        _set("tensors/blk.1.attn_norm/offset", -4096), r"offset must be a non-negative integer \(got -4096\)")}[case]
    bad = edited(tiny_model, tmp_path / "bad.jlm", edit)
    cache = tmp_path / "cache"
    result = subprocess.run([sys.executable, "-c", PROBE, "run", "-devices", "cpu", str(bad), "hi"],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, JITLLM_CACHE_DIR=str(cache)))
    assert_one_line_error(result)
    assert re.search(f"^jitllm: error: {re.escape(str(bad))}: .*{message}", result.stderr)
    # Refused before anything that compiles was even imported (this replaces a wall-clock bound, which a
    # loaded machine broke): no compile started, no cache made.
    assert result.stdout.strip() == "[]" and not cache.exists()
