"""Structured output on the random-weight checkpoint: its free output is noise, so only the grammar can
make a response valid. Every loop (plain, overlap, overlap under chaos, the device process), mixed
batches whose free requests must not notice the constrained ones, an abort mid-generation, retraction,
and the refusals."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from gapless import LLM, SamplingParams
from gapless.engine.request import ReqStatus

SCHEMAS = [
    {  # nested objects, required fields, additionalProperties false, bounded integers and numbers
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 3, "maximum": 42},
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "number", "minimum": -1, "maximum": 1},
                    "ok": {"type": "boolean"},
                },
                "required": ["x", "ok"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "point"],
        "additionalProperties": False,
    },
    {  # arrays with min/max items, enums, length-bounded strings
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 3,
            },
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
        },
        "required": ["tags", "name"],
        "additionalProperties": False,
    },
    {  # an array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": [1, 2, "three", None]}},
            "required": ["k"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
]
REGEX = r"(ab|cd)-\d{2,3}"
CHOICES = ["yes", "no", "maybe so"]
EBNF = 'root ::= "(" [a-z] ("," [a-z])* ")"'
FREE = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9] * 20, list(range(30, 70)), [11, 12], [100, 101, 102, 103]]
LOOPS = {
    "plain": {"overlap": False},
    "overlap": {"overlap": True, "cpu_worker": "thread"},
    "chaos-0": {"overlap": True, "cpu_worker": "thread", "chaos_seed": 0},
    "chaos-1": {"overlap": True, "cpu_worker": "thread", "chaos_seed": 1},
}


def constrained() -> list[SamplingParams]:
    """One request per kind of constraint, seeded sampling and greedy."""
    sample = {"max_tokens": 60, "temperature": 1.0}
    return [
        *(SamplingParams(**sample, seed=i, json_schema=s) for i, s in enumerate(SCHEMAS)),
        SamplingParams(**sample, seed=7, json_schema=json.dumps(SCHEMAS[0])),  # as JSON text
        # any object: its free-text keys would run on, so a logit_bias (on the same row as the grammar's
        # mask) favours the tokens '"', '}' and '"}' of the built-in tokenizer
        SamplingParams(**sample, seed=1, json_object=True, logit_bias={4: 6.0, 95: 6.0, 806: 6.0}),
        SamplingParams(**sample, seed=3, regex=REGEX),
        SamplingParams(**sample, seed=4, choice=CHOICES),
        SamplingParams(**sample, seed=5, ebnf=EBNF, top_k=50, top_p=0.9),
    ]


def check_valid(params: SamplingParams, text: str) -> None:
    """`text` is what `params`' constraint allows."""
    if params.json_schema is not None:
        schema = (
            params.json_schema if isinstance(params.json_schema, dict) else json.loads(params.json_schema)
        )
        jsonschema.validate(json.loads(text), schema)
    elif params.json_object:
        assert isinstance(json.loads(text), dict)
    elif params.regex is not None:
        assert re.fullmatch(params.regex, text), text
    elif params.choice is not None:
        assert text in params.choice
    else:
        assert re.fullmatch(r"\([a-z](,[a-z])*\)", text), text


@pytest.fixture(scope="module")
def qwen3(ckpt_factory):
    return str(ckpt_factory("qwen3"))


@pytest.fixture(scope="module")
def plain_llm(qwen3):
    """A plain-loop engine: the yardstick of the other loops, and the engine of the cheaper tests."""
    with LLM(qwen3, device="cpu", overlap=False, kv_cache_tokens=4096) as llm:
        yield llm


@pytest.fixture(scope="module")
def free_reference(plain_llm):
    """The free requests' tokens when they run alone."""
    return [o.token_ids for o in plain_llm.generate(PROMPTS, FREE, use_tqdm=False)]


@pytest.fixture(scope="module")
def constrained_reference(plain_llm):
    """The constrained requests' texts in the plain loop."""
    return [o.text for o in run_mixed(plain_llm)[0]]


