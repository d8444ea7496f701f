"""`specvoice bench-server` end to end on the tiny models, with tiny counts: the JSON it promises (no timing is
judged here; the measurement is the command's)."""

from __future__ import annotations

import json

import pytest

from commands.bench_server import MALFORMED
from commands.cli import main


@pytest.mark.models
def test_bench_server_writes_its_measurements(tmp_path, capsys):
    out = tmp_path / "server.json"
    args = ["bench-server", "--cycles", "3", "--status-requests", "3", "--flood-requests", "5", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    memory, flood, malformed = result["memory"], result["status_under_flood"], result["malformed"]
    assert memory["cycles"] == 3 and memory["sessions_left"] == 0
    assert all(isinstance(memory[k], float) for k in ("start_mb", "end_mb", "rss_growth_mb"))
    assert memory["rss_growth_mb"] == pytest.approx(memory["end_mb"] - memory["start_mb"])
    assert flood["requests"] == 3 and flood["flood_requests"] == 5 and flood["flood_sample_rate"] == 96000
    assert 0 < flood["median_ms"] <= flood["max_ms"] and flood["answer_audio_bytes"] > 0
    assert isinstance(flood["client_closed_by_server"], bool) and isinstance(flood["flood_audio_bytes_read"], int)
    assert malformed["messages"] == len(MALFORMED) and isinstance(malformed["tracebacks"], int)
    assert set(malformed["unanswered"]) >= set(malformed["dropped"])  # a dropped socket answers nothing
    assert all(isinstance(result[k]["met"], bool) for k in ("memory", "status_under_flood", "malformed"))
    assert result["status_after_ms"] > 0 and set(result["definitions"]) >= {"rss_mb", "status_ms", "tracebacks"}
    assert "memory: RSS" in capsys.readouterr().out
