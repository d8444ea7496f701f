"""The LLM stage against an OpenAI-compatible server such as vLLM: HTTP and server-sent events with the standard
library.

Replies stream from POST /v1/chat/completions (server-sent events). Speculation facts come from the
server's Prometheus endpoint: vLLM's counters (pipeline/vllm_metrics.py) are scraped before and after each reply and
the difference fills ReplyStats.spec, so the panels that show the in-process engine show a remote one too.
`specvoice vllm-serve` prints the `vllm serve` line for such a server.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from urllib.parse import urlsplit

from .llm import Controls, LLMDelta, ReplyStats
from .vllm_metrics import SpecCounters, add_spec_delta, spec_counters


def sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The `data` payloads of a server-sent event stream, one string per event."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        name, _, value = line.partition(":")
        if name == "data":  # other fields (event, id, retry) and comments (":") carry nothing we need
            data.append(value.removeprefix(" "))
    if data:
        yield "\n".join(data)


def _root(url: str) -> str:
    """Server root from either `http://host:8000` or `http://host:8000/v1`."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def _shutdown_on_cancel(conn: http.client.HTTPConnection, cancel: threading.Event, done: threading.Event) -> None:
    # Shutting the socket down wakes a read blocked on a silent server; closing from here could race it.
    while not done.is_set():
        if cancel.wait(0.05):
            if conn.sock is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
            return


