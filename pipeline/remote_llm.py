"""The LLM stage against an OpenAI-compatible server such as vLLM: HTTP and server-sent events with the standard
library, the Prometheus text format with prometheus_client's parser.

Replies stream from POST /v1/chat/completions (server-sent events). Speculation facts come from the
server's Prometheus endpoint: vLLM's counters are scraped before and after each reply and the
difference fills ReplyStats.spec, so the panels that show the in-process engine show a remote one too.

`python -m pipeline.remote_llm [engine options]` prints the `vllm serve` line that serves what those options
name (vllm_serve_command).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import shlex
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from specdec.build import EngineSpec
from specdec.drafters import NGramDrafter
from specdec.metrics import SpecStats, alpha_from_acceptance_rate
from specdec.models import PRESETS

from .llm import LLMDelta, ReplyStats

SPEC_PREFIX = "vllm:spec_decode_"
# Counter names without vLLM's prefix and without the `_total` the Prometheus exposition may add.
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def parse_prometheus(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Samples of the Prometheus text exposition format: (name, labels, value); timestamps dropped.
    ValueError on text that is not in that format."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, float(sample.value)


@dataclass
class SpecCounters:
    """vLLM's speculative decoding counters at one moment (or the difference between two)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        positions = self.accepted_per_pos.keys() | before.accepted_per_pos.keys()
        return SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            {p: self.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0) for p in positions},
        )

    @property
    def k(self) -> int:
        """Draft length: the positions vLLM reports, else the mean draft tokens per draft."""
        if self.accepted_per_pos:
            return max(self.accepted_per_pos) + 1
        return round(self.draft_tokens / self.drafts) if self.drafts else 0

    @property
    def emitted(self) -> float:
        return self.drafts + self.accepted  # each draft step emits its accepted tokens plus the target's own


def spec_counters(text: str, model: str | None = None) -> SpecCounters | None:
    """The speculative decoding counters in a /metrics page, summed over engines; None when there are none.

    Samples labelled with another model_name are left out when some carry `model`'s (a server may host several).
    """
    samples = []
    try:
        for name, labels, value in parse_prometheus(text):
            if not name.startswith(SPEC_PREFIX):
                continue
            short = name[len(SPEC_PREFIX) :].removesuffix("_total")
            if short in SPEC_COUNTERS:
                samples.append((short, labels, value))
    except ValueError:  # not a Prometheus page (a proxy's error page, say): no counters to read
        return None
    if not samples:
        return None
    if model and any(labels.get("model_name") == model for _, labels, _ in samples):
        samples = [s for s in samples if s[1].get("model_name", model) == model]
    out = SpecCounters()
    for short, labels, value in samples:
        if short == "num_accepted_tokens_per_pos":
            pos = int(labels.get("position", 0))
            out.accepted_per_pos[pos] = out.accepted_per_pos.get(pos, 0.0) + value
        elif short == "num_drafts":
            out.drafts += value
        elif short == "num_draft_tokens":
            out.draft_tokens += value
        else:
            out.accepted += value
    return out


