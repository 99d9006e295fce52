"""fairseq-rope-serve's ``GET /metrics``: Prometheus' text format, from the maintained
prometheus-client, in a registry of the server's own (two servers in one process count apart).

    fairseq_rope_requests_total{route, status}   answered requests
    fairseq_rope_sentences_total                 sentences translated
    fairseq_rope_queue_sentences                 sentences waiting for a batch
    fairseq_rope_connections_open                client connections open
    fairseq_rope_connections_refused_total       connections refused (--max-connections) or closed for a
                                                 late request head (--head-timeout), by reason
    fairseq_rope_split_texts_total               texts too long split into sentences (--too-long split)
    fairseq_rope_sentences_left_out_total        sentences of split texts still too long, left out
                                                 (--too-long-sentence skip)
    fairseq_rope_batch_sentences                 sentences per decoded batch (histogram)
    fairseq_rope_decode_seconds                  decoding time of a batch (histogram)
    fairseq_rope_request_seconds                 a request's time, arrival to answer (histogram, by route)
"""

from typing import Callable, Dict

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: request and decoding times: 1 ms to 1 minute
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


#: what ``counts()`` gives ServiceMetrics at each scrape
COUNTS = ("waiting", "open", "refused", "timed_out", "split_texts", "sentences_left_out")


class ServiceMetrics:
    """The service's counters; ``counts``: read at each scrape, a dict of :data:`COUNTS`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch_size: int, counts: Callable[[], Dict[str, int]]):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("fairseq_rope_requests", "answered requests", ("route", "status"), registry=registry)
        self.sentences = Counter("fairseq_rope_sentences", "sentences translated", registry=registry)
        Gauge("fairseq_rope_queue_sentences", "sentences waiting for a batch",
              registry=registry).set_function(lambda: counts()["waiting"])
        registry.register(_Counts(counts))
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


class _Counts:
    """The counts the connection guard and the service keep, read when scraped (a custom collector)."""

    def __init__(self, counts):
        self.counts = counts

    def collect(self):
        counts = self.counts()
        yield GaugeMetricFamily("fairseq_rope_connections_open", "client connections open", value=counts["open"])
        refusals = CounterMetricFamily("fairseq_rope_connections_refused",
                                       "connections refused or closed before a request", labels=("reason",))
        refusals.add_metric(("max_connections",), counts["refused"])
        refusals.add_metric(("head_timeout",), counts["timed_out"])
        yield refusals
        yield CounterMetricFamily("fairseq_rope_split_texts", "texts too long split into sentences",
                                  value=counts["split_texts"])
        yield CounterMetricFamily("fairseq_rope_sentences_left_out", "sentences of split texts still too long, "
                                  "left out", value=counts["sentences_left_out"])
