"""The asyncio engine end to end on flint-tiny (CPU): concurrency, aborts, preemption, failures."""

import asyncio
import dataclasses
import random

import pytest
import torch

from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.engine import EngineConfig, EngineError
from flint_sched.engine.builder import build_engine, build_parts
from flint_sched.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tiny_short_window):
    return dummy_checkpoint(tiny_short_window, "bf16", seed=11, device="cpu")


def parts_for(ckpt, **kw):
    args = dict(device="cpu", max_num_seqs=16, max_num_batched_tokens=64, block_size=4, num_kv_blocks=400)
    return build_parts(EngineConfig(**{**args, **kw}), progress=False, checkpoint=ckpt)


@pytest.fixture(scope="module")
def parts(ckpt):
    return parts_for(ckpt)


async def collect(stream):
    deltas, last = [], None
    async for out in stream:
        deltas.append(out)
        last = out
    return deltas, last


async def run_engine(parts, requests):
    engine = build_engine(parts)
    engine.start()
    try:
        results = await asyncio.gather(*(collect(engine.add_request(p, sp)) for p, sp in requests))
        allocator = engine.scheduler.kv_allocator
        assert allocator.num_used_blocks == 0 and allocator.num_used_ring_slots == 0
        return results, engine
    finally:
        await engine.shutdown()


def prompt(rng, n):
    return [rng.randrange(4000) for _ in range(n)]


async def test_100_concurrent_requests_with_random_parameters(parts):
    rng = random.Random(0)
    requests = []
    for _ in range(100):
        params = SamplingParams(
            n=rng.choice([1, 1, 2]), temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([0, 20]), min_p=rng.choice([0.0, 0.05]), max_tokens=rng.randint(1, 12),
            seed=rng.choice([None, rng.randrange(100)]), logprobs=rng.choice([None, 0, 3]), ignore_eos=True,
            presence_penalty=rng.choice([0.0, 0.5]), repetition_penalty=rng.choice([1.0, 1.2]))
        requests.append((prompt(rng, rng.randint(1, 40)), params))
    results, _ = await run_engine(parts, requests)
    for (_, params), (deltas, last) in zip(requests, results):
        assert last.finished and len(last.outputs) == params.n
        for choice in last.outputs:
            assert len(choice.token_ids) == params.max_tokens and choice.finish_reason == "length"
            if params.logprobs is not None:
                assert len(choice.logprobs) == params.max_tokens
                assert all(len(lp.top) == params.logprobs for lp in choice.logprobs)
        streamed = {}
        for out in deltas:
            for c in out.outputs:
                streamed.setdefault(c.index, []).extend(c.delta_token_ids)
        assert {c.index: c.token_ids for c in last.outputs} == streamed


async def test_abort_mid_stream_returns_every_block_and_slot(parts):
    engine = build_engine(parts)
    engine.start()
    try:
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        stream = engine.add_request(prompt(random.Random(1), 30), params)
        other = engine.add_request(prompt(random.Random(2), 20), params, request_id="explicit")
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break                         # the consumer leaves: the request is aborted
        await stream.aclose()
        assert engine.abort("explicit") and not engine.abort("explicit")
        deltas, last = await collect(other)
        assert last.outputs[0].finish_reason == "abort"
        await asyncio.sleep(0.05)
        allocator = engine.scheduler.kv_allocator
        assert allocator.num_used_blocks == 0 and allocator.num_used_ring_slots == 0
        assert not engine.scheduler.has_unfinished_requests()
    finally:
        await engine.shutdown()


async def test_greedy_under_a_tiny_pool_equals_an_unconstrained_run(ckpt, parts):
    rng = random.Random(3)
    requests = [(prompt(rng, rng.randint(5, 30)), SamplingParams(temperature=0, max_tokens=rng.randint(5, 20),
                                                                 ignore_eos=True)) for _ in range(12)]
    free, _ = await run_engine(parts, requests)
    tight, engine = await run_engine(parts_for(ckpt, num_kv_blocks=14), requests)
    assert engine.num_preemptions > 0
    assert [last.outputs[0].token_ids for _, last in free] == [last.outputs[0].token_ids for _, last in tight]


