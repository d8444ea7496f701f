"""A small stand-in for a vLLM OpenAI-compatible server, speaking its wire format on 127.0.0.1.

- POST /v1/chat/completions with stream=true: chunked SSE `data: {...}` chunks shaped like vLLM's
  (id, object "chat.completion.chunk", created, model, choices[{index, delta, logprobs, finish_reason}]),
  a usage chunk when stream_options.include_usage is set, then `data: [DONE]`.
- GET /v1/models, and GET /metrics in the Prometheus text format as prometheus_client renders vLLM's
  counters (# HELP / # TYPE, `_total` suffixes, `_created` gauges, engine and model_name labels).
- Speculation is simulated step by step: each step proposes K tokens, accepts the next count from
  `accept_pattern` and streams accepted + 1 tokens in one chunk, advancing the counters as it goes.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEFAULT_REPLY = (
    "Sure. The capital of France is Paris, a city on the Seine known for its museums, cafés and "
    "the Eiffel Tower, which was built for the world fair of 1889."
)


def tokenize(text: str) -> list[str]:
    """Word-ish pieces with their leading space, so that joining them gives the text back."""
    pieces = re.findall(r"\s*[\w']+|\s*[^\w\s]", text)
    assert "".join(pieces) == text, "reply must tokenize losslessly"
    return pieces


class FakeVLLM:
    def __init__(
        self,
        reply: str = DEFAULT_REPLY,
        model: str = "meta-llama/Meta-Llama-3-70B-Instruct",
        k: int = 4,
        accept_pattern: tuple[int, ...] = (4, 2, 3, 0, 4, 1),
        speculative: bool = True,
        step_delay_s: float = 0.0,
        first_token_delay_s: float = 0.0,
        total_suffix: bool = True,
        honor_usage: bool = True,
        background_drafts_per_step: int = 0,
    ) -> None:
        self.tokens = tokenize(reply)
        self.model = model
        self.k = k
        self.accept_pattern = accept_pattern
        self.speculative = speculative
        self.step_delay_s = step_delay_s
        self.first_token_delay_s = first_token_delay_s
        self.total_suffix = total_suffix  # prometheus_client adds `_total` to counters; older exports did not
        self.honor_usage = honor_usage
        self.background_drafts_per_step = background_drafts_per_step  # other clients' traffic in the counters
        self.lock = threading.Lock()
        self.drafts = self.draft_tokens = self.accepted = self.generated = 0
        self.per_pos = [0] * k
        self.requests: list[dict] = []
        self.disconnects = 0
        self.steps_sent = 0
        self.created = time.time()
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> FakeVLLM:
        fake = self

        class Handler(_Handler):
            server_fake = fake

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeVLLM:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- what a reply does to the counters ---------------------------------------------------------------

    def plan(self, max_tokens: int) -> list[tuple[int, int]]:
        """(tokens emitted, drafts accepted) per step: the prefill step first, then one step per draft."""
        total = min(len(self.tokens), max_tokens)
        steps, done, i = [(1, -1)], 1, 0
        while done < total:
            n = self.accept_pattern[i % len(self.accept_pattern)] if self.speculative else -1
            emit = min(n + 1 if self.speculative else 1, total - done)
            steps.append((emit, n))
            done, i = done + emit, i + 1
        return steps

    def count_step(self, accepted: int) -> None:
        with self.lock:
            if accepted >= 0:
                self.drafts += 1 + self.background_drafts_per_step
                self.draft_tokens += self.k * (1 + self.background_drafts_per_step)
                self.accepted += accepted + self.k * self.background_drafts_per_step
                for j in range(self.k):
                    self.per_pos[j] += int(j < accepted) + self.background_drafts_per_step
            self.steps_sent += 1

    def metrics_text(self) -> str:
        labels = f'engine="0",model_name="{self.model}"'
        sfx = "_total" if self.total_suffix else ""
        out = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} 0.0",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} 1.0',
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} 1.0',
            f"vllm:time_to_first_token_seconds_count{{{labels}}} 1.0",
            f"vllm:time_to_first_token_seconds_sum{{{labels}}} 0.05",
        ]

        def counter(name: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name}{sfx} {help_}", f"# TYPE {name}{sfx} counter"])
            out.extend(f"{name}{sfx}{{{lbl}}} {value:.1f}" for lbl, value in samples)
            out.extend([f"# HELP {name}_created {help_}", f"# TYPE {name}_created gauge"])
            out.extend(f"{name}_created{{{lbl}}} {self.created}" for lbl, _ in samples)

        with self.lock:
            counter("vllm:generation_tokens", "Number of generation tokens processed.", [(labels, self.generated)])
            if self.speculative:
                counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", [(labels, self.drafts)])
                counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", [(labels, self.draft_tokens)])
                counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", [(labels, self.accepted)])
                counter(
                    "vllm:spec_decode_num_accepted_tokens_per_pos",
                    "Accepted tokens per draft position.",
                    [(f'{labels},position="{j}"', v) for j, v in enumerate(self.per_pos)],
                )
        return "\n".join(out) + "\n"


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # Clients that hang up mid-stream (the cancel tests do so on purpose) are normal here.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked transfer encoding, as uvicorn streams
    server_fake: FakeVLLM

    def log_message(self, format: str, *args) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: dict) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def do_GET(self) -> None:
        fake = self.server_fake
        if self.path == "/metrics":
            self._send(200, fake.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif self.path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": fake.model,
                            "object": "model",
                            "created": int(fake.created),
                            "owned_by": "vllm",
                            "root": fake.model,
                            "parent": None,
                        }
                    ],
                },
            )
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        fake = self.server_fake
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path != "/v1/chat/completions":
            self._json(404, {"detail": "Not Found"})
            return
        fake.requests.append(body)
        if body.get("model") != fake.model:
            self._json(
                404,
                {
                    "object": "error",
                    "message": f"The model `{body.get('model')}` does not exist.",
                    "type": "NotFoundError",
                    "param": None,
                    "code": 404,
                },
            )
            return
        if not body.get("stream"):
            self._json(
                400,
                {
                    "object": "error",
                    "message": "this fake only streams",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
            )
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            self._stream(fake, body)
        except (BrokenPipeError, ConnectionResetError):
            with fake.lock:
                fake.disconnects += 1
            self.close_connection = True

    def _event(self, obj: dict | str) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        data = f"data: {payload}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _stream(self, fake: FakeVLLM, body: dict) -> None:
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict, finish: str | None = None) -> dict:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if finish:
                choice["stop_reason"] = None
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": fake.model,
                "choices": [choice],
            }

        self._event(chunk({"role": "assistant", "content": ""}))
        max_tokens = int(body.get("max_tokens") or 1 << 30)
        plan = fake.plan(max_tokens)
        time.sleep(fake.first_token_delay_s)
        sent = 0
        for i, (emit, accepted) in enumerate(plan):
            if i:
                time.sleep(fake.step_delay_s)
            text = "".join(fake.tokens[sent : sent + emit])
            sent += emit
            last = i == len(plan) - 1
            finish = None if not last else ("length" if sent < len(fake.tokens) else "stop")
            self._event(chunk({"content": text}, finish))
            fake.count_step(accepted)
            with fake.lock:
                fake.generated += emit
        if fake.honor_usage and (body.get("stream_options") or {}).get("include_usage"):
            prompt = sum(len(tokenize(m.get("content", "").strip())) for m in body.get("messages", []))
            self._event(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": fake.model,
                    "choices": [],
                    "usage": {"prompt_tokens": prompt, "total_tokens": prompt + sent, "completion_tokens": sent},
                }
            )
        self._event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