def run_mixed(llm: LLM) -> tuple[list, list]:
    """Constrained and free requests in one workload; (constrained outputs, free outputs)."""
    params = constrained()
    outs = llm.generate(PROMPTS + [[3, 4]] * len(params), [FREE] * len(PROMPTS) + params, use_tqdm=False)
    return outs[len(PROMPTS) :], outs[: len(PROMPTS)]


@pytest.mark.parametrize("loop", LOOPS)
def test_every_constrained_output_is_valid_and_free_ones_unchanged(
    qwen3, free_reference, constrained_reference, loop
):
    with LLM(qwen3, device="cpu", kv_cache_tokens=4096, chunked_prefill_size=16, **LOOPS[loop]) as llm:
        cons, free = run_mixed(llm)
        for params, out in zip(constrained(), cons):
            assert out.finish_reason == "stop", (params.structured, out.text)
            check_valid(params, out.text)
        assert [o.token_ids for o in free] == free_reference
        # the same tokens whichever loop: seeded rows are batch-invariant, and the masks are exact
        assert [o.text for o in cons] == constrained_reference
        llm.check_integrity()


@pytest.mark.slow  # (a device process, ~8 s)
def test_device_process_overlap_matches_plain(qwen3, constrained_reference):
    """The deferred sampling job crosses the device process's pipe too."""
    with LLM(
        qwen3, device="cpu", overlap=True, cpu_worker="process", chaos_seed=3, kv_cache_tokens=4096
    ) as llm:
        cons, _ = run_mixed(llm)
        assert [o.text for o in cons] == constrained_reference
        llm.check_integrity()


def test_overlap_defers_the_mask_and_counts_the_wait(qwen3):
    """In the overlap loop a constrained decode is launched before its previous token is processed: its
    sampling waits for the mask in a second job, and the meter counts that wait as device idle time."""
    with LLM(qwen3, device="cpu", overlap=True, cpu_worker="thread", kv_cache_tokens=4096) as llm:
        eng = llm.engine
        req = eng.add_request([3, 4], SamplingParams(max_tokens=30, temperature=0.0, regex=r"[a-z]{30}"))
        deferred = 0
        while eng.has_unfinished():
            eng.step()
            deferred += any(b.forward.defer_sampling for b, _ in eng.scheduler.inflight)
        assert deferred > 10
        assert re.fullmatch("[a-z]+", eng.output_text(req))
        llm.check_integrity()


@pytest.mark.parametrize("chaos_seed", [0, 1])
def test_abort_mid_generation(qwen3, plain_llm, chaos_seed):
    """A constrained request aborted mid-decode (a deferred batch in flight) leaves no leak, and the
    others' outputs are as without it."""
    params = constrained()
    expected = [o.text for o in plain_llm.generate([[3, 4]] * len(params), params, use_tqdm=False)]
    with LLM(qwen3, device="cpu", overlap=True, cpu_worker="thread", chaos_seed=chaos_seed) as llm:
        eng = llm.engine
        reqs = [eng.add_request([3, 4], p) for p in params]
        victim = reqs[0]
        while not (victim.status is ReqStatus.RUNNING and len(victim.output_ids) >= 3 and victim.inflight):
            eng.step()
        eng.abort(victim.rid)
        while eng.has_unfinished():
            eng.step()
        assert victim.finish_reason == "abort"
        assert [eng.output_text(r) for r in reqs[1:]] == expected[1:]
        llm.check_integrity()


