"""Structured outputs on flint-tiny (random weights: only the grammar keeps the output valid), through
the engine on the CPU: hundreds of sampled JSON documents validate against their schemas, regexes and
choices hold, a finished grammar stops the request, and unconstrained requests are left as they were."""

import json
import re

import jsonschema
import pytest
import torch

from conftest import final_outputs
from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.engine import EngineConfig
from flint_sched.engine.builder import build_parts
from flint_sched.executor.grammar_masks import GrammarMasks, unpack_bitmask
from flint_sched.sampling_params import SamplingParams
from flint_sched.structured import StructuredOutputsParams
from flint_sched.structured.compiler import GrammarCompiler

SCHEMAS = {
    "flat with enum and bounds": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 130},
                       "role": {"enum": ["admin", "user", "guest"]}}},
    "nested objects and arrays": {
        "type": "object", "additionalProperties": False, "required": ["user", "tags", "score"],
        "properties": {
            "user": {"type": "object", "additionalProperties": False, "required": ["id", "email"],
                     "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                                    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}}},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
            "score": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.5},
            "note": {"type": ["string", "null"], "maxLength": 6}}},
    "array of records": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "ok"],
                  "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                 "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                 "ok": {"type": "boolean"}}}},
    "numbers and constants": {
        "type": "object", "additionalProperties": False, "required": ["version", "ratio", "unit"],
        "properties": {"version": {"const": 2}, "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                                                                     "multipleOf": 0.125},
                       "unit": {"type": "string", "enum": ["ms", "s"]}}},
}
PER_SCHEMA = 50


@pytest.fixture(scope="module")
def parts(tiny_config):
    ckpt = dummy_checkpoint(tiny_config, "bf16", seed=5, device="cpu")
    config = EngineConfig(device="cpu", max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=2048)
    return build_parts(config, progress=False, checkpoint=ckpt)


run = final_outputs


def constrained(max_tokens=160, seed=None, **kind):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed,
                          structured_outputs=StructuredOutputsParams(**kind))


@pytest.mark.slow
def test_hundreds_of_sampled_json_documents_validate(parts):
    requests = [(f"Give me JSON number {i}.", constrained(json=schema))
                for schema in SCHEMAS.values() for i in range(PER_SCHEMA)]
    outputs = run(parts, requests)
    for (_, params), out in zip(requests, outputs, strict=True):
        choice = out.outputs[0]
        assert choice.finish_reason == "stop", choice.text     # the grammar finished, then a stop token
        jsonschema.validate(json.loads(choice.text), json.loads(params.structured_outputs.json))


def test_json_object_regex_and_choice_hold(parts):
    regex = "[a-z]{2,5}-[0-9]{3}( ok)?"
    choices = ["yes", "no", "maybe later"]
    # any JSON object: strings and numbers are unbounded, so favour the tokens that close them (the
    # grammar still decides what is allowed: its mask comes before the bias)
    encode = parts.checkpoint.tokenizer.encode
    closing = {encode(c)[0]: 6.0 for c in ('"', "}", "]", ",")}
    any_object = SamplingParams(temperature=1.0, max_tokens=256, logit_bias=closing,
                                structured_outputs=StructuredOutputsParams(json_object=True))
    requests = ([("any json", any_object)] * 20 + [("id", constrained(regex=regex))] * 30
                + [("pick", constrained(choice=choices))] * 30)
    outputs = [out.outputs[0] for out in run(parts, requests)]
    finished = [o for o in outputs[:20] if o.finish_reason == "stop"]
    assert len(finished) >= 15 and all(isinstance(json.loads(o.text), dict) for o in finished)
    assert any(o.text != "{}" for o in finished)
    assert all(re.fullmatch(regex, o.text) for o in outputs[20:50]), [o.text for o in outputs[20:50]]
    assert all(o.text in choices and o.finish_reason == "stop" for o in outputs[50:])
    assert len({o.text for o in outputs[50:]}) > 1                         # sampled, not stuck on one