async def test_a_seeded_request_does_not_depend_on_the_batch(parts):
    rng = random.Random(4)
    target = (prompt(rng, 10), SamplingParams(temperature=1.0, seed=77, max_tokens=10, ignore_eos=True))
    alone, _ = await run_engine(parts, [target])
    others = [(prompt(rng, 12), SamplingParams(temperature=1.0, max_tokens=8)) for _ in range(5)]
    crowded, _ = await run_engine(parts, others[:2] + [target] + others[2:])
    assert alone[0][1].outputs[0].token_ids == crowded[2][1].outputs[0].token_ids


async def test_stop_strings_are_never_streamed_past(parts):
    p = prompt(random.Random(5), 12)
    base, _ = await run_engine(parts, [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))])
    text = base[0][1].outputs[0].text
    assert len(text) > 12
    stop = text[6:10]
    expected = text[: text.find(stop)]
    stopped, _ = await run_engine(parts, [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                            stop=[stop, "never-there"]))])
    deltas, last = stopped[0]
    choice = last.outputs[0]
    assert "".join(c.delta_text for out in deltas for c in out.outputs) == expected == choice.text
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    # include_stop_str_in_output (vLLM's): the stop string ends the streamed text
    kept, _ = await run_engine(parts, [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                         stop=[stop], include_stop_str_in_output=True))])
    deltas, last = kept[0]
    assert "".join(c.delta_text for out in deltas for c in out.outputs) == expected + stop == last.outputs[0].text
    # a stop token's text: left out, or kept with include_stop_str_in_output
    ids = base[0][1].outputs[0].token_ids
    k = ids.index(ids[5])
    decode = parts.checkpoint.tokenizer.decode
    for include in (False, True):
        ended, _ = await run_engine(parts, [(p, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[k]],
                                                              include_stop_str_in_output=include))])
        choice = ended[0][1].outputs[0]
        assert choice.token_ids == ids[:k + 1] and choice.stop_reason == ids[k]
        assert choice.text == decode(ids[:k + include])


async def test_allowed_token_ids_and_bad_words(parts):
    """vLLM's allowed_token_ids (only those tokens come out) and bad_words (tokenized by the engine,
    each word alone and after a space; no output ever holds a word's whole token sequence), each
    beside a plain request in the same steps."""
    from flint_sched.engine.async_engine import with_bad_words_tokenized
    p = prompt(random.Random(9), 12)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base, _ = await run_engine(parts, [(p, greedy)])
    ids, text = base[0][1].outputs[0].token_ids, base[0][1].outputs[0].text
    allowed = sorted(set(ids[2:5]))
    words = [w for w in text.split() if w][:3]
    params = [dataclasses.replace(greedy, allowed_token_ids=tuple(allowed)),
              dataclasses.replace(greedy, temperature=1.0, seed=3, allowed_token_ids=tuple(allowed)),
              dataclasses.replace(greedy, bad_words=tuple(words)), greedy]
    results, _ = await run_engine(parts, [(p, sp) for sp in params])
    outs = [last.outputs[0].token_ids for _, last in results]
    assert set(outs[0]) <= set(allowed) and set(outs[1]) <= set(allowed) and outs[3] == ids
    tokenizer = parts.checkpoint.tokenizer
    sequences = with_bad_words_tokenized(params[2], tokenizer).bad_words_token_ids
    assert {tuple(tokenizer.encode(w)) for w in words} | {tuple(tokenizer.encode(" " + w)) for w in words} == set(
        sequences)
    holds = lambda out, seq: any(tuple(out[i:i + len(seq)]) == seq for i in range(len(out)))  # noqa: E731
    assert any(holds(ids, seq) for seq in sequences)          # the plain output writes one of them
    assert not any(holds(outs[2], seq) for seq in sequences), outs[2]


