"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

from typing import Sequence

from tqdm.auto import tqdm

from runtime.engine_args import EngineArgs
from runtime.engine.input_processor import PromptType
from runtime.engine.llm_engine import LLMEngine
from runtime.entrypoints.logprobs_limit import check_max_logprobs
from runtime.model_loader.default_model import default_model_path
from runtime.outputs import RequestOutput
from runtime.sampling_params import RequestOutputKind, SamplingParams
from runtime.stat_logger import StatLogger, log_stats_interval, show_stats_on_stderr


class LLM:
    """Generate completions for batches of prompts with one in-process engine.

    ``model`` defaults to the embedded SmolLM2-135M-Instruct GGUF (as ``runtime serve``).
    Keyword arguments are engine arguments with vLLM's names (``max_num_seqs``,
    ``enable_prefix_caching``, ``dtype``, ``trust_remote_code``, ``tokenizer_mode`` ...);
    as in vLLM, ``disable_log_stats`` defaults to True here.
    """

    def __init__(self, model: str | None = None, **kwargs):
        kwargs.setdefault("disable_log_stats", True)
        self.engine_args = EngineArgs.from_kwargs(model=model or default_model_path(), **kwargs)
        if self.engine_args.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={self.engine_args.data_parallel_size}: the offline LLM runs one engine in this "
                "process; serve replicas with `runtime serve --data-parallel-size N` (-dp N), or use 1 here"
            )
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        if not self.engine_args.disable_log_stats:
            show_stats_on_stderr()
            self.llm_engine.stat_logger = StatLogger(log_stats_interval())

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
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
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
                engine.add_request(request_id, prompt, sp, priority[i] if priority else 0)
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
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        processor = self.llm_engine.input_processor
        prompts = [
            processor.apply_chat_template(conv, add_generation_prompt, **(chat_template_kwargs or {}))
            for conv in conversations
        ]
        # The template already holds the special tokens; don't add a second BOS.
        tokenizer = self.llm_engine.tokenizer
        token_prompts = [{"prompt_token_ids": tokenizer.encode(p, add_special_tokens=False), "prompt": p} for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm)

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
