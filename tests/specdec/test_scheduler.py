"""Continuous batching on the tiny fp32 models: the batch runner against transformers, every answer in a batch equal
to the same answer alone, joining and leaving between steps, cancel and failures, and the load-aware K choice."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import pytest
import torch

from specdec import compute, quant_layers
from specdec.cost_grid import (
    ForwardCosts,
    cached_forward_costs,
    cached_min_feed,
    measure_forward_costs,
)
from specdec.drafters import DraftModelDrafter, Proposal
from specdec.engine import GenerationConfig, StepEvent, collect
from specdec.kv import PENDING
from specdec.metrics import expected_tokens_per_step
from specdec.runner import BatchRunner, Feed
from specdec.sampling import SamplingParams
from specdec.scheduler import (
    FORGET,
    OPENING_STEPS,
    BatchScheduler,
    Calibration,
    LoadEstimate,
    _Running,
    choose_ks,
)
from specdec.session import EngineSession
from specdec.tree import ROOT, build_tree, keep_best
from tests.support.engine import draft_factory, heads_engine, make_engine, target_only, tiny_prompts


def batched_engine(target, drafter_factory, k="3", **kw):
    return make_engine(target, drafter_factory, k, **kw)


def run_together(scheduler, prompts, configs, sessions=None):
    """Stream every prompt at once through the scheduler, one reader thread each; tokens and events per prompt."""
    results: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def read(i):
        start.wait()
        session = sessions[i] if sessions else None
        results[i] = collect(scheduler.stream(prompts[i], configs[i], session=session))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_runner_logits_match_transformers(tiny_engine):
    target = tiny_engine.target
    runner = BatchRunner(target.model, target.device)
    a, b, c = tiny_prompts(target, 3, seed=5)
    caches = [runner.new_cache() for _ in range(3)]

    def reference(ids, n):  # transformers' own forward over the whole sequence
        with torch.inference_mode():
            return target.model(input_ids=torch.tensor([ids], device=target.device)).logits[0, -n:]

    feeds = [(a, 3), (b, 1), (c + [7, 8], 2)]
    got = runner.extend([Feed(cache, ids, n) for cache, (ids, n) in zip(caches, feeds)])
    for out, (ids, n) in zip(got, feeds):
        assert out.shape == (n, target.model.config.vocab_size)
        torch.testing.assert_close(out, reference(ids, n), rtol=1e-4, atol=1e-4)
    # the next step: one sequence rolls back drafts, one decodes, one verifies three (fed from the device)
    feeds = [(a[:-2] + [9], 1), (b + [4], 1), (c + [7, 5, 6, 1], 4)]
    got = runner.extend(
        [
            Feed(caches[0], feeds[0][0]),
            Feed(caches[1], feeds[1][0]),
            Feed(caches[2], c + [7], 4, torch.tensor([5, 6, 1], device=target.device)),
        ]
    )
    for out, (ids, n) in zip(got, feeds):
        torch.testing.assert_close(out, reference(ids, n), rtol=1e-4, atol=1e-4)
    assert caches[0].tokens == feeds[0][0] and caches[2].tokens == c + [7, PENDING, PENDING, PENDING]


def test_runner_keeps_the_last_hidden_states_of_what_it_fed(tiny_engine):
    target = tiny_engine.target
    runner = BatchRunner(target.model, target.device)
    a, b = tiny_prompts(target, 2, seed=6)
    mine, other = runner.new_cache(), runner.new_cache()
    mine.keep_hidden = True
    runner.extend([Feed(other, b), Feed(mine, a)])
    with torch.inference_mode():
        ids = torch.tensor([a], device=target.device)
        ref = target.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
    assert mine.hidden_start == 0
    torch.testing.assert_close(mine.hidden, ref, rtol=1e-4, atol=1e-4)
    assert other.hidden is None


def test_runner_grows_its_cache_and_resets_after_a_failed_forward(tiny_engine):
    target = tiny_engine.target
    runner = BatchRunner(target.model, target.device)
    long = tiny_prompts(target, 1, seed=7)[0] * 40  # past the first allocation
    cache = runner.new_cache()
    for n in range(300, len(long), 97):
        cache.extend(long[:n])
    assert len(cache.tokens) == len(long[:n]) and cache.capacity >= n

    def out_of_memory(*args):
        raise RuntimeError("out of memory")

    # The second layer fails, after the first wrote its cache. (Not an id past the vocabulary: on a GPU that is a
    # device-side assert, which leaves CUDA unusable for the rest of the run.)
    runner.parts[1] = (out_of_memory, runner.parts[1][1])
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.extend([Feed(cache, long + [10])])
    assert cache.tokens == []


@pytest.mark.parametrize("sampled", [False, True])
def test_every_answer_in_a_batch_equals_the_answer_alone(tiny_engine, sampled):
    target, draft = tiny_engine.models
    prompts = tiny_prompts(target, 4, seed=8)
    params = SamplingParams(temperature=0.8) if sampled else SamplingParams()
    configs = [GenerationConfig(30 + 7 * i, params, seed=i, speculate=i != 1) for i in range(4)]
    alone_engine = batched_engine(target, draft_factory(draft))
    alone = [collect(alone_engine.stream(p, c))[0] for p, c in zip(prompts, configs)]
    scheduler = BatchScheduler(batched_engine(target, draft_factory(draft)))
    together = run_together(scheduler, prompts, configs)
    assert [tokens for tokens, _ in together] == alone
    if not sampled:
        assert alone[0] == target_only(target, prompts[0], 30)
    sizes = {ev.batch_size for _, events in together for ev in events}
    assert max(sizes) == 4 and min(sizes) == 1  # the answers really shared forwards, and left at their own ends
    assert any(ev.accepted for _, events in together for ev in events)


def test_heads_drafters_in_a_batch_read_their_own_hidden_states(tiny_engine, tiny_heads):
    engine = heads_engine(tiny_engine, tiny_heads)
    target = engine.target
    prompts = tiny_prompts(target, 3, seed=9)
    configs = [GenerationConfig(24)] * 3
    expected = [target_only(target, p, 24) for p in prompts]
    results = run_together(BatchScheduler(engine), prompts, configs)
    assert [tokens for tokens, _ in results] == expected
    assert any(ev.accepted for _, events in results for ev in events)


def test_answers_join_and_leave_between_steps_and_sessions_carry_over(tiny_engine):
    target, draft = tiny_engine.models
    engine = batched_engine(target, draft_factory(draft))
    scheduler = BatchScheduler(engine)
    first, second = tiny_prompts(target, 2, seed=10)
    session = EngineSession(engine)
    long_reader = scheduler.stream(first, GenerationConfig(60), session=session)
    head = [next(long_reader) for _ in range(3)]  # the first answer is running alone
    joined = collect(scheduler.stream(second, GenerationConfig(12)))  # joins, finishes, leaves
    rest = collect(long_reader)
    tokens = [t for ev in head for t in ev.tokens] + rest[0]
    assert tokens == target_only(target, first, 60)
    assert joined[0] == target_only(target, second, 12)
    assert max(ev.batch_size for ev in joined[1]) == 2
    # the session kept its KV: the next turn of that conversation prefills only what is new
    follow = first + tokens + tiny_prompts(target, 1, seed=11)[0]
    assert session.target.common_prefix(follow) == len(first) + len(tokens) - 1  # the last token was never fed
    assert collect(scheduler.stream(follow, GenerationConfig(10), session=session))[0] == target_only(
        target, follow, 10
    )


def test_cancel_and_an_abandoned_reader_leave_the_batch(tiny_engine):
    target, draft = tiny_engine.models
    scheduler = BatchScheduler(batched_engine(target, draft_factory(draft)))
    a, b, c = tiny_prompts(target, 3, seed=12)
    cancel = threading.Event()
    cancelled = scheduler.stream(a, GenerationConfig(200), cancel)
    abandoned = scheduler.stream(b, GenerationConfig(200))
    next(cancelled), next(abandoned)
    cancel.set()
    events = list(cancelled)
    assert events[-1].finish_reason == "cancelled" and sum(len(ev.tokens) for ev in events) < 200
    abandoned.close()  # a client that went away
    tokens, events = collect(scheduler.stream(c, GenerationConfig(15)))
    assert tokens == target_only(target, c, 15)
    assert events[-1].batch_size == 1 and scheduler.active == 0


class Broken(DraftModelDrafter):
    def __init__(self, *args, fail_after: int = 2) -> None:
        super().__init__(*args)
        self.calls, self.fail_after = 0, fail_after

    def propose(self, *args, **kw):
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("draft server went away")
        return super().propose(*args, **kw)


def test_a_failing_drafter_costs_only_its_own_answer_nothing(tiny_engine):
    target, draft = tiny_engine.models
    runner = BatchRunner(draft.model, draft.device)
    engine = batched_engine(target, lambda: Broken(runner))
    prompts = tiny_prompts(target, 2, seed=13)
    results = run_together(BatchScheduler(engine), prompts, [GenerationConfig(30)] * 2)
    assert [tokens for tokens, _ in results] == [target_only(target, p, 30) for p in prompts]
    assert all(any("drafter failed" in ev.note for ev in events) for _, events in results)


def test_a_bad_prompt_fails_in_the_caller_and_the_scheduler_goes_on(tiny_engine):
    target, draft = tiny_engine.models
    scheduler = BatchScheduler(batched_engine(target, draft_factory(draft)))
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.stream([], GenerationConfig(5))
    prompt = tiny_prompts(target, 1, seed=14)[0]
    assert collect(scheduler.stream(prompt, GenerationConfig(5)))[0] == target_only(target, prompt, 5)


def test_speculation_is_disabled_by_batch_size_with_vllm_meaning(tiny_engine):
    target, draft = tiny_engine.models
    engine = batched_engine(target, draft_factory(draft), disable_by_batch_size=2)
    prompts = tiny_prompts(target, 3, seed=15)
    lengths = [8, 30, 30]  # three at first, two once the first has finished
    results = run_together(BatchScheduler(engine), prompts, [GenerationConfig(n) for n in lengths])
    events = [ev for _, evs in results for ev in evs]
    assert all(ev.k_chosen == 0 for ev in events if ev.batch_size > 2)
    assert any(ev.k_chosen > 0 for ev in events if ev.batch_size <= 2)
    assert any("--speculative-disable-by-batch-size 2" in ev.note for ev in events)
    assert [tokens for tokens, _ in results] == [target_only(target, p, n) for p, n in zip(prompts, lengths)]


# ---------------------------------------------------------------------------------------------- load-aware K


def by_rows(rows: list[int], seconds: list[float]) -> ForwardCosts:
    """Costs that depend on the tokens fed only (one batch row of the grid)."""
    return ForwardCosts([1], rows, [seconds])


def test_forward_costs_interpolate_in_tokens_and_batch_size():
    costs = by_rows([1, 4, 8], [0.1, 0.1, 0.3])
    assert costs(1, 1) == costs(3, 3) == 0.1 and costs(1, 6) == pytest.approx(0.2)
    assert costs(1, 12) == pytest.approx(0.5)
    grid = ForwardCosts([1, 4], [1, 2], [[0.1, 0.12], [0.2, 0.3]])  # 4 sequences: 4 or 8 tokens
    assert grid(1, 2) == pytest.approx(0.12) and grid(4, 4) == pytest.approx(0.2) and grid(4, 6) == pytest.approx(0.25)
    assert grid(2, 2) == pytest.approx((2 * 0.12 + 0.2) / 3)  # a third of the way from batch 1 to batch 4
    # beyond the largest batch: 8 tokens cost 0.24 at batch 1 (extended in tokens) and 0.3 at batch 4, so batch 8
    # adds 4/3 of that difference
    assert grid(8, 8) == pytest.approx(0.3 + (0.3 - 0.24) * 4 / 3)


def test_measured_forward_costs_cover_the_grid_and_never_fall_with_more_tokens(tiny_engine):
    target, _ = tiny_engine.models
    costs = measure_forward_costs(batched_engine(target, None), batches=(1, 3), per_sequence=(1, 4), trials=1)
    assert costs.batches == [1, 3] and costs.per_sequence == [1, 4]
    assert all(row[0] <= row[1] and row[0] > 0 for row in costs.seconds)
    assert all(s <= m for row, measured in zip(costs.seconds, costs.measured) for s, m in zip(row, measured))


def test_the_grid_is_measured_once_per_machine_model_and_format(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVOICE_CACHE", str(tmp_path))
    target, draft = tiny_engine.models
    engine = batched_engine(target, None)
    measured = []
    real = measure_forward_costs

    def counting(engine, trials=1):
        measured.append(engine.runner)
        return real(engine, batches=(1, 2), per_sequence=(1, 2), trials=trials)

    monkeypatch.setattr("specdec.cost_grid.measure_forward_costs", counting)
    first, cached = cached_forward_costs(engine)
    again, cached_again = cached_forward_costs(engine)
    assert (cached, cached_again) == (False, True) and again == first and len(measured) == 1
    padded = make_engine(target, None, min_feed=2)  # another way of feeding the same model: another grid
    assert cached_forward_costs(padded)[1] is False and len(measured) == 2
    for path in (tmp_path / "forward-costs").iterdir():
        path.write_text("{torn")  # a torn file is measured again, not a crash
    assert cached_forward_costs(engine)[1] is False and len(measured) == 3


def test_fbgemm_at_8_bits_is_timed_apart_from_7_bits(monkeypatch):
    """fbgemm's w8a8 at 8-bit activations costs a little more: a grid or width timed at 7 bits (the cache files made
    before 8 bits, whose key stays) is not its own."""
    linear = torch.nn.Linear(64, 32)
    monkeypatch.setattr(quant_layers, "cpu_has", lambda flag: False)
    seven = quant_layers.FbgemmW8A8Linear(linear)
    monkeypatch.setattr(quant_layers, "cpu_has", lambda flag: flag == "avx512_vnni")
    eight = quant_layers.FbgemmW8A8Linear(linear)
    assert quant_layers.kernel_format(seven) == "FbgemmW8A8Linear" and quant_layers.kernel_format(linear) == "Linear"
    assert quant_layers.kernel_format(eight) == "FbgemmW8A8Linear/8-bit"


def test_the_one_token_width_is_timed_once_per_machine_model_and_format(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVOICE_CACHE", str(tmp_path))
    target, _ = tiny_engine.models
    runner = BatchRunner(target.model, target.device)
    timed = []
    monkeypatch.setattr("specdec.cost_grid.fastest_min_feed", lambda runner: timed.append(runner) or 2)
    assert [cached_min_feed(runner, target.name) for _ in range(2)] == [2, 2] and len(timed) == 1
    assert cached_min_feed(runner, "another model") == 2 and len(timed) == 2
    for path in (tmp_path / "forward-costs").iterdir():
        path.write_text("{torn")  # timed again, not a crash
    assert cached_min_feed(runner, target.name) == 2 and len(timed) == 3


def test_choose_ks_drafts_while_the_forward_is_memory_bound_and_stops_past_the_ridge():
    ridge = by_rows([1, 8, 16], [0.1, 0.1, 0.2])  # flat to 8 tokens, then 12.5 ms a token
    good = LoadEstimate.geometric(0.8, draft_s=0.001)
    assert choose_ks([1], [4], [good], ridge) == [4]
    assert choose_ks([1, 1], [4, 4], [good, good], ridge) == [3, 3]  # 8 tokens: the top of the flat part
    assert choose_ks([1] * 16, [4] * 16, [good] * 16, ridge) == [0] * 16  # compute-bound: drafts only cost
    # a sequence whose drafts are rarely accepted gets none while one that drafts well does
    poor = LoadEstimate.geometric(0.05, draft_s=0.001)
    sloped = by_rows([1, 16], [0.1, 0.25])  # every token fed costs 10 ms
    poor_ks, good_ks = choose_ks([1, 1], [4, 4], [poor, good], sloped)
    assert poor_ks == 0 and good_ks >= 3
    # an expensive drafter (a draft model per sequence) drafts less than a cheap one
    costly = LoadEstimate.geometric(0.6, 0.05)
    assert sum(choose_ks([1], [6], [costly], ridge)) < sum(choose_ks([1], [6], [good], ridge))
    assert choose_ks([1, 1], [0, 4], [good, good], ridge)[0] == 0  # never above what the answer's policy wants


def test_a_gated_drafter_is_asked_only_for_the_drafts_it_proposes():
    """The shipped heads stop at their confidence gate: asked for 4, they propose one draft, accepted half the time.
    Measured per position, asking for more than one brings nothing but drafting time, so the choice stops at one."""
    gated = LoadEstimate.geometric(0.9, draft_s=0.002)
    for i in range(40):
        step = StepEvent(step=i, tokens=[1], from_draft=[], speculative=True, k_chosen=4, draft_tokens=[7])
        step.draft_seconds = 0.008
        step.accepted = i % 2
        gated.observe(step)
    assert gated.proposed[0] > 0.95 and gated.proposed[1] < 0.05 and 0.3 < gated.accepted[0] < 0.7
    assert gated.tokens(4) == pytest.approx(gated.tokens(1), abs=0.05)
    flat = by_rows([1, 16], [0.1, 0.1])  # drafts ride free on the forward: only the drafting time counts
    assert choose_ks([1], [4], [gated], flat) == [1]
    assert choose_ks([1], [4], [LoadEstimate.geometric(0.9, draft_s=0.002)], flat) == [4]


def test_a_tree_s_nodes_are_learned_by_rank_not_by_depth():
    """A tree of 3 siblings whose second-ranked node is accepted every other step: one node alone would bring
    nothing. Learned by depth (a chain's position), the first node would get the credit and the choice stop at one;
    by rank, the second node brings the tokens, so two are asked for (each row costs 5 % of a forward)."""
    tree = LoadEstimate.geometric(0.9, draft_s=0.0005)
    for i in range(40):
        step = StepEvent(step=i, tokens=[1] * (1 + i % 2), from_draft=[], speculative=True, k_chosen=3)
        step.draft_tokens, step.accepted, step.accepted_ranks = [7, 8, 9], i % 2, [1] * (i % 2)
        tree.observe(step)
    assert tree.accepted[0] < 0.05 and 0.3 < tree.accepted[1] < 0.7 and tree.accepted[2] < 0.05
    sloped = by_rows([1, 5], [0.1, 0.12])
    assert choose_ks([1], [3], [tree], sloped) == [2]


# This AMD EPYC's (no AMX) grid at one sequence, bench --batched: 1, 2, 3 rows in 87, 91, 98 ms.
NO_AMX = by_rows([1, 2, 3], [0.087, 0.0914, 0.0976])


def drafting_share(acceptance: float, steps: int = 400, seed: int = 0) -> float:
    """One answer's steps under choose_ks and its LoadEstimate, each verified draft accepted with this chance (a
    chain: the first rejection ends the step); the share of steps that drafted."""
    rng = random.Random(seed)
    estimate = LoadEstimate.geometric(0.5, draft_s=0.001).copy(decay=0.7, forget=FORGET)
    drafted = 0
    for i in range(steps):
        (k,) = choose_ks([1], [3], [estimate], NO_AMX)
        n = next((j for j in range(k) if rng.random() >= acceptance), k)
        step = StepEvent(step=i, tokens=[1] * (n + 1), from_draft=[], speculative=k > 0, k_chosen=k)
        step.draft_tokens, step.accepted, step.draft_seconds = [7] * k, n, 0.001 * k
        estimate.observe(step)
        drafted += k > 0
    return drafted / steps


def test_a_plain_step_measures_nothing_so_what_was_learned_ages_back_toward_the_prior():
    """Learned from the steps that verify it, a draft rejected a few times in a row got K = 0, and K = 0 was never
    measured again: on the AMD grid, drafts accepted 41 % of the time (worth +30 % a step) ran in 43 % of forwards
    (bench --batched). Aging what a plain step did not measure, the answer drafts again, and a drafter that is
    never right still drafts in few steps."""
    stuck = LoadEstimate.geometric(0.5, draft_s=0.001).copy(decay=0.7, forget=FORGET)
    for i in range(6):
        stuck.observe(StepEvent(step=i, tokens=[1], from_draft=[], speculative=True, k_chosen=1, draft_tokens=[7]))
    assert choose_ks([1], [3], [stuck], NO_AMX) == [0]
    plain = StepEvent(step=7, tokens=[1], from_draft=[])
    for _ in range(3):
        stuck.observe(plain)
    assert choose_ks([1], [3], [stuck], NO_AMX)[0] > 0
    assert drafting_share(0.41) > 0.9
    assert drafting_share(0.0) < 0.45
    never = LoadEstimate.geometric(0.5, draft_s=0.001)  # the scheduler's shared estimates do not age
    for _ in range(3):
        never.observe(plain)
    assert never.accepted == LoadEstimate.geometric(0.5).accepted


def test_choose_ks_picks_the_best_rate_found_by_search():
    costs = by_rows([1, 4, 8, 16, 32], [0.10, 0.11, 0.14, 0.22, 0.40])
    estimates = [LoadEstimate.geometric(a, 0.004) for a in (0.3, 0.6, 0.9)]
    fed, wanted = [1, 1, 1], [4, 4, 4]

    def rate(ks):
        tokens = sum(expected_tokens_per_step(e.accepted[0], k) for e, k in zip(estimates, ks))  # geometric: α^i
        return tokens / (costs(3, sum(fed) + sum(ks)) + sum(k * e.draft_s for e, k in zip(estimates, ks)))

    every = [(a, b, c) for a in range(5) for b in range(5) for c in range(5)]
    best = max(rate(list(ks)) for ks in every)
    assert rate(choose_ks(fed, wanted, estimates, costs)) >= 0.98 * best


def test_load_aware_scheduler_stays_lossless_and_reports_its_ks(tiny_engine):
    target, draft = tiny_engine.models
    # Forwards of 1 s (the costs are only read, never slept), so the drafting time the scheduler measures (a few ms
    # for the tiny draft; far more on a loaded machine, where with 0.01 s a CI run chose K = 0 alone) cannot decide
    # the choice; the costs' shape does.
    costs = by_rows([1, 4, 8], [1.0, 1.0, 5.0])
    scheduler = BatchScheduler(batched_engine(target, draft_factory(draft), "4"), costs)
    prompts = tiny_prompts(target, 4, seed=16)
    lengths = [10, 15, 20, 45]
    results = run_together(scheduler, prompts, [GenerationConfig(n) for n in lengths])
    assert [tokens for tokens, _ in results] == [target_only(target, p, n) for p, n in zip(prompts, lengths)]
    events = [ev for _, evs in results for ev in evs]
    assert all(ev.k_chosen <= 4 for ev in events)
    assert any(ev.k_chosen > 0 for ev in events if ev.batch_size == 1)
    assert any(ev.k_chosen == 0 for ev in events if ev.batch_size == 4)  # past the ridge: plain steps


def test_an_answer_may_opt_out_of_the_load_aware_k(tiny_engine):
    """Drafting never pays under these costs: the load-aware answer gets K = 0, the one that opted out its own K,
    and both stay lossless."""
    target, draft = tiny_engine.models
    steep = by_rows([1, 2], [0.01, 1.0])
    scheduler = BatchScheduler(batched_engine(target, draft_factory(draft), "3"), steep)
    prompts = tiny_prompts(target, 2, seed=19)
    configs = [GenerationConfig(20, load_aware=True), GenerationConfig(20, load_aware=False)]
    sessions = [EngineSession(scheduler.engine) for _ in prompts]
    for session, prompt in zip(sessions, prompts):  # no step carries a prefill, next to which drafts look cheap
        session.prefill(prompt[:-1])
    (aware, aware_events), (own, own_events) = run_together(scheduler, prompts, configs, sessions)
    assert all(ev.k_chosen == 0 for ev in aware_events)
    assert any(ev.k_chosen == 3 for ev in own_events)
    assert [aware, own] == [target_only(target, p, 20) for p in prompts]


def test_an_unexpected_failure_ends_the_answers_in_the_step_not_the_scheduler(tiny_engine):
    target, draft = tiny_engine.models

    class Broken(ForwardCosts):
        def __call__(self, batch, rows):
            raise RuntimeError("cost table corrupted")

    scheduler = BatchScheduler(batched_engine(target, draft_factory(draft)), Broken([1], [1], [[0.1]]))
    prompt = tiny_prompts(target, 1, seed=20)[0]
    with pytest.raises(RuntimeError, match="corrupted"):
        collect(scheduler.stream(prompt, GenerationConfig(5)))
    scheduler.costs = None
    assert collect(scheduler.stream(prompt, GenerationConfig(5)))[0] == target_only(target, prompt, 5)


def test_the_scheduler_loops_on_the_compute_thread_and_ends_when_idle(tiny_engine):
    """No thread of its own: the steps run on the compute thread, and the loop ends once no answer is left (bench-load
    makes a scheduler per window), then starts again for the next answer."""
    target, draft = tiny_engine.models
    engine = batched_engine(target, draft_factory(draft))
    scheduler = BatchScheduler(engine)
    threads = []
    step = engine._step
    engine._step = lambda *a: threads.append(threading.current_thread().name) or step(*a)
    prompt = tiny_prompts(target, 1, seed=21)[0]
    for _ in range(2):
        assert collect(scheduler.stream(prompt, GenerationConfig(5)))[0] == target_only(target, prompt, 5)
        compute.run(lambda: None)  # queued after the last step: served once the loop has returned
        assert not scheduler._looping
    assert threads and set(threads) == {"compute"}


def test_the_scheduler_serves_other_compute_jobs_between_its_steps(tiny_engine):
    """A prefill asked for while an answer runs waits one step, not the whole answer."""
    target, draft = tiny_engine.models
    engine = batched_engine(target, draft_factory(draft))
    scheduler = BatchScheduler(engine)
    steps: list[int] = []
    served: list[int] = []
    step = engine._step

    def counted(*a):
        steps.append(1)
        if len(steps) == 1:  # another thread asks for compute during the first step
            threading.Thread(target=lambda: compute.run(lambda: served.append(len(steps)))).start()
            for _ in range(200):
                if compute._jobs.qsize():
                    break
                threading.Event().wait(0.01)
        return step(*a)

    engine._step = counted
    prompt = tiny_prompts(target, 1, seed=22)[0]
    tokens, events = collect(scheduler.stream(prompt, GenerationConfig(6)))
    assert tokens == target_only(target, prompt, 6)
    assert len(events) > 1 and served == [1]  # right after the first step


class OpeningMisser:
    """Knows each prompt's greedy answer: proposes wrong tokens for its first OPENING_STEPS tokens, right ones after
    (the shipped heads' pattern, at its extreme)."""

    kind, reads_target_hidden, target_layers = "ngram", False, ()

    def __init__(self, answers: dict[tuple[int, ...], list[int]], device: torch.device) -> None:
        self.answers, self.device = answers, device

    def propose(self, context, k, params, generator):
        prompt = next(p for p in self.answers if tuple(context[: len(p)]) == p)
        done = len(context) - len(prompt)
        right = self.answers[prompt][done : done + k]
        wrong = [(t + 1) % 50 for t in right]  # never the target's token
        return Proposal.of(wrong if done < OPENING_STEPS else right, self.device)

    def prefill(self, ids):
        pass

    def start(self, prompt_len, question_start=0):
        pass

    def rollback(self, length):
        pass

    def observe(self, event, target):
        pass


def test_an_answers_opening_steps_learn_their_own_acceptance(tiny_engine):
    """A drafter that misses every answer's opening and hits the rest: after a few answers the opening steps are
    plain (their verification would cost the first chunk time for nothing) and the later ones draft, losslessly.
    With one estimate for every step, the later steps' acceptance would make the openings draft too."""
    target, _ = tiny_engine.models
    fbgemm_like = by_rows([1, 2, 4, 8], [0.100, 0.115, 0.145, 0.205])  # each row fed costs 15% of a step
    prompts = tiny_prompts(target, 3, seed=23)
    answers = {tuple(p): target_only(target, p, 24) for p in prompts}
    engine = batched_engine(target, lambda: OpeningMisser(answers, target.device), "3")
    scheduler = BatchScheduler(engine, fbgemm_like)
    openings, later = [], []
    for i in range(12):
        prompt = prompts[i % len(prompts)]
        tokens, events = collect(scheduler.stream(prompt, GenerationConfig(24)))
        assert tokens == answers[tuple(prompt)]
        if i >= 6:
            openings += events[1:OPENING_STEPS]
            later += events[OPENING_STEPS:]
    # The first step reads the prompt, next to which a few drafts cost little; the opening's one-token steps are
    # plain, but for what a plain step's aging of the estimate tries again now and then (LoadEstimate)
    assert sum(ev.k_chosen > 0 for ev in openings) <= len(openings) / 4
    assert any(ev.k_chosen > 0 and ev.accepted == ev.k_chosen for ev in later)


# ------------------------------------------------------------------------- drafts kept by the drafter's confidence


def test_best_keeps_a_chain_s_first_drafts_with_their_q():
    q = torch.softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(0)), -1)
    chain = Proposal(torch.tensor([3, 1, 4, 1]), torch.tensor(3), q, 4, confidence=torch.tensor([0.9, 0.5, 0.2, 0.1]))
    two = chain.best(2)
    assert two.tokens.tolist() == [3, 1] and int(two.proposed) == 2 and torch.equal(two.probs, q[:2])
    assert two.confidence.tolist() == pytest.approx([0.9, 0.5])
    assert int(chain.best(3).proposed) == 3 and chain.best(4) is chain
    assert chain.best(0).tokens.numel() == 0 and int(chain.best(0).proposed) == 0


