"""`runtime bench serve --dataset-name random-ids` against a server without a tokenizer (--skip-tokenizer-init)."""

from __future__ import annotations

import json
import subprocess
import sys

from runtime.bench.throughput import make_workload

from support.remote_server import SERVER_FLAGS, running_server


def test_token_id_prompts_need_no_tokenizer_and_match_bench_throughput(tmp_path):
    from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model

    model = build_untokenized_model("llama", tmp_path / "model")
    result_file = tmp_path / "result.json"
    with running_server(model, SERVER_FLAGS + ["--skip-tokenizer-init"], tmp_path / "server.log") as server:
        cmd = [sys.executable, "-m", "runtime.cli.main", "bench", "serve", "--base-url", server.url,
               "--dataset-name", "random-ids", "--input-len", "4,12", "--output-len", "3,6", "--num-prompts", "8",
               "--max-concurrency", "4", "--seed", "3", "--save-result", "--result-filename", str(result_file)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        chat = subprocess.run([*cmd[:-3], "--endpoint", "chat"], capture_output=True, text=True, timeout=300)
        assert chat.returncode != 0 and "needs --endpoint completions" in chat.stderr
    result = json.loads(result_file.read_text())
    workload = make_workload(8, (4, 12), (3, 6), UNTOKENIZED_VOCAB_SIZE, 3)  # the vocab from the model's config.json
    assert result["model"] == model  # the name the server lists: its model argument as given
    assert (result["completed"], result["failed"], result["max_concurrency"]) == (8, 0, 4)
    assert result["total_input_tokens"] == workload.num_prompt_tokens
    assert result["total_output_tokens"] == workload.num_output_tokens
    assert sorted(r["output_tokens"] for r in result["results"]) == sorted(workload.output_lens)
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
