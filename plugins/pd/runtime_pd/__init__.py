"""runtime-plugin-pd: prefill/decode disaggregation over TCP, or between GPUs of one host.

``--kv-transfer-config '{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_ip":
"10.0.0.5", "kv_port": 14579}'`` on a prefill instance and ``"kv_role": "kv_consumer"`` on a
decode instance (``kv_both`` for either). The flow is pull-based, as vLLM's NixlConnector:
a request whose ``kv_transfer_params`` ask ``do_remote_decode`` keeps its prompt blocks under a
lease after it finishes and returns where to fetch them; the decode instance, given the same
request with those parameters (``do_remote_prefill``), waits without blocks while a thread
pulls them into host memory, writes them into its cache in the background (the steps of other
requests go on) and computes only the prompt's last token.
Ports: ``kv_port`` serves blocks (the worker), ``kv_port + 1`` takes "pulled" notices (the
scheduler). ``kv_connector_extra_config``: ``lease_s``, ``pull_timeout_s``,
``on_transfer_failure`` (``recompute`` or ``fail``), ``checksum``.

``"kv_connector": "CudaIpcConnector"`` is the same flow with blocks copied GPU to GPU through
CUDA IPC handles (peer access over NVLink, no host copy) between instances on one host; the
decode instance must see the prefill GPU (``CUDA_VISIBLE_DEVICES=1,0``: its own GPU first).
"""

from __future__ import annotations

from runtime import hookimpl

CONNECTOR_NAME = "TcpConnector"
CUDA_IPC_CONNECTOR_NAME = "CudaIpcConnector"


@hookimpl
def register_kv_connectors(register):
    def tcp(config, role):
        from runtime.kv_transfer import KVConnectorRole

        if role == KVConnectorRole.SCHEDULER:
            from runtime_pd.scheduler_half import TcpConnectorScheduler

            return TcpConnectorScheduler(config)
        from runtime_pd.worker_half import TcpConnectorWorker

        return TcpConnectorWorker(config)

    def cuda_ipc(config, role):
        from runtime.kv_transfer import KVConnectorRole

        if role == KVConnectorRole.SCHEDULER:
            from runtime_pd.ipc_scheduler import CudaIpcConnectorScheduler

            return CudaIpcConnectorScheduler(config)
        from runtime_pd.ipc_worker import CudaIpcConnectorWorker

        return CudaIpcConnectorWorker(config)

    register(CONNECTOR_NAME, tcp)
    register(CUDA_IPC_CONNECTOR_NAME, cuda_ipc)


@hookimpl
def register_routes(app):
    from runtime_pd.routes import add_release_route

    add_release_route(app)
