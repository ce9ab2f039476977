"""The engine's metrics as Prometheus text (`GET /metrics` of `fastrag serve`)."""


def prometheus_text(m: dict) -> str:
    """The engine's metrics in the Prometheus text exposition format (prometheus_client's own writer)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    up = max(m["uptime_s"], 1e-9)
    for name, doc, value in (
        ("fastrag_queue_depth", "questions waiting for a slot in the batch", m["queue_depth"]),
        ("fastrag_inflight", "questions being served", m["inflight"]),
        ("fastrag_decode_batch", "sequences in the decode batch", m["decode_batch"]),
        ("fastrag_tokens_per_second", "streamed tokens per second since start", m["tokens"] / up),
        ("fastrag_retrievals_per_second", "retrievals per second since start", m["retrievals"] / up),
    ):
        Gauge(name, doc, registry=reg).set(value)
    for key in ("submitted", "finished", "failed", "cancelled", "rejected", "tokens", "retrievals"):
        Counter(f"fastrag_{key}", f"{key} since start", registry=reg).inc(m[key])
    for key, value in m["engine"].items():
        Counter(f"fastrag_engine_{key}", f"engine counter {key}", registry=reg).inc(value)
    # the registry is built per scrape from the engine's totals: a counter's `_created` sample would be the scrape
    # time, which a Prometheus reading it takes for a reset at every scrape (dropped here; prometheus_client's own
    # switch for it is process-wide, and would change the metrics of an application that embeds the server)
    def name(line: str) -> str:  # the metric a line is about ("# HELP name ...", "# TYPE name ...", "name value")
        parts = line.split()
        if line.startswith("#"):
            return parts[2] if len(parts) > 2 else ""
        return parts[0] if parts else ""

    return "".join(line for line in generate_latest(reg).decode().splitlines(keepends=True)
                   if not name(line).endswith("_created"))
