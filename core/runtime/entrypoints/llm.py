"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import time
from typing import Sequence

from tqdm.auto import tqdm

from runtime.engine_args import EngineArgs
from runtime.engine.metrics_reader import Metric, get_metrics_snapshot
from runtime.engine.input_processor import PromptType
from runtime.engine.llm_engine import LLMEngine
from runtime.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from runtime.entrypoints.chat_render import refuse_unsupported, render_chat, template_messages
from runtime.entrypoints.logprobs_limit import check_max_logprobs
from runtime.executor.broadcast import WorkerDied
from runtime.model_loader.default_model import default_model_path, default_served_model_name
from runtime.outputs import RequestOutput
from runtime.sampling_params import RequestOutputKind, SamplingParams
from runtime.stat_logger import log_stats_interval, show_stats_on_stderr


class LLM:
    """Generate completions for batches of prompts with one in-process engine.

    ``model`` defaults to the embedded SmolLM2-135M-Instruct GGUF (as ``runtime serve``).
    Keyword arguments are engine arguments with vLLM's names (``max_num_seqs``,
    ``enable_prefix_caching``, ``dtype``, ``trust_remote_code``, ``tokenizer_mode`` ...);
    as in vLLM, ``disable_log_stats`` defaults to True here (``get_metrics`` needs it False), and
    ``enable_sleep_mode=True`` allows ``sleep`` / ``wake_up``.
    """

    def __init__(self, model: str | None = None, **kwargs):
        kwargs.setdefault("disable_log_stats", True)
        if not model:  # the embedded default, named by its file name unless served_model_name is given
            model = default_model_path()
            if kwargs.get("served_model_name") is None:
                kwargs["served_model_name"] = default_served_model_name(model)
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        if self.engine_args.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={self.engine_args.data_parallel_size}: the offline LLM runs one engine in this "
                "process; serve replicas with `runtime serve --data-parallel-size N` (-dp N), or use 1 here"
            )
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        if not self.engine_args.disable_log_stats:
            show_stats_on_stderr()
            self.llm_engine.enable_stats(log_stats_interval())

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation config defaults (``generation_config``), used when none are given."""
        return SamplingParams(**self.llm_engine.config.model_config.default_sampling_params)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        refuse_unsupported(lora_request=lora_request)
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        max_logprobs = self.llm_engine.config.model_config.max_logprobs
        for sp in params:
            check_max_logprobs(sp, max_logprobs)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        # Offline callers only read finished outputs: skip building the partial ones.
        final_only: dict[int, SamplingParams] = {}
        for sp in params:
            if id(sp) not in final_only:
                final_only[id(sp)] = sp.clone()
                final_only[id(sp)].output_kind = RequestOutputKind.FINAL_ONLY
        params = [final_only[id(sp)] for sp in params]
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                request_id = engine.next_request_id()
                try:
                    engine.add_request(request_id, prompt, sp, priority[i] if priority else 0)
                except ValueError as exc:  # of several prompts, the one refused is named by its index
                    if len(prompts) == 1 or not str(exc).startswith("prompt "):
                        raise
                    raise ValueError(f"prompt[{i}]{str(exc).removeprefix('prompt')}") from None
                ids.append(request_id)
        except BaseException:  # a prompt refused: the ones added before it must not stay in the engine
            if ids:
                engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: each conversation rendered by the chat template (``chat_template`` replaces the
        model's for this call; ``tools`` are given to it), then generated from as token ids."""
        refuse_unsupported(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template_kwargs = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
                           "continue_final_message": continue_final_message, "tools": tools}
        template_kwargs.update(chat_template_kwargs or {})  # vLLM's order: chat_template_kwargs win
        prompts = [
            render_chat(self.llm_engine.input_processor, template_messages(conv, chat_template_content_format),
                        template_kwargs)
            for conv in conversations
        ]
        # The template already holds the special tokens; don't add a second BOS.
        tokenizer = self.llm_engine.tokenizer
        token_prompts = [{"prompt_token_ids": tokenizer.encode(p, add_special_tokens=False), "prompt": p} for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm)

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's ``LLM.collective_rpc``: ``worker.method(*args, **kwargs)`` on every worker of the engine, their
        results in rank order. ``timeout`` (seconds) raises TimeoutError when the workers do not answer in time."""
        if not isinstance(method, str):
            raise TypeError(
                f"collective_rpc takes the name of a Worker method (a str), got {type(method).__name__}; "
                "callables are not sent to the workers here"
            )
        executor = self.llm_engine.engine_core.executor
        start = time.monotonic()
        try:
            return executor.collective_rpc(method, tuple(args), dict(kwargs or {}), timeout_s=timeout)
        except WorkerDied as exc:
            if timeout is not None and time.monotonic() - start >= timeout:
                raise TimeoutError(f"collective_rpc({method!r}): {exc}") from exc
            raise

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` (see :mod:`runtime.entrypoints.beam_search`); ``params`` is a BeamSearchParams."""
        refuse_unsupported(lora_request=lora_request)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"beam_search takes BeamSearchParams, got {type(params).__name__}")
        return run_beam_search(self, prompts, params)

    def reset_prefix_cache(self, device=None) -> bool:
        """Forget the cached prefix blocks (vLLM's); False when blocks are still in use and nothing was reset."""
        return self.llm_engine.engine_core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``enable_sleep_mode=True``): free the device memory of the weights and the KV cache
        while idle. Level 1 keeps the weights in host memory; level 2 discards them (``wake_up`` reloads them from
        the checkpoint, so weights changed in place since the start are lost). The KV cache is discarded at both
        levels and the prefix cache reset. Refused while requests are unfinished; requests are refused until
        ``wake_up``."""
        self.llm_engine.engine_core.control.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``sleep`` freed: all of it, or the parts ``tags`` names ("weights", "kv_cache")."""
        self.llm_engine.engine_core.control.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.engine_core.control.is_sleeping()

    def start_profile(self) -> None:
        """Start torch.profiler in every worker; needs ``RUNTIME_TORCH_PROFILER_DIR`` (vLLM's
        ``VLLM_TORCH_PROFILER_DIR``) set before the engine starts."""
        self.llm_engine.engine_core.control.start_profile()

    def stop_profile(self) -> list[str]:
        """Stop the profile and write each worker's Chrome trace (and a table of its ops) into the folder;
        returns the traces' paths in rank order."""
        return self.llm_engine.engine_core.control.stop_profile()

    def get_metrics(self) -> list[Metric]:
        """vLLM's ``LLM.get_metrics``: a snapshot of the engine's Prometheus metrics as Counter, Gauge,
        Histogram and Vector objects (runtime.engine.metrics_reader). Needs ``disable_log_stats=False``."""
        metrics = self.llm_engine.metrics
        if metrics is None:
            raise RuntimeError(
                "get_metrics() needs the engine's stats: create the LLM with disable_log_stats=False "
                "(True is the offline default, as in vLLM)"
            )
        return get_metrics_snapshot(metrics.registry)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
                for output in engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [finished[i] for i in request_ids]
