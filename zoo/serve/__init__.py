"""`zoo serve`: an OpenAI-compatible HTTP server over the compiled graphs, with continuous batching.

    scheduler.py  one thread owns the model: admits requests into free rows, steps the decode graph
    text.py       detokenization with stop strings held back while they could still match
    metrics.py    Prometheus counters, gauges and histograms
    api.py        the FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics
"""