def test_a_grammar_written_in_gbnf_or_lark_holds(parts):
    gbnf = 'root ::= "(" [0-9]{1,3} ("+" [0-9]{1,3}){0,3} ")"'
    lark = 'start: WORD (" " WORD)~2\nWORD: /[a-z]{1,6}/'
    outputs = run(parts, [("sum", constrained(grammar=gbnf))] * 10 + [("words", constrained(grammar=lark))] * 10)
    assert all(re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3}){0,3}\)", o.outputs[0].text) for o in outputs[:10])
    assert all(re.fullmatch(r"[a-z]{1,6}( [a-z]{1,6}){2}", o.outputs[0].text) for o in outputs[10:])


def test_requests_without_a_grammar_are_unaffected(parts):
    plain = SamplingParams(temperature=1.0, max_tokens=24, seed=1234)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = run(parts, [("hello there", plain), ("general kenobi", greedy)])
    mixed = run(parts, [("hello there", plain), ("x", constrained(json_object=True)), ("general kenobi", greedy),
                        ("y", constrained(regex="[0-9]{4}")),
                        ("z", SamplingParams(max_tokens=4, prompt_logprobs=2))])
    assert [o.outputs[0].token_ids for o in alone] == [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids]


def test_a_constraint_after_the_reasoning_leaves_the_reasoning_free(tiny_config):
    """begin_after_token: free until that token, then the grammar (the masks alone, no model)."""
    from flint_sched.core.plan import ScheduledRequest
    from flint_sched.tokenizer import build_tokenizer
    tokenizer = build_tokenizer(tiny_config.vocab_size, 0)
    end = tokenizer.token_id("</think>")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+", begin_after_token=end))
    output: list[int] = []
    entry = ScheduledRequest("r", [1], 1, [0], 0, True, params, [1], output, False)
    masks = GrammarMasks(GrammarCompiler(tokenizer))
    digit, letter = tokenizer.encode("7")[0], tokenizer.encode("q")[0]

    def allowed():
        rows, bitmask = masks.fill([entry])
        return unpack_bitmask(bitmask, tiny_config.vocab_size)[0]

    assert allowed().all()                                       # reasoning: anything goes
    output += tokenizer.encode("some thoughts")
    assert allowed()[letter]
    output.append(end)
    assert allowed()[digit] and not allowed()[letter]            # the grammar has begun
    output.append(digit)
    mask = allowed()
    assert mask[digit] and not mask[letter] and all(mask[t] for t in tokenizer.eos_token_ids)


def test_compiler_refuses_bad_constraints_and_caches_good_ones(tiny_config):
    from flint_sched.tokenizer import build_tokenizer
    compiler = GrammarCompiler(build_tokenizer(tiny_config.vocab_size, 0))
    good = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    same = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert compiler.compile(good) is compiler.compile(same)
    for bad in ({"json": {"type": "bogus"}}, {"regex": "(unclosed"}, {"grammar": "start: undefined_rule"},
                {"json": {"type": "array", "uniqueItems": True}, "strict": True}):
        with pytest.raises(ValueError):
            compiler.compile(StructuredOutputsParams(**bad))
    compiler.compile(StructuredOutputsParams(json={"type": "array", "uniqueItems": True}))     # not strict: ignored
    for bad in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"json": "not json"}, {"json": 3}):
        with pytest.raises(ValueError):
            StructuredOutputsParams(**bad)


def test_a_finished_grammar_wins_over_min_tokens():
    """min_tokens bans the stop tokens, the finished grammar allows nothing else: the stop token it is."""
    from flint_sched.core.plan import ScheduledRequest
    from flint_sched.executor.sampler import sample_batch

    class OnlyStop:
        def fill(self, entries):
            bitmask = torch.zeros(1, 1, dtype=torch.int32)
            bitmask[0, 0] = 1 << 3                               # token 3 only
            return [0], bitmask

        def mask(self, logits, filled):
            return GrammarMasks.mask(self, logits, filled)

    params = SamplingParams(min_tokens=5, structured_outputs=StructuredOutputsParams(regex="a"))
    entry = ScheduledRequest("r", [1], 1, [0], 0, True, params, [1], [9], False)
    (token, _), = sample_batch(torch.randn(1, 32), [entry], {3}, None, OnlyStop())
    assert token == 3