def test_best_keeps_a_tree_s_surest_nodes_and_its_confidence_is_by_rank():
    logp = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1]]).log()

    def expand(frontier):
        d = 0 if int(frontier[0]) == ROOT else 1
        return torch.tensor([[10 * d + 1, 10 * d + 2, 10 * d + 3]]).expand(len(frontier), -1), logp[d].expand(
            len(frontier), -1
        )

    tree = build_tree(expand, 3, 2, 12)
    whole = Proposal.of_tree(tree, forwards=1)
    assert whole.confidence.tolist() == pytest.approx(sorted(tree.scores.exp().tolist(), reverse=True))
    three = whole.best(3)
    kept = keep_best(tree, 3)
    assert torch.equal(three.tree.tokens, kept.tokens) and torch.equal(three.tree.parents, kept.parents)
    assert three.confidence.tolist() == pytest.approx([0.7, 0.42, 0.21])  # 0.7, 0.7 × 0.6, 0.7 × 0.3 (not 0.2)
    nothing = whole.best(0)
    assert nothing.tree is None and nothing.tokens.numel() == 0
    with pytest.raises(ValueError, match="sampled draft tree"):
        Proposal.of_tree(replace(tree, q=torch.ones(len(tree), 5) / 5), forwards=1).best(2)


def kept_of(tiny_engine, confidence: list[float], calibration: Calibration | None = None, costs=NO_AMX) -> int:
    """What the load-aware scheduler verifies of one answer's chain with this confidence, at one sequence."""
    target, draft = tiny_engine.models
    scheduler = BatchScheduler(batched_engine(target, draft_factory(draft), "4"), costs)
    prompt = tiny_prompts(target, 1, seed=3)[0]
    session = EngineSession(scheduler.engine)
    session.prefill(prompt[:-1])  # a decoding step feeds one token, not the prompt, beside which drafts look free
    answer = scheduler.engine.new_answer(prompt, GenerationConfig(16), session)
    run = _Running(answer, LoadEstimate.geometric(0.5), calibration=calibration or Calibration())
    n = len(confidence)
    proposal = Proposal(torch.arange(n), torch.tensor(n), None, 1, confidence=torch.tensor(confidence))
    (k,) = scheduler._verified_ks([run], [proposal], [])
    assert run.confidence == pytest.approx(confidence)  # kept for the calibration after the step
    return k


