"""Speculative sampling keeps the target's distribution, checked through the real engine.stream on the tiny fp32
pair against exact target probabilities: a χ² test on the joint distribution of the first two tokens, and a
probability-integral-transform test over whole answers. Each check is also run on a deliberately broken sampler
and must fail there ("teeth"); the seeds are fixed, so every outcome is reproducible."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from specdec import drafters as drafters_module
from specdec import engine as engine_module
from specdec import heads_drafter as heads_drafter_module
from specdec import sampling
from specdec.build import build_engine, k_policy_factory
from specdec.cost_grid import ForwardCosts
from specdec.drafters import DraftModelDrafter, NGramDrafter, Proposal
from specdec.engine import GenerationConfig, SpeculativeEngine, collect
from specdec.heads_file import load_heads, read_heads, save_heads
from specdec.models import build_tiny_random
from specdec.runner import BatchRunner
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.scheduler import BatchScheduler
from specdec.session import EngineSession
from tests.support.engine import heads_engine
from tests.support.stats import chi2_pvalue

pytestmark = pytest.mark.slow

N_PAIRS = 5000
N_ANSWERS = 1000
ANSWER_TOKENS = 8
P_FAIL = 1e-3  # a check fails below this p-value
PARAMS = SamplingParams(temperature=0.5, top_p=0.9)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models are too small to split across threads: a second one costs more in handoffs than it adds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tiny_engine):
    return tiny_engine.target


@pytest.fixture(scope="module")
def good_draft(tiny_engine):
    """A draft that agrees with the target most of the time, so whole proposals are accepted and bonus tokens come."""
    return tiny_engine.draft.model


@pytest.fixture(scope="module")
def poor_draft():
    """A draft far from the target, so rejections and the residual do real work."""
    return build_tiny_random(7, noise=0.3)


def prompt(target, text: str = "hi") -> list[int]:
    return target.tokenizer.chat_ids([{"role": "user", "content": text}])


def engine_for(target, factory, k: int) -> SpeculativeEngine:
    runner = BatchRunner(target.model, target.device)
    return SpeculativeEngine(target, runner, factory, k_policy_factory(str(k)), auto_off=False)


@torch.inference_mode()
def exact_pair_probs(target, ids: list[int], params: SamplingParams) -> dict[tuple, float]:
    """P(first two tokens) under the target alone; an EOS first token ends the answer: (eos, None)."""
    p1 = logits_to_probs(target.model(torch.tensor([ids])).logits[0, -1], params)
    firsts = p1.nonzero().flatten().tolist()
    eos = target.tokenizer.eos_token_ids
    p2 = logits_to_probs(target.model(torch.tensor([ids + [t] for t in firsts])).logits[:, -1], params)
    joint: dict[tuple, float] = {}
    for row, t1 in enumerate(firsts):
        if t1 in eos:
            joint[(t1, None)] = float(p1[t1])
            continue
        for t2 in p2[row].nonzero().flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[row, t2])
    return joint


def sample_pairs(engine: SpeculativeEngine, ids: list[int], n: int, session: EngineSession | None = None) -> Counter:
    """The first two tokens of n answers. Each answer may run to 4 tokens: a budget of 2 would cap K at 1."""
    pairs: Counter = Counter()
    for seed in range(n):
        tokens = collect(engine.stream(ids, GenerationConfig(4, PARAMS, seed=seed), session=session))[0]
        pairs[(tokens[0], tokens[1] if len(tokens) > 1 else None)] += 1
    return pairs


@torch.inference_mode()
def pit_pvalues(engine: SpeculativeEngine, target, ids: list[int], n: int, bonus_of_a_chain: bool = True) -> tuple:
    """Randomized PIT of emitted tokens under the target's exact conditionals, KS-tested against U(0, 1): for every
    token (i.i.d. uniform when answers follow the target, Rosenblatt), and for the bonus tokens alone (a step's
    last token after all its drafts were accepted: it is chosen as a bonus before it is drawn, so its PIT is
    uniform too). Returns (p all tokens, p bonus tokens); only the first for a tree's steps (bonus_of_a_chain off),
    whose bonus tokens this does not tell apart."""
    rng = np.random.default_rng(0)
    every, bonus = [], []
    for seed in range(n):
        tokens, events = collect(engine.stream(ids, GenerationConfig(ANSWER_TOKENS, PARAMS, seed=seed)))
        probs = logits_to_probs(target.model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1], PARAMS)
        below = torch.cumsum(probs, -1) - probs  # P(token id < x)
        pos = 0
        for ev in events:
            for j, tok in enumerate(ev.tokens):
                u = float(below[pos, tok]) + rng.random() * float(probs[pos, tok])
                every.append(u)
                if j == ev.drafted == ev.accepted > 0:
                    bonus.append(u)
                pos += 1
    if not bonus_of_a_chain:
        return (float(scipy_stats.kstest(every, "uniform").pvalue),)
    assert len(bonus) > n // 4  # enough bonus tokens to test
    return (float(scipy_stats.kstest(every, "uniform").pvalue), float(scipy_stats.kstest(bonus, "uniform").pvalue))


def draft_model_factory(model, target, **kw):
    runner = BatchRunner(model, target.device)
    return lambda: DraftModelDrafter(runner, **kw)


def gate_at_first_confidence(model, ids: list[int]) -> float:
    """A confidence gate that lets the first draft through and cuts some later ones."""
    with torch.inference_mode():
        return 0.999 * float(logits_to_probs(model(torch.tensor([ids])).logits[0, -1], PARAMS).max())


# The engine as shipped, with each kind of drafter: all must pass.


@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_keeps_the_target_joint(target, poor_draft, k):
    ids = prompt(target)
    engine = engine_for(target, draft_model_factory(poor_draft, target), k)
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) > P_FAIL


@pytest.mark.parametrize("gate_on_host", [False, True], ids=["device-gate", "host-gate"])
def test_confidence_gate_keeps_the_target_joint(target, poor_draft, gate_on_host):
    ids = prompt(target)
    gate = gate_at_first_confidence(poor_draft, ids)
    drafter = draft_model_factory(poor_draft, target, min_prob=gate, gate_on_host=gate_on_host)
    engine = engine_for(target, drafter, 3)
    drafted = {collect(engine.stream(ids, GenerationConfig(4, PARAMS, seed=s)))[1][0].drafted for s in range(60)}
    assert len(drafted) > 1, drafted  # the gate cuts some proposals short and lets others through
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) > P_FAIL


def test_ngram_drafter_keeps_the_target_joint(target):
    ids = prompt(target, "a b a b a b a b")
    engine = engine_for(target, NGramDrafter, 3)
    _, events = collect(engine.stream(ids, GenerationConfig(2, PARAMS)))
    assert events[0].drafted > 0  # the prompt repeats, so the lookup proposes
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) > P_FAIL


def test_int8_cut_vocabulary_draft_keeps_the_target_joint(target, tiny_engine):
    ids = prompt(target)
    engine, _ = build_engine(tiny_engine.spec_with(draft_quant="int8", draft_vocab=120, draft_min_prob=0.0))
    engine.auto_off = False
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) > P_FAIL


def test_reused_session_keeps_the_target_joint(target, poor_draft):
    ids = prompt(target)
    engine = engine_for(target, draft_model_factory(poor_draft, target), 3)
    session = EngineSession(engine)
    session.prefill(ids[:-3])  # the cached prefix every answer then shares
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS, session), exact_pair_probs(target, ids, PARAMS)) > P_FAIL


# The load-aware scheduler verifies the drafts its drafter is sure enough of (Proposal.best): rows free here, so a
# draft is kept while its calibrated confidence earns its share (scheduler.MIN_GAIN).
FREE_ROWS = ForwardCosts([1], [1, 64], [[1.0, 1.0]])


def test_drafts_cut_by_their_confidence_keep_the_target_joint(target, poor_draft):
    ids = prompt(target)
    scheduler = BatchScheduler(engine_for(target, draft_model_factory(poor_draft, target), 3), FREE_ROWS)
    events = [ev for s in range(60) for ev in collect(scheduler.stream(ids, GenerationConfig(4, PARAMS, seed=s)))[1]]
    assert {1, 3} < {ev.k_chosen for ev in events if ev.speculative}  # proposals kept whole and cut short
    assert chi2_pvalue(sample_pairs(scheduler, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) > P_FAIL


def test_whole_answers_and_bonus_tokens_follow_the_target(target, good_draft):
    engine = engine_for(target, draft_model_factory(good_draft, target), 3)
    assert min(pit_pvalues(engine, target, prompt(target), N_ANSWERS)) > P_FAIL


def test_draft_heads_keep_the_target_joint(target, tiny_engine, tiny_heads):
    """The heads draft from the second token on (the first comes from the prefill), so the pair's second token is
    where their q is tested."""
    ids = prompt(target)
    engine = heads_engine(tiny_engine, tiny_heads)
    events = [collect(engine.stream(ids, GenerationConfig(4, PARAMS, seed=s)))[1] for s in range(200)]
    assert sum(e[1].drafted for e in events if len(e) > 1) > 0
    assert sum(e[1].accepted for e in events if len(e) > 1) > 0
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) > P_FAIL


def test_whole_answers_with_draft_heads_follow_the_target(target, tiny_engine, tiny_heads):
    engine = heads_engine(tiny_engine, tiny_heads, k=1)
    assert min(pit_pvalues(engine, target, prompt(target), N_ANSWERS)) > P_FAIL


@pytest.mark.parametrize("tiny_heads", ["medusa"], indirect=True)  # eagle drafts a chain
def test_a_medusa_tree_keeps_the_target_joint(target, tiny_engine, tiny_heads):
    """A tree's candidates are the heads' top tokens, verified one-hot by multi_candidate_verdict."""
    ids = prompt(target)
    engine = heads_engine(tiny_engine, tiny_heads, k=3, tree=3)
    events = [collect(engine.stream(ids, GenerationConfig(4, PARAMS, seed=s)))[1] for s in range(200)]
    assert sum(e[1].accepted for e in events if len(e) > 1) > 0
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) > P_FAIL


@pytest.mark.parametrize("tiny_heads", ["medusa", "medusa-draft"], indirect=True)  # eagle drafts a chain
def test_whole_answers_with_a_medusa_tree_follow_the_target(target, tiny_engine, tiny_heads):
    engine = heads_engine(tiny_engine, tiny_heads, k=3, tree=3)
    assert min(pit_pvalues(engine, target, prompt(target), N_ANSWERS, bonus_of_a_chain=False)) > P_FAIL


def leaning_on_the_draft_before(tiny_heads, folder: Path) -> tuple[Path, list]:
    """The tiny reads_draft heads with their view of the draft before scaled up: each block's q then depends on that
    draft strongly, so a q conditioned on the wrong draft (or none) shows."""
    path, val = tiny_heads
    heads, _ = read_heads(path)
    assert heads.draft_in is not None
    with torch.no_grad():
        for linear in heads.draft_in:
            linear.weight.mul_(DRAFT_IN_SCALE)
    save_heads(heads, folder / "leaning.safetensors")
    return folder / "leaning.safetensors", val


DRAFT_IN_SCALE = 30.0


@pytest.mark.parametrize("tiny_heads", ["medusa-draft"], indirect=True)
def test_whole_answers_with_a_reads_draft_chain_follow_the_target(target, tiny_engine, tiny_heads, tmp_path):
    """Block i ≥ 1 samples after the draft sampled before it, so its q is the one conditioned on that draft, as
    min(1, p / q) at draft i needs (the tree of such heads is verified one-hot: test_tree_engine)."""
    engine = heads_engine(tiny_engine, leaning_on_the_draft_before(tiny_heads, tmp_path), k=3)
    events = [collect(engine.stream(prompt(target), GenerationConfig(8, PARAMS, seed=s)))[1] for s in range(100)]
    assert sum(ev.accepted >= 2 for evs in events for ev in evs) > 0  # a draft after a draft was accepted
    # every token's PIT only: the tiny heads rarely have all three drafts accepted, too few bonus tokens to test
    assert pit_pvalues(engine, target, prompt(target), N_ANSWERS, bonus_of_a_chain=False)[0] > P_FAIL


@pytest.mark.parametrize("tiny_heads", ["medusa-draft"], indirect=True)
@pytest.mark.parametrize("broken", [False, True], ids=["as-drawn", "teeth-q-of-no-draft-before"])
def test_a_reads_draft_chain_records_the_q_each_draft_was_drawn_from(
    tiny_engine, tiny_heads, tmp_path, monkeypatch, broken
):
    """Draft 2 is drawn after draft 1: over many proposals whose first draft is the same token, the second drafts
    follow the q recorded for them (χ²). The tiny heads' first drafts are rarely accepted, so the engine's checks
    above barely reach draft 2; this one reads it directly. Broken: q recorded as if block 2 read no draft before."""
    if broken:
        chain = chain_with_q_of_no_draft_before(heads_drafter_module.HeadsDrafter._medusa_chain)
        monkeypatch.setattr(heads_drafter_module.HeadsDrafter, "_medusa_chain", chain)
    path, val = leaning_on_the_draft_before(tiny_heads, tmp_path)
    target = tiny_engine.cpu_target
    drafter = heads_drafter_module.HeadsDrafter(load_heads(path, target.model, target.name))
    s = val[0]
    drafter.add_features(s.tokens[:-1], 0, s.features)
    context = s.tokens[: s.answer_start + 1]
    generator = torch.Generator().manual_seed(0)
    draws = [drafter.propose(context, 2, PARAMS, generator) for _ in range(N_PAIRS)]
    first = Counter(int(d.tokens[0]) for d in draws).most_common(1)[0][0]
    after = [d for d in draws if int(d.tokens[0]) == first]
    assert len(after) > 500 and all(d.probs is not None for d in after)
    q = after[0].probs[1]
    assert all(torch.equal(d.probs[1], q) for d in after)  # a function of the first draft alone
    exact = {(t,): float(p) for t, p in enumerate(q.tolist()) if p > 0}
    pvalue = chi2_pvalue(Counter((int(d.tokens[1]),) for d in after), exact)
    assert (pvalue < P_FAIL) == broken


def target_greedy_lookup(target):
    """A lookup (drafters.ngram_lookup's signature) that proposes the target's own two likeliest next tokens, one
    after the other: a deterministic chain, often accepted, often a twin of the heads' first candidates."""

    @torch.inference_mode()
    def lookup(context: list[int], k: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
        chain: list[int] = []
        for _ in range(min(k, 2)):
            chain.append(int(target.model(torch.tensor([context + chain])).logits[0, -1].argmax()))
        return chain

    return lookup


@pytest.mark.parametrize("tiny_heads", ["medusa"], indirect=True)  # eagle drafts a chain
def test_a_medusa_tree_with_a_grafted_lookup_keeps_the_target_joint(target, tiny_engine, tiny_heads, monkeypatch):
    """The lookup's chain grafted onto the tree (tree.graft): one-hot candidates too, twins included."""
    monkeypatch.setattr(heads_drafter_module, "ngram_lookup", target_greedy_lookup(target))
    ids = prompt(target)
    engine = heads_engine(tiny_engine, tiny_heads, k=3, tree=3, lookup=2)
    events = [collect(engine.stream(ids, GenerationConfig(4, PARAMS, seed=s)))[1] for s in range(200)]
    assert sum(e[1].accepted == 2 for e in events if len(e) > 1) > 20  # the chain was accepted whole
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) > P_FAIL


# Teeth: the same checks on deliberately broken samplers must fail.


def test_joint_check_catches_heads_that_record_the_wrong_q(target, tiny_engine, tiny_heads, monkeypatch):
    """Heads that sample their draft from the untempered q but record the tempered one."""
    monkeypatch.setattr(drafters_module, "sample", sample_untempered)  # heads and draft models draw through it
    ids = prompt(target)
    engine = heads_engine(tiny_engine, tiny_heads, k=1)
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) < P_FAIL


