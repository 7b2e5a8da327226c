"""Speculative decoding inside the batch (engine/speculation.py, mlxkv/speculative/).

Greedy output with speculation equals speculation off and mlx-lm's
stream_generate, solo, batched, across preemption and prefix hits, for the
plain, sliding-window and sink families; sampled output keeps the target's
distribution; a rollback leaves the pool as a plain run leaves it. Random
models rarely repeat themselves, so most tests propose with a script that
knows mlx-lm's answer and spoils it at random places: every accept length
gets exercised.
"""

from __future__ import annotations

import logging
import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from family_support import model_with_oracle, prompt_of
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.engine.sampling import Sampler
from mlxkv.engine.speculation import Speculation
from mlxkv.errors import MlxkvError
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model
from mlxkv.speculative.prompt_lookup import PromptLookup
from mlxkv.speculative.proposal_length import EMPTY_LIMIT, PAUSE_STEPS, ProposalLength
from mlxkv.speculative.proposer import Proposal
from mlxkv.speculative.step_cost import AlwaysSpeculate
from mlxkv.speculative.verify import greedy_tokens, sampled_tokens

BLOCK = 16
SPECS = {
    "llama": TinyModelSpec(family="llama", seed=61),
    "gemma3_text": TinyModelSpec(family="gemma3_text", num_layers=4, sliding_pattern=2, seed=62),
    "gpt_oss": TinyModelSpec(family="gpt_oss", num_layers=2, seed=63),
}


@pytest.fixture(scope="module", params=list(SPECS))
def family(request, tmp_path_factory):
    return model_with_oracle(tmp_path_factory.mktemp("speculative") / request.param, SPECS[request.param])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return model_with_oracle(tmp_path_factory.mktemp("speculative") / "llama", SPECS["llama"])


class ScriptedProposer:
    """Proposes the reference continuation, spoiled at random places: what the target accepts varies."""

    def __init__(self, answers: dict[tuple, list[int]], seed: int = 0, spoil: float = 0.3):
        self.answers, self.random, self.spoil = answers, random.Random(seed), spoil
        self.proposed = 0

    def propose(self, requests, lengths):
        out = []
        for request, k in zip(requests, lengths):
            answer = self.answers.get(tuple(request.prompt), [])
            tokens = answer[len(request.output) : len(request.output) + k]
            tokens = [t if self.random.random() > self.spoil else (t + 1) % 500 + 3 for t in tokens]
            self.proposed += len(tokens)
            out.append(Proposal(tokens))
        return out

    def forget(self, request):
        pass


def always_speculating(engine: Engine) -> Engine:
    if engine.loop.speculation is not None:  # None: speculation off, or a hybrid model
        # These tests check what speculation does, not whether this CPU gains from it (test_step_cost.py).
        engine.loop.speculation.cost = AlwaysSpeculate()
    return engine


def engine_for(loaded, num_blocks=256, proposer=None, max_k=4, **cache) -> Engine:
    cache = {"speculative": "lookup", **cache}
    config = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, memory_tier_bytes=0, speculative_tokens=max_k, **cache)
    engine = Engine(loaded, config, prefill_chunk=512)
    if proposer is not None:
        engine.loop.speculation = Speculation(proposer, max_k)
    return always_speculating(engine)


# -- the pieces ---------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_longest_recent_match():
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3])
    assert lookup.propose(3) == [4, 5, 9]  # "1 2 3" came once, followed by 4 5 9
    lookup.extend([8, 2, 3])
    assert lookup.propose(2) == [8, 2]  # no earlier "8 2 3"; "2 3" last came before 8
    assert lookup.propose(0) == [] and PromptLookup([5]).propose(3) == []
    assert PromptLookup([1, 2, 1]).propose(4) == [2, 1]  # what followed, up to the end


