"""The OpenAI-compatible server through the real `openai` client (and raw HTTP where the client hides
the wire): completions and chat, streamed and not, logprobs in both formats, DSpark vs no drafting
vs `dsv4gen run`, usage, models, tokenize/detokenize, metrics invariants."""
from __future__ import annotations

import json

import httpx
import pytest

from lib.cli.main import main as dsv4gen
from serve_util import MODEL, running_server

PROMPTS = ["What is 2+2?", "Tell me about Beijing.", "写一首诗"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def dspark(tiny_ckpt):
    with running_server(tiny_ckpt, "--speculative", "dspark") as server:
        yield server


@pytest.fixture(scope="module")
def plain(tiny_ckpt):
    with running_server(tiny_ckpt, "--speculative", "none") as server:
        yield server


def _chat(server, prompt: str, **kw):
    return server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0, **kw)


def _chat_stream(server, prompt: str, **kw) -> tuple[str, list, object]:
    chunks = list(_chat(server, prompt, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks, chunks[-1].usage


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chat_is_the_same_with_and_without_dspark_and_equals_dsv4gen_run(dspark, plain, tiny_ckpt,
                                                                                 prompt, capsys):
    assert dsv4gen(["run", "--model", str(tiny_ckpt), "--prompt", prompt, "--max-tokens", str(MAX_TOKENS),
                    "--speculative", "none"]) == 0
    from_cli = capsys.readouterr().out.removesuffix("\n")
    results = []
    for server in (dspark, plain):
        whole = _chat(server, prompt, logprobs=True, top_logprobs=1)
        streamed, chunks, usage = _chat_stream(server, prompt, logprobs=True, top_logprobs=1)
        assert whole.choices[0].message.content == streamed
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert all("\ufffd" not in d for d in deltas) or "\ufffd" in streamed    # no split UTF-8 characters
        assert usage.completion_tokens == whole.usage.completion_tokens <= MAX_TOKENS
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        entries = whole.choices[0].logprobs.content
        streamed_entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert [e.token for e in entries] == [e.token for e in streamed_entries]
        assert len(entries) == usage.completion_tokens       # one record per emitted token, none for drafts
        results.append((streamed, whole.choices[0].finish_reason, [e.token for e in entries],
                        [e.logprob for e in entries]))
    assert results[0][:3] == results[1][:3]
    assert results[0][3] == pytest.approx(results[1][3], abs=1e-4)   # verified rows vs single-token rows
    assert results[0][0] == from_cli


def test_stop_strings_cut_the_text_streamed_or_not(dspark, plain):
    full = _chat(plain, PROMPTS[1]).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3
    expected = full[: full.index(stop)]
    for server in (dspark, plain):
        whole = _chat(server, PROMPTS[1], stop=[stop])
        streamed, _, _ = _chat_stream(server, PROMPTS[1], stop=stop)
        assert whole.choices[0].message.content == streamed == expected
        assert whole.choices[0].finish_reason == "stop"


def test_greedy_completions_match_dsv4gen_run_raw(dspark, plain, tiny_ckpt, capsys):
    prompt = "The capital of France is"
    assert dsv4gen(["run", "--model", str(tiny_ckpt), "--prompt", prompt, "--raw", "--max-tokens", "20"]) == 0
    from_cli = capsys.readouterr().out.removesuffix("\n")
    for server in (dspark, plain):
        whole = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        streamed = "".join(c.choices[0].text for c in server.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True) if c.choices)
        assert whole.choices[0].text == streamed == from_cli
        assert whole.object == "text_completion" and whole.id.startswith("cmpl-")


def test_completion_logprobs_are_parallel_lists(dspark):
    res = dspark.client().completions.create(model=MODEL, prompt="Hello, world!", max_tokens=10, temperature=0,
                                             logprobs=3)
    lp = res.choices[0].logprobs
    n = res.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and token in top and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(value, abs=1e-5)    # greedy: the chosen one is the best


def test_chat_logprobs_stream_and_whole_agree(dspark):
    whole = _chat(dspark, "Hello", logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token
    _, chunks, _ = _chat_stream(dspark, "Hello", logprobs=True, top_logprobs=2)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_sse_framing_on_the_wire(dspark):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", dspark.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishes = [p for p in payloads if p["choices"] and p["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and payloads[-1]["choices"] == [] and "usage" in payloads[-1]
    for p in payloads[1:-1]:
        assert p["object"] == "chat.completion.chunk" and p["id"] == payloads[0]["id"]
        assert p["choices"][0]["delta"] or p["choices"][0]["finish_reason"]      # no empty chunks


def test_thinking_mode_returns_reasoning_content(dspark):
    res = dspark.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Why?"}], max_tokens=12, temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = res.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None)
    # the tiny model never closes its reasoning within 12 tokens: all of it is reasoning, none content
    assert reasoning and msg.content == ""
    tok = dspark.http().post("/tokenize", json={"messages": [{"role": "user", "content": "Why?"}],
                                                "chat_template_kwargs": {"thinking": True}}).json()
    assert dspark.http().post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith("<think>")


def test_models_tokenize_detokenize(dspark):
    models = dspark.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    http = dspark.http()
    tok = http.post("/tokenize", json={"prompt": "Hello, world! 你好", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert tok["max_model_len"] == models.data[0].model_extra["max_model_len"]
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello, world! 你好"}
    assert http.get("/health").status_code == 200 and http.get("/version").json()["version"]


def test_metrics_count_emitted_tokens_and_keep_the_spec_invariants(dspark):
    before = dspark.metrics()
    usages = [_chat(dspark, p).usage for p in PROMPTS]
    after = dspark.metrics()

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)
    assert delta("dsv4gen:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("dsv4gen:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    reasons = sum(delta("dsv4gen:request_success_total", (("finished_reason", r),)) for r in ("stop", "length"))
    assert reasons == len(PROMPTS)
    assert delta("dsv4gen:time_to_first_token_seconds_count") == len(PROMPTS)
    drafts, tokens = after[("dsv4gen:spec_decode_num_drafts_total", ())], \
        after[("dsv4gen:spec_decode_num_draft_tokens_total", ())]
    accepted = after[("dsv4gen:spec_decode_num_accepted_tokens_total", ())]
    per_pos = [v for (name, labels), v in sorted(after.items()) if name.endswith("accepted_tokens_per_pos_total")]
    assert drafts > 0 and accepted <= tokens and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))          # a later position needs the earlier ones
    assert after[("dsv4gen:num_requests_running", ())] == 0 and dspark.blocks_used() == 0
