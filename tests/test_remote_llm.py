"""OpenAICompatibleLLM against a local fake of vLLM's wire format (SSE chat chunks and Prometheus counters)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fake_vllm import DEFAULT_REPLY, FakeVLLM, tokenize

from pipeline.llm import ReplyStats
from pipeline.remote_llm import OpenAICompatibleLLM, parse_prometheus, spec_counters, sse_data
from specdec.metrics import SpecStats

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def expected_spec(fake: FakeVLLM, max_tokens: int, step_event) -> SpecStats:
    """What the in-process engine would have recorded for the fake's plan, via SpecStats.observe."""
    spec = SpecStats()
    for _, accepted in fake.plan(max_tokens)[1:]:
        spec.observe(step_event(accepted=accepted, drafted=fake.k))
    return spec


def run(
    llm: OpenAICompatibleLLM, speculation: bool = True, cancel: threading.Event | None = None
) -> tuple[str, ReplyStats, list]:
    stats = ReplyStats()
    deltas = list(llm.stream_reply(MESSAGES, speculation, stats, cancel))
    return "".join(d.text for d in deltas), stats, deltas


@pytest.fixture
def fake():
    with FakeVLLM() as f:
        yield f


def test_streams_the_reply_and_counts_tokens_from_usage(fake: FakeVLLM) -> None:
    text, stats, deltas = run(OpenAICompatibleLLM(fake.url))
    assert text == DEFAULT_REPLY
    assert deltas[-1].finish_reason == "stop"
    # Several tokens arrive per chunk under speculation, so the server's usage count must win over chunks.
    assert stats.tokens == len(tokenize(DEFAULT_REPLY))
    assert len([d for d in deltas if d.text]) < stats.tokens
    body = fake.requests[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == fake.model  # taken from /v1/models when not given
    assert body["messages"] == MESSAGES
    assert stats.tokens_per_s > 0


def test_counts_chunks_when_the_server_sends_no_usage() -> None:
    with FakeVLLM(honor_usage=False) as fake:
        text, stats, deltas = run(OpenAICompatibleLLM(fake.url))
    assert text == DEFAULT_REPLY
    assert stats.tokens == len([d for d in deltas if d.text]) == len(fake.plan(1 << 30))


def test_acceptance_from_counter_deltas(fake: FakeVLLM, step_event) -> None:
    llm = OpenAICompatibleLLM(fake.url + "/v1/")  # either spelling of the base URL
    run(llm)  # a first reply moves the counters, so the second must be measured by difference
    _, stats, _ = run(llm)
    want = expected_spec(fake, 1 << 30, step_event)
    got = stats.spec
    assert (got.proposed, got.accepted, got.speculative_steps, got.target_forwards, got.emitted) == (
        want.proposed,
        want.accepted,
        want.speculative_steps,
        want.target_forwards,
        want.emitted,
    )
    assert got.per_position_proposed == want.per_position_proposed
    assert got.per_position_accepted == want.per_position_accepted
    assert got.rejections == want.rejections
    assert got.draft_acceptance_rate == pytest.approx(want.draft_acceptance_rate)
    assert got.alpha == pytest.approx(want.alpha)
    assert got.tokens_per_target_forward == pytest.approx(want.tokens_per_target_forward)
    assert stats.notes == []


def test_max_tokens_limits_the_reply_and_the_counters() -> None:
    with FakeVLLM() as fake:
        text, stats, deltas = run(OpenAICompatibleLLM(fake.url, max_tokens=10))
        assert deltas[-1].finish_reason == "length"
        assert stats.tokens == 10 and text == "".join(tokenize(DEFAULT_REPLY)[:10])
        assert stats.spec.speculative_steps == len(fake.plan(10)) - 1


def test_counters_without_total_suffix_are_read_too(step_event) -> None:
    with FakeVLLM(total_suffix=False) as fake:
        _, stats, _ = run(OpenAICompatibleLLM(fake.url))
        assert stats.spec.proposed == expected_spec(fake, 1 << 30, step_event).proposed > 0


def test_other_traffic_in_the_counters_is_noted() -> None:
    with FakeVLLM(background_drafts_per_step=3) as fake:
        _, stats, _ = run(OpenAICompatibleLLM(fake.url))
    assert any("other requests" in n for n in stats.notes)


def test_speculation_off_without_a_second_server_is_noted(fake: FakeVLLM) -> None:
    _, stats, _ = run(OpenAICompatibleLLM(fake.url), speculation=False)
    assert any("cannot be switched off" in n for n in stats.notes)


def test_speculation_off_goes_to_the_target_only_server(fake: FakeVLLM) -> None:
    with FakeVLLM(speculative=False) as plain:
        llm = OpenAICompatibleLLM(fake.url, base_url_no_spec=plain.url)
        text, stats, _ = run(llm, speculation=False)
        assert text == DEFAULT_REPLY
        assert len(plain.requests) == 1 and fake.requests == []
        assert stats.spec.speculative_steps == 0 and stats.notes == []
        _, stats_on, _ = run(OpenAICompatibleLLM(plain.url), speculation=True)
        assert any("not speculating" in n for n in stats_on.notes)


def test_cancel_stops_reading_and_closes_the_connection() -> None:
    with FakeVLLM(reply=" ".join(["word"] * 400), step_delay_s=0.02) as fake:
        cancel = threading.Event()
        stats = ReplyStats()
        deltas = []
        t0 = time.perf_counter()
        for d in OpenAICompatibleLLM(fake.url).stream_reply(MESSAGES, True, stats, cancel):
            deltas.append(d)
            if d.text:
                cancel.set()
        assert time.perf_counter() - t0 < 2.0
        assert deltas[-1].finish_reason == "cancelled"
        assert len([d for d in deltas if d.text]) == 1
        deadline = time.monotonic() + 3
        while fake.disconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fake.disconnects == 1  # the server saw the client go away and stopped generating
        assert fake.steps_sent < len(fake.plan(1 << 30)) // 2


def test_cancel_while_the_server_is_silent() -> None:
    with FakeVLLM(first_token_delay_s=5.0) as fake:
        cancel = threading.Event()
        threading.Timer(0.2, cancel.set).start()
        t0 = time.perf_counter()
        _, stats, deltas = run(OpenAICompatibleLLM(fake.url), cancel=cancel)
        assert time.perf_counter() - t0 < 2.0
        assert deltas[-1].finish_reason == "cancelled" and stats.tokens == 0


def test_connection_refused_names_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    llm = OpenAICompatibleLLM(url, model="m")
    with pytest.raises(RuntimeError, match=f"cannot reach {url}/v1/chat/completions"):
        run(llm)


def test_http_error_names_the_url_and_status(fake: FakeVLLM) -> None:
    with pytest.raises(RuntimeError, match=rf"{fake.url}/v1/chat/completions answered HTTP 404.*does not exist"):
        run(OpenAICompatibleLLM(fake.url, model="no-such-model"))


def test_prometheus_parsing_handles_labels_suffixes_and_other_models() -> None:
    text = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="a"} 10.0',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="a"} 5.0',
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="b"} 100.0',
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="a"} 1.7e9',
            'vllm:spec_decode_num_draft_tokens{model_name="a"} 60 1700000000000',
            'vllm:spec_decode_num_accepted_tokens_total{model_name="a"} 33',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="1"} 12',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="0"} 14',
            'other_metric{path="/x,y=\\"z\\""} 1',
        ]
    )
    assert ("other_metric", {"path": '/x,y="z"'}, 1.0) in list(parse_prometheus(text))
    c = spec_counters(text, "a")
    assert (c.drafts, c.draft_tokens, c.accepted) == (15, 60, 33)
    assert c.accepted_per_pos == {0: 14, 1: 12} and c.k == 2
    assert spec_counters(text, None).drafts == 115
    assert spec_counters("vllm:num_requests_running 0\n") is None


def test_sse_parser_joins_multiline_data_and_skips_comments() -> None:
    raw = [b": keep-alive\n", b"event: message\n", b'data: {"a":\n', b"data: 1}\n", b"\n", b"data:[DONE]\r\n", b"\r\n"]
    assert list(sse_data(raw)) == ['{"a":\n1}', "[DONE]"]
