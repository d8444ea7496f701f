"""One prepared check of the GPU the product is for (issue 22), run by scripts/gpu-check.sh; it writes one JSON file.

On --device (cuda by default), within --budget-s (8 minutes by default), with no network and no real weights:
1. environment: Python, torch, the device, and which of the project's packages this machine lacks;
2. host_reads: the device reads per speculative step on the tiny engine (counted by tests/specdec/test_host_reads.py);
3. models: the forward-cost grid (batch × tokens per sequence) of Qwen2.5-0.5B-, 1.5B- and 7B-shaped models with
   random weights, timed through the engine's BatchRunner as its own cost grid is (cost_grid.measure_forward_costs),
   a voice turn's prefill, and the drafters' proposals as a step meets them (specdec/calibrate.py): the 0.5B as a
   draft model, untrained medusa heads (the shipped kind) on each target;
4. prediction: speedup and TTFA for this device from those costs and the acceptance measured on the CPU with the
   real weights (ACCEPTANCE) — a prediction, not a measurement;
5. casestudy: the case study's roofline (casestudy/latency_model.py) calibrated from the measured curve;
6. tests: the fast suite on the device (SPECVOICE_TEST_DEVICE), with whatever time is left.

--small (the default on the CPU, what CI runs) shrinks the shapes, the grid and the test run to seconds.
Every section that fails is reported under "errors" and the rest still run; the JSON is rewritten after each one.
Sections 1–3 and 6 (with SHAPES and ACCEPTANCE) are in gpu_sections.py, 4–5 in gpu_predict.py; this file runs them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sections, beside it, however this file is loaded
from gpu_predict import casestudy_calibration, prediction  # noqa: E402
from gpu_sections import environment, host_reads, model_costs, run_tests  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    out = os.environ.get("OUT")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(out) / "gpu-check.json" if out else Path("gpu-check.json"),
        help="where the JSON goes (default: $OUT/gpu-check.json where $OUT is set, else ./gpu-check.json)",
    )
    parser.add_argument(
        "--small",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="shapes ÷ 8 with two layers, a 3 × 4 grid and a handful of tests (default: on for the CPU only)",
    )
    parser.add_argument("--budget-s", type=float, default=480, help="the whole check's seconds (8 minutes)")
    args = parser.parse_args(argv)
    if args.small is None:
        args.small = args.device == "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "check": "scripts/gpu-check.sh (issue 22)",
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "small": args.small,
        "errors": {},
    }

    def save() -> None:
        report["seconds"] = time.perf_counter() - t_start
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))

    def section(name: str, run: Callable[[], Any]) -> None:
        print(f"gpu-check: {name} …", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            report[name] = run()
        except Exception as e:  # report it and go on: one missing package must not hide the other results
            traceback.print_exc()
            report["errors"][name] = f"{type(e).__name__}: {e}"
        report.setdefault("section_seconds", {})[name] = time.perf_counter() - t0  # where the budget went
        save()

    # Filled as it is read, so that what was found survives a missing torch or device.
    section("environment", lambda: environment(args.device, report.setdefault("environment", {})))
    if "environment" in report["errors"]:  # no torch or no such device: nothing else can run
        report["ok"] = False
        save()
        return 1
    section("host_reads", lambda: host_reads(args.device))
    # Filled model by model: a model that fails (out of memory, say) leaves the ones before it for the prediction.
    section("models", lambda: model_costs(args.device, args.small, report.setdefault("models", {})))
    if report["models"]:
        section("prediction", lambda: prediction(report["models"]))
        section("casestudy", lambda: casestudy_calibration(args.device, args.small, report["models"]))
    left = args.budget_s - (time.perf_counter() - t_start) - 10  # 10 s to write up
    section("tests", lambda: run_tests(args.device, args.small, left))
    tests = report.get("tests", {})
    # ok: every test that could run here passed (a failure from a missing module is counted apart, not hidden)
    missing = sum(tests.get("problems_from_missing_modules", {}).values())
    report["ok"] = (
        not report["errors"]
        and "failed" in tests
        and tests["failed"] + tests["errors"] == missing
        and not tests.get("interrupted_at_budget")
    )
    save()
    print(f"gpu-check: wrote {args.json} in {report['seconds']:.0f} s; ok: {report['ok']}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
