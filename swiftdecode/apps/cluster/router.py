"""The replicas' request router: Ray's PrefixCacheAffinityRouter, its prefix followed only where it pays.

Ray's router keeps a prefix tree of the routing texts each replica was sent (routing.py) and sends a request to
the replica whose text shares the longest beginning with its own; below a match rate it picks the replica with
the smallest tree, whatever its load. On a few replicas that sent a burst of new requests (each matching only its
tenant's digest) to one replica while another idled. Here a match is followed only when it is at least
`match_rate_threshold` of the text and its replica runs fewer than `capacity` requests (one batch); every other
request gets Ray's power-of-two choice: the less loaded of two. Ray is pinned: the base class lives in ray.llm's
internal modules (its public alias needs vLLM).
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter


class AffinityRouter(PrefixCacheAffinityRouter):
    """`capacity`: requests a replica decodes at once (serve's --max-batch); the rest as Ray's router."""

    def initialize_state(self, capacity: int, **kwargs) -> None:
        self.capacity = capacity
        super().initialize_state(**kwargs)

    async def _prefix_match_best_replicas(self, pending_request, candidate_replicas) -> list[list]:
        """The replicas holding the longest match of the request's text, if long enough, less those with no
        free slot (a replica whose load probe went unanswered stays: on a busy machine a probe may miss its
        deadline); [[]] sends the request to Ray's power-of-two choice."""
        text = self._extract_text_from_request(pending_request)
        names = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        matched, tenants = await self._tree_actor.prefix_match.remote(text, list(names))
        if not tenants or len(matched) < self._match_rate_threshold * len(text):
            return [[]]
        loads = await self._probe_queue_lens([names[t] for t in tenants if t in names], 0)
        return [[r for r, load in loads if load is None or load < self.capacity]]