def test_what_a_step_verifies_follows_how_sure_its_drafter_is(tiny_engine):
    """Without AMX (each row ~5 % of a forward): a sure chain is verified whole, an unsure one to its first draft,
    a hopeless one not at all; a drafter measured to be right a tenth as often as it says is trusted that much: its
    surest drafts are then not worth a row."""
    sure, unsure, hopeless = [0.95, 0.9, 0.85], [0.2, 0.05, 0.01], [0.02, 0.01, 0.005]
    assert [kept_of(tiny_engine, c) for c in (sure, unsure, hopeless)] == [3, 1, 0]
    steep = by_rows([1, 2, 4], [0.087, 0.0957, 0.113])  # a row 10 % of a forward
    assert kept_of(tiny_engine, sure, costs=steep) == 3
    assert kept_of(tiny_engine, sure, Calibration(accepted=0.1, expected=1.0), costs=steep) == 0


def test_the_calibration_learns_how_often_the_drafter_is_right():
    calibration = Calibration()
    assert calibration.ratio == pytest.approx(0.8)  # the shipped heads' (docs/results.md), before any step
    for _ in range(60):
        calibration.observe(expected=2.0, accepted=1)  # sure of 2 drafts a step, 1 accepted
    assert calibration.ratio == pytest.approx(0.5, abs=0.01)


def test_a_cut_sees_every_answer_of_the_step_in_order_a_cancelled_one_as_none(tiny_engine):
    target, draft = tiny_engine.models
    engine = batched_engine(target, draft_factory(draft), "3")
    cancel = threading.Event()
    first, second = tiny_prompts(target, 2, seed=5)
    answers = [
        engine.new_answer(first, GenerationConfig(16), cancel=cancel),
        engine.new_answer(second, GenerationConfig(16)),
    ]
    engine.step(answers)  # the prefills
    cancel.set()
    seen = []

    def cut(proposals):
        seen.append(proposals)
        return [None, 1]

    events = engine.step(answers, cut=cut)
    assert len(seen[0]) == 2 and seen[0][0] is None and seen[0][1] is not None
    assert events[0].finish_reason == "cancelled" and events[1].k_chosen == 1 and events[1].drafted <= 1