def test_retraction_resumes_the_grammar(qwen3, plain_llm):
    """A KV pool too small for the workload retracts constrained requests mid-output: they resume where
    they were (the matcher keeps its state) and produce what they produce without retraction."""
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=i, json_schema=SCHEMAS[i % 3]) for i in range(6)
    ]
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    expected = [o.text for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    retract = {"init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}
    with LLM(qwen3, device="cpu", overlap=True, cpu_worker="thread", kv_cache_tokens=160, **retract) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.stats.retractions > 0
        assert [o.text for o in outs] == expected
        llm.check_integrity()


def test_stop_string_and_max_tokens_end_a_constrained_request(plain_llm):
    out = plain_llm.generate([[3, 4]], SamplingParams(max_tokens=40, temperature=0.0, regex="[a-c]{10}-z"))[0]
    base = out.text
    stop = base[3:5]
    cut = plain_llm.generate(
        [[3, 4]], SamplingParams(max_tokens=40, temperature=0.0, regex="[a-c]{10}-z", stop=stop)
    )
    assert cut[0].finish_reason == "stop" and cut[0].text == base[: base.index(stop)]
    short = plain_llm.generate([[3, 4]], SamplingParams(max_tokens=4, temperature=0.0, regex="[a-c]{10}-z"))
    assert short[0].finish_reason == "length" and base.startswith(short[0].text)
    plain_llm.check_integrity()


def test_the_grammar_ends_the_request_even_with_ignore_eos(plain_llm):
    out = plain_llm.generate(
        [[3, 4]], SamplingParams(max_tokens=40, temperature=0.0, choice=CHOICES, ignore_eos=True)
    )
    assert out[0].finish_reason == "stop" and out[0].text in CHOICES


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json_schema": {"type": "nonsense"}}, "json_schema cannot be compiled"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"regex": "a("}, "regex cannot be compiled"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf cannot be compiled"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias token id 1000000 is outside the vocabulary"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_by_name(plain_llm, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):  # nothing of the call is queued
        plain_llm.generate(
            [[3, 4]] * 2, [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, **fields)]
        )
    assert not plain_llm.engine.has_unfinished()
    assert plain_llm.generate([[3, 4]], SamplingParams(max_tokens=2))[0].finish_reason == "length"
    plain_llm.check_integrity()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"regex": "a", "choice": ["a"]}, "exclude each other"),
        ({"choice": []}, "choice must be a non-empty list of strings"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json_schema": 3}, "json_schema must be a JSON schema"),
        ({"json_object": "yes"}, "json_object must be a bool"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {3: 101}}, "logit_bias must map token ids >= 0 to values in [-100, 100]"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be in [0, max_tokens=4]"),
    ],
)
def test_bad_structured_params_are_value_errors(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**fields)


def test_compiled_grammars_are_cached_by_schema(plain_llm):
    grammars = plain_llm.engine.grammars
    before = grammars.allocated()
    for _ in range(3):  # the same schema, once as a dict with other key order, once as text
        plain_llm.generate(
            [[3, 4]], SamplingParams(max_tokens=2, json_schema={"type": "object", "required": []})
        )
        plain_llm.generate(
            [[3, 4]], SamplingParams(max_tokens=2, json_schema='{"required": [], "type": "object"}')
        )
    assert grammars.allocated() == before + 1


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_device_jobs_never_sync(qwen3, overlap):
    """The masks, logit_bias and the deferred sampling job read nothing back from the device."""
    from tests.engine.test_no_sync import forbid_host_syncs

    with LLM(qwen3, device="cpu", overlap=overlap, cpu_worker="thread", kv_cache_tokens=2048) as llm:
        runner = llm.engine.runner
        run = runner.run

        def watched(job):
            with forbid_host_syncs():
                return run(job)

        runner.run = watched
        params = [
            SamplingParams(max_tokens=12, temperature=1.0, seed=1, regex="[a-z]{12}"),
            SamplingParams(max_tokens=6, temperature=0.0, logit_bias={7: 3.0}, min_tokens=3, logprobs=2),
            FREE,
        ]
        outs = llm.generate([[3, 4], [5, 6], [7, 8]], params, use_tqdm=False)
        assert re.fullmatch("[a-z]+", outs[0].text)
        llm.check_integrity()