def add_spec_delta(spec: SpecStats, d: SpecCounters) -> None:
    """Fold one reply's counter difference into SpecStats, as the in-process engine would have recorded it."""
    drafts, proposed, accepted = round(d.drafts), round(d.draft_tokens), round(d.accepted)
    if drafts <= 0:
        return
    k = d.k
    per_pos = [round(d.accepted_per_pos.get(i, 0.0)) for i in range(k)]
    if d.accepted_per_pos and proposed == k * drafts:
        # A draft whose last position was accepted had no rejection; every other draft stopped at one.
        rejections = drafts - per_pos[-1]
    else:  # no per-position counters: estimate from the rate under independent acceptance
        alpha = alpha_from_acceptance_rate(accepted / proposed if proposed else 0.0, k)
        rejections = round(accepted * (1 - alpha) / alpha) if alpha > 0 else drafts
    # The server's counters, as the in-process engine would have recorded them (a draft is a speculative step).
    spec.merge(
        SpecStats(
            target_forwards=drafts,
            speculative_steps=drafts,
            proposed=proposed,
            accepted=accepted,
            emitted=drafts + accepted,
            rejections=rejections,
            per_position_proposed=[drafts] * k,  # vLLM's per-position rate divides by the drafts
            per_position_accepted=per_pos,
        )
    )


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

    def stream_reply(
        self,
        messages: list[dict[str, str]],
        speculation: bool,
        stats: ReplyStats,
        cancel: threading.Event | None = None,
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
                    yield LLMDelta(
                        text=text, tokens=n, from_draft=[], drafted=0, accepted=0, t=now, finish_reason=finish
                    )
        except (OSError, http.client.HTTPException) as e:
            if cancel is None or not cancel.is_set():
                raise RuntimeError(f"{url}: connection lost mid-reply: {e}") from e
        finally:
            done.set()
            conn.close()  # on cancel this is what tells the server to abort the request
        if cancel is not None and cancel.is_set():
            yield LLMDelta(
                text="",
                tokens=0,
                from_draft=[],
                drafted=0,
                accepted=0,
                t=time.perf_counter(),
                finish_reason="cancelled",
            )
        elif usage and usage.get("completion_tokens") is not None:
            # The server's own count: with speculation one chunk often carries several tokens.
            stats.tokens += int(usage["completion_tokens"]) - chunk_tokens


# ------------------------------------------------------------------------------------------- serving it with vLLM


def vllm_serve_command(spec: EngineSpec, port: int = 8000, max_num_seqs: int = 256) -> list[str]:
    """`vllm serve` for the target and drafter that `spec` names, with this engine's options in vLLM's terms.

    vLLM fixes speculation at launch in one JSON --speculative-config: the method, the draft `model` and K as
    `num_speculative_tokens` (fixed there, so an adaptive K becomes its most, --k-max).
    --speculative-disable-by-batch-size N is vLLM's old flag. Moved into that JSON as `disable_by_batch_size`, it was
    read only by the V0 engine, so by nothing since v0.10.0, and vLLM has dropped it (vllm-project/vllm#35060).
    Current vLLM says the same with a batch-size schedule of K, `num_speculative_tokens_per_batch_size`: K for 1 to
    N sequences, 0 from N + 1 to --max-num-seqs.
    The CPU weight formats and the draft confidence gate have no vLLM counterpart and are left out.
    """
    if spec.draft == "heads":
        raise ValueError(
            "--draft heads: vLLM cannot load specvoice's draft heads (its EAGLE method needs an EAGLE checkpoint); "
            "use a draft model from the target's family (e.g. --draft qwen-0.5b) or --draft ngram"
        )
    command = ["vllm", "serve", _vllm_model(spec.target, "--target"), "--port", str(port), "--dtype", spec.dtype]
    if spec.draft == "none":
        return command
    k = int(spec.k) if spec.k.isdigit() else spec.k_max
    config: dict[str, object]
    if spec.draft == "ngram":
        ngram = NGramDrafter()  # the n-gram sizes our drafter looks up
        config = {"method": "ngram", "prompt_lookup_max": ngram.max_ngram, "prompt_lookup_min": ngram.min_ngram}
    else:
        config = {"method": "draft_model", "model": _vllm_model(spec.draft, "--draft")}
    config["num_speculative_tokens"] = k
    limit = spec.disable_by_batch_size
    if limit is not None and limit < max_num_seqs:  # else vLLM never batches enough sequences for it to bite
        config["num_speculative_tokens_per_batch_size"] = [[1, limit, k], [limit + 1, max_num_seqs, 0]]
        command += ["--max-num-seqs", str(max_num_seqs)]
    return command + ["--speculative-config", json.dumps(config)]


def _vllm_model(name: str, option: str) -> str:
    """What vLLM loads for a preset (its hub id), a hub id or a local directory (as given)."""
    preset = PRESETS.get(name)
    if preset is None:
        return name
    if preset.hub_id is None:
        raise ValueError(f"{option} {name}: a preset without a hub model, so nothing vLLM can load")
    return preset.hub_id


def main(argv: list[str] | None = None) -> None:
    # Imported here: the command-line options import the whole voice agent, which the LLM stage does not need.
    from .options import add_engine_arguments, spec_from_args

    parser = argparse.ArgumentParser(
        prog="python -m pipeline.remote_llm",
        description="Print the `vllm serve` command that serves what these engine options name, for --llm-url.",
    )
    add_engine_arguments(parser)
    parser.add_argument("--port", type=int, default=8000, help="the port vLLM listens on")
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="the most sequences vLLM batches (with a batch-size limit)"
    )
    args = parser.parse_args(argv)
    try:
        command = vllm_serve_command(spec_from_args(args), args.port, args.max_num_seqs)
    except ValueError as e:
        parser.error(str(e))
    print(shlex.join(command))


if __name__ == "__main__":
    main()
