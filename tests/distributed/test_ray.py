"""The ``ray`` executor (runtime-plugin-ray) on a local Ray cluster that this module starts
(2 logical CPUs, one per worker actor): TP=2 and PP=2 greedy tokens identical to one worker
and to transformers, async scheduling included; ``runtime serve`` over the same cluster gives
the same tokens, and a killed actor fails the request in flight naming its rank, without a
hang; messages to the executor's TCP socket from anyone without its secret are dropped unread;
the executor flag's errors list ``ray`` among the valid names.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import re
import signal
import threading
import time

import pytest
import ray
import zmq

from support.remote_server import SERVER_FLAGS, RemoteServer, stream
from support.token_id_completions import concurrent_greedy_completions

from runtime import LLM, SamplingParams, plugins
from runtime.cli.args import engine_args_from_namespace
from runtime.cli.main import build_parser
from runtime.engine_args import build_engine_config
from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import check_logprobs_close, check_outputs_equal, make_prompts, reference_outputs


NUM_NEW_TOKENS = 8
LOGPROB_ATOL = 1e-3  # float32; the ranks' partial sums add up in another order than one matmul
# Eager steps: what is tested is the executor, and compiling decode graphs takes longer than the test.
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, num_gpu_blocks_override=256, max_model_len=256, enforce_eager=True)
FAIL_BOUND_S = 15.0  # from the kill to the request's error
STOP_BOUND_S = 30.0


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(checkpoint, prompts, transformers' outputs, one worker's tokens)."""
    path = build_untokenized_model("llama", tmp_path_factory.mktemp("ray_llama"))
    prompts = make_prompts()[:4]
    single = LLM(path, **ENGINE)
    one_worker = [o.token_ids for o in generate(single, prompts)]
    del single
    gc.collect()
    return path, prompts, reference_outputs(path, prompts, NUM_NEW_TOKENS), one_worker


def assert_resources_released() -> None:
    """The actors and their placement group are gone (Ray returns their CPUs shortly after)."""
    deadline = time.monotonic() + 10.0
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2, f"the actors outlived the engine: {ray.available_resources()}"


