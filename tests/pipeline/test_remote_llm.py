"""OpenAICompatibleLLM against a local fake of vLLM's wire format (SSE chat chunks and Prometheus counters), and
against a real server where one can run here (llama-cpp-python's, the llama extra). The `vllm serve` line:
test_vllm_serve.py."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from pipeline.llm import ReplyStats
from pipeline.remote_llm import OpenAICompatibleLLM, sse_data
from pipeline.vllm_metrics import parse_prometheus, spec_counters
from specdec.build import EngineSpec
from specdec.llamacpp import preset_gguf
from specdec.metrics import SpecStats
from tests.support.fake_vllm import DEFAULT_REPLY, FakeVLLM, tokenize

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
        for d in OpenAICompatibleLLM(fake.url).stream_reply(MESSAGES, True, stats, cancel):
            deltas.append(d)
            if d.text:
                cancel.set()
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
        _, stats, deltas = run(OpenAICompatibleLLM(fake.url), cancel=cancel)
        assert deltas[-1].finish_reason == "cancelled" and stats.tokens == 0  # before the server's first token


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


# ---------------------------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def llama_server(real_models, tmp_path_factory) -> Iterator[str]:
    """llama-cpp-python's OpenAI-compatible server on the target preset's GGUF, on a free loopback port."""
    check = subprocess.run(
        [sys.executable, "-c", "import llama_cpp.server.app"], capture_output=True, text=True, timeout=120
    )
    if check.returncode:
        last = (check.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"llama_cpp.server cannot be imported ({last}): it needs llama-cpp-python's server extra")
    gguf = preset_gguf(EngineSpec().target)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with log.open("w") as out:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--n_ctx",
                "1024",
                "--n_threads",
                "2",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HOST": "127.0.0.1", "PORT": str(port)},  # its settings read these too
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:  # it listens once the model is loaded
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"llama_cpp.server did not answer:\n{log.read_text()[-3000:]}"
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.models
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (the llama extra, built by scripts/setup.sh --llama; not in CI)",
)
def test_a_streamed_reply_from_llama_cpp_server_on_the_target_gguf(llama_server: str) -> None:
    llm = OpenAICompatibleLLM(llama_server, max_tokens=16, temperature=0.0)  # the model: the one it lists
    stats = ReplyStats()
    question = [{"role": "user", "content": "Name the capital of France and one landmark there, in one sentence."}]
    deltas = list(llm.stream_reply(question, True, stats))
    assert "Paris" in "".join(d.text for d in deltas)
    assert len([d for d in deltas if d.text]) > 1  # streamed, not one block
    assert deltas[-1].finish_reason in ("stop", "length") and 1 <= stats.tokens <= 16
    # It has no Prometheus endpoint: the reply still streams, and the panels say why acceptance is unknown.
    assert any("metrics unavailable" in n for n in stats.notes) and stats.spec.proposed == 0
