"""The gateway through the official `openai` client (and httpx where the client can't go).

The fake backend echoes the prompt's bytes, so every expected text and
token count below follows from the prompt: a completion of "hello world"
is "hello world", 12 prompt tokens (BOS + 11 bytes) and 11 completion tokens.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.gateway.conftest import MAX_SEQ_LEN, MODEL, make_site
from exaserve_hpc.engine.tokenizer import ByteTokenizer, apply_chat_template
from exaserve_hpc.gateway.backend import BackendError

TOKENIZER = ByteTokenizer()


def metric_value(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


# ------------------------------------------------------------ happy paths


def test_models_lists_served_models(gateway):
    models = gateway.client().models.list()
    assert [m.id for m in models.data] == [MODEL, "other"]
    assert models.data[0].owned_by == "exaserve"
    assert models.data[0].created == 1700000000


def test_completion_echoes_prompt_with_usage(gateway):
    result = gateway.client().completions.create(model=MODEL, prompt="hello world", max_tokens=100)
    assert result.id.startswith("cmpl-")
    assert result.object == "text_completion"
    assert result.choices[0].text == "hello world"
    assert result.choices[0].finish_reason == "stop"
    # the echo's 11 tokens and the stop token it ended on ("stop": generated, not sent, counted as vLLM counts it)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (12, 12, 24)
    sent = gateway.backend.requests[-1]
    assert sent.prompt_token_ids == TOKENIZER.encode("hello world")
    assert result.id == f"cmpl-{sent.request_id}" and len(sent.request_id) == 32


def test_prompt_as_list_of_one_string(gateway):
    result = gateway.client().completions.create(model=MODEL, prompt=["abc"], max_tokens=10)
    assert result.choices[0].text == "abc"


def test_max_tokens_cuts_completion_with_finish_reason_length(gateway):
    result = gateway.client().completions.create(model=MODEL, prompt="hello world", max_tokens=5)
    assert result.choices[0].text == "hello"
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 5
    assert gateway.backend.requests[-1].max_tokens == 5


def test_default_max_tokens_comes_from_site_and_is_fitted_to_max_seq_len(start_gateway):
    gw = start_gateway(make_site(gateway={"default_max_tokens": 7}))
    gw.client().completions.create(model=MODEL, prompt="hello world")
    assert gw.backend.requests[-1].max_tokens == 7
    gw.client().completions.create(model="other", prompt="x" * 60)  # 61 prompt tokens of 64
    assert gw.backend.requests[-1].max_tokens == 3


def test_sampling_parameters_and_seed_pass_through(gateway):
    gateway.client().completions.create(model=MODEL, prompt="hi", max_tokens=3, seed=1234, temperature=0.5,
                                        top_p=0.9)
    sent = gateway.backend.requests[-1]
    assert (sent.seed, sent.temperature, sent.top_p, sent.quota_group) == (1234, 0.5, 0.9, None)


def test_multibyte_text_split_across_chunks_is_reassembled(gateway):
    prompt = "héllo wörld ✓ 日本"  # 1-3 byte characters; chunks of 3 bytes split them
    result = gateway.client().completions.create(model=MODEL, prompt=prompt, max_tokens=100)
    assert result.choices[0].text == prompt
    streamed = gateway.client().completions.create(model=MODEL, prompt=prompt, max_tokens=100, stream=True)
    pieces = [c.choices[0].text for c in streamed]
    assert "".join(pieces) == prompt
    assert all("\ufffd" not in p for p in pieces)


def test_completion_stream_with_usage(gateway):
    stream = gateway.client().completions.create(model=MODEL, prompt="streaming works", max_tokens=100,
                                                 stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 3  # really streamed, 3 bytes a chunk
    assert "".join(c.choices[0].text for c in text_chunks) == "streaming works"
    assert text_chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15 + 1  # + the stop token
    assert chunks[-1].usage.prompt_tokens == 16
    assert all(c.usage is None for c in text_chunks)


def test_sse_ends_with_done(gateway):
    with httpx.stream("POST", f"{gateway.url}/v1/completions",
                      json={"model": MODEL, "prompt": "abcdef", "max_tokens": 10, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_chat_completion(gateway):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    result = gateway.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=200)
    prompt = apply_chat_template(messages)
    assert result.id.startswith("chatcmpl-")
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == prompt  # the echo of the templated prompt
    assert result.usage.prompt_tokens == len(TOKENIZER.encode(prompt))
    assert result.usage.completion_tokens == len(prompt.encode()) + 1  # + the stop token


def test_chat_max_completion_tokens_wins_over_max_tokens(gateway):
    result = gateway.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=50, max_completion_tokens=4)
    assert result.usage.completion_tokens == 4
    assert result.choices[0].finish_reason == "length"


def test_chat_stream_sends_role_first_then_content(gateway):
    messages = [{"role": "user", "content": "stream me"}]
    stream = gateway.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=200, stream=True,
                                                      stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == apply_chat_template(messages)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.total_tokens == 2 * len(content.encode()) + 1 + 1  # BOS, and the stop token


# ------------------------------------------------------------ stop strings


def test_stop_string_truncates_and_aborts_backend(gateway):
    # "STOP" straddles the 3-byte chunks ("...t S", "TOP"), so it is found across chunk boundaries.
    result = gateway.client().completions.create(model=MODEL, prompt="first STOP second part", max_tokens=100,
                                                 stop=["nomatch", "STOP"])
    assert result.choices[0].text == "first "
    assert result.choices[0].finish_reason == "stop"
    rid = gateway.backend.requests[-1].request_id
    assert gateway.backend.wait_for(lambda: rid in gateway.backend.aborted)


def test_stop_string_in_stream_truncates_and_aborts_backend(gateway):
    stream = gateway.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "alpha END omega"}], max_tokens=200, stream=True,
        stop="END")
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == apply_chat_template([{"role": "user", "content": "alpha "}]).removesuffix("\n<|assistant|>\n")
    assert chunks[-1].choices[0].finish_reason == "stop"
    rid = gateway.backend.requests[-1].request_id
    assert gateway.backend.wait_for(lambda: rid in gateway.backend.aborted)


def test_partial_stop_prefix_is_released_when_it_does_not_match(gateway):
    result = gateway.client().completions.create(model=MODEL, prompt="a STO b ST", max_tokens=100, stop="STOP")
    assert result.choices[0].text == "a STO b ST"
    assert result.choices[0].finish_reason == "stop"
    assert gateway.backend.requests[-1].request_id not in gateway.backend.aborted


# ------------------------------------------------------------ bad input


def test_unknown_model_is_404_listing_served_models(gateway):
    with pytest.raises(openai.NotFoundError) as caught:
        gateway.client().completions.create(model="nope", prompt="hi")
    assert caught.value.status_code == 404
    assert "'nope'" in caught.value.message and MODEL in caught.value.message and "other" in caught.value.message
    assert caught.value.body["param"] == "model" and caught.value.body["type"] == "invalid_request_error"


def test_prompt_longer_than_max_seq_len(gateway):
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client().completions.create(model=MODEL, prompt="x" * 300, max_tokens=1)
    assert caught.value.status_code == 400
    assert "301 tokens" in caught.value.message and f"max_seq_len {MAX_SEQ_LEN}" in caught.value.message
    assert caught.value.code == "context_length_exceeded"


def test_prompt_plus_max_tokens_longer_than_max_seq_len(gateway):
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client().completions.create(model=MODEL, prompt="x" * 10, max_tokens=250)
    message = caught.value.message
    assert "max_tokens is 250" in message and "11 tokens" in message and str(MAX_SEQ_LEN) in message
    assert "at most 245" in message
    assert caught.value.body["param"] == "max_tokens"


def test_chat_max_completion_tokens_too_large_names_that_field(gateway):
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_completion_tokens=10_000)
    assert "max_completion_tokens is 10000" in caught.value.message
    assert caught.value.body["param"] == "max_completion_tokens"


@pytest.mark.parametrize("kwargs, param, fragments", [
    ({"max_tokens": 0}, "max_tokens", ["greater than or equal to 1", "found 0"]),
    ({"max_tokens": -5}, "max_tokens", ["greater than or equal to 1", "found -5"]),
    ({"max_tokens": 10**12}, "max_tokens", [str(10**12), f"max_seq_len {MAX_SEQ_LEN}"]),
    ({"max_tokens": "ten"}, "max_tokens", ["valid integer", "'ten'"]),
    ({"n": 2}, "n", ["n is 2", "only n=1"]),
    ({"temperature": 3}, "temperature", ["less than or equal to 2", "found 3"]),
    ({"top_p": 0}, "top_p", ["greater than 0", "found 0"]),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", ["5 strings", "at most 4"]),
    ({"prompt": [1, 2, 3]}, "prompt", ["token ids"]),
    ({"prompt": ["one", "two"]}, "prompt", ["batch of 2 prompts"]),
    ({"prompt": 42}, "prompt", ["must be a string", "42 (int)"]),
    ({"echo": True}, "echo", ["does not support echo"]),
    ({"seed": "7"}, "seed", ["valid integer", "'7'"]),
])
def test_bad_completion_parameters_are_400_naming_the_field(gateway, kwargs, param, fragments):
    request = {"model": MODEL, "prompt": "hello", "max_tokens": 5, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client().completions.create(**request)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param
    assert caught.value.body["type"] == "invalid_request_error"
    for fragment in fragments:
        assert fragment in caught.value.message
    assert gateway.backend.requests == []  # rejected before reaching the backend


@pytest.mark.parametrize("messages, fragment", [
    ([{"role": "wizard", "content": "hi"}], "messages[1].role is 'wizard'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
    ([], "non-empty list"),
])
def test_bad_chat_messages_are_400(gateway, messages, fragment):
    if fragment.startswith("messages[1]"):  # the bad role after a good message
        messages = [{"role": "user", "content": "ok"}, *messages]
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client().chat.completions.create(model=MODEL, messages=messages)
    assert fragment in caught.value.message
    assert caught.value.body["param"] == "messages"


def test_chat_accepts_text_content_parts(gateway):
    result = gateway.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert result.choices[0].message.content == apply_chat_template([{"role": "user", "content": "ab"}])


def test_malformed_json_is_400_not_422(gateway):
    response = httpx.post(f"{gateway.url}/v1/completions", content=b'{"model": "tiny-echo", "prompt": ',
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "malformed JSON" in error["message"] and "character" in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


@pytest.mark.parametrize("body, fragment", [
    ([1, 2], "must be a JSON object"),
    ({"prompt": "hi"}, "missing required field 'model'"),
    ({"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream: Input should be a valid boolean; found 'yes'"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
])
def test_wrong_shapes_are_400_with_openai_error(gateway, body, fragment):
    response = httpx.post(f"{gateway.url}/v1/completions", json=body)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


def test_unknown_route_is_404_in_openai_shape(gateway):
    response = httpx.get(f"{gateway.url}/v1/engines")
    assert response.status_code == 404
    assert "/v1/completions" in response.json()["error"]["message"]


# ------------------------------------------------------------ overload, backend errors, failures


def test_overload_is_429_with_retry_after_and_admitted_requests_still_answered(start_gateway):
    gw = start_gateway(make_site(gateway={"max_queued_requests": 2}), hold=True)
    client = gw.client()
    before = metric_value(gw.url, "exaserve_inflight_requests")  # the gauge is the process's (other tests' admissions)
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(client.completions.create, model=MODEL, prompt="held", max_tokens=4) for _ in range(2)]
        assert gw.backend.wait_for(lambda: len(gw.backend.requests) == 2)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="one too many", max_tokens=4)
        assert caught.value.status_code == 429
        assert int(caught.value.response.headers["retry-after"]) >= 1
        assert "limit of 2 requests in flight" in caught.value.message
        assert metric_value(gw.url, "exaserve_inflight_requests") == before + 2
        gw.backend.release.set()
        assert [f.result(timeout=5).choices[0].text for f in held] == ["held", "held"]
    assert client.completions.create(model=MODEL, prompt="room again", max_tokens=20).choices[0].text == "room again"


def test_backend_503_passes_through_with_retry_after(start_gateway):
    gw = start_gateway(refuse_with=BackendError(503, "no_replica", "no replica of 'tiny-echo' is up", 3.2))
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as caught:
            gw.client().completions.create(model=MODEL, prompt="hi", stream=stream)
        assert caught.value.status_code == 503
        assert caught.value.response.headers["retry-after"] == "4"
        assert caught.value.code == "no_replica" and "no replica" in caught.value.message


def test_unexpected_backend_exception_is_500_in_openai_shape(start_gateway):
    gw = start_gateway(fail_after_chunks=0, fail_mid_stream_with=KeyError("boom"))
    with pytest.raises(openai.InternalServerError) as caught:
        gw.client().completions.create(model=MODEL, prompt="hello", max_tokens=5)
    assert caught.value.status_code == 500
    assert "KeyError" in caught.value.message and caught.value.body["type"] == "server_error"
    rid = gw.backend.requests[-1].request_id
    assert rid in caught.value.message


def test_exception_mid_stream_becomes_error_event_then_done(start_gateway):
    gw = start_gateway(fail_after_chunks=2)
    with pytest.raises(openai.APIError) as caught:
        list(gw.client().completions.create(model=MODEL, prompt="hello world", max_tokens=50, stream=True))
    assert "fake replica exploded" in caught.value.message
    with httpx.stream("POST", f"{gw.url}/v1/completions",
                      json={"model": MODEL, "prompt": "hello world", "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert '"text":"hel"' in lines[0] and '"text":"lo "' in lines[1]
    assert '"error"' in lines[2] and "internal error" in lines[2]
    assert lines[3] == "data: [DONE]"


def test_backend_error_mid_stream_keeps_its_code(start_gateway):
    gw = start_gateway(fail_after_chunks=1,
                       fail_mid_stream_with=BackendError(502, "replica_failed", "replica fake-0 died; retries spent"))
    with pytest.raises(openai.APIError) as caught:
        list(gw.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 stream=True))
    assert caught.value.code == "replica_failed" and "fake-0 died" in caught.value.message


# ------------------------------------------------------------ client going away


def test_client_disconnect_mid_stream_aborts_backend_request(start_gateway):
    gw = start_gateway(chunk_delay=0.1)  # 60 tokens, 3 a chunk: about 2 s if left running
    before = metric_value(gw.url, "exaserve_inflight_requests")  # the process's gauge (other tests' admissions)
    stream = gw.client().completions.create(model=MODEL, prompt="y" * 100, max_tokens=60, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text == "yyy"
    stream.close()
    rid = gw.backend.requests[-1].request_id
    assert gw.backend.wait_for(lambda: rid in gw.backend.aborted, timeout=2)
    assert rid not in gw.backend.completed
    assert gw.backend.wait_for(lambda: metric_value(gw.url, "exaserve_inflight_requests") == before, timeout=2)


def test_client_giving_up_on_non_streaming_request_aborts_backend(start_gateway):
    gw = start_gateway(chunk_delay=0.1)  # about 2 s if left running
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "z" * 100, "max_tokens": 60},
                   timeout=0.3)
    rid = gw.backend.requests[-1].request_id
    assert gw.backend.wait_for(lambda: rid in gw.backend.aborted, timeout=2)
    assert rid not in gw.backend.completed


# ------------------------------------------------------------ API keys and quota groups


QUOTAS = [{"name": "climate", "api_keys": ["key-climate"], "max_concurrent_requests": 1},
          {"name": "bio", "api_keys": ["key-bio"]}]


def test_api_key_required(start_gateway):
    gw = start_gateway(make_site(gateway={"require_api_key": True}, quota_groups=QUOTAS))
    with pytest.raises(openai.AuthenticationError) as caught:
        gw.client(api_key="wrong").completions.create(model=MODEL, prompt="hi")
    assert caught.value.status_code == 401 and "not one of this site's keys" in caught.value.message
    assert caught.value.body["type"] == "authentication_error"
    response = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert response.status_code == 401 and "Authorization: Bearer" in response.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        gw.client(api_key="wrong").models.list()
    result = gw.client(api_key="key-bio").completions.create(model=MODEL, prompt="hi")
    assert result.choices[0].text == "hi"
    assert gw.backend.requests[-1].quota_group == "bio"


def test_quota_group_concurrency_limit_is_429(start_gateway):
    gw = start_gateway(make_site(gateway={"require_api_key": True}, quota_groups=QUOTAS), hold=True)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(gw.client(api_key="key-climate").completions.create, model=MODEL, prompt="a")
        assert gw.backend.wait_for(lambda: len(gw.backend.requests) == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            gw.client(api_key="key-climate").completions.create(model=MODEL, prompt="b")
        assert "'climate'" in caught.value.message and "max_concurrent_requests" in caught.value.message
        assert "retry-after" in caught.value.response.headers
        gw.backend.release.set()  # another group is not limited by climate's cap
        assert gw.client(api_key="key-bio").completions.create(model=MODEL, prompt="c").choices[0].text == "c"
        assert held.result(timeout=5).choices[0].text == "a"


def test_quota_group_tokens_per_minute_is_429_with_retry_after(start_gateway):
    groups = [{"name": "small", "api_keys": ["key-small"], "tokens_per_minute": 20},
              {"name": "bio", "api_keys": ["key-bio"]}]
    gw = start_gateway(make_site(gateway={"require_api_key": True}, quota_groups=groups))
    first = gw.client(api_key="key-small").completions.create(model=MODEL, prompt="a long enough prompt",
                                                               max_tokens=8)
    assert first.usage.total_tokens >= 20  # the group's whole minute in one request
    with pytest.raises(openai.RateLimitError) as caught:
        gw.client(api_key="key-small").completions.create(model=MODEL, prompt="again", max_tokens=4)
    assert "'small'" in caught.value.message and "tokens_per_minute" in caught.value.message
    assert int(caught.value.response.headers["retry-after"]) >= 50
    assert gw.client(api_key="key-bio").completions.create(model=MODEL, prompt="x", max_tokens=1).choices


# ------------------------------------------------------------ operations endpoints


def test_health_follows_backend_readiness(gateway):
    assert httpx.get(f"{gateway.url}/health").status_code == 200
    gateway.backend.is_ready = False
    response = httpx.get(f"{gateway.url}/health")
    assert response.status_code == 503 and "retry-after" in response.headers


def test_metrics_count_requests_and_tokens(gateway):
    labels = {"model": MODEL, "endpoint": "completions", "status": "200"}
    before = metric_value(gateway.url, "exaserve_requests_total", **labels)
    tokens_before = metric_value(gateway.url, "exaserve_generated_tokens_total", model=MODEL)
    gateway.client().completions.create(model=MODEL, prompt="count me", max_tokens=50)
    with pytest.raises(openai.NotFoundError):
        gateway.client().completions.create(model="nope", prompt="x")
    response = httpx.get(f"{gateway.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    assert metric_value(gateway.url, "exaserve_requests_total", **labels) == before + 1
    assert metric_value(gateway.url, "exaserve_generated_tokens_total", model=MODEL) == tokens_before + 8 + 1
    assert metric_value(gateway.url, "exaserve_requests_total", model="unknown", endpoint="completions",
                        status="404") >= 1
    for name in ("exaserve_time_to_first_token_seconds_count", "exaserve_request_seconds_count",
                 "exaserve_time_per_output_token_seconds_count"):
        assert metric_value(gateway.url, name, model=MODEL) >= 1
    # The fleet's per-replica series come from a controller (tests/observability): none behind a fake backend.


def test_openapi_document(gateway):
    document = httpx.get(f"{gateway.url}/openapi.json").json()
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"} <= set(document["paths"])
    schema = document["components"]["schemas"]["CompletionRequest"]
    assert {"model", "prompt", "max_tokens", "stop", "seed", "stream"} <= set(schema["properties"])


def test_status_endpoint_returns_backend_status(gateway):
    gateway.client().completions.create(model=MODEL, prompt="a", max_tokens=1)
    assert httpx.get(f"{gateway.url}/v1/exaserve/status").json() == {"backend": "fake", "requests_seen": 1}


def test_the_gateway_hashes_prompts_for_a_prefix_affinity_router(start_gateway):
    from exaserve_hpc.config.schema import parse_site
    from exaserve_hpc.router.affinity import AffinitySettings
    site = parse_site({"site": "gateway-test", "models": [{"model_name": MODEL, "max_seq_len": MAX_SEQ_LEN, "engine": "echo"}],
                       "router": {"policy": "prefix_affinity", "block_size": 8}})
    gw = start_gateway(site)
    gw.client().completions.create(model=MODEL, prompt="the same long system prompt, then a question", max_tokens=2)
    [request] = gw.backend.requests
    hasher = AffinitySettings(block_size=8).hasher()
    assert request.prefix_scheme == hasher.scheme
    assert request.prefix_hashes == hasher(request.prompt_token_ids)
    assert len(request.prefix_hashes) == len(request.prompt_token_ids) // 8 > 0


def test_the_gateway_sends_no_hashes_to_a_router_without_prefix_affinity(start_gateway):
    from exaserve_hpc.config.schema import parse_site
    site = parse_site({"site": "gateway-test", "models": [{"model_name": MODEL, "max_seq_len": MAX_SEQ_LEN, "engine": "echo"}],
                       "router": {"policy": "least_load"}})
    gateway = start_gateway(site)
    gateway.client().completions.create(model=MODEL, prompt="a prompt long enough for two blocks", max_tokens=2)
    [request] = gateway.backend.requests
    assert request.prefix_hashes == [] and request.prefix_scheme == ""