def generate(llm: LLM, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_ray_workers_match_one_worker_and_transformers(ray_cluster, llama, tp, pp):
    path, prompts, expected, one_worker = llama
    llm = LLM(path, executor="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp, async_scheduling=True, **ENGINE)
    core = llm.llm_engine.engine_core
    executor = core.executor
    assert type(executor).__name__ == "RayExecutor" and core.async_scheduling
    try:
        # One actor per rank, each in its own process, none of them this one.
        assert len(set(executor.worker_pids)) == 2 and os.getpid() not in executor.worker_pids
        label = f"ray tp={tp} pp={pp}"
        outputs = generate(llm, prompts)
        check_outputs_equal([tokens for tokens, _ in expected], [o.token_ids for o in outputs], label + " vs hf")
        check_outputs_equal(one_worker, [o.token_ids for o in outputs], label + " vs one worker")
        for (_, ref_steps), out in zip(expected, outputs):
            check_logprobs_close(ref_steps, out.logprobs, atol=LOGPROB_ATOL, label=label)
        # A call that fails on the actors names a rank and leaves the engine working.
        with pytest.raises(RuntimeError, match=r"(?s)worker rank \d failed in no_such_method:\n.*AttributeError"):
            executor.collective_rpc("no_such_method")
        specs = executor.collective_rpc("attention_specs")
        assert [[s.layer_idx for s in rank_specs] for rank_specs in specs] == ([[0, 1]] * 2 if pp == 1 else [[0], [1]])
        assert all(s.num_heads == 4 // tp for rank_specs in specs for s in rank_specs)
        check_outputs_equal(one_worker, [o.token_ids for o in generate(llm, prompts)], label + " again")
    finally:
        core.shutdown()
    assert_resources_released()


def test_serve_over_ray_matches_and_a_killed_actor_fails_the_request(ray_cluster, llama, tmp_path):
    """``runtime serve -tp 2 --distributed-executor-backend ray`` joins this module's cluster
    (``RAY_ADDRESS``): its tokens are one worker's; then an actor killed mid-generation fails
    the streamed request naming its rank within seconds, and the server exits non-zero."""
    path, prompts, _, one_worker = llama
    flags = SERVER_FLAGS + ["--skip-tokenizer-init", "-tp", "2", "--distributed-executor-backend", "ray", "--max-model-len", "512",
             "--enforce-eager"]
    env = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    server = RemoteServer(path, flags, tmp_path / "server.log", env=env).wait_ready()
    try:
        pids = {int(r): int(p) for r, p in re.findall(r"worker rank (\d+) placed on node \S+ \(pid (\d+)", server.log())}
        assert sorted(pids) == [0, 1], server.log()[-3000:]
        assert concurrent_greedy_completions(server, prompts, NUM_NEW_TOKENS) == one_worker
        events, started = [], threading.Event()
        body = {"model": path, "prompt": prompts[0], "max_tokens": 400, "ignore_eos": True, "logprobs": 1}
        reader = threading.Thread(target=stream, args=(server, body, started, events), daemon=True)
        reader.start()
        assert started.wait(60) and events and "error" not in events[0], server.log()[-3000:]
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        reader.join(FAIL_BOUND_S)
        assert not reader.is_alive(), "the stream hangs after a Ray worker actor died"
        assert time.monotonic() - killed_at < FAIL_BOUND_S
        assert re.search(r"worker rank 1 \(Ray actor on node .*\) died unexpectedly", events[-2]), events[-3:]
        assert not any('"finish_reason":"length"' in line for line in events), events[-3:]
        server.proc.wait(STOP_BOUND_S)
        assert server.proc.returncode == 1, server.log()[-3000:]
        assert "worker rank 1 (Ray actor on node" in server.log()
    finally:
        server.stop()
    # The engine process was the actors' owner: Ray ends them and frees their bundles.
    assert_resources_released()


class Exploit:
    """Unpickling it creates ``path``: the proof that a forged message was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_messages_not_signed_with_the_executors_secret_are_dropped_unread(ray_cluster, llama, tmp_path, caplog):
    """The socket listens on the node's address: a host that reaches it and sends a pickle (bare,
    or signed with another secret) has it dropped with a warning, never unpickled; the actors'
    signed traffic goes on, and the tokens are one worker's."""
    from runtime.executor import signing

    caplog.set_level(logging.WARNING, logger=signing.__name__)
    path, prompts, _, one_worker = llama
    marker = tmp_path / "pwned"
    llm = LLM(path, executor="ray", tensor_parallel_size=2, **ENGINE)
    core = llm.llm_engine.engine_core
    ctx = zmq.Context()
    intruder = ctx.socket(zmq.DEALER)
    try:
        intruder.connect(core.executor.workers.socket.address)
        evil = pickle.dumps(Exploit(marker))
        intruder.send_multipart([evil])
        intruder.send_multipart([evil, signing.mac(signing.new_secret(), signing.REPLY, evil)])
        check_outputs_equal(one_worker, [o.token_ids for o in generate(llm, prompts)], "ray tp=2 with an intruder")
        dropped = lambda: sum("does not carry this executor's signature" in r.getMessage() for r in caplog.records)  # noqa: E731
        deadline = time.monotonic() + 10.0
        while dropped() < 2 and time.monotonic() < deadline:  # both read (and dropped) while waiting for the actors
            core.executor.collective_rpc("attention_specs")
        assert dropped() == 2, caplog.text
        assert not marker.exists(), "the executor unpickled a message that its actors did not send"
    finally:
        intruder.close(linger=0)
        ctx.term()
        core.shutdown()
    assert_resources_released()


def test_executor_flag_names_ray_and_lists_the_valid_ones(tmp_path):
    """vLLM's ``--distributed-executor-backend ray`` selects it; a misspelt name lists the valid ones, ray among them."""
    path = build_untokenized_model("llama", tmp_path / "model")

    def config(backend: str):
        argv = ["serve", path, "--skip-tokenizer-init", "-tp", "2", "--distributed-executor-backend", backend]
        return build_engine_config(engine_args_from_namespace(build_parser().parse_args(argv), model=path))

    assert config("ray").parallel_config.executor == "ray"
    with pytest.raises(ValueError, match=r"unknown executor 'raay'; installed: .*\bmultiproc\b.*\bray\b"):
        config("raay")
    # Installed but left out of the allow-list: the error names the package and how to load it.
    saved = plugins._manager
    plugins.reset_plugin_manager(plugins.PluginManager(["cpu"]))
    try:
        expected = (
            r"unknown executor 'ray'; installed: mp, multiproc, uni, uniproc "
            r"\(runtime-plugin-ray provides 'ray'; it is installed but not loaded: add its plugin to RUNTIME_PLUGINS"
        )
        with pytest.raises(ValueError, match=expected):
            config("ray")
    finally:
        plugins.reset_plugin_manager(saved)


def test_ranks_go_node_by_node_this_node_first_and_by_device_number():
    """Device ids are numbers: GPU 2 comes before GPU 10 (as text it would not), so a node's
    tensor-parallel ranks follow its devices."""
    from runtime_ray.executor import rank_order

    infos = [{"ip": ip, "gpu_ids": gpus} for ip, gpus in [
        ("10.0.0.2", ["0"]), ("10.0.0.1", ["10"]), ("10.0.0.1", ["2"]), ("10.0.0.1", ["1"]), ("10.0.0.3", []),
    ]]
    assert rank_order(infos, here="10.0.0.1") == [3, 2, 1, 0, 4]