def residual_is_p(p, q):
    return p


def bonus_from_previous_row(real):
    def broken(drafts, proposed, p, q, generator=None):
        if len(p) > 1:  # row K replaced by row K − 1 (a plain step has only row 0)
            p = torch.cat([p[:-1], p[-2:-1]])
        return real(drafts, proposed, p, q, generator)

    return broken


def sample_untempered(probs, generator=None):
    """Draws the draft token from the untempered, unfiltered q while the tempered q is what gets recorded."""
    untempered = probs.clamp_min(1e-30) ** PARAMS.temperature
    return sampling.sample(untempered / untempered.sum(), generator)


@pytest.mark.parametrize("broken", ["residual_is_p", "q_recorded_without_temperature", "bonus_from_row_k_minus_1"])
def test_joint_check_catches_a_broken_sampler(target, poor_draft, monkeypatch, broken):
    if broken == "residual_is_p":
        monkeypatch.setattr(sampling, "residual_distribution", residual_is_p)
    elif broken == "q_recorded_without_temperature":
        monkeypatch.setattr(drafters_module, "sample", sample_untempered)
    else:
        monkeypatch.setattr(engine_module, "sampled_verdict", bonus_from_previous_row(sampling.sampled_verdict))
    ids = prompt(target)
    engine = engine_for(target, draft_model_factory(poor_draft, target), 1)
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) < P_FAIL


