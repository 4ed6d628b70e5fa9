"""`echo-trtllm serve --batch-invariant` through the official openai client: a seeded bfloat16 completion is the same
text alone and sent among 15 concurrent others (other prompts, other seeds), for AR and for ECHO, and ECHO's text
is AR's (models/invariant.py; the engine-level tests are tests/runtime/test_batch_invariant.py)."""

import asyncio

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from echo_trtllm import LLM, EchoConfig

from .conftest import RunningServer

MODEL = "echo-test"
FIELDS = dict(max_tokens=24, temperature=1.0, extra_body={"ignore_eos": True})


async def _together(srv, prompts, seeds):
    client = srv.async_client()
    try:
        rs = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, seed=s, **FIELDS)
                                    for p, s in zip(prompts, seeds)))
    finally:
        await client.close()
    return [r.choices[0].text for r in rs]


def test_a_seeded_completion_is_the_same_alone_and_among_others(prompts):
    texts = {}
    for policy in ("ar", "echo"):
        llm = LLM(dtype="bfloat16", batch_invariant=True, speculative_config=EchoConfig(policy=policy),
                  max_batch_size=16, fallback=False)
        srv = RunningServer(llm)
        try:
            assert srv.client().models.list().data[0].batch_invariant is True
            alone = srv.client().completions.create(model=MODEL, prompt=prompts[0], seed=7, **FIELDS).choices[0].text
            crowd = asyncio.run(_together(srv, [prompts[0]] + prompts[1:16], [7] + list(range(15))))
            assert crowd[0] == alone, policy
            texts[policy] = crowd
        finally:
            srv.stop()
            llm.shutdown()
    assert texts["echo"] == texts["ar"]
