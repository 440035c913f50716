"""The TcpConnector's scheduler half: leases on the prefill side, pulls on the decode side.

Prefill (``do_remote_decode``): when the request finishes, the blocks of its prompt but the
last token (which the decode instance computes to sample: a one-token row, as a decode step's,
so that step still runs as a captured graph) are leased, the last of them maybe partly full, and
the request's output carries ``kv_transfer_params`` saying where to pull them; the scheduler
holds the blocks until :meth:`get_finished_sending` names the request.

Decode (``do_remote_prefill``): the first lookup starts a pull and answers "loads
asynchronously", so the request waits holding no blocks; once :meth:`get_finished_recving`
names it, the next lookup counts the pulled tokens past the device prefix hit and the
request gets blocks for them. The worker writes them in the background (on a side stream
on a GPU) while steps run without the request; once the worker reports the write done
(:meth:`update_connector_output`, :meth:`get_finished_loading`) the request is admitted with
those tokens computed. A long copy never holds a decode step.
"""

from __future__ import annotations

import collections
import logging
import uuid
from dataclasses import dataclass, field

from runtime.kv_transfer import KVConnectorMetadata, RequestInputError
from runtime.scheduler.request import RequestStatus

from runtime_pd.lease import Leases
from runtime_pd.puller import Puller, Staged
from runtime_pd.settings import layout_key, malformed_reason, prompt_digest, settings_of, transfer_params

logger = logging.getLogger(__name__)

_PULLING, _DONE = "pulling", "done"  # pull states besides Staged blocks
SEEN_LEASES = 65536  # leases this decode instance pulled, remembered so that a sibling never pulls one again


def lease_key(params: dict) -> tuple:
    """Names one lease of one prefill instance: the requests ``n > 1`` fans out share it. The instance's start
    (``remote_instance``) is part of it: a restarted prefill instance may reuse its engine id and request ids."""
    return params.get("remote_engine_id"), params.get("remote_instance"), params.get("remote_request_id")


@dataclass
class PDMetadata(KVConnectorMetadata):
    leases: dict[str, list[int]] = field(default_factory=dict)  # request id -> block ids now served
    unleases: list[str] = field(default_factory=list)  # requests whose blocks are no longer served
    loads: list = field(default_factory=list)  # what to write: (request id, Staged.load_entry)
    lease_deadlines: dict[str, float] = field(default_factory=dict)  # request id -> time.monotonic() its lease ends
    poll: bool = False  # background writes are under way: the step must reach the worker to hear of them

    @property
    def is_empty(self) -> bool:
        return not (self.leases or self.unleases or self.loads or self.poll)


