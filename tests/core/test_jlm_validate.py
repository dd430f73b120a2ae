"""The .jlm container checks at open (jitllm.core.jlm_validate): a header that is valid JSON but lays out
regions or tensors wrongly is one JitllmError line naming the entry, before any tensor is read."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from jlm_headers import edited, read_header, write_with_header

from jitllm.core.errors import JitllmError
from jitllm.core.jlm import JlmFile


def _tensor(h: dict, name: str) -> dict:
    return h["tensors"][name]


def _swap_regions(h: dict) -> None:
    h["regions"][1], h["regions"][2] = h["regions"][2], h["regions"][1]


def _region_of(h: dict, name: str) -> dict:
    return next(r for r in h["regions"] if r["name"] == _tensor(h, name)["region"])


BAD_CONTAINERS = {
    "regions not a list": (lambda h: h.update(regions={"globals": 0}), r"regions must be a list \(got \{'globals'"),
    "region lacks its size": (lambda h: h["regions"][1].pop("size"), "region 1 lacks size"),
    "region name not a string": (lambda h: h["regions"][0].update(name=7), "region 0 name must be a non-empty string"),
    "region listed twice": (lambda h: h["regions"][2].update(name="block.0"), "region 'block.0' is listed twice"),
    "region offset a string": (lambda h: h["regions"][1].update(offset=str(h["regions"][1]["offset"])),
                               r"region 'block.0' offset must be a non-negative integer \(got '\d+'\)"),
    "region offset negative": (lambda h: h["regions"][1].update(offset=-4096), r"offset must be .*\(got -4096\)"),
    "region offset a float": (lambda h: h["regions"][1].update(offset=h["regions"][1]["offset"] + 0.0),
                              r"must be a non-negative integer \(got \d+\.0\)"),
    "region unaligned": (lambda h: h["regions"][1].update(offset=h["regions"][1]["offset"] + 64),
                         "is not a multiple of 4096"),
    "region over the header": (lambda h: h["regions"][0].update(offset=0), "starts at byte 0, inside the header"),
    "regions out of order": (_swap_regions, r"region 'block.0' starts at byte \d+, inside region 'block.1'"),
    "regions overlap": (lambda h: h["regions"][2].update(offset=h["regions"][1]["offset"]),
                        "region 'block.1' starts at byte .* inside region 'block.0'"),
    "region past the end": (lambda h: h["regions"][-1].update(size=h["regions"][-1]["size"] + 1 << 20),
                            r"truncated .jlm file \(\d+ bytes; region 'block.1' ends at byte"),
    "region deleted": (lambda h: h["regions"].pop(1), "tensor 'blk.0.attn_norm' is in region 'block.0', which the "
                                                      "header does not list"),
    "tensors not an object": (lambda h: h.update(tensors=[]), r"tensors must be an object \(got \[\]\)"),
    "tensor entry not an object": (lambda h: h["tensors"].update({"blk.0.attn_norm": 3}),
                                   "tensor 'blk.0.attn_norm' must be an object"),
    "tensor lacks its dtype": (lambda h: _tensor(h, "blk.0.ffn_norm").pop("dtype"), "tensor 'blk.0.ffn_norm' lacks dtype"),
    "unknown dtype": (lambda h: _tensor(h, "output_norm").update(dtype="float8"), "has dtype 'float8' .known: float32"),
    "object dtype": (lambda h: _tensor(h, "output_norm").update(dtype="object"), "has dtype 'object'"),
    "shape not a list": (lambda h: _tensor(h, "output_norm").update(shape=64), r"shape must be a list \(got 64\)"),
    "negative dimension": (lambda h: _tensor(h, "output_norm").update(shape=[-64]), r"shape must be .*\(got -64\)"),
    "boolean dimension": (lambda h: _tensor(h, "output_norm").update(shape=[True]), r"\(got True\)"),
    "dimension beyond the file": (lambda h: _tensor(h, "output_norm").update(shape=[0, 2 ** 70]),
                                  "is larger than the file"),
    "negative tensor offset": (lambda h: _tensor(h, "blk.1.attn_norm").update(offset=-4096),
                               r"tensor 'blk.1.attn_norm' offset must be a non-negative integer \(got -4096\)"),
    "unaligned tensor offset": (lambda h: _tensor(h, "blk.1.attn_norm").update(offset=1), "is not a multiple of 64"),
    "tensor past its region": (lambda h: _tensor(h, "blk.1.ffn_norm").update(offset=_region_of(h, "blk.1.ffn_norm")["size"] // 64 * 64),
                               r"tensor 'blk.1.ffn_norm' \(\[64\] float32\) ends at byte \d+ of region 'block.1', which has"),
    "shape larger than its bytes": (lambda h: _tensor(h, "token_embd.qs").update(shape=[80, 2, 16, 64]),
                                    r"tensor 'token_embd.qs' \(\[80, 2, 16, 64\] uint8\) ends at byte"),
    "tensors overlap": (lambda h: _tensor(h, "blk.0.ffn_norm").update(offset=_tensor(h, "blk.0.attn_norm")["offset"]),
                        "tensors 'blk.0.attn_norm' and 'blk.0.ffn_norm' overlap in region 'block.0'"),
}


@pytest.mark.parametrize("case", list(BAD_CONTAINERS))
def test_bad_layouts_are_one_line_at_open(tiny_model, tmp_path, case):
    edit, message = BAD_CONTAINERS[case]
    bad = edited(tiny_model, tmp_path / "bad.jlm", edit)
    with pytest.raises(JitllmError, match=message) as e:
        JlmFile(bad)
    assert str(e.value).startswith(f"{bad}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("blob,message", [
    (b"[1, 2]", r"not a JSON object"),
    (b"{\"regions\": [", r"corrupt .jlm header \(not JSON\)"),
    (b"[" * 100_000, r"corrupt .jlm header \(not JSON\)"),  # deeper than the parser recurses
    (b"\xff\xfe{}", r"corrupt .jlm header \(not JSON\)"),
])
def test_headers_that_are_no_json_object(tiny_model, tmp_path, blob, message):
    data = tiny_model.read_bytes()
    bad = tmp_path / "bad.jlm"
    bad.write_bytes(data[:16] + len(blob).to_bytes(8, "little") + blob + data[24 + len(blob):])
    with pytest.raises(JitllmError, match=message):
        JlmFile(bad)


def test_an_unedited_rewrite_opens_and_every_view_lies_inside_the_file(tiny_model, tiny_hybrid_model, tmp_path):
    """The helper the cases use changes nothing by itself, and the files of the writer open."""
    for model in (tiny_model, tiny_hybrid_model):
        same = write_with_header(model, tmp_path / model.name, read_header(model))
        assert same.read_bytes() == model.read_bytes()
        f = JlmFile(same)
        size = Path(same).stat().st_size
        for name, entry in f.tensors.items():
            start = f.regions[entry.region].offset + entry.offset
            assert f.tensor(name).shape == entry.shape and start + entry.nbytes <= size


def test_opening_what_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    """Through the Python API too (the CLI checks first): a FIFO is refused without waiting for a writer.
    If the open blocks, a writer comes after 20 s to end the wait, and the test fails on that."""
    fifo = tmp_path / "model.jlm"
    os.mkfifo(fifo)
    refused, unblocked = threading.Event(), []

    def unblock() -> None:
        if not refused.wait(20):
            unblocked.append(True)
            with open(fifo, "wb"):
                pass

    threading.Thread(target=unblock, daemon=True).start()
    try:
        with pytest.raises(JitllmError, match=f"{fifo} is a FIFO, not a .jlm model file"):
            JlmFile(fifo)
    finally:
        refused.set()
    assert not unblocked
    with pytest.raises(JitllmError, match="/dev/null is a character device, not a .jlm model file"):
        JlmFile("/dev/null")
    with pytest.raises(JitllmError, match="is a directory, not a .jlm model file"):
        JlmFile(tmp_path)
