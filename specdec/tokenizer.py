"""One small tokenizer interface for real (Hugging Face) and test (byte-level) models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_ids: set[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]: ...

    def vocab_fingerprint(self) -> tuple: ...


class HFTokenizer:
    def __init__(self, tok) -> None:
        self.tok = tok
        ids = {tok.eos_token_id}
        for special in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = tok.convert_tokens_to_ids(special)
            if isinstance(tid, int) and tid != tok.unk_token_id:
                ids.add(tid)
        self.eos_token_ids = {i for i in ids if i is not None}

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return list(out)
        return self.encode("\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:")

    def vocab_fingerprint(self) -> tuple:
        vocab = self.tok.get_vocab()
        # Same ids for the same strings, and the same special ids: enough for token-level drafting.
        return (len(vocab), hash(frozenset(vocab.items())), tuple(sorted(self.eos_token_ids)))


class ByteTokenizer:
    """UTF-8 bytes as tokens plus three specials; used with the tiny random models."""

    BOS, EOS, PAD = 256, 257, 258
    VOCAB_SIZE = 259

    def __init__(self) -> None:
        self.eos_token_ids = {self.EOS}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return [self.BOS, *self.encode(text)]

    def vocab_fingerprint(self) -> tuple:
        return ("bytes", self.VOCAB_SIZE)


class IncrementalDecoder:
    """Token ids → text deltas, holding back bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        delta, self.text = full[len(self.text) :], full
        return delta


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def words_start(tokenizer: Tokenizer, head: list[dict[str, str]]) -> int:
    """Where the words of a user message that follows the messages `head` begin in its chat prompt."""
    a, b = (tokenizer.chat_ids([*head, {"role": "user", "content": words}]) for words in ("a", "zz"))
    return common_prefix_length(a, b)


def shared_prefix_ids(tokenizer: Tokenizer, system: str) -> list[int]:
    """Tokens that every conversation with this system prompt starts with (worth caching once)."""
    head = [{"role": "system", "content": system}]
    return tokenizer.chat_ids([*head, {"role": "user", "content": "a"}])[: words_start(tokenizer, head)]
