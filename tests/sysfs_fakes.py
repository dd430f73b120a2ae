"""A fake procfs/sysfs tree for jitllm.runtime.inventory.detect_cpu (its `root`): the CPU and NUMA tests'."""

from __future__ import annotations

from pathlib import Path


def fake_sysfs(root: Path, siblings: dict[int, str], extra: dict[str, str]) -> None:
    """/proc/cpuinfo, each CPU's thread_siblings_list (`siblings`) and the files of `extra` under `root`."""
    files = {
        "proc/cpuinfo": "processor\t: 0\nmodel name\t: Fake Core i9\nflags\t\t: fpu avx avx2 fma f16c avx_vnni\n"
    }
    for cpu, sib in siblings.items():
        files[f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"] = sib
    files.update(extra)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text + "\n")