async def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(parts):
    engine = build_engine(parts)
    real = engine.executor
    calls = {"n": 0}

    class Flaky:
        def execute(self, plan):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("device on fire")
            return real.execute(plan)

    engine.executor = Flaky()
    engine.start()
    try:
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        with pytest.raises(EngineError, match="device on fire"):
            await collect(engine.add_request([1, 2, 3], params))
        _, last = await collect(engine.add_request([4, 5, 6], params))
        assert last.finished and len(last.outputs[0].token_ids) == 10
        assert engine.scheduler.kv_allocator.num_used_blocks == 0
    finally:
        await engine.shutdown()


async def test_bad_requests_fail_when_made(parts):
    engine = build_engine(parts)
    engine.start()
    try:
        limit = engine.max_model_len
        with pytest.raises(ValueError, match="maximum context length"):
            engine.add_request([1] * (limit - 3), SamplingParams(max_tokens=5))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request([1, 10**6], SamplingParams())
        with pytest.raises(ValueError, match="logit_bias"):
            engine.add_request([1], SamplingParams(logit_bias={10**6: 1.0}))
        with pytest.raises(ValueError, match="empty"):
            engine.add_request([], SamplingParams())
        assert not engine.scheduler.has_unfinished_requests()
    finally:
        await engine.shutdown()
    with pytest.raises(EngineError, match="not running"):
        engine.add_request([1], SamplingParams())


async def test_shutdown_ends_open_streams(parts):
    engine = build_engine(parts)
    engine.start()
    stream = engine.add_request([1, 2], SamplingParams(max_tokens=500, ignore_eos=True))
    await stream.__anext__()
    await engine.shutdown()
    with pytest.raises(EngineError, match="shut down"):
        await collect(stream)


def test_offline_llm_api(ckpt, tmp_path, monkeypatch):
    from flint_sched.llm import LLM
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    llm = LLM("flint-tiny", progress=False, device="cpu", max_num_seqs=4)
    outs = llm.generate(["Hello", "Bonjour"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    again = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert dataclasses.is_dataclass(outs[0])
    # chat, as vLLM's LLM.chat: one conversation or several, through the checkpoint's chat template
    conversation = [{"role": "user", "content": "Hello"}]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [chat] = llm.chat(conversation, greedy)
    rendered = llm.tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False)
    assert rendered == "[gMASK]<sop><|user|>Hello<|assistant|><think>"
    assert chat.outputs[0].token_ids == llm.generate(chat.prompt_token_ids, greedy)[0].outputs[0].token_ids
    opened = conversation + [{"role": "assistant", "content": "Hi"}]
    both = llm.chat([conversation, opened], greedy, add_generation_prompt=False, continue_final_message=True,
                    chat_template_kwargs={"enable_thinking": False})
    assert llm.tokenizer.decode(both[1].prompt_token_ids, skip_special_tokens=False).endswith("<|assistant|></think>Hi")
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(opened, greedy, continue_final_message=True)


def test_a_model_too_big_for_the_host_is_refused_before_anything_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="weights need about 159 GB.*GPU"):
        build_parts(EngineConfig(model="flint", device="cpu"), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_engine_prefix_caching_on_by_default_and_off_on_request(ckpt):
    """A repeated prompt reports its cached tokens and gives the same greedy tokens; with caching
    off nothing is cached and no snapshot slots are made."""
    prompt = list(range(3, 40))                          # 37 tokens, blocks of 4: hit at 36
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def twice(parts):
        engine = build_engine(parts)
        engine.start()
        try:
            first = (await collect(engine.add_request(prompt, params)))[1]
            second = (await collect(engine.add_request(prompt, params)))[1]
            return first, second, engine
        finally:
            await engine.shutdown()

    on = parts_for(ckpt)
    assert on.scheduler_config.enable_prefix_caching and on.scheduler_config.num_ring_snapshots == 16
    assert on.executor.kv.ring.shape[2] == 16 + 16
    first, second, engine = asyncio.run(twice(on))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 36)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert engine.reset_prefix_cache()
    off = parts_for(ckpt, enable_prefix_caching=False)
    assert off.scheduler_config.num_ring_snapshots == 0 and off.executor.kv.ring.shape[2] == 16
    first, second, engine = asyncio.run(twice(off))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 0)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert engine.scheduler.prefix_cache is None and not engine.reset_prefix_cache()


