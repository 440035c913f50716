"""runtime-plugin-ray: the ``ray`` executor.

Each rank's worker is a Ray actor placed by a placement group (one bundle per rank: one GPU
on GPU platforms, one CPU on the CPU platform) on a Ray cluster: the one ``RAY_ADDRESS``
names or that ``ray start`` left running on this host, else a local one started by the
executor. The engine core stays in the serving process and drives the actors as the
multiproc executor drives its processes (one pickled broadcast per step over ZMQ, now on
TCP; ``collective_rpc``; async steps). Select it with vLLM's flag
``--distributed-executor-backend ray`` (or ``--executor ray``).
"""

from __future__ import annotations

from runtime import hookimpl


@hookimpl
def register_executors(register):
    def ray(config):
        from runtime_ray.executor import RayExecutor

        return RayExecutor(config)

    register("ray", ray)
