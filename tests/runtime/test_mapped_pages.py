"""Issue 27 class 8: a loaded model's weights are held once, in their device buffers, not a second time as
the .jlm file's mapped pages (on the host both count in the process's memory)."""

from __future__ import annotations

import re
from pathlib import Path

from dataclasses import replace

from jitllm.model import load
from jitllm.random_model import PRESETS, write_random_model

_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def resident_mapped_bytes(path: Path) -> int:
    """Bytes of this process's mappings of `path` that are resident (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if _MAPPING.match(line):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_uploaded_weights_are_not_also_held_as_mapped_pages(tmp_path, cache_dir):
    path = tmp_path / "deep.jlm"  # (the tiny preset's kinds, 48 blocks of them: weights of many pages)
    write_random_model(path, replace(PRESETS["tiny"], num_blocks=48), "q4_1", seed=1)
    model = load(path, devices="cpu", cache_dir=cache_dir, ctx=64)
    weights = sum(t.nbytes for t in model.executor.model.tensors.values())
    assert model.generate_ids(model.encode_prompt("hi"), 4)  # (runs on the uploaded weights)
    # What stays mapped: the pages of the few embedding rows looked up since (each row's page).
    assert resident_mapped_bytes(path.resolve()) < 0.2 * weights
