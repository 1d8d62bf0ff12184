"""Per-request weight versions of the engine steps that sampled each token.

The worker extension (actor/engines/vllm/worker/extension.py) records, under the per-forward-pass
lock, the live version for every request a step samples for; the engine fetches
them with ``nonstop_poll`` when a request is collected (actor/engines/vllm/client.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def external_id(internal: str) -> str:
    """vLLM appends ``-<8 random chars>`` to the client's request id."""
    head, _, tail = internal.rpartition("-")
    return head if head and len(tail) == 8 else internal


class StepVersions:
    """Per request, run-length versions of the engine steps that sampled a token for it.

    A step samples for a request unless it is a prefill chunk that does not reach
    the end of the request's known tokens (prompt + tokens sampled so far). No
    speculative decoding: the vLLM engine refuses it (one token per decode step).
    """

    def __init__(self, keep_finished: int = 65536):
        self.known: dict[str, int] = {}
        self.rle: dict[str, list[list[int]]] = {}
        self.finished: OrderedDict[str, list[list[int]]] = OrderedDict()
        self.keep_finished, self.evicted = keep_finished, 0

    def record(self, so: Any, version: int) -> None:
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.known[new.req_id] = len(new.prompt_token_ids or ())
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for rid, done in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
            computed[rid] = done
        for rid, n in so.num_scheduled_tokens.items():
            known = self.known.get(rid)
            if n == 1 or known is None or computed.get(rid, 0) + n >= known:
                self.known[rid] = (known or 0) + 1
                runs = self.rle.setdefault(rid, [])
                if runs and runs[-1][0] == version:
                    runs[-1][1] += 1
                else:
                    runs.append([version, 1])
        for rid in so.finished_req_ids:
            self.known.pop(rid, None)
            self.finished[external_id(rid)] = self.rle.pop(rid, [])
        while len(self.finished) > self.keep_finished:
            self.finished.popitem(last=False)
            self.evicted += 1

    def take(self, ids: list[str]) -> dict[str, list[list[int]]]:
        """Finished requests' runs (removed), or a running request's runs so far."""
        out = {}
        for ext in ids:
            if ext in self.finished:
                out[ext] = self.finished.pop(ext)
                continue
            for rid, runs in self.rle.items():
                if external_id(rid) == ext:
                    out[ext] = [list(r) for r in runs]
        return out
