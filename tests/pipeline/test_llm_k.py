"""A conversation's K (the page's setting, EngineLLM.configure) is read once, where it is set; each reply still gets
a policy of its own (AdaptiveK learns within one answer)."""

from __future__ import annotations

import pytest

from pipeline import llm as llm_module
from pipeline.llm import Controls, EngineLLM, ReplyStats
from specdec.build import build_engine
from specdec.engine import EngineSession
from specdec.kpolicy import AdaptiveK, FixedK


def test_k_is_read_once_and_each_reply_gets_a_fresh_policy(tiny_engine, monkeypatch):
    engine, _ = build_engine(tiny_engine.spec)
    llm = EngineLLM(engine, 6, session=EngineSession(engine))
    reads: list[str] = []
    read = llm_module.k_policy_factory
    monkeypatch.setattr(llm_module, "k_policy_factory", lambda k: reads.append(k) or read(k))
    given = []
    stream = engine.stream

    def recorded(prompt, config, *args):
        given.append(config.k_policy)
        return stream(prompt, config, *args)

    monkeypatch.setattr(engine, "stream", recorded)
    llm.configure(Controls(k="adaptive"))
    for _ in range(2):
        list(llm.stream_reply([{"role": "user", "content": "hi"}], True, ReplyStats()))
    assert reads == ["adaptive"] and given[0] is given[1] is llm.k_policy  # read once, not per reply
    first, second = given[0](), given[0]()
    assert isinstance(first, AdaptiveK) and first is not second  # a fresh policy per reply
    with pytest.raises(ValueError, match="--k must be an integer or 'adaptive'"):
        llm.configure(Controls(k="many"))
    assert llm.k == "adaptive" and llm.k_policy is given[0]  # a refused K leaves the one set
    llm.configure(Controls(k="2"))
    assert isinstance(llm.k_policy(), FixedK) and llm.k_policy().next_k() == 2