class OpenAICompatibleLLM:
    """LLMStage for an OpenAI-compatible chat server (vLLM, SGLang, llama.cpp server ...).

    A server's speculation is fixed at launch, so `speculation=False` goes to `base_url_no_spec` when one
    is given (a target-only server) and otherwise to the same server, with a note in stats.notes.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        base_url_no_spec: str | None = None,
        api_key: str | None = None,
        max_tokens: int = 96,
        temperature: float = 0.0,
        timeout_s: float = 60.0,
        metrics: bool = True,
        metrics_timeout_s: float = 2.0,
    ) -> None:
        self.name = "openai-compatible"
        self.keeps_cache = False  # the server reads the whole prompt with the answer
        self.base_url = _root(base_url)
        self.base_url_no_spec = _root(base_url_no_spec) if base_url_no_spec else None
        self.model = model
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.metrics_timeout_s = metrics_timeout_s
        self._models: dict[str, str] = {}

    # -- HTTP ---------------------------------------------------------------------------------------

    def _open(
        self, method: str, url: str, body: dict | None, timeout: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; a refused connection or an HTTP error becomes a RuntimeError naming the URL."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RuntimeError(f"not an http(s) URL: {url!r}")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname, parts.port, timeout=timeout)
        headers = {"Accept": "text/event-stream" if body and body.get("stream") else "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=headers)
            resp = conn.getresponse()
        except OSError as e:
            conn.close()
            raise RuntimeError(f"cannot reach {url}: {e}") from e
        if resp.status >= 400:
            detail = resp.read(600).decode("utf-8", "replace").strip()
            conn.close()
            raise RuntimeError(f"{url} answered HTTP {resp.status} {resp.reason}: {detail}")
        return conn, resp

    def _get_json(self, url: str) -> dict:
        conn, resp = self._open("GET", url, None, self.timeout_s)
        try:
            return json.loads(resp.read())
        finally:
            conn.close()

    def model_for(self, base: str) -> str:
        """The model to ask for: the configured one, else the first the server lists."""
        if self.model:
            return self.model
        if base not in self._models:
            listed = self._get_json(f"{base}/v1/models").get("data") or []
            if not listed:
                raise RuntimeError(f"{base}/v1/models lists no model")
            self._models[base] = listed[0]["id"]
        return self._models[base]

    def scrape(self, base: str) -> str | None:
        """The server's /metrics page, or None when it has none or cannot be reached."""
        try:
            conn, resp = self._open("GET", f"{base}/metrics", None, self.metrics_timeout_s)
        except RuntimeError:
            return None
        try:
            return resp.read().decode("utf-8", "replace")
        except OSError:
            return None
        finally:
            conn.close()

    # -- the stage ----------------------------------------------------------------------------------

    def configure(self, controls: Controls) -> None:
        raise ValueError("a remote LLM server has no drafter/K/temperature controls here")

    def prefill_words(self, messages: list[dict[str, str]]) -> None:
        """Nothing is cached here: the server reads the whole prompt with the answer."""

    def rewind(self) -> None:
        """Nothing is kept between turns here."""

    def stream_reply(
        self,
        messages: list[dict[str, str]],
        speculation: bool,
        stats: ReplyStats,
        cancel: threading.Event | None = None,
        end_probe: bool = False,  # a server does not give the words' row: no end_of_message_probability
    ) -> Iterator[LLMDelta]:
        base = self.base_url_no_spec if not speculation and self.base_url_no_spec else self.base_url
        model = self.model_for(base)
        page = self.scrape(base) if self.metrics else None
        before = spec_counters(page, model) if page is not None else None
        if self.metrics and page is None:
            stats.notes.append(f"{base}/metrics unavailable: draft acceptance of this reply is unknown")
        elif before is None and speculation and self.metrics:
            stats.notes.append(f"{base} reports no vllm:spec_decode_* counters: it is not speculating")
        elif before is not None and not speculation and base == self.base_url:
            stats.notes.append(
                f"speculation cannot be switched off per request on {base}; this reply used the "
                "server's speculative decoding (give base_url_no_spec for a target-only server)"
            )
        yield from self._stream(base, model, messages, stats, cancel)
        if before is not None:
            self._record_spec(base, model, before, stats)

    def _record_spec(self, base: str, model: str, before: SpecCounters, stats: ReplyStats) -> None:
        # vLLM updates its counters as it processes engine outputs, which can trail the last streamed chunk.
        delta = SpecCounters()
        for attempt in range(4):
            page = self.scrape(base)
            after = spec_counters(page, model) if page is not None else None
            if after is None:
                return
            delta = after - before
            if delta.emitted >= stats.tokens - 1:
                break
            time.sleep(0.05 * (attempt + 1))
        if delta.emitted > stats.tokens + delta.k + 1:
            stats.notes.append(
                f"{base}'s counters include other requests during this reply: acceptance figures "
                f"cover {delta.emitted:.0f} tokens, not only this reply's {stats.tokens}"
            )
        add_spec_delta(stats.spec, delta)

    def _stream(
        self, base: str, model: str, messages: list[dict[str, str]], stats: ReplyStats, cancel: threading.Event | None
    ) -> Iterator[LLMDelta]:
        url = f"{base}/v1/chat/completions"
        body = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        conn, resp = self._open("POST", url, body, self.timeout_s)
        done = threading.Event()
        if cancel is not None:
            threading.Thread(target=_shutdown_on_cancel, args=(conn, cancel, done), daemon=True).start()
        usage: dict | None = None
        chunk_tokens = 0
        try:
            for data in sse_data(resp):
                if cancel is not None and cancel.is_set():
                    break
                if data.strip() == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    raise RuntimeError(f"{url} reported an error mid-reply: {obj['error']}")
                usage = obj.get("usage") or usage
                for choice in obj.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    finish = choice.get("finish_reason")
                    if choice.get("index", 0) != 0 or not (text or finish):
                        continue  # the role-only opening chunk, or another choice
                    now = time.perf_counter()
                    n = 1 if text else 0  # without per-chunk counts each content chunk counts as a token
                    if text:
                        stats.add(1, now)
                        chunk_tokens += 1
                    yield LLMDelta(text, n, now, [(text, None)] if text else [], finish_reason=finish)
        except (OSError, http.client.HTTPException) as e:
            if cancel is None or not cancel.is_set():
                raise RuntimeError(f"{url}: connection lost mid-reply: {e}") from e
        finally:
            done.set()
            conn.close()  # on cancel this is what tells the server to abort the request
        if cancel is not None and cancel.is_set():
            yield LLMDelta("", 0, time.perf_counter(), finish_reason="cancelled")
        elif usage and usage.get("completion_tokens") is not None:
            # The server's own count: with speculation one chunk often carries several tokens.
            stats.tokens += int(usage["completion_tokens"]) - chunk_tokens
