"""Where `specvoice app`'s resident memory goes: the app's agent built step by step the way app/server.py and
app/loader.py build it (the app's own option defaults), the process's memory printed after each step.

    .venv/bin/python scripts/memory_breakdown.py [--no-page] [--no-prepack] [--answers N]

Each row: VmRSS, its change, the step's own peak (VmHWM, reset before each step through /proc/self/clear_refs), the
anonymous and file-backed parts of the RSS (RssAnon, RssFile: a memory-mapped weights file counts as RssFile), and
the number of threads. After the steps: the live torch tensors (by storage, and whether a file mapping backs them),
the big file mappings by resident size, the modules' parameter bytes, the KV caches; then gc + malloc_trim(0), to
tell freed-but-held heap from live memory.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T0 = time.perf_counter()
MB = 1 << 20
ROWS: list[tuple] = []
PEAKS: list[int] = []


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
            elif key == "Threads":
                out[key] = int(rest.split()[0])
    return out


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass


_last = [0]


def mark(step: str) -> None:
    """One row: the memory now, and the peak since the previous row."""
    s = status()
    PEAKS.append(s["VmHWM"])
    delta = s["VmRSS"] - _last[0]
    _last[0] = s["VmRSS"]
    row = (step, s["VmRSS"], delta, s["VmHWM"], s["RssAnon"], s["RssFile"], s["Threads"], time.perf_counter() - T0)
    ROWS.append(row)
    print(
        f"{row[0]:<52} rss {row[1] / MB:7.0f}  Δ {row[2] / MB:+7.0f}  step peak {row[3] / MB:7.0f}  "
        f"anon {row[4] / MB:7.0f}  file {row[5] / MB:7.0f}  thr {row[6]:3d}  t {row[7]:6.1f}s",
        flush=True,
    )
    reset_peak()


def table() -> None:
    print("\n| step | RSS MB | Δ MB | step peak MB | RssAnon MB | RssFile MB | threads | t s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for step, rss, delta, hwm, anon, file, threads, t in ROWS:
        print(
            f"| {step} | {rss / MB:.0f} | {delta / MB:+.0f} | {hwm / MB:.0f} | {anon / MB:.0f} | {file / MB:.0f} | "
            f"{threads} | {t:.1f} |"
        )
    print(f"\npeak over the run (max of the step peaks): {max(PEAKS) / MB:.0f} MB")


def wrap(module, name: str, label: str | None = None) -> None:
    """module.name(...) marks a row after it returns (its peak: what it used on the way)."""
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        mark(f"  (before {label or name})")
        out = original(*args, **kwargs)
        mark(f"  {label or name}")
        return out

    setattr(module, name, wrapped)


# ---- what holds the memory


def mappings() -> list[tuple[int, int, str, int]]:
    """(start, end, path, resident bytes) of every mapping (/proc/self/smaps)."""
    out = []
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = [lo, hi, head[5] if len(head) > 5 else "", 0]
                out.append(current)
            elif head[0] == "Rss:" and current is not None:
                current[3] = int(head[1]) * 1024
    return [tuple(m) for m in out]


def big_file_mappings(limit: int = 10) -> None:
    files: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for lo, hi, path, rss in mappings():
        if path.startswith("/"):
            files[path][0] += hi - lo
            files[path][1] += rss
    print("\nfile mappings by resident size (mapped MB / resident MB):")
    for path, (size, rss) in sorted(files.items(), key=lambda kv: -kv[1][1])[:limit]:
        print(f"  {size / MB:8.0f} {rss / MB:8.0f}  {path}")


def tensor_census(limit: int = 12) -> None:
    """Every live torch tensor reachable by the gc, by storage (views counted once), and which file mapping, if any,
    holds its bytes."""
    import torch

    maps = [(lo, hi, path) for lo, hi, path, _ in mappings()]
    storages: dict[int, tuple[int, str, tuple]] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            continue
        try:
            st = obj.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
        except Exception:  # opaque (mkldnn) tensors
            continue
        if ptr == 0 or ptr in storages:
            continue
        where = next((p for lo, hi, p in maps if lo <= ptr < hi), "?")
        storages[ptr] = (nbytes, where, (tuple(obj.shape), str(obj.dtype).removeprefix("torch.")))
    by_where: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for nbytes, where, _ in storages.values():
        key = where if where.startswith("/") else "heap/anonymous"
        by_where[key][0] += nbytes
        by_where[key][1] += 1
    print("\nlive tensors' storages by where their bytes lie (MB, count):")
    for where, (nbytes, n) in sorted(by_where.items(), key=lambda kv: -kv[1][0]):
        print(f"  {nbytes / MB:8.0f}  {n:6d}  {where}")
    print(f"largest {limit} storages:")
    for nbytes, where, (shape, dtype) in sorted(storages.values(), key=lambda v: -v[0])[:limit]:
        print(f"  {nbytes / MB:8.1f} MB  {dtype:9} {shape!s:24} {where if where.startswith('/') else 'heap'}")


def module_bytes(module) -> tuple[int, int]:
    """(parameter and buffer bytes, storages counted once; the w8a8 layers' packed_weight_bytes)."""
    seen, total, packed = set(), 0, 0
    for t in list(module.parameters()) + list(module.buffers()):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    for m in module.modules():
        packed += getattr(m, "packed_weight_bytes", 0) if hasattr(m, "_packed") else 0
    return total, packed


def engine_census(agent) -> None:
    from specdec.heads_drafter import HeadsDrafter
    from specdec.heads_model import DraftHeads, EagleCache
    from specdec.kv import SequenceCache

    llm = agent.llm
    if llm.engine is not None:
        model = llm.engine.target.model
        params, packed = module_bytes(model)
        emb = model.get_input_embeddings().weight
        print(
            f"\ntarget: params+buffers {params / MB:.0f} MB (embedding {emb.nbytes / MB:.0f} MB {emb.dtype}), "
            f"w8a8 packed weights {packed / MB:.0f} MB"
        )
    caches = [o for o in gc.get_objects() if isinstance(o, SequenceCache)]
    kv = sum(k.untyped_storage().nbytes() for c in caches for k in c.keys + c.values)
    print(
        f"KV caches: {len(caches)} SequenceCache, {kv / MB:.1f} MB, capacities {[c.capacity for c in caches]}, "
        f"dtype {caches[0].keys[0].dtype if caches else '-'}"
    )
    hidden = sum(c.hidden.nbytes for c in caches if c.hidden is not None)
    heads = [o for o in gc.get_objects() if isinstance(o, DraftHeads)]
    for h in heads:
        b, p = module_bytes(h)
        print(f"draft heads: params+buffers {b / MB:.1f} MB, w8a8 packed {p / MB:.1f} MB")
    drafters = [o for o in gc.get_objects() if isinstance(o, HeadsDrafter)]
    eagles = [o for o in gc.get_objects() if isinstance(o, EagleCache)]
    feats = sum(d.features.nbytes for d in drafters)
    eagle = sum(e.keys.nbytes + e.values.nbytes for e in eagles)
    print(
        f"drafters: {len(drafters)} HeadsDrafter (features {feats / MB:.1f} MB), {len(eagles)} EagleCache "
        f"({eagle / MB:.1f} MB), kept hidden rows {hidden / MB:.1f} MB"
    )


QUESTIONS = (
    "What is the capital of France?",
    "How do I boil an egg?",
    "Give me one tip for better sleep.",
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-page", action="store_true", help="skip Gradio's page (build_app)")
    ap.add_argument("--no-prepack", action="store_true", help="skip the early packing the app starts")
    ap.add_argument("--answers", type=int, default=3)
    ap.add_argument("--no-census", action="store_true")
    opts = ap.parse_args()
    reset_peak()
    mark("start (python)")

    import warnings

    import torch  # noqa: F401

    warnings.filterwarnings("ignore", category=FutureWarning)  # gc.get_objects() meets torch's deprecated aliases

    import app.loader as loader_mod
    import app.server as server_mod
    import commands.app as app_command
    import pipeline.agent as agent_mod
    import pipeline.llm_provider as provider_mod
    import specdec.build as build_mod
    from pipeline.timeline import Timeline

    mark("imports (torch, app, pipeline, specdec)")

    parser = argparse.ArgumentParser()
    app_command.add_arguments(parser)
    config, options = app_command.server_setup(parser.parse_args([]))
    e = config.engine
    print(
        f"config: target {e.target} {e.target_quant} {e.dtype}, draft {e.draft} {e.draft_quant}, batched "
        f"{e.batched}, load_aware {e.load_aware}, asr {config.asr_model}, tts {config.tts}, "
        f"turn_end {config.turn_end.mode}, prompt_tokens {config.prompt_tokens}, torch threads "
        f"{torch.get_num_threads()}",
        flush=True,
    )

    # the steps inside the LLM's build
    for name in ("load_model", "heads_drafter_factory", "quantize_target", "cached_min_feed"):
        wrap(build_mod, name, f"engine: {name}")
    wrap(build_mod, "BatchRunner", "engine: BatchRunner")
    wrap(build_mod.compute, "release_workers", "engine: release_workers")
    wrap(provider_mod, "BatchScheduler", "provider: BatchScheduler")
    wrap(provider_mod, "shared_prefix_ids", "provider: shared_prefix_ids")
    wrap(provider_mod, "cached_forward_costs", "warmup: cached_forward_costs")
    wrap(agent_mod, "load_smart_turn", "agent: load_smart_turn")

    server = server_mod.AppServer(config, options)  # heap.limit_arenas(), as the app does first
    mark("AppServer (limit_arenas)")
    if not opts.no_prepack:
        server.loader.prepack()
        mark("loader.prepack() started")
    # wrapped after the loader's own call: the object is one, and only the build's call is the engine's step
    wrap(build_mod.early_packing, "start", "engine: early_packing.start")
    if not opts.no_page:
        server.build_app()
        mark("page: build_app (Gradio)")

    result: dict = {}

    def build() -> None:  # on a thread of its own, as the app's model-loader
        try:
            agent = loader_mod.ModelLoader._build_agent(server.loader, lambda step: mark(f"progress {step}"))
            mark("agent built")
            agent.warmup(lambda step: mark(f"warmup: {agent.WARMUP_STEPS[step]} (start)"))
            mark("warmup done")
            result["agent"] = agent
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=build, name="model-loader")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    agent = result["agent"]

    conv = agent.new_conversation()
    mark("new_conversation (system prompt prefilled)")
    for question in QUESTIONS[: opts.answers]:
        turn = agent.respond(conv, question, Timeline(), speculation=True)
        mark(f"answer: {question[:30]!r} ({turn.stats.tokens} tok)")
        print(f"    → {turn.answer[:100]!r}", flush=True)

    if not opts.no_census:
        engine_census(agent)
        tensor_census()
        big_file_mappings()
    gc.collect()
    mark("gc.collect()")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    mark("malloc_trim(0)")
    table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