def test_joint_check_catches_a_host_gate_that_keeps_the_wrong_q_rows(target, poor_draft, monkeypatch):
    """A proposal the host gate cut short (a forward more than its drafts) with q's rows out of order."""
    gated = drafters_module.Proposal.gated

    def misaligned(drafts, tops, probs, min_prob, forwards):
        proposal = gated(drafts, tops, probs, min_prob, forwards)
        if probs and forwards > len(drafts):
            proposal.probs = torch.cat(probs).flip(0)
        return proposal

    monkeypatch.setattr(drafters_module.Proposal, "gated", staticmethod(misaligned))
    ids = prompt(target)
    gate = gate_at_first_confidence(poor_draft, ids)
    engine = engine_for(target, draft_model_factory(poor_draft, target, min_prob=gate, gate_on_host=True), 3)
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) < P_FAIL


def test_joint_check_catches_a_cut_that_keeps_the_wrong_q_rows(target, poor_draft, monkeypatch):
    """A proposal cut by its confidence keeping q's last rows instead of its first."""
    best = Proposal.best

    def misaligned(self, n):
        kept = best(self, n)
        if kept is not self and self.probs is not None and n:
            kept.probs = self.probs[len(self.tokens) - n :]
        return kept

    monkeypatch.setattr(Proposal, "best", misaligned)
    ids = prompt(target)
    scheduler = BatchScheduler(engine_for(target, draft_model_factory(poor_draft, target), 3), FREE_ROWS)
    assert chi2_pvalue(sample_pairs(scheduler, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) < P_FAIL


@pytest.mark.parametrize("tiny_heads", ["medusa"], indirect=True)  # eagle drafts a chain
@pytest.mark.parametrize("lookup", [False, True])
def test_joint_check_catches_a_tree_verdict_that_forgets_its_rejected_candidates(
    target, tiny_engine, tiny_heads, monkeypatch, lookup
):
    monkeypatch.setattr(sampling, "residual_distribution", residual_is_p)
    if lookup:  # a grafted twin is then tried again with the whole p: it must show
        monkeypatch.setattr(heads_drafter_module, "ngram_lookup", target_greedy_lookup(target))
    ids = prompt(target)
    engine = heads_engine(tiny_engine, tiny_heads, k=3, tree=3, lookup=2 if lookup else 0)
    assert chi2_pvalue(sample_pairs(engine, ids, N_PAIRS), exact_pair_probs(target, ids, PARAMS)) < P_FAIL


def chain_with_q_of_no_draft_before(real):
    """reads_draft's chain that samples block i after the draft before it but records q as block i read no draft."""

    def broken(self, f, k, params, generator):
        proposal = real(self, f, k, params, generator)
        heads = self.heads
        unconditioned = torch.stack([heads.lm(block(f)) for block in list(heads.medusa)[: len(proposal.tokens)]])
        full = drafters_module.full_vocab_logits(unconditioned, heads.vocab_ids, heads.cfg.vocab_size)
        return replace(proposal, probs=logits_to_probs(full, params))

    return broken


def test_pit_check_catches_a_bonus_from_the_wrong_row(target, good_draft, monkeypatch):
    monkeypatch.setattr(engine_module, "sampled_verdict", bonus_from_previous_row(sampling.sampled_verdict))
    engine = engine_for(target, draft_model_factory(good_draft, target), 3)
    assert pit_pvalues(engine, target, prompt(target), N_ANSWERS)[1] < P_FAIL
