"""The page's Case study tab: it builds, and its numbers follow its sliders."""

from __future__ import annotations

import pytest

from app import casestudy
from casestudy.story import calibrated_scenario


def test_case_study_tab_builds_and_updates() -> None:
    gr = pytest.importorskip("gradio")
    with gr.Blocks():
        tab = casestudy.build_tab()
    assert tab.label == "Case study"
    s = calibrated_scenario()
    idle, _ = casestudy.tab_outputs(s.alpha, 4, 0.114, 70.6, 2.0, 4, 7.3, 1)
    busy, fig = casestudy.tab_outputs(s.alpha, 4, 0.114, 70.6, 2.0, 4, 7.3, 512)
    assert "76." in idle and "Best K here: **0**" in busy
    assert fig.axes  # a plot came with the numbers
