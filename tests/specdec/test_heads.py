"""Draft heads on the tiny target: data, training (resumable), the file format, the drafter, and the engine with
heads staying lossless (greedy output identical to target-only; sampling is covered in test_distribution.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from commands import cli
from specdec import heads_data
from specdec.build import build_engine
from specdec.corpus import read_rows, write_rows
from specdec.engine import GenerationConfig, collect
from specdec.heads_data import Sequence, corpus_dataset, load_shards, read_sequences, shard_path, teacher_forced
from specdec.heads_drafter import HeadsDrafter
from specdec.heads_file import load_heads, read_heads, save_heads
from specdec.heads_loss import (
    eagle_losses,
    eagle_predictions,
    local_labels,
    make_batch,
    medusa_logits,
    medusa_losses,
    noised,
)
from specdec.heads_model import DraftHeads
from specdec.heads_train import TrainConfig, eagle3_layers, heads_config, simulated_acceptance, train_heads
from specdec.runner import BatchRunner
from specdec.sampling import SamplingParams
from specdec.session import EngineSession
from specdec.tokenizer import common_prefix_length
from tests.support.engine import TINY_FUSE, WORDS, eagle_path_alone, heads_engine, tiny_prompts


def test_the_data_holds_each_position_s_feature(tiny_engine, tiny_data):
    """A shard's features are the LM head's inputs: the head turns feature j into the logits for token j + 1."""
    target = tiny_engine.target
    seqs = load_shards(tiny_data)
    assert len(seqs) == 48 and shard_path(tiny_data, 2).exists()
    s = seqs[0]
    assert s.features.shape == (len(s.tokens) - 1, target.model.config.hidden_size)
    with torch.inference_mode():
        logits = target.model(torch.tensor([s.tokens], device=target.device)).logits[0, :-1]
        from_features = target.model.get_output_embeddings()(s.features.to(target.device).float())
    answer = slice(s.answer_start - 1, None)
    # Stored in bf16: the logits agree to bf16's precision (a near tie may flip), and they are the greedy answer's.
    assert torch.allclose(from_features, logits, atol=0.05, rtol=0.02)
    chosen = from_features[answer].argmax(-1)
    assert (chosen == torch.tensor(s.tokens[s.answer_start :], device=target.device)).float().mean() > 0.9


def test_keep_hidden_leaves_the_logits_bit_for_bit(tiny_engine):
    target = tiny_engine.target
    ids = tiny_prompts(target, 1)[0]
    runner = BatchRunner(target.model, target.device)
    plain, split = runner.new_cache(), runner.new_cache()
    split.keep_hidden = True
    for n in (len(ids) - 3, len(ids)):  # a prefill, then a step of three tokens with logits for all three
        assert torch.equal(plain.extend(ids[:n], n_logits=3), split.extend(ids[:n], n_logits=3))
    assert split.hidden_start == len(ids) - 3 and split.hidden is not None and len(split.hidden) == 3


def test_kept_layers_are_transformers_hidden_states(tiny_engine):
    """A cache that keeps layers gets, for the positions each forward fed, transformers' hidden_states at those
    indices side by side (the embeddings, after layer 1, the final norm's output); its logits stay bit for bit."""
    target = tiny_engine.target
    ids = tiny_prompts(target, 1)[0]
    runner = BatchRunner(target.model, target.device)
    plain, kept = runner.new_cache(), runner.new_cache()
    kept.keep_hidden, kept.keep_layers = True, TINY_FUSE
    for n in (len(ids) - 3, len(ids)):  # a prefill, then a step of three tokens
        assert torch.equal(plain.extend(ids[:n], n_logits=3), kept.extend(ids[:n], n_logits=3))
    with torch.inference_mode():
        states = target.model(torch.tensor([ids], device=target.device), output_hidden_states=True).hidden_states
    assert kept.hidden_start == len(ids) - 3
    torch.testing.assert_close(kept.hidden, torch.cat([states[i][0, -3:] for i in TINY_FUSE], -1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "tiny_heads", ["eagle", "medusa", "eagle3", "medusa-token", "medusa-draft", "medusa-deep"], indirect=True
)
def test_greedy_output_with_heads_is_target_only(tiny_engine, tiny_heads):
    engine = heads_engine(tiny_engine, tiny_heads)
    target = engine.target
    accepted = 0
    for ids in tiny_prompts(target, 6, seed=1):
        plain, _ = collect(engine.stream(ids, GenerationConfig(32, speculate=False)))
        spec, events = collect(engine.stream(ids, GenerationConfig(32)))
        assert spec == plain
        assert events[0].drafted == 0  # the first token comes from the prefill: no features before it
        accepted += sum(e.accepted for e in events)
    assert accepted > 0  # drafts were accepted, so the accept path ran


@pytest.mark.parametrize("tiny_heads", ["eagle", "medusa", "eagle3"], indirect=True)
def test_a_session_keeps_features_across_answers(tiny_engine, tiny_heads):
    """A conversation's second answer prefills only what is new; the heads still draft from the cached part."""
    engine = heads_engine(tiny_engine, tiny_heads)
    target = engine.target
    session = EngineSession(engine)
    first = tiny_prompts(target, 1, seed=2)[0]
    answer, _ = collect(engine.stream(first, GenerationConfig(16), session=session))
    second = first + answer + target.tokenizer.encode(" and then")
    plain, _ = collect(engine.stream(second, GenerationConfig(16, speculate=False)))
    spec, events = collect(engine.stream(second, GenerationConfig(16), session=session))
    assert spec == plain
    assert sum(e.drafted for e in events) > 0


@pytest.mark.parametrize("tiny_heads", ["medusa", "medusa-token"], indirect=True)
def test_medusa_drafts_what_it_was_trained_to(tiny_engine, tiny_heads):
    """Drafting at context length L + 1 reads what training scores at feature L − 1: with reads_token, the token
    the target just emitted; and that token changes the drafts."""
    path, val = tiny_heads
    target = tiny_engine.cpu_target
    heads = load_heads(path, target.model, target.name)
    s = val[0]
    trained = [logits[0].argmax(-1) for logits in medusa_logits(heads, make_batch([s]))]
    drafter = HeadsDrafter(heads)
    drafter.add_features(s.tokens[:-1], 0, s.features)
    greedy = SamplingParams()
    for last in range(s.answer_start, len(s.tokens)):
        drafts = drafter.propose(s.tokens[: last + 1], 4, greedy, None).tokens
        assert drafts.tolist() == [int(heads.vocab_ids[t[last - 1]]) for t in trained]
    context = s.tokens[: s.answer_start + 1]
    first = drafter.propose(context, 4, greedy, None).tokens.tolist()
    swapped = [context[:-1] + [int(t)] for t in heads.vocab_ids[:16]]
    changed = [drafter.propose(c, 4, greedy, None).tokens.tolist() != first for c in swapped]
    assert any(changed) == heads.cfg.reads_token


@pytest.mark.parametrize("tiny_heads", ["medusa-token", "medusa-draft", "medusa-deep"], indirect=True)
def test_a_block_reads_the_draft_before_its_own_as_training_does(tiny_engine, tiny_heads):
    """reads_draft: block k ≥ 1 drafts after block k − 1's draft, which training teacher-forces as token j + 1 + k:
    the chain drafted at context length L + 1 is what training scores at feature L − 1 on a sequence that goes on
    with those drafts; and another token there changes block 1's logits (reads_token alone: it does not)."""
    path, val = tiny_heads
    target = tiny_engine.cpu_target
    heads = load_heads(path, target.model, target.name)
    s = val[0]
    drafter = HeadsDrafter(heads)
    drafter.add_features(s.tokens[:-1], 0, s.features)
    changed = []
    for last in range(s.answer_start, len(s.tokens)):
        drafts = drafter.propose(s.tokens[: last + 1], 4, SamplingParams(), None).tokens.tolist()
        assert len(drafts) == 4
        logits = [], []
        for i, first in enumerate((drafts[0], drafts[0] + 1)):
            tokens = s.tokens[: last + 1] + [first] + drafts[1:]
            features = F.pad(s.features[:last], (0, 0, 0, len(tokens) - 1 - last))
            batch = make_batch([Sequence(tokens, s.answer_start, features, [0] * (len(tokens) - 1))])
            logits[i].extend(block[0, last - 1] for block in medusa_logits(heads, batch))
        assert [int(heads.vocab_ids[block.argmax()]) for block in logits[0]] == drafts
        changed.append(not torch.equal(logits[0][1], logits[1][1]))
    assert any(changed) == heads.cfg.reads_draft and all(changed) == heads.cfg.reads_draft


@pytest.mark.parametrize("tiny_heads", ["eagle", "eagle3"], indirect=True)  # medusa keeps no cache
def test_eagle_drafts_the_same_with_or_without_its_cache(tiny_engine, tiny_heads):
    path, val = tiny_heads
    target = tiny_engine.target
    heads = read_heads(path)[0].to(target.device)  # as the engine holds them (specdec/build.py)
    heads.attach(target.model.get_input_embeddings(), target.model.get_output_embeddings().weight)
    s = val[0]
    incremental = HeadsDrafter(heads)
    greedy = SamplingParams()
    for pos in range(s.answer_start + 1, len(s.tokens)):
        held = len(incremental.tokens)
        incremental.add_features(s.tokens[: pos - 1], held, s.features[held : pos - 1])
        fresh = HeadsDrafter(heads)
        fresh.add_features(s.tokens[: pos - 1], 0, s.features[: pos - 1])
        ctx = s.tokens[:pos]
        assert torch.equal(incremental.propose(ctx, 3, greedy, None).tokens, fresh.propose(ctx, 3, greedy, None).tokens)


@pytest.mark.parametrize("tiny_heads", ["eagle3"], indirect=True)
def test_a_session_keeps_the_layers_its_heads_read(tiny_engine, tiny_heads):
    """Also through the opening echo, which wraps the heads; none while another drafter drafts."""
    path, _ = tiny_heads
    engine, _ = build_engine(tiny_engine.spec_with(draft="heads", heads=str(path), opening_echo=True))
    session = EngineSession(engine)
    assert session.target.keep_hidden and session.target.keep_layers == TINY_FUSE
    session.use_drafter("ngram")
    assert not session.target.keep_hidden and session.target.keep_layers == ()
    session.use_drafter("heads")
    assert session.target.keep_layers == TINY_FUSE


def test_a_fresh_eagle_layer_passes_its_feature_through(tiny_engine):
    """Before training, the layer's prediction is its input feature (RMS-normed): it starts where medusa's blocks do,
    from the target's own head, not from a random map."""
    target = tiny_engine.cpu_target
    torch.manual_seed(0)
    heads = DraftHeads(heads_config("eagle", target.model.config, target.name), torch.arange(96))
    layer = heads.eagle
    assert layer is not None
    hidden = target.model.config.hidden_size
    emb, feat = torch.randn(1, 5, hidden), torch.randn(1, 5, hidden) * 3
    with torch.no_grad():
        torch.testing.assert_close(layer(emb, feat, torch.arange(1, 6)), layer.out_norm(feat))


@pytest.mark.parametrize("fuse", [(), TINY_FUSE])
def test_training_time_test_attends_as_drafting_does(tiny_engine, tiny_corpus, fuse):
    """Step d of the training-time test at slot L + d − 1 predicts the feature drafting computes there (given the
    true tokens): the eagle layer on its cache over the true slots up to L, then one slot per draft position."""
    target = tiny_engine.cpu_target
    torch.manual_seed(0)
    heads = DraftHeads(heads_config("eagle", target.model.config, target.name, fuse), torch.arange(96))
    heads.attach(target.model.get_input_embeddings(), target.model.get_output_embeddings().weight)
    layer = heads.eagle
    assert layer is not None
    for linear in (layer.o, layer.down):  # as trained: a fresh layer's attention and MLP add nothing, masked or not
        torch.nn.init.normal_(linear.weight, std=0.05)
    seqs = [
        s for (s,) in teacher_forced(target, read_rows(tiny_corpus / "answers" / "answers_0000.jsonl.gz")[:3], (fuse,))
    ]
    with torch.no_grad():
        preds = eagle_predictions(heads, make_batch(seqs), steps=3)
        for b, s in enumerate(seqs):
            for last in (s.answer_start, len(s.tokens) - 3):
                alone = eagle_path_alone(heads, s, last, s.tokens[last + 1 : last + 3])  # the true tokens
                assert len(alone) == 3
                for d, pred in enumerate(alone, start=1):
                    torch.testing.assert_close(preds[d - 1][b, last + d - 2], pred, rtol=1e-4, atol=1e-4)


def test_prompts_that_begin_alike_feed_their_shared_head_once(tiny_engine, tiny_corpus, monkeypatch):
    """Prompts that begin with the same system turn: the first prompt is fed whole once, each row then feeds only
    what follows the head it shares with that prompt, and the features are still a direct forward's."""
    fed: list[int] = []

    class CountingRunner(BatchRunner):
        def extend(self, feeds):
            fed.append(sum(f.length - min(f.cache.common_prefix(f.tokens), f.length - f.n_logits) for f in feeds))
            return super().extend(feeds)

    monkeypatch.setattr(heads_data, "BatchRunner", CountingRunner)
    target = tiny_engine.cpu_target
    system = target.tokenizer.encode("<system>Answer in one short sentence.\n")
    rows = [
        {**row, "prompt_ids": system + row["prompt_ids"]}
        for row in read_rows(tiny_corpus / "answers" / "answers_0000.jsonl.gz")
    ]
    first = rows[0]["prompt_ids"]
    shared = [common_prefix_length(first, row["prompt_ids"]) for row in rows]
    assert min(shared) > len(system)
    seqs = list(teacher_forced(target, rows, ((),), batch_tokens=100))
    whole = sum(len(row["prompt_ids"]) + len(row["answer_ids"]) - 1 for row in rows)
    assert sum(fed) == len(first) + whole - sum(shared)
    assert [s.tokens for (s,) in seqs] == [row["prompt_ids"] + row["answer_ids"] for row in rows]
    for (s,) in seqs:
        with torch.inference_mode():
            direct = target.model(torch.tensor([s.tokens[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(s.features, direct.to(torch.bfloat16))


def test_corpus_features_are_a_direct_forward_s(tiny_engine, tiny_corpus):
    """Teacher-forced over corpus rows, a few to a forward: the features are transformers' hidden_states at the fused
    layers (in bf16); a greedy answer's labels are its tokens, a sampled one's the target's greedy choices."""
    target = tiny_engine.cpu_target
    rows = read_rows(tiny_corpus / "answers" / "answers_0000.jsonl.gz")
    both = list(teacher_forced(target, rows, (TINY_FUSE, ()), batch_tokens=100))
    seqs = [fused for fused, _ in both]
    assert len(seqs) == len(rows) and {s.is_answer for s in seqs} == {True, False}
    for row, s, (_, plain) in zip(rows, seqs, both):
        assert s.tokens == row["prompt_ids"] + row["answer_ids"] and s.answer_start == len(row["prompt_ids"])
        with torch.inference_mode():
            out = target.model(torch.tensor([s.tokens[:-1]]), output_hidden_states=True)
        direct = torch.cat([out.hidden_states[i][0] for i in TINY_FUSE], -1)
        torch.testing.assert_close(s.features, direct.to(torch.bfloat16))
        # the same prefill's final norm output (the LM head's input), for the other kind of heads
        torch.testing.assert_close(plain.features, out.hidden_states[-1][0].to(torch.bfloat16))
        assert (plain.tokens, plain.answer_start, plain.labels, plain.is_answer) == (
            s.tokens,
            s.answer_start,
            s.labels,
            s.is_answer,
        )
        assert s.is_answer == (row["temperature"] == 0)
        if s.is_answer:
            assert s.labels == s.tokens[1:]
        else:
            assert s.labels == s.tokens[1 : s.answer_start] + out.logits[0, s.answer_start - 1 :].argmax(-1).tolist()
    assert any(s.labels[s.answer_start - 1 :] != s.tokens[s.answer_start :] for s in seqs if not s.is_answer)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's list of mapped files")
def test_features_are_read_mapped_from_their_shards_not_copied_into_memory(tiny_engine, tiny_corpus, tmp_path):
    shards = sorted((tiny_corpus / "answers").glob("answers_*.jsonl.gz"))
    paths = corpus_dataset(tiny_engine.cpu_target, "none", shards, tmp_path, TINY_FUSE)
    seqs = read_sequences(paths)
    mapped = Path("/proc/self/maps").read_text()
    assert seqs and all(str(p.resolve()) in mapped for p in paths)


def test_corpus_features_are_cached_per_shard_and_recipe(tiny_engine, tiny_corpus, tmp_path):
    target = tiny_engine.cpu_target
    shards = sorted((tiny_corpus / "answers").glob("answers_*.jsonl.gz"))
    paths = corpus_dataset(target, "none", shards, tmp_path, TINY_FUSE)
    assert len(paths) == 2 and len(read_sequences(paths)) == 48
    first = paths[0].stat().st_mtime_ns
    paths[1].unlink()  # stopped after the first shard: the run resumes with the second
    assert corpus_dataset(target, "none", shards, tmp_path, TINY_FUSE) == paths
    assert paths[0].stat().st_mtime_ns == first and paths[1].exists()
    plain = corpus_dataset(target, "none", shards, tmp_path, ())
    assert plain[0].parent != paths[0].parent
    assert read_sequences(plain[:1])[0].features.shape[1] == target.model.config.hidden_size
    remade = tmp_path / "remade" / "answers_0000.jsonl.gz"  # a remade answer shard is read anew
    write_rows(remade, read_rows(shards[0])[:5])
    again = corpus_dataset(target, "none", [remade], tmp_path, TINY_FUSE)
    assert again[0] != paths[0] and len(read_sequences(again)) == 5


def test_one_prefill_caches_the_features_of_both_kinds(tiny_engine, tiny_corpus, tmp_path):
    """also: the fused run caches the final norm's features too, which a medusa run then reads instead of making
    them; a shard missing from one recipe only is made again for that recipe only."""
    target = tiny_engine.cpu_target
    shards = sorted((tiny_corpus / "answers").glob("answers_*.jsonl.gz"))
    fused = corpus_dataset(target, "none", shards, tmp_path / "both", TINY_FUSE, also=((), TINY_FUSE))
    made = {p: p.stat().st_mtime_ns for p in (tmp_path / "both" / "corpus").rglob("*.pt")}
    assert len(made) == 4
    plain = corpus_dataset(target, "none", shards, tmp_path / "both", ())
    assert plain[0].parent != fused[0].parent and {p: made[p] for p in plain} == {
        p: p.stat().st_mtime_ns for p in plain
    }
    alone = corpus_dataset(target, "none", shards, tmp_path / "alone", ())
    for a, b in zip(read_sequences(plain), read_sequences(alone), strict=True):
        torch.testing.assert_close(a.features, b.features)
        assert (a.tokens, a.labels, a.is_answer) == (b.tokens, b.labels, b.is_answer)
    plain[1].unlink()
    assert corpus_dataset(target, "none", shards, tmp_path / "both", TINY_FUSE, also=((),)) == fused
    assert plain[1].exists() and all(p.stat().st_mtime_ns == made[p] for p in (*fused, plain[0]))


@pytest.mark.parametrize("tiny_heads", ["eagle"], indirect=True)
def test_a_heads_file_from_before_fused_layers_loads_and_drafts_the_same(tiny_engine, tiny_heads, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path, val = tiny_heads
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    config = json.loads(meta["config"])
    del config["fuse_layers"]
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata={**meta, "config": json.dumps(config)})
    target = tiny_engine.cpu_target
    heads, old_heads = (load_heads(p, target.model, target.name) for p in (path, old))
    assert old_heads.cfg == heads.cfg and old_heads.cfg.fuse_layers == ()
    s = val[0]
    a, b = HeadsDrafter(heads), HeadsDrafter(old_heads)
    for drafter in (a, b):
        drafter.add_features(s.tokens[:-2], 0, s.features[: len(s.tokens) - 2])
    ctx, greedy = s.tokens[:-1], SamplingParams()
    assert torch.equal(a.propose(ctx, 3, greedy, None).tokens, b.propose(ctx, 3, greedy, None).tokens)


def test_eagle3_layers_follow_the_target_s_depth():
    assert eagle3_layers(28) == (2, 14, 25)  # Qwen2.5-1.5B
    with pytest.raises(ValueError, match="need 8 decoder layers"):
        eagle3_layers(2)


def test_heads_without_features_propose_nothing(tiny_engine, tiny_heads):
    path, _ = tiny_heads
    heads = load_heads(path, tiny_engine.target.model, tiny_engine.target.name)
    proposal = HeadsDrafter(heads).propose([1, 2, 3], 4, SamplingParams(), None)
    assert proposal.tokens.tolist() == [] and proposal.forwards == 0


def test_a_failing_observe_keeps_the_answer(tiny_engine, tiny_heads, monkeypatch):
    engine = heads_engine(tiny_engine, tiny_heads)
    ids = tiny_prompts(engine.target, 1, seed=3)[0]
    plain, _ = collect(engine.stream(ids, GenerationConfig(20, speculate=False)))
    calls = []

    def observe(self, event, target):
        calls.append(target.hidden_start)
        if len(calls) == 3:
            raise RuntimeError("heads broke")
        return real(self, event, target)

    real = HeadsDrafter.observe
    monkeypatch.setattr(HeadsDrafter, "observe", observe)
    tokens, events = collect(engine.stream(ids, GenerationConfig(20)))
    assert tokens == plain
    assert any("drafter failed (RuntimeError: heads broke)" in e.note for e in events)


def test_a_broken_heads_file_gets_a_clear_error(tiny_heads, tmp_path):
    path, _ = tiny_heads
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(ValueError, match="is not a draft heads file"):
        read_heads(broken)
    with pytest.raises(FileNotFoundError, match="train them with `specvoice train-heads`"):
        read_heads(tmp_path / "absent.safetensors")


def test_heads_for_another_target_are_refused(tiny_engine, tiny_heads):
    path, _ = tiny_heads
    with pytest.raises(ValueError, match="trained for 'tiny-random-target', not 'other'"):
        load_heads(path, tiny_engine.target.model, "other")


def test_the_file_round_trips(tiny_heads, tmp_path):
    path, _ = tiny_heads
    heads, _ = read_heads(path)
    again = tmp_path / "again.safetensors"
    save_heads(heads, again, extra={"note": "x"})
    copy, extra = read_heads(again)
    assert copy.cfg == heads.cfg and torch.equal(copy.vocab_ids, heads.vocab_ids) and extra == {"note": "x"}
    for name, tensor in heads.trained_state().items():
        assert torch.equal(copy.trained_state()[name], tensor), name


def test_switching_drafters_in_a_session(tiny_engine, tiny_heads):
    engine = heads_engine(tiny_engine, tiny_heads)
    target = engine.target
    session = EngineSession(engine)
    ids = tiny_prompts(target, 1, seed=4)[0]
    plain, _ = collect(engine.stream(ids, GenerationConfig(16, speculate=False)))
    for kind in ("ngram", "heads"):
        session.use_drafter(kind)
        assert collect(engine.stream(ids, GenerationConfig(16), session=session))[0] == plain
    with pytest.raises(ValueError, match="no draft model loaded: start with --draft MODEL"):
        session.use_drafter("draft-model")


@pytest.mark.parametrize("regularised", [False, True])
def test_training_resumes_where_it_stopped(tiny_engine, tiny_data, tmp_path, regularised):
    """A run stopped after some steps and resumed from its checkpoint ends with the weights of an unbroken run, with
    feature noise too (its random draws go on where they stopped); the training-time test over 3 draft positions
    reports an accuracy for each."""
    target = tiny_engine.cpu_target  # train-heads runs on the CPU
    seqs = load_shards(tiny_data)
    cfg = TrainConfig(kind="eagle", vocab=96, epochs=2, lr=3e-3, batch_sequences=8, checkpoint_every_s=0.0, ttt_steps=3)
    if regularised:
        cfg = dataclasses.replace(cfg, feature_noise=0.3, weight_decay=0.1)
    lm_weight = target.model.get_output_embeddings().weight

    def fresh() -> DraftHeads:
        torch.manual_seed(0)
        heads = DraftHeads(heads_config("eagle", target.model.config, target.name), torch.arange(96))
        heads.attach(target.model.get_input_embeddings(), lm_weight)
        return heads

    unbroken = fresh()
    assert len(train_heads(unbroken, seqs[:40], seqs[40:], cfg, tmp_path / "a.ckpt", print)) == 3

    def stop_at_5(step: int, total: int, info: dict) -> None:
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_heads(fresh(), seqs[:40], seqs[40:], cfg, tmp_path / "b.ckpt", print, stop_at_5)
    logged: list[str] = []
    resumed = fresh()
    train_heads(resumed, seqs[:40], seqs[40:], cfg, tmp_path / "b.ckpt", logged.append)
    assert any("resumed from" in m and "at step 4/" in m for m in logged), logged
    for name, tensor in unbroken.trained_state().items():
        assert torch.allclose(resumed.trained_state()[name], tensor, atol=1e-6), name


@pytest.mark.parametrize("tiny_heads", ["medusa", "medusa-token", "eagle", "eagle3"], indirect=True)
def test_losses_at_the_scored_positions_only_equal_those_of_every_positions_logits(
    tiny_heads, tiny_engine, tiny_data, tiny_corpus
):
    """The losses project only the positions they score (the prompt's are about half): the same losses, hits and
    counts as the logits at every position, masked."""
    path, _ = tiny_heads
    target = tiny_engine.cpu_target
    heads = load_heads(path, target.model, target.name)
    if heads.cfg.fuse_layers:  # the fused layers' features, which the fixture cached
        shards = sorted((tiny_corpus / "answers").glob("answers_*.jsonl.gz"))
        seqs = read_sequences(corpus_dataset(target, "none", shards, tiny_corpus / "work", TINY_FUSE))
    else:
        seqs = load_shards(tiny_data)
    batch = make_batch(seqs[:6])
    b, t = batch.tokens.shape
    pos = torch.arange(t - 1)
    answer = pos[None, :] + 1 >= batch.answer_start[:, None]
    expected = []
    with torch.no_grad():
        if heads.cfg.kind == "medusa":
            got = medusa_losses(heads, batch)
            for k, full in enumerate(medusa_logits(heads, batch)):
                counted = answer & (pos[None, :] + 2 + k < batch.lengths[:, None])
                after = (pos + 1 + k).clamp(max=t - 2).expand(b, -1)
                expected.append((full, local_labels(batch.labels.gather(1, after), heads.vocab_ids), counted))
        else:
            got = eagle_losses(heads, batch, 1.0, 0.0, 3)
            labels = local_labels(batch.labels[:, 1:], heads.vocab_ids)
            for d, pred in enumerate(eagle_predictions(heads, batch, 3), start=1):
                slot = pos[None, :-1] + 1
                counted = answer[:, :-1] & (slot + 1 < batch.lengths[:, None]) & (slot >= d)
                expected.append((heads.lm(pred[:, :-1]), labels, counted))
    assert len(got) == len(expected)
    for (loss, hits, n), (full, labels, counted) in zip(got, expected):
        lab = labels.masked_fill(~counted, -100)
        valid = lab != -100
        assert n == int(counted.sum()) > 0 and hits == int((full.argmax(-1)[valid] == lab[valid]).sum())
        ce = F.cross_entropy(full.reshape(-1, full.shape[-1]), lab.reshape(-1), ignore_index=-100)
        torch.testing.assert_close(loss, ce)


@pytest.mark.parametrize("tiny_heads", ["medusa-token", "eagle"], indirect=True)
def test_feature_noise_is_on_what_heads_read_not_on_what_they_are_scored_on(tiny_heads, tiny_engine, tiny_data):
    path, _ = tiny_heads
    target = tiny_engine.cpu_target
    heads = load_heads(path, target.model, target.name)
    batch = make_batch(load_shards(tiny_data)[:4])
    torch.manual_seed(0)
    noisy = noised(batch, 0.05)
    assert noisy.features is batch.features and batch.inputs is batch.features
    moved = (noisy.inputs - batch.features).abs()
    assert 0.04 < float(moved.max()) <= 0.05
    with torch.no_grad():
        if heads.cfg.kind == "medusa":
            clean, read = medusa_logits(heads, batch)[0], medusa_logits(heads, noisy)[0]
            assert not torch.equal(clean, read)
        else:
            assert not torch.equal(eagle_predictions(heads, batch, 1)[0], eagle_predictions(heads, noisy, 1)[0])
            # the regression target stays the target's feature: scored against the noised one, the loss would differ
            scored_on_noise = dataclasses.replace(noisy, features=noisy.inputs)
            loss = eagle_losses(heads, noisy, 1.0, 0.5, 1)[0][0]
            assert loss != eagle_losses(heads, scored_on_noise, 1.0, 0.5, 1)[0][0]


def test_replay_counts_acceptance_by_position(tiny_heads, tiny_engine):
    path, val = tiny_heads
    target = tiny_engine.cpu_target  # the replay is train-heads' report, on the CPU
    heads = load_heads(path, target.model, target.name)
    replay = simulated_acceptance(heads, val, k=3)
    by_position = replay["acceptance_by_position"]
    assert len(by_position) == 3 and by_position[0] >= by_position[1] >= by_position[2]
    assert replay["tokens_per_target_forward"] == pytest.approx(1 + sum(by_position), rel=1e-9)


def test_train_heads_command_writes_heads_and_resumes(tiny_engine, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(WORDS[i : i + 4])}) + "\n" for i in range(12)))
    out, work, report = tmp_path / "h.safetensors", tmp_path / "work", tmp_path / "r.json"
    argv = ["train-heads", "--target", "tiny-random-target", "--target-quant", "none", "--dtype", "float32"]
    argv += ["--prompts", str(prompts), "--max-new-tokens", "12", "--batch-size", "8", "--vocab", "64"]
    argv += ["--epochs", "1", "--work", str(work), "--out", str(out), "--json", str(report), "--text-chars", "1200"]
    assert cli.main(argv) == 0
    data = json.loads(report.read_text())
    assert data["kind"] == "medusa" and len(data["held_out_replay_k4"]["acceptance_by_position"]) == 4
    heads = load_heads(out, tiny_engine.target.model, "tiny-random-target")
    assert heads.cfg.kind == "medusa" and len(heads.vocab_ids) <= 64 + 1
    shards = sorted((work / "data").glob("*.pt"))
    assert [p.name for p in shards] == ["shard_0000.pt", "shard_0001.pt", "text_0000.pt"]  # 4 passages of 256
    shard_times = [p.stat().st_mtime_ns for p in shards]
    assert cli.main(argv) == 0  # again: the data and the finished training are reused
    assert [p.stat().st_mtime_ns for p in sorted((work / "data").glob("*.pt"))] == shard_times
    assert "resumed from" in capsys.readouterr().err
    assert cli.main(argv[:-2] + ["--text-chars", "2400"]) == 2  # other text: not mixed into the old data
    assert "holds data made from other inputs" in capsys.readouterr().err
    assert cli.main(argv + ["--reads-token"]) == 0  # its own checkpoint: it does not resume plain medusa's
    assert "resumed from" not in capsys.readouterr().err and json.loads(report.read_text())["reads_token"]
    assert load_heads(out, tiny_engine.target.model, "tiny-random-target").cfg.reads_token
    assert cli.main(argv + ["--reads-token", "--reads-draft"]) == 0  # its own checkpoint again
    assert "resumed from" not in capsys.readouterr().err and json.loads(report.read_text())["reads_draft"]
    assert load_heads(out, tiny_engine.target.model, "tiny-random-target").cfg.reads_draft
    assert cli.main(argv + ["--reads-draft"]) == 2
    assert "reads_draft is for medusa heads that read the token" in capsys.readouterr().err
    deep = ["--reads-token", "--reads-draft", "--block-layers", "2"]
    assert cli.main(argv + deep) == 0  # its own checkpoint: two layers a block resume no one-layer run
    assert "resumed from" not in capsys.readouterr().err and json.loads(report.read_text())["block_layers"] == 2
    heads = load_heads(out, tiny_engine.target.model, "tiny-random-target")
    assert heads.cfg.block_layers == 2 and heads.medusa is not None and len(heads.medusa[0]) == 2
    assert cli.main(argv + ["--kind", "eagle", "--block-layers", "2"]) == 2
    assert "block_layers is medusa's residual layers per block" in capsys.readouterr().err


def test_train_heads_from_the_corpus_with_fused_layers(tiny_engine, tiny_corpus, tmp_path, capsys):
    out, work, report = tmp_path / "h.safetensors", tmp_path / "work", tmp_path / "r.json"
    argv = ["train-heads", "--target", "tiny-random-target", "--target-quant", "none", "--dtype", "float32"]
    argv += ["--kind", "eagle", "--vocab", "64", "--epochs", "1", "--work", str(work), "--out", str(out)]
    corpus = ["--corpus", str(tiny_corpus), "--fuse-layers", "0,1,2", "--ttt-steps", "3", "--json", str(report)]
    assert cli.main(argv + corpus) == 0
    data = json.loads(report.read_text())
    assert (data["corpus"], data["fuse_layers"], data["ttt_steps"]) == (str(tiny_corpus), [0, 1, 2], 3)
    assert data["corpus_shards"] == 2  # all of them, by number: the data is named while the corpus grows
    assert len(data["validation_top1_per_head"]) == 3 and len(data["held_out_replay_k4"]["acceptance_by_position"]) == 4
    assert load_heads(out, tiny_engine.target.model, "tiny-random-target").cfg.fuse_layers == TINY_FUSE
    features = sorted((work / "corpus").glob("*/answers_*.pt"))
    times = [p.stat().st_mtime_ns for p in features]
    assert len(features) == 2
    assert cli.main(argv + corpus) == 0  # again: the features and the finished training are reused
    assert [p.stat().st_mtime_ns for p in features] == times and "resumed from" in capsys.readouterr().err
    assert cli.main(argv + ["--fuse-layers", "0,1,2"]) == 2
    assert "--fuse-layers and --also-cache need --corpus" in capsys.readouterr().err
    # the fused run caches medusa's features too (a fresh work folder: the fused ones are there already)
    both = tmp_path / "both"
    argv_both = [a if a != str(work) else str(both) for a in argv]
    assert cli.main(argv_both + corpus + ["--also-cache", ""]) == 0
    features = sorted((both / "corpus").glob("*/answers_*.pt"))
    times = [p.stat().st_mtime_ns for p in features]
    assert len(features) == 4
    medusa = [a if a != "eagle" else "medusa" for a in argv_both]
    assert cli.main(medusa + ["--corpus", str(tiny_corpus), "--out", str(tmp_path / "m.safetensors")]) == 0
    assert [p.stat().st_mtime_ns for p in features] == times
    assert cli.main(argv + ["--corpus", str(tiny_corpus), "--fuse-layers", "auto"]) == 2
    assert "need 8 decoder layers" in capsys.readouterr().err
    assert cli.main(argv + ["--corpus", str(tiny_corpus), "--also-cache", "0,9"]) == 2  # before any prefill
    assert "the target's hidden_states go to" in capsys.readouterr().err
    assert cli.main(argv + ["--corpus", str(tiny_corpus), "--reads-token"]) == 2
    assert "reads_token is for medusa heads" in capsys.readouterr().err


def test_train_heads_reads_only_the_corpus_shards_asked_for(tiny_corpus):
    """--corpus-shards N: a heads file's recipe names its data while the corpus grows past it."""
    from commands.train_heads import corpus_shards

    everything = corpus_shards(tiny_corpus, "tiny-random-target")
    assert [p.name for p in everything] == ["answers_0000.jsonl.gz", "answers_0001.jsonl.gz"]
    assert corpus_shards(tiny_corpus, "tiny-random-target", 1) == everything[:1]
    with pytest.raises(ValueError, match="--corpus-shards 3, but .* holds 2 answer shards"):
        corpus_shards(tiny_corpus, "tiny-random-target", 3)


def test_shipped_heads_fit_the_default_target():
    """The shipped file is what --draft heads loads by default: the right target, under the size budget."""
    from specdec.build import EngineSpec
    from specdec.heads_file import default_heads_path

    path = default_heads_path(EngineSpec().target)
    assert path.exists(), f"{path} is not in the checkout"
    assert path.stat().st_size <= 100 * 10**6  # issue 38's budget for the shipped file
    heads, extra = read_heads(path)
    assert heads.cfg.target == EngineSpec().target
    assert extra["target_quant"] == EngineSpec().target_quant
    assert dataclasses.asdict(heads.cfg)["kind"] in ("eagle", "medusa")


def test_assets_are_found_beside_the_source_or_in_the_working_directory(tmp_path, monkeypatch):
    """An installed package run from its source folder (the Docker image) finds assets/ in the working directory."""
    from specdec.models import asset_path
    from tests.support.engine import ROOT

    (tmp_path / "assets" / "extra").mkdir(parents=True)
    (tmp_path / "assets" / "extra" / "f.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    assert asset_path("extra", "f.txt") == tmp_path / "assets" / "extra" / "f.txt"
    assert asset_path("heads", "qwen-1.5b.safetensors") == ROOT / "assets" / "heads" / "qwen-1.5b.safetensors"


def test_bench_runs_drafters_side_by_side(tiny_engine, tiny_heads, tmp_path):
    path, _ = tiny_heads
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"category": "a", "prompt": "hello"}\n{"category": "b", "prompt": "the cat sat"}\n')
    out = tmp_path / "bench.json"
    drafters = f"ngram,heads:{path}"
    argv = ["bench", *tiny_engine.cli_args, "--prompts", str(prompts), "--max-new-tokens", "12", "--compare", "none"]
    assert cli.main([*argv, "--draft-min-prob", "0", "--drafters", drafters, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    names = [tiny_engine.spec.draft, "ngram", f"heads:{path}"]
    assert list(data["summary"]["drafters"]) == names
    for name in names:
        s = data["summary"]["drafters"][name]
        assert s["greedy_identical_fraction"] == 1.0 and s["speedup_median"] > 0 and "per_position_acceptance" in s
        assert set(s["per_category"]) == {"a", "b"} and s["resident_bytes_added"] >= 0
    for p in data["prompts"]:
        assert p["speculative"] == p["drafters"][tiny_engine.spec.draft]
    assert data["summary"]["drafters"]["ngram"]["resident_bytes_added"] == 0


def test_calibrate_times_the_heads(tiny_engine, tiny_heads, tmp_path):
    """The default drafter calibrates too: its proposals timed as a step meets them, after the target's features."""
    path, _ = tiny_heads
    out = tmp_path / "c.json"
    argv = ["calibrate", *tiny_engine.cli_args, "--draft", "heads", "--heads", str(path), "--k-values", "2,6"]
    assert cli.main([*argv, "--repeats", "1", "--max-new-tokens", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["drafter_kind"] == "heads" and data["draft_cost_ratio"] > 0
    cfg = read_heads(path)[0].cfg
    most = 6 if cfg.kind == "eagle" else cfg.n_medusa  # medusa drafts one token per head
    assert [row["drafted"] for row in data["per_k"]] == [2, most]
    for row in data["per_k"]:
        # the prediction comes from a line fitted to timings: finite, of any sign on a loaded machine (a fresh run saw
        # −0.21× where one-token forwards timed 0.9 ms and sixteen-token ones 75 ms)
        assert row["draft_s"] > 0 and math.isfinite(row["predicted_speedup"]) and row["measured_speedup"] > 0


def test_vocab_coverage_counts_the_held_out_choices_a_vocabulary_holds():
    from specdec.heads_data import Sequence as Seq
    from specdec.heads_train import vocab_coverage

    def seq(labels: list[int]) -> Seq:
        return Seq([0, *labels], 1, torch.zeros(len(labels), 2), labels)

    train = [seq([5, 5, 5, 6, 6, 7])]
    held = [seq([5, 6, 7, 8])]
    assert vocab_coverage(train, held, (1, 2, 3), eos={9}) == {1: 0.25, 2: 0.5, 3: 0.75}
