"""The engine behind a socket (engine/remote.py): an EngineClient's streams add up to what the engine
streams in-process, aborts and bad requests behave the same, a dead engine fails the client's
requests; and a reader behind its producer gets merged outputs (engine/output_queue.py)."""

import asyncio
import socket
from contextlib import asynccontextmanager

import pytest

from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.engine import EngineConfig, EngineError
from flint_sched.engine.output_queue import OutputQueue
from flint_sched.engine.builder import build_engine, build_parts
from flint_sched.engine.outputs import CompletionOutput, RequestOutput
from flint_sched.engine.remote import EngineClient, EngineConnection
from flint_sched.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def parts(tiny_short_window):
    ckpt = dummy_checkpoint(tiny_short_window, "bf16", seed=11, device="cpu")
    return build_parts(EngineConfig(device="cpu", max_num_seqs=16, max_num_batched_tokens=64, block_size=4,
                                    num_kv_blocks=400, async_scheduling=True), progress=False, checkpoint=ckpt)


async def connected(engine):
    """An EngineClient talking to `engine` through a socket pair, on this loop."""
    near, far = socket.socketpair()
    engine_side = await asyncio.open_connection(sock=near)
    client_side = await asyncio.open_connection(sock=far)
    connection = EngineConnection(engine, *engine_side)
    serving = asyncio.ensure_future(connection.serve({}))
    client = EngineClient(*client_side, engine.tokenizer, engine.vocab_size, engine.max_model_len,
                          engine.grammar_compiler)
    client.start()
    return client, serving


@asynccontextmanager
async def serving_client(parts):
    """A running engine and a client connected to it; the client's connection closed after."""
    engine = build_engine(parts)
    engine.start()
    try:
        client, serving = await connected(engine)
        yield engine, client, serving
        await client.shutdown()
        await asyncio.wait_for(serving, 5)
    finally:
        await engine.shutdown()


async def until_no_requests(engine, timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if not engine.num_unfinished_requests:
            return
        await asyncio.sleep(0.01)


async def outputs_of(stream):
    return [out async for out in stream]


def rounded(logprobs):
    """Logprobs to 3 decimals: a second run of the same request may differ in the last float bits."""
    return None if logprobs is None else [
        None if p is None else (p.token_id, round(p.logprob, 3), [(t, round(v, 3)) for t, v in p.top])
        for p in logprobs]


def summary(outs):
    """What a request's stream says, as the server reads it: the deltas in order and the final totals."""
    last = outs[-1]
    deltas = {}
    for out in outs:
        for c in out.outputs:
            text, ids, logprobs = deltas.get(c.index, ("", [], []))
            deltas[c.index] = (text + c.delta_text, ids + c.delta_token_ids,
                               logprobs + rounded(c.delta_logprobs or []))
    final = [(c.index, c.text, c.token_ids, rounded(c.logprobs), c.finish_reason, c.stop_reason)
             for c in last.outputs]
    return last.finished, deltas, final, rounded(last.prompt_logprobs)


REQUESTS = [
    ([5, 6, 7, 8, 9], SamplingParams(max_tokens=12, temperature=0.0)),
    ([11, 12, 13], SamplingParams(n=2, max_tokens=7, temperature=0.8, seed=3, logprobs=2)),
    (list(range(20, 45)), SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=1)),
    ([3, 4], SamplingParams(max_tokens=9, temperature=0.0, stop=["e"])),
]


async def test_a_clients_streams_add_up_to_the_engines_own(parts):
    async with serving_client(parts) as (engine, client, _):
        direct = await asyncio.gather(*(outputs_of(engine.add_request(p, sp)) for p, sp in REQUESTS))
        remote = await asyncio.gather(*(outputs_of(client.add_request(p, sp)) for p, sp in REQUESTS))
        for alone, through in zip(direct, remote):
            assert summary(through) == summary(alone)
            assert [c.index for c in through[-1].outputs] == [c.index for c in alone[-1].outputs]
        stats = await client.fetch_stats()
        assert stats.num_running == stats.num_waiting == 0 and stats.num_used_blocks == 0
        assert client.stats() is stats and client.num_unfinished_requests == 0


async def test_leaving_a_stream_aborts_the_engines_request(parts):
    async with serving_client(parts) as (engine, client, _):
        stream = client.add_request([1, 2, 3], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        await until_no_requests(engine)
        assert engine.num_unfinished_requests == 0
        assert engine.scheduler.kv_allocator.num_used_blocks == 0
        # a second stream after the first's abort runs to its end
        outs = await outputs_of(client.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0)))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


async def test_bad_requests_are_refused_before_they_are_sent(parts):
    async with serving_client(parts) as (engine, client, _):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            client.add_request([engine.vocab_size + 5], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="maximum context length"):
            client.add_request([1, 2], SamplingParams(max_tokens=engine.max_model_len))
        assert client.num_unfinished_requests == 0


async def test_a_closed_connection_aborts_its_requests(parts):
    async with serving_client(parts) as (engine, client, serving):
        stream = client.add_request([4, 5], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
        await stream.__anext__()
        await client.shutdown()                  # the API process goes away
        await asyncio.wait_for(serving, 5)
        with pytest.raises(EngineError, match="shut down"):
            await stream.__anext__()
        await until_no_requests(engine)
        assert engine.num_unfinished_requests == 0


async def test_an_engine_that_dies_fails_the_clients_requests(parts):
    engine = build_engine(parts)
    engine.start()
    client, serving = await connected(engine)
    stream = client.add_request([4, 5], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    await stream.__anext__()
    engine._task.cancel()                        # the loop ends (as a shutdown does)
    await engine.shutdown()
    with pytest.raises(EngineError):
        async for _ in stream:
            pass
    assert await asyncio.wait_for(client.join(), 5) is not None
    assert not client.is_running
    with pytest.raises(EngineError, match="not running"):
        client.add_request([1], SamplingParams(max_tokens=1))
    await asyncio.wait_for(serving, 5)


def output(index, text, ids, finish=None, finished=False):
    c = CompletionOutput(index, token_ids=list(ids), delta_text=text, delta_token_ids=list(ids), finish_reason=finish)
    return RequestOutput("r", [1], [c], finished)


async def test_a_reader_behind_its_producer_gets_one_merged_output():
    queue = OutputQueue()
    queue.put_nowait(output(0, "a", [1]))
    queue.put_nowait(output(1, "x", [9]))
    queue.put_nowait(output(0, "b", [2], finish="length"))
    queue.put_nowait(RequestOutput("r", [1], [], True))
    merged = await queue.get()
    assert merged.finished
    assert [(c.index, c.delta_text, c.delta_token_ids, c.finish_reason) for c in merged.outputs] == [
        (0, "ab", [1, 2], "length"), (1, "x", [9], None)]
    error = EngineError("gone")
    queue.put_nowait(error)
    queue.put_nowait(output(0, "c", [3]))        # never merged into an error
    assert await queue.get() is error
    assert (await queue.get()).outputs[0].delta_text == "c"
