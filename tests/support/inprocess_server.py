"""A real HTTP server on a loopback port whose front end runs in this process (in a thread of its own).

``runtime serve``'s app and AsyncLLM (the engine core is its own process, as in ``runtime serve``), so a
test can speak HTTP to it, close sockets, and then look at the front end's own state: requests still
tracked by the AsyncLLM, the output processor and the metrics.
"""

from __future__ import annotations

import asyncio
import threading

import httpx

from support.remote_server import free_port, wait_for


class InProcessServer:
    """``InProcessServer(["MODEL", "--flag", ...])``: serve until ``stop()``; ``engine`` is the AsyncLLM."""

    def __init__(self, argv: list[str], startup_timeout_s: float = 240.0):
        from runtime.cli.args import engine_args_from_namespace
        from runtime.cli.main import build_parser

        self.port = free_port()
        args = build_parser().parse_args(["serve", *argv, "--port", str(self.port), "--disable-uvicorn-access-log"])
        self.args = args
        self.engine_args = engine_args_from_namespace(args, model=args.model_tag)
        self.engine = None
        self.app = None
        self.server = None
        self.error: BaseException | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="inprocess-server", daemon=True)
        self.thread.start()
        if not wait_for(self._ready, startup_timeout_s) or self.error is not None:
            self.stop()
            raise RuntimeError(f"the in-process server did not start: {self.error!r}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        if self.error is not None or not self.thread.is_alive():
            return True
        return self.server is not None and self.server.started

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported by the constructor or stop()
            self.error = exc
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        import uvicorn

        from runtime.engine.async_llm import AsyncLLM
        from runtime.entrypoints.openai.api_server import build_app, uvicorn_config

        self.engine = await AsyncLLM.start(self.engine_args)
        try:
            self.app = build_app(self.args, self.engine)
            self.server = uvicorn.Server(uvicorn_config(self.app, self.args))
            await self.server.serve()
        finally:
            await self.engine.shutdown()

    def call(self, fn, timeout_s: float = 10.0):
        """``fn()`` run on the server's event loop (where its state changes), its result returned here."""
        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout_s)

    def front_end_state(self) -> dict[str, int]:
        """How many requests each part of the front end still tracks (all 0 when nothing runs)."""
        def count():
            engine = self.engine
            output_processor = engine.output_processor
            return {
                "queues": len(engine._queues),
                "parent_of": len(engine._parent_of),
                "child_ids": len(engine._child_ids),
                "output_states": len(output_processor.request_states),
                "parents": len(output_processor.parent_requests),
                "ids_only_final": len(output_processor._ids_only_final),
                "metrics_requests": len(engine.metrics._times),
                "metrics_parents": len(engine.metrics._parents),
                "stat_logger_prompts": len(engine.metrics.stat_logger._pending_prompts),
                "http_in_flight": self._http_in_flight(),
            }

        return self.call(count)

    def _http_in_flight(self) -> int:
        """Requests holding a slot of --max-concurrent-requests (0 without the limit)."""
        from runtime.entrypoints.openai.middleware import ConcurrencyLimitMiddleware

        layer = self.app.middleware_stack  # built at the first request
        while layer is not None and not isinstance(layer, ConcurrencyLimitMiddleware):
            layer = getattr(layer, "app", None)
        return 0 if layer is None else layer.in_flight

    def metric(self, name: str, **labels) -> float:
        """A /metrics sample of this server (``labels``: those besides model_name)."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name == name and {k: v for k, v in sample.labels.items() if k != "model_name"} == labels:
                    return sample.value
        raise KeyError(f"no sample {name}{labels} in /metrics")

    def is_idle(self) -> bool:
        """The engine reports nothing running, nothing waiting and no KV block in use; the front end tracks nothing."""
        engine_idle = all(self.metric(f"runtime:{name}") == 0
                          for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
        return engine_idle and not any(self.front_end_state().values())

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(60)
        if self.thread.is_alive():
            raise RuntimeError("the in-process server did not stop")