class TcpConnectorScheduler:
    def __init__(self, config):
        self.settings = s = settings_of(config)
        self.block_size = config.cache_config.block_size
        self.layout = layout_key(config)
        self.engine_id = str((config.cache_config.kv_transfer_config or {}).get("engine_id") or uuid.uuid4())
        self.instance = uuid.uuid4().hex[:16]  # this start of the instance (see lease_key)
        self.metadata = PDMetadata()
        self.leases = Leases(self.engine_id, s.lease_s, f"tcp://{s.host}:{s.control_port}") if s.is_producer else None
        self.puller = self.make_puller() if s.is_consumer else None
        self.pulls: dict[str, object] = {}  # request id -> _PULLING, Staged, _DONE, or why it failed
        # One pull per lease: the samples of an ``n > 1`` request carry the same kv_transfer_params, and a
        # prefill instance serves a lease once (the pull frees it). The first sample pulls; the others
        # wait for that pull and load the same host copy into their own blocks (or compute the prompt here).
        self.lease_pullers: dict[tuple, str] = {}  # lease -> request id whose pull is in flight
        self.lease_followers: dict[tuple, list[str]] = {}  # lease -> requests waiting for that pull
        self.request_leases: dict[str, tuple] = {}  # request id -> its lease (pulling, following or staged)
        self.seen_leases: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self.rejected: set[str] = set()  # requests whose kv_transfer_params are malformed: they fail in any mode
        self.num_failed_pulls = 0
        self.writing: dict[str, int] = {}  # request id -> worker ranks that reported its background write
        self.written: set[str] = set()  # background writes every rank finished
        self.write_failures: dict[str, str] = {}  # request id -> why a rank's write failed
        self.num_ranks = 1

    def set_handshake_metadata(self, per_rank: list) -> None:
        """The workers' layout key (the same on every rank), which names the attention backend's order of a
        block's bytes: a decode instance's pulls carry it, and a prefill instance refuses a different one."""
        layouts = {info["layout"] for info in per_rank if info and "layout" in info}
        if len(layouts) > 1:
            raise ValueError(f"the tensor-parallel ranks report different KV layouts: {sorted(layouts)}")
        if layouts:
            self.layout = layouts.pop()
            if self.puller is not None:
                self.puller.layout = self.layout

    def make_puller(self) -> Puller:
        """The decode side's puller (a connector whose blocks travel otherwise returns its own)."""
        return Puller(self.layout, self.settings.pull_timeout_s, self.settings.checksum)

    # ---------------------------------------------------------------- decode side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = transfer_params(request) if self.puller is not None else None
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        state = self.pulls.get(request.request_id)
        if state is None:
            bad = malformed_reason(params)
            if bad is not None:  # a client error, whatever on_transfer_failure says (and no lease to free)
                bad = RequestInputError(bad)  # a 400, where a failed transfer is the server's (a 500)
                self.pulls[request.request_id] = bad
                self.rejected.add(request.request_id)
                self.puller.ended.append((request.request_id, bad))
                return 0, True
            why = self._check(request, params)
            if why is not None:
                self.pulls[request.request_id] = why
                self.puller.ended.append((request.request_id, why))
                self.puller.cancel(params)
                return 0, True
            if not params["remote_block_ids"]:  # a one-token prompt: the prefill instance leased nothing
                self.pulls[request.request_id] = _DONE
                return 0, False
            key = lease_key(params)
            self.request_leases[request.request_id] = key
            if key in self.lease_pullers:  # a sibling's pull of the same lease is under way: wait for it
                self.pulls[request.request_id] = _PULLING
                self.lease_followers.setdefault(key, []).append(request.request_id)
                return 0, True
            if key in self.seen_leases:  # pulled already: share a sibling's blocks, or compute the prompt here
                shared = self._shareable(key)
                self.pulls[request.request_id] = shared if shared is not None else _DONE
                state = self.pulls[request.request_id]
            else:
                self._see(key)
                self.lease_pullers[key] = request.request_id
                self.pulls[request.request_id] = _PULLING
                self.puller.start(request.request_id, params)
                return 0, True
        if state is _PULLING:
            return 0, True
        if isinstance(state, Staged) and state.num_tokens > num_computed_tokens:
            why = state.stale_reason()
            if why is None:
                return state.num_tokens - num_computed_tokens, False
            self._drop(request, state, why)
        return 0, False  # the device cache holds them, they were loaded, or the pull failed: compute

    def _see(self, key: tuple) -> None:
        self.seen_leases[key] = None
        while len(self.seen_leases) > SEEN_LEASES:
            self.seen_leases.popitem(last=False)

    def _shareable(self, key: tuple) -> Staged | None:
        """Pulled blocks of ``key`` another request still holds in host memory and that stay valid for
        more loads (those released at the pull: a host copy), or None."""
        for request_id, other in self.request_leases.items():
            state = self.pulls.get(request_id)
            if other == key and isinstance(state, Staged) and state.released_at_pull:
                return state
        return None

    def _check(self, request, params: dict) -> str | None:
        """Why the remote blocks cannot be used for ``request`` (None: they can)."""
        num_tokens = params["num_remote_tokens"]
        if params.get("block_size") != self.block_size or len(params["remote_block_ids"]) != -(-num_tokens // self.block_size):
            return f"the prefill instance's block size {params.get('block_size')} differs from this one's {self.block_size}"
        if num_tokens >= request.num_prompt_tokens or prompt_digest(request.prompt_token_ids[:num_tokens]) != params.get("prompt_digest"):
            return RequestInputError("the prompt differs from the one the prefill instance computed")  # the client's
        return None

    def _drop(self, request, state, why: str) -> None:
        """The staged blocks of ``request`` are not used: it computes its prompt here."""
        logger.warning("request %s: %s; computing its prompt here", request.request_id, why)
        self.pulls[request.request_id] = why
        self.num_failed_pulls += 1
        self._release(request, state)

    def _release(self, request, state) -> None:
        """Free the prefill instance's blocks of a staged pull that will not be loaded (unless done already)."""
        params = transfer_params(request)
        if isinstance(state, Staged) and not state.released_at_pull and params:
            self.puller.cancel(params)

    def get_finished_recving(self) -> dict[str, str | None]:
        """Requests whose pulls ended: None when they may run (the blocks, or a local recompute),
        else why they fail (``on_transfer_failure: fail``)."""
        ended = {}
        while self.puller is not None and self.puller.ended:
            request_id, result = self.puller.ended.popleft()
            key = self.request_leases.get(request_id)
            followers = []
            if key is not None and self.lease_pullers.get(key) == request_id:
                del self.lease_pullers[key]
                followers = self.lease_followers.pop(key, [])
            for rid in [request_id, *followers]:
                if rid not in self.pulls:
                    continue  # aborted meanwhile
                if rid in self.rejected:
                    self.rejected.discard(rid)
                    ended[rid] = result
                    continue
                if rid != request_id and isinstance(result, Staged) and not result.released_at_pull:
                    self.pulls[rid] = _DONE  # blocks read in place once: a sibling computes its prompt here
                    ended[rid] = None
                    continue
                self.pulls[rid] = result
                if isinstance(result, Staged):
                    ended[rid] = None
                    continue
                self.num_failed_pulls += 1
                ended[rid] = result if self.settings.on_transfer_failure == "fail" else None
        return ended

    def loads_in_background(self, request) -> bool:
        """Pulled blocks are written while steps run without the request (see the module docstring)."""
        return isinstance(self.pulls.get(request.request_id), Staged)

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        state = self.pulls.get(request.request_id)
        if not isinstance(state, Staged) or (not num_external_tokens and not block_ids):
            return  # nothing pulled, or no blocks this step (the request tries again)
        self.pulls[request.request_id] = _DONE
        if num_external_tokens:  # from a device prefix hit of whole blocks to the (maybe partial) last one
            num_blocks = -(-state.num_tokens // self.block_size)
            first = (state.num_tokens - num_external_tokens) // self.block_size
            self.metadata.loads.append((request.request_id, state.load_entry(block_ids, first, num_blocks)))
            self.writing[request.request_id] = 0
        else:
            self._release(request, state)  # the device prefix cache held them all

    def update_connector_output(self, per_rank: list) -> None:
        """The workers' reports of a step: background writes finished (on every rank) or failed."""
        self.num_ranks = max(self.num_ranks, len(per_rank))
        for report in per_rank:
            if not report:
                continue
            for request_id, why in report.get("failed", {}).items():
                self.write_failures.setdefault(request_id, why)
            for request_id in report.get("written", ()):
                if request_id in self.writing:
                    self.writing[request_id] += 1
        for request_id in [r for r, n in self.writing.items() if n >= self.num_ranks or r in self.write_failures]:
            del self.writing[request_id]
            if request_id not in self.write_failures:
                self.written.add(request_id)

    def get_finished_loading(self) -> tuple[set[str], dict[str, str | None]]:
        """(background writes done, failed writes: why the request fails, or None to compute it here)."""
        written, self.written = self.written, set()
        failed = {}
        for request_id, why in self.write_failures.items():
            self.writing.pop(request_id, None)
            self.num_failed_pulls += 1
            logger.warning("request %s: %s", request_id, why)
            if request_id in self.pulls:
                self.pulls[request_id] = why  # its next lookup computes the prompt here
            failed[request_id] = why if self.settings.on_transfer_failure == "fail" else None
        self.write_failures = {}
        return written, failed

    # ---------------------------------------------------------------- prefill side
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = transfer_params(request)
        state = self.pulls.pop(request.request_id, None)
        self.request_leases.pop(request.request_id, None)
        self.rejected.discard(request.request_id)
        if (state is None and params and params.get("do_remote_prefill") and self.puller is not None
                and malformed_reason(params) is None
                and lease_key(params) not in self.seen_leases):  # a sibling's pull frees the lease otherwise
            self.puller.cancel(params)  # never pulled: free the prefill instance's blocks now
        elif isinstance(state, Staged):
            self._release(request, state)  # pulled but never loaded (aborted)
        if self.leases is None or not params or not params.get("do_remote_decode"):
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        num_blocks = min(-(-(request.num_prompt_tokens - 1) // self.block_size), len(block_ids))
        num_tokens = min(request.num_prompt_tokens - 1, num_blocks * self.block_size)
        out = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_instance": self.instance, "remote_request_id": request.request_id, "remote_block_ids": block_ids[:num_blocks],
            "remote_host": self.settings.host, "remote_port": self.settings.port, "num_remote_tokens": num_tokens,
            "block_size": self.block_size, "prompt_digest": prompt_digest(request.prompt_token_ids[:num_tokens]),
        }
        if not num_blocks:
            out["remote_block_ids"] = []
            return False, out
        self.leases.add(request.request_id)
        self.metadata.leases[request.request_id] = block_ids[:num_blocks]
        self.metadata.lease_deadlines[request.request_id] = self.leases.deadlines[request.request_id]
        return True, out

    def get_finished_sending(self) -> set[str]:
        """Leased requests whose blocks may be freed: pulled, or their lease expired."""
        if self.leases is None:
            return set()
        ended = self.leases.take_ended()
        for request_id in ended:
            self.metadata.leases.pop(request_id, None)
            self.metadata.lease_deadlines.pop(request_id, None)
            self.metadata.unleases.append(request_id)
        return ended

    # ---------------------------------------------------------------- steps
    def build_connector_meta(self, scheduler_output) -> PDMetadata:
        metadata, self.metadata = self.metadata, PDMetadata()
        metadata.poll = bool(self.writing)
        return metadata

    def has_pending_work(self) -> bool:
        return not self.metadata.is_empty or bool(self.writing) or (self.leases is not None and self.leases.has_due())

    def get_stats(self) -> dict:
        stats = {"kv_transfer_failed_pulls": self.num_failed_pulls}
        if self.leases is not None:
            stats.update(kv_transfer_leases=len(self.leases.deadlines), kv_transfer_leases_pulled=self.leases.num_pulled,
                         kv_transfer_leases_expired=self.leases.num_expired)
        if self.puller is not None:
            stats.update(kv_transfer_pulled_blocks=self.puller.num_pulled_blocks)
        return stats

    def shutdown(self) -> None:
        if self.leases is not None:
            self.leases.close()
        if self.puller is not None:
            self.puller.close()
