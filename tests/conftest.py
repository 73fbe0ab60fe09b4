import os

import pytest
import torch

# Tests never reach the network: Hub loads come from caches the tests populate.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Loads convert their checkpoints every time (what most tests check); tests/test_weight_cache.py
# turns the cache of converted weights on in a temporary directory.
os.environ.setdefault("ZOO_WEIGHT_CACHE", "0")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
