"""Prometheus metrics of one server (its own registry, so servers in one process do not mix)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("zoo_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("zoo_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("zoo_generation_tokens", "tokens generated", registry=r)
        self.finished_seqs = Counter("zoo_sequences_finished", "sequences ended, by reason", ["reason"],
                                     registry=r)
        self.queue_depth = Gauge("zoo_queue_depth", "sequences waiting for a row", registry=r)
        self.running = Gauge("zoo_running_sequences", "rows in use", registry=r)
        self.occupancy = Gauge("zoo_batch_occupancy", "fraction of the static batch's rows in use", registry=r)
        self.ttft = Histogram("zoo_time_to_first_token_seconds", "submission to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("zoo_inter_token_latency_seconds", "time between a sequence's tokens",
                             buckets=_LATENCY, registry=r)
        # speculative decoding (runtime.speculative): one verify step per row and round
        self.spec_steps = Counter("zoo_spec_verify_steps", "speculative verify steps, counted per row", registry=r)
        self.spec_drafted = Counter("zoo_spec_draft_tokens", "draft tokens proposed", registry=r)
        self.spec_accepted = Counter("zoo_spec_accepted_tokens", "draft tokens the verify step kept", registry=r)
        self.spec_cut = Counter("zoo_spec_grammar_rejected_tokens", "draft tokens a row's grammar rejected "
                                "(cut before verification)", registry=r)
        self.spec_emitted = Counter("zoo_spec_emitted_tokens", "tokens speculative steps chose", registry=r)
        self.spec_acceptance = Gauge("zoo_spec_acceptance_rate", "accepted / drafted tokens since the start",
                                     registry=r)
        self.spec_tokens_per_step = Gauge("zoo_spec_tokens_per_step", "tokens a row gets per verify step since the "
                                          "start (plain decoding: 1; the speedup if a verify costs one step)",
                                          registry=r)

        self.prefix_bytes = Gauge("zoo_prefix_cache_bytes", "bytes of prompt caches held in host memory",
                                  registry=r)
        self.prefix_max_bytes = Gauge("zoo_prefix_cache_max_bytes", "bound on zoo_prefix_cache_bytes "
                                      "(least recently used entries are evicted)", registry=r)
        self.prefix_entries = Gauge("zoo_prefix_cache_entries", "prompt caches held", registry=r)
        self.prefix_lookups = Counter("zoo_prefix_cache_lookups", "admissions that looked for a cached prefix",
                                      registry=r)
        self.prefix_hits = Counter("zoo_prefix_cache_hits", "admissions that started from a cached prefix",
                                   registry=r)
        self.prefix_tokens = Counter("zoo_prefix_cache_tokens_reused", "prompt tokens not recomputed",
                                     registry=r)
        self.prefix_evictions = Counter("zoo_prefix_cache_evictions", "prompt caches evicted to stay in bounds",
                                        registry=r)
        self.prefix_mode = Gauge("zoo_prefix_cache_reuse", "1 for what a cached prefix can be reused from "
                                 "(any_prefix; or prompt_ends: the model keeps constant state, e.g. a recurrent "
                                 "one, which exists only at the token counts it was saved at, so only whole "
                                 "stored prompts are reused)", ["mode"], registry=r)

    # called by the scheduler thread
    def prefix_cache(self, cache, before: dict) -> None:
        """The prefix cache's state, and its counters' growth since `before` (its counters then)."""
        self.prefix_bytes.set(cache.bytes)
        self.prefix_max_bytes.set(cache.max_bytes)
        self.prefix_entries.set(len(cache))
        for counter, name in ((self.prefix_lookups, "lookups"), (self.prefix_hits, "hits"),
                              (self.prefix_tokens, "tokens_reused"), (self.prefix_evictions, "evictions")):
            counter.inc(getattr(cache, name) - before[name])
        self.prefix_mode.labels("any_prefix" if cache.any_prefix else "prompt_ends").set(1)

    def token(self, seconds: float, first: bool) -> None:
        self.generation_tokens.inc()
        (self.ttft if first else self.itl).observe(seconds)

    def speculative(self, before, after) -> None:
        """Counts of a speculative step: before / after are its speculator's SpecStats."""
        self.spec_steps.inc(after.rounds - before.rounds)
        self.spec_drafted.inc(after.drafted - before.drafted)
        self.spec_accepted.inc(after.accepted - before.accepted)
        self.spec_cut.inc(after.cut - before.cut)
        self.spec_emitted.inc(after.emitted - before.emitted)
        self.spec_acceptance.set(after.acceptance)
        self.spec_tokens_per_step.set(after.emitted / after.rounds if after.rounds else 0.0)

    def finished(self, reason: str) -> None:
        self.finished_seqs.labels(reason).inc()

    def gauges(self, waiting: int, running: int, max_batch: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)
        self.occupancy.set(running / max_batch)

    def render(self) -> bytes:
        return generate_latest(self.registry)