def test_offline_llm_keeps_its_prefix_cache_across_generate_calls(tmp_path, monkeypatch):
    from flint_sched.llm import LLM
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    llm = LLM("flint-tiny", progress=False, device="cpu", max_num_seqs=2)
    prompt = list(range(100, 150))                       # 50 tokens, blocks of 16: hit at 48
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    second = llm.generate(prompt, params)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 48)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    assert llm.generate(prompt, params)[0].num_cached_tokens == 0


def test_long_prefill_token_threshold_reads_prompts_in_smaller_chunks_with_the_same_tokens(ckpt):
    """--long-prefill-token-threshold 7: prompts beside each other advance at most 7 tokens a step
    (many more steps than the 64-token budget needs), and every request's greedy tokens are those
    of the unthrottled engine."""
    prompts = [list(range(3, 90)), list(range(5, 40)), [9] * 3]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run(parts):
        engine = build_engine(parts)
        schedule, chunks = engine.scheduler.schedule, []

        def recording():
            plan = schedule()
            chunks.extend(len(e.token_ids) for e in plan.scheduled_requests)
            return plan

        engine.scheduler.schedule = recording
        engine.start()
        try:
            outs = await asyncio.gather(*(collect(engine.add_request(p, params)) for p in prompts))
            return [out[1].outputs[0].token_ids for out in outs], chunks
        finally:
            await engine.shutdown()

    throttled = parts_for(ckpt, long_prefill_token_threshold=7)
    assert throttled.scheduler_config.long_prefill_token_threshold == 7
    tokens, chunks = asyncio.run(run(throttled))
    reference, reference_chunks = asyncio.run(run(parts_for(ckpt)))
    assert tokens == reference
    assert max(chunks) == 7 and max(reference_chunks) > 7


async def test_an_fp8_kv_cache_serves_requests_and_halves_the_bytes_per_block(ckpt):
    """kv_cache_dtype="fp8": the cache is e4m3 (a quarter of the CPU's float32 per block); requests
    sharing a prefix (prefix-cache hits, ring snapshots) in a cache too small for all of them at
    once run to the end and every block comes back; a bad name is refused."""
    parts = parts_for(ckpt, kv_cache_dtype="fp8", num_kv_blocks=40)
    kv = parts.executor.kv
    assert kv.full.dtype == torch.float8_e4m3fn and kv.ring.dtype == torch.float8_e4m3fn
    assert kv.full.element_size() * 4 == parts_for(ckpt).executor.kv.full.element_size()
    rng = random.Random(3)
    shared = prompt(rng, 30)
    requests = [(shared + prompt(rng, rng.randint(1, 20)), SamplingParams(temperature=0.0, max_tokens=12,
                                                                           ignore_eos=True)) for _ in range(12)]
    results, _ = await run_engine(parts, requests)
    assert all(last.finished and len(last.outputs[0].token_ids) == 12 for _, last in results)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


async def test_outputs_carry_the_queue_time_until_the_first_step(ckpt):
    """RequestOutput.queue_time_s (what /metrics' request_queue_time histogram observes): from
    add_request to the first step that ran the request, the same on every output; with one slot,
    the second request waits the first one's whole generation."""
    results, _ = await run_engine(parts_for(ckpt, max_num_seqs=1), [
        ([5, 6, 7], SamplingParams(max_tokens=24, ignore_eos=True)),
        ([8, 9], SamplingParams(n=2, max_tokens=2, ignore_eos=True)),
    ])
    (first, first_last), (second, second_last) = results
    waits = [{out.queue_time_s for out in outs} for outs in (first, second)]
    assert all(len(w) == 1 and None not in w for w in waits), waits
    (first_wait,), (second_wait,) = waits
    assert 0 <= first_wait < second_wait
    assert first_last.finished and second_last.finished


