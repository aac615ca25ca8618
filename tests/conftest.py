import asyncio
import dataclasses

import pytest
import torch

from flint_sched.checkpoint.random_init import random_tensor
from flint_sched.config import preset
from flint_sched.model.weights import tensor_specs


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A fresh kernel cache, so a compile test really compiles."""
    from flint_sched.kernels import _compiler
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    monkeypatch.setattr(_compiler, "_cubins", {})


def final_outputs(parts, requests):
    """The final RequestOutput of each (prompt, params), all run together in one fresh engine."""
    from flint_sched.engine.builder import build_engine

    async def main():
        engine = build_engine(parts)
        engine.start()

        async def last(stream):
            out = None
            async for out in stream:
                pass
            return out

        try:
            return await asyncio.gather(*(last(engine.add_request(p, sp)) for p, sp in requests))
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def fp32_weights(config, seed=0):
    """The seeded random weights of a config, in fp32 on the CPU."""
    return {s.name: random_tensor(s, config, seed) for s in tensor_specs(config)}


@pytest.fixture(scope="session")
def tiny_config():
    return preset("flint-tiny")


@pytest.fixture(scope="session")
def tiny_short_window(tiny_config):
    """flint-tiny with an 8-token window, so sequences wrap it cheaply."""
    return dataclasses.replace(tiny_config, sliding_window=8)


@pytest.fixture(scope="module")
def fake_openai_server():
    """The fake OpenAI-compatible server (tests/fake_openai_server.py) on loopback, one per module."""
    from fake_openai_server import running_fake_server
    with running_fake_server() as server:
        yield server


@pytest.fixture
def fake(fake_openai_server):
    """That server, reset to its defaults for each test."""
    fake_openai_server.reset()
    return fake_openai_server


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