def test_proposal_length_follows_acceptance_and_pauses_when_it_fails():
    length = ProposalLength(4)
    assert length.next() == 4
    for _ in range(8):
        length.observe(4, 0)
        if not length.active:
            break
    assert not length.active and length.next() == 0
    for _ in range(PAUSE_STEPS):
        length.tick()
    assert length.active and length.next() == 1  # back with a short proposal
    for _ in range(EMPTY_LIMIT):
        length.observe(0, 0)
    assert not length.active


def test_greedy_acceptance_keeps_the_matching_run_and_the_targets_next_token():
    assert greedy_tokens([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert greedy_tokens([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert greedy_tokens([5], []) == [5]


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
@pytest.mark.parametrize("draft", [False, True])
def test_the_rejection_rule_keeps_the_targets_distribution(draft):
    """Over many draws the first token kept is distributed as the target's p, whatever was proposed."""
    vocab, trials = 6, 4000
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = np.array([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    logprobs = mx.log(mx.array(np.tile(p, (2, 1)), dtype=mx.float32))
    sampler = Sampler(1.0, 0.0, 0.0, 0, seed=5)
    counts = np.zeros(vocab)
    rng = np.random.default_rng(1)
    for _ in range(trials):
        x = int(rng.choice(vocab, p=q)) if draft else 4  # a lookup proposes an unlikely token, surely
        probs = mx.array(q[None], dtype=mx.float32) if draft else None
        counts[sampled_tokens(sampler, logprobs, [x], probs)[0]] += 1
    assert np.abs(counts / trials - p).max() < 0.03


# -- greedy equality ---------------------------------------------------------------


def test_greedy_output_is_the_same_as_without_speculation_and_as_mlx_lm(family):
    _, loaded, reference = family
    prompts = [prompt_of(45, salt=1), prompt_of(70, salt=2)]
    answers = {tuple(p): reference(p, 40) for p in prompts}
    proposer = ScriptedProposer(answers, seed=3)
    engine = engine_for(loaded, proposer=proposer)
    results = [engine.generate(prompt, max_tokens=40) for prompt in prompts]
    assert [r.tokens for r in results] == [answers[tuple(p)] for p in prompts]
    stats = engine.stats()["speculative"]
    assert proposer.proposed > 20 and 0 < stats["accepted"] < stats["proposed"]
    assert sum(r.stats.proposed_tokens for r in results) == stats["proposed"]  # each reply's share
    assert sum(r.stats.accepted_tokens for r in results) == stats["accepted"]
    assert stats["tokens_per_step"] > 1.3


def test_a_concurrent_batch_and_a_prefix_hit_equal_their_solo_runs(family):
    _, loaded, reference = family
    shared = prompt_of(40, salt=5)
    prompts = [shared + prompt_of(3 + 7 * i, salt=10 + i) for i in range(4)] + [prompt_of(20, salt=9)]
    answers = {tuple(p): reference(p, 30) for p in prompts}
    engine = engine_for(loaded, proposer=ScriptedProposer(answers, seed=4))
    engine.generate(shared + [7], max_tokens=2)  # the shared prefix is cached: the batch starts on hits
    results = engine.generate_batch(prompts, max_tokens=30)
    assert [r.tokens for r in results] == [answers[tuple(p)] for p in prompts]
    assert all(r.stats.cached_tokens["pool"] >= 32 for r in results[:4])


def test_preemption_with_speculation_keeps_the_output(llama):
    _, loaded, reference = llama
    prompts = [prompt_of(60, salt=s) for s in range(4)]
    answers = {tuple(p): reference(p, 40) for p in prompts}
    peak = engine_for(loaded).coordinator.peak_blocks(60 + 40, 512)
    engine = engine_for(loaded, num_blocks=peak + 4, proposer=ScriptedProposer(answers, seed=5))
    results = engine.generate_batch(prompts, max_tokens=40)
    assert any(r.stats.preemptions for r in results)
    assert [r.tokens for r in results] == [answers[tuple(p)] for p in prompts]
    assert engine.block_pool.in_use == 0


def test_prompt_lookup_on_a_repeating_reply_is_accepted_and_exact(llama):
    """A reply that repeats what came before: the real proposer's proposals are accepted."""
    _, loaded, reference = llama
    prompt = prompt_of(30, salt=21)
    answer = reference(prompt, 120)
    engine = engine_for(loaded)
    repeat = prompt + answer[:60]  # the next tokens the model writes are often ones it wrote
    assert engine.generate(prompt, max_tokens=120).tokens == answer
    assert engine.generate(repeat, max_tokens=40).tokens == reference(repeat, 40)


# -- the pool after rollbacks ---------------------------------------------------------


class Recorder:
    """A connector that keeps the hashes offered to it (written through) and hands nothing back."""

    def __init__(self):
        self.stored: list[bytes] = []

    def cache_blocks(self, hashes, read):
        self.stored += list(hashes)

    def __getattr__(self, name):  # the rest of the no-op protocol
        from mlxkv.cache.connector import NoopKVCacheConnector

        return getattr(NoopKVCacheConnector(), name)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), spoil=st.floats(0.0, 1.0), max_k=st.integers(1, 7))
@pytest.mark.slow
def test_rollback_leaves_the_pool_as_a_plain_run_leaves_it(llama, seed, spoil, max_k):
    _, loaded, reference = llama
    prompts = [prompt_of(37, salt=seed % 7), prompt_of(50, salt=seed % 5 + 7)]
    answers = {tuple(p): reference(p, 36) for p in prompts}
    ends = []
    for speculate in (False, True):
        recorder = Recorder()
        config = dict(connector=recorder)
        if speculate:
            engine = engine_for(loaded, proposer=ScriptedProposer(answers, seed, spoil), max_k=max_k, **config)
        else:
            engine = Engine(loaded, CacheConfig(block_size=BLOCK, num_blocks=256, memory_tier_bytes=0, **config),
                            prefill_chunk=512)
        results = engine.generate_batch(prompts, max_tokens=36)
        assert [r.tokens for r in results] == [answers[tuple(p)] for p in prompts]
        pool = engine.block_pool
        assert all(b.ref_count == 0 for b in pool.blocks)
        ends.append((set(pool.cached), sorted(recorder.stored)))
    assert ends[0] == ends[1]  # the same blocks registered and written through: no rejected token's


# -- where speculation is off -----------------------------------------------------------


def test_a_request_may_opt_out(llama):
    _, loaded, reference = llama
    prompt = prompt_of(40, salt=31)
    proposer = ScriptedProposer({tuple(prompt): reference(prompt, 20)})
    engine = engine_for(loaded, proposer=proposer)
    assert engine.generate(prompt, max_tokens=20, speculative=False).tokens == reference(prompt, 20)
    assert proposer.proposed == 0 and engine.stats()["speculative"]["rows"] == 0
    with pytest.raises(MlxkvError, match="speculative must be true or false"):
        engine.generate(prompt, max_tokens=2, speculative="yes")


def test_hybrid_models_decode_plain_and_say_so(tmp_path, caplog):
    _, loaded, reference = model_with_oracle(tmp_path / "lfm2", TinyModelSpec(family="lfm2", num_layers=4, seed=64))
    with caplog.at_level(logging.WARNING):
        engine = engine_for(loaded)
    assert engine.loop.speculation is None and engine.stats()["speculative"]["mode"] is None
    assert any("speculative decoding is off" in r.getMessage() for r in caplog.records)
    prompt = prompt_of(30)
    assert engine.generate(prompt, max_tokens=12).tokens == reference(prompt, 12)


@pytest.mark.parametrize(("fields", "match"), [
    (dict(speculative="maybe"), "lookup or draft"),
    (dict(speculative="lookup", speculative_tokens=0), "from 1 to 7"),
    (dict(speculative="draft"), "give both or neither"),
    (dict(draft_model="x"), "give both or neither"),
])
def test_bad_speculation_options_are_one_line_errors(fields, match):
    with pytest.raises(MlxkvError, match=match):
        CacheConfig(**fields)


def sampled_tokens_of(engine, prompt, seeds, max_tokens) -> list[list[int]]:
    out = {}
    for seed in seeds:
        out[seed] = []
        engine.loop.add(engine.make_request(prompt, lambda r, s=seed: out[s].append(r.token), max_tokens=max_tokens,
                                            temperature=1.0, top_k=TOP_K, seed=seed))
    while engine.loop.has_work:
        engine.loop.step()
    return [out[s] for s in seeds]


TOP_K = 3  # a few likely tokens per position, so frequencies settle in hundreds of draws


def total_variation(a: list[int], b: list[int]) -> float:
    values = sorted(set(a) | set(b))
    fa = np.array([a.count(v) for v in values]) / len(a)
    fb = np.array([b.count(v) for v in values]) / len(b)
    return 0.5 * np.abs(fa - fb).sum()


@pytest.mark.slow
def test_sampling_with_speculation_keeps_the_token_frequencies(llama):
    _, loaded, reference = llama
    prompt = prompt_of(20, salt=40)
    seeds = range(800)
    plain = sampled_tokens_of(engine_for(loaded, speculative=None), prompt, seeds, 4)
    again = sampled_tokens_of(engine_for(loaded, speculative=None), prompt, range(800, 1600), 4)
    # Proposals: the greedy answer, often accepted at temperature 1, often not.
    engine = engine_for(loaded, proposer=ScriptedProposer({tuple(prompt): reference(prompt, 4)}, spoil=0.2))
    spec = sampled_tokens_of(engine, prompt, seeds, 4)
    stats = engine.stats()["speculative"]
    assert 100 < stats["accepted"] < stats["proposed"]  # proposals were taken, and rejected
    for position in range(1, 4):  # the first token comes from the prefill, unspeculated
        noise = total_variation([t[position] for t in plain], [t[position] for t in again])
        drift = total_variation([t[position] for t in plain], [t[position] for t in spec])
        assert drift < max(0.08, 2 * noise), (position, drift, noise)


# -- a draft model -------------------------------------------------------------------


def draft_engine(loaded, draft: str, **cache) -> Engine:
    config = CacheConfig(block_size=BLOCK, num_blocks=256, memory_tier_bytes=0, speculative="draft",
                         draft_model=draft, **cache)
    return always_speculating(Engine(loaded, config, prefill_chunk=512))


def test_a_draft_that_is_the_model_itself_is_always_right(llama):
    path, loaded, reference = llama
    engine = draft_engine(loaded, path)
    prompt = prompt_of(40, salt=50)
    assert engine.generate(prompt, max_tokens=30).tokens == reference(prompt, 30)
    stats = engine.stats()["speculative"]
    assert stats["mode"] == "draft" and stats["acceptance_rate"] == 1.0 and stats["tokens_per_step"] == 5.0


def test_the_draft_runs_through_the_batch_loops_step_code(llama, monkeypatch):
    """Every forward of the draft model goes through run.py's prefill_chunk and forward_rows
    (engine/sequences.py), the functions the batch loop steps with: no copy of them."""
    from mlxkv.engine import run, sequences

    path, loaded, reference = llama
    engine = draft_engine(loaded, path)
    inside, stray, used = [], [], set()

    def through(fn):
        def step_code(*args, **kwargs):
            inside.append(fn.__name__)
            try:
                return fn(*args, **kwargs)
            finally:
                used.add(inside.pop())
        return step_code

    monkeypatch.setattr(sequences, "forward_rows", through(run.forward_rows))
    monkeypatch.setattr(sequences, "prefill_chunk", through(run.prefill_chunk))
    forward = engine.draft.runner.forward

    def watched(*args, **kwargs):
        if not inside:
            stray.append(args[1].shape)
        return forward(*args, **kwargs)

    engine.draft.runner.forward = watched
    prompt = prompt_of(40, salt=53)
    assert engine.generate(prompt, max_tokens=12).tokens == reference(prompt, 12)
    assert used == {"forward_rows", "prefill_chunk"} and stray == []


def test_a_draft_model_batched_equals_mlx_lm_and_resumes_its_own_cached_prefix(llama, tmp_path):
    _, loaded, reference = llama
    other = str(write_tiny_model(tmp_path / "draft", TinyModelSpec(family="llama", num_layers=1, seed=66)))
    engine = draft_engine(loaded, other)
    prefilled = []
    forward = engine.draft.runner.forward

    def counted(seqs, tokens, **kwargs):
        if tokens.shape[1] > 1:
            prefilled.append(tokens.shape[1])
        return forward(seqs, tokens, **kwargs)

    engine.draft.runner.forward = counted
    shared = prompt_of(60, salt=51)
    prompts = [shared + prompt_of(5 + i, salt=52 + i) for i in range(3)]
    results = engine.generate_batch(prompts, max_tokens=20)
    assert [r.tokens for r in results] == [reference(p, 20) for p in prompts]
    assert engine.stats()["speculative"]["proposed"] > 0
    prefilled.clear()
    again = shared + prompt_of(9, salt=60)
    assert engine.generate(again, max_tokens=12).tokens == reference(again, 12)
    assert sum(prefilled) <= len(again) - 48  # the draft's pool had the shared prefix's blocks


def test_a_draft_of_another_tokenizer_or_with_recurrent_layers_is_refused_at_load(llama, tmp_path):
    path, loaded, _ = llama
    other = str(write_tiny_model(tmp_path / "vocab", TinyModelSpec(family="llama", vocab_size=300, seed=67)))
    with pytest.raises(MlxkvError, match="does not share the tokenizer"):
        draft_engine(loaded, other)
    hybrid = str(write_tiny_model(tmp_path / "hybrid", TinyModelSpec(family="lfm2", num_layers=4, seed=68)))
    with pytest.raises(MlxkvError, match="recurrent layers"):
        draft_engine(loaded, hybrid)


class SometimesWrong:
    """Wraps a draft proposer whose draft is the target itself: at the reply positions in `wrong`
    it proposes a wrong token (then drafts on from it), and it records every token it drafted
    itself, by position. After a rejected proposal the draft must roll its KV back: else it
    drafts on over the wrong token's KV and parts from the target where nothing was injected."""

    def __init__(self, draft, wrong: set[int]):
        self.draft, self.wrong = draft, wrong
        self.drafted: list[tuple[int, int]] = []  # (reply position, token) of each un-injected proposal
        pick = draft._pick

        def picking(request, logprobs, proposal):
            token = pick(request, logprobs, proposal)
            position = request.num_output + len(proposal.tokens) - 1
            if position in self.wrong and len(proposal.tokens) == 1:  # a proposal's first token: it is verified
                proposal.tokens[-1] = token = (token + 1) % 500 + 3
            elif not proposal.tokens[:-1] or all(request.num_output + i not in self.wrong
                                                  for i in range(len(proposal.tokens) - 1)):
                self.drafted.append((position, token))
            return token

        draft._pick = picking

    def __getattr__(self, name):
        return getattr(self.draft, name)


def test_a_draft_that_is_sometimes_wrong_rolls_back_and_drafts_right_again(llama):
    path, loaded, reference = llama
    engine = draft_engine(loaded, path)
    wrapped = SometimesWrong(engine.loop.speculation.proposer, wrong={3, 9, 10, 17})
    prompt = prompt_of(40, salt=55)
    answer = reference(prompt, 28)
    assert engine.generate(prompt, max_tokens=28).tokens == answer
    assert len(wrapped.drafted) > 10
    assert [t for _, t in wrapped.drafted] == [answer[p] for p, _ in wrapped.drafted]  # every own guess right
    stats = engine.stats()["speculative"]
    assert 0 < stats["acceptance_rate"] < 1.0