async def test_a_stream_interval_sends_tokens_in_groups_with_the_same_text(ckpt, parts):
    """--stream-interval 3: the first token alone, then outputs of 3 tokens, the last with what is
    left; the same tokens, text and logprobs as interval 1, and n > 1 choices each on their own count."""
    rng = random.Random(8)
    requests = [(prompt(rng, 9), SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=2)),
                (prompt(rng, 14), SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=7, ignore_eos=True))]
    every, _ = await run_engine(parts, requests)
    grouped, _ = await run_engine(parts_for(ckpt, stream_interval=3), requests)
    for (deltas_1, last_1), (deltas_3, last_3) in zip(every, grouped):
        assert [c.token_ids for c in last_3.outputs] == [c.token_ids for c in last_1.outputs]
        assert [c.text for c in last_3.outputs] == [c.text for c in last_1.outputs]
        assert [c.logprobs for c in last_3.outputs] == [c.logprobs for c in last_1.outputs]
        for index, choice in enumerate(last_3.outputs):
            sizes = [len(c.delta_token_ids) for out in deltas_3 for c in out.outputs if c.index == index]
            sizes = [s for s in sizes if s]
            total = len(choice.token_ids)
            assert sizes[0] == 1 and all(s == 3 for s in sizes[1:-1]) and 1 <= sizes[-1] <= 3, sizes
            assert sum(sizes) == total
            texts = "".join(c.delta_text for out in deltas_3 for c in out.outputs if c.index == index)
            assert texts == choice.text
            if choice.logprobs is not None:
                streamed = [lp for out in deltas_3 for c in out.outputs if c.index == index for lp in c.delta_logprobs]
                assert streamed == choice.logprobs
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)


async def test_an_abort_sends_the_tokens_a_stream_interval_held(ckpt):
    """A request aborted between two outputs of its interval still streams every token it made."""
    engine = build_engine(parts_for(ckpt, stream_interval=5))
    engine.start()
    try:
        stream = engine.add_request(prompt(random.Random(9), 10), SamplingParams(max_tokens=40, ignore_eos=True),
                                    request_id="held")
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 2:                       # 1 token, then 5: abort while the next 5 gather
                await asyncio.sleep(0.05)
                engine.abort("held")
        last = outs[-1].outputs[0]
        assert last.finish_reason == "abort"
        streamed = [t for out in outs for t in out.outputs[0].delta_token_ids]
        assert streamed == last.token_ids and len(streamed) >= 6
    finally:
        await engine.shutdown()


def test_held_deltas_accumulate_and_survive_a_failure(ckpt):
    """ChoiceState under an interval of 4: deltas gather until due; fail() keeps what was held."""
    from flint_sched.core.plan import RequestStepOutput
    from flint_sched.engine.output_processor import ChoiceState

    state = ChoiceState(0, SamplingParams(max_tokens=20), ckpt.tokenizer)
    tokens = [400 + i for i in range(7)]
    state.apply(RequestStepOutput("r", tokens[:1]))
    assert state.due(4)                          # the first token at once
    state.mark_published()
    for t in tokens[1:4]:
        out = state.apply(RequestStepOutput("r", [t]))
        assert not state.due(4)
    assert out.delta_token_ids == tokens[1:4]
    out = state.apply(RequestStepOutput("r", tokens[4:5]))
    assert state.due(4) and out.delta_token_ids == tokens[1:5]
    state.mark_published()
    state.apply(RequestStepOutput("r", tokens[5:7]))
    out = state.fail("abort")
    assert out.delta_token_ids == tokens[5:7] and out.finish_reason == "abort"
