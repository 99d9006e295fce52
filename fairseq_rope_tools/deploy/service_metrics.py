"""fairseq-rope-serve's ``GET /metrics``: Prometheus' text format, from the maintained
prometheus-client, in a registry of the server's own (two servers in one process count apart).

    fairseq_rope_requests_total{route, status}   answered requests
    fairseq_rope_sentences_total                 sentences translated
    fairseq_rope_queue_sentences                 sentences waiting for a batch
    fairseq_rope_connections_open                client connections open
    fairseq_rope_connections_refused_total       connections refused (--max-connections) or closed for a
                                                 late request head (--head-timeout), by reason
    fairseq_rope_batch_sentences                 sentences per decoded batch (histogram)
    fairseq_rope_decode_seconds                  decoding time of a batch (histogram)
    fairseq_rope_request_seconds                 a request's time, arrival to answer (histogram, by route)
"""

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: request and decoding times: 1 ms to 1 minute
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServiceMetrics:
    """The service's counters; ``waiting``, ``open_connections``, ``refused`` and ``timed_out``:
    functions read at each scrape."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch_size: int, waiting: Callable[[], int], open_connections: Callable[[], int],
                 refused: Callable[[], int], timed_out: Callable[[], int]):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("fairseq_rope_requests", "answered requests", ("route", "status"), registry=registry)
        self.sentences = Counter("fairseq_rope_sentences", "sentences translated", registry=registry)
        Gauge("fairseq_rope_queue_sentences", "sentences waiting for a batch",
              registry=registry).set_function(waiting)
        registry.register(_Connections(open_connections, refused, timed_out))
        buckets, size = [], 1
        while size < max_batch_size:
            buckets.append(size)
            size *= 2
        self.batch_sentences = Histogram("fairseq_rope_batch_sentences", "sentences per decoded batch",
                                         buckets=(*buckets, max_batch_size), registry=registry)
        self.decode_seconds = Histogram("fairseq_rope_decode_seconds", "decoding time of a batch",
                                        buckets=SECONDS_BUCKETS, registry=registry)
        self.request_seconds = Histogram("fairseq_rope_request_seconds", "a request's time, arrival to answer",
                                         ("route",), buckets=SECONDS_BUCKETS, registry=registry)

    def batch_decoded(self, sentences: int, seconds: float) -> None:
        self.batch_sentences.observe(sentences)
        self.decode_seconds.observe(seconds)
        self.sentences.inc(sentences)

    def answered(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.request_seconds.labels(route).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Connections:
    """The connection guard's counts, read when scraped (a custom collector: the guard counts)."""

    def __init__(self, open_connections, refused, timed_out):
        self.open_connections, self.refused, self.timed_out = open_connections, refused, timed_out

    def collect(self):
        yield GaugeMetricFamily("fairseq_rope_connections_open", "client connections open",
                                value=self.open_connections())
        refusals = CounterMetricFamily("fairseq_rope_connections_refused",
                                       "connections refused or closed before a request", labels=("reason",))
        refusals.add_metric(("max_connections",), self.refused())
        refusals.add_metric(("head_timeout",), self.timed_out())
        yield refusals
