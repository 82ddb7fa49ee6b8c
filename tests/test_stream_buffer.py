"""The streaming buffer on its own: AReaL's admission rule, stale drops, exactly-once prompts, seeds."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest

from cluster.pipeline.collector import chunk_seed
from cluster.pipeline.stream_buffer import StreamBuffer
from cluster.prompts.loader import Prompt, PromptStream
from cluster.records.chunks import SampleFacts


class _Scores:
    def __init__(self, n):
        self.ok = np.ones(n, dtype=bool)


def _prompts(n):
    return [Prompt(i, f"p{i}", np.array([1, i + 3]), {}) for i in range(n)]


def _buffer(n_prompts=12, P=4, chunk=2, eta=1):
    return StreamBuffer(PromptStream(_prompts(n_prompts), seed=0, shuffle=False), P, chunk, eta, run_seed=7)


def _finish(buf, chunk, version, n=1):
    chunk.facts = [SampleFacts(p.index, version, 3, "stop") for p in chunk.prompts for _ in range(n)]
    chunk.samples_ref = chunk.ref_logprobs_ref = object()
    chunk.scores = _Scores(len(chunk.facts))
    buf.add_scored(chunk)


def test_admission_follows_the_capacity_rule():
    buf = _buffer(P=4, chunk=2, eta=1)
    got = []
    while (c := buf.next_chunk(version=0)) is not None:
        got.append(c)
    assert sum(len(c.prompts) for c in got) == (1 + 0 + 1) * 4  # (eta + v + 1) x P
    assert buf.capacity(0) == 0 and buf.capacity(1) == 4
    assert buf.next_chunk(version=1) is not None


def test_eta_zero_chunks_like_sync_mode_with_the_same_seeds():
    buf = _buffer(n_prompts=10, P=5, chunk=2, eta=0)
    chunks = []
    while (c := buf.next_chunk(version=0)) is not None:
        chunks.append(c)
    assert [len(c.prompts) for c in chunks] == [2, 2, 1]  # never straddles the step's 5 prompts
    assert [c.seed for c in chunks] == [chunk_seed(7, 1, i) for i in range(3)]
    for c in chunks:
        _finish(buf, c, 0)
    taken = buf.take(0)
    assert [p.index for p in taken.prompts] == [0, 1, 2, 3, 4]
    c = buf.next_chunk(version=1)
    assert c.seed == chunk_seed(7, 2, 0) and [p.index for p in c.prompts] == [5, 6]


def test_take_waits_for_a_full_batch_and_keeps_chunk_order():
    buf = _buffer(P=4, chunk=2, eta=1)
    a, b, c = (buf.next_chunk(0) for _ in range(3))
    _finish(buf, c, 0, n=2)
    assert buf.take(0) is None  # 2 of the 4 prompts of a batch
    _finish(buf, a, 0, n=2)
    taken = buf.take(0)
    _finish(buf, b, 0, n=2)
    # The first 4 prompts that became ready (c, a), handed to the learner in chunk order (a, c).
    assert [ch.index for ch, _ in taken.parts] == [a.index, c.index]
    assert all(pos == [0, 1, 2, 3] for _, pos in taken.parts)
    assert taken.staleness == [0] * 8 and buf.depth() == 2


def _admit_and_finish_some(buf, version, inflight, rng):
    """Admit every chunk the buffer allows at `version`, then finish each chunk in flight with
    probability 0.6, in random order (chunks finish in any order; some are slow and finish after later
    steps). Returns the chunks still in flight, as (chunk, version admitted at)."""
    while (c := buf.next_chunk(version)) is not None:
        inflight.append((c, version))
    rng.shuffle(inflight)
    keep = []
    for c, v in inflight:
        if rng.random() < 0.6:
            _finish(buf, c, v)
        else:
            keep.append((c, v))
    return keep


def test_stale_samples_are_dropped_and_their_prompts_trained_later_exactly_once():
    rng = random.Random(0)
    P, eta, steps = 4, 1, 12
    buf = StreamBuffer(PromptStream(_prompts(16), seed=3, shuffle=True), P, 2, eta, run_seed=1)
    trained = collections.Counter()
    version, dropped = 0, 0
    inflight = []
    for _ in range(steps):
        inflight = _admit_and_finish_some(buf, version, inflight, rng)
        taken = buf.take(version)
        if taken is None or not taken.parts:
            dropped += taken.stale_samples if taken else 0
            continue
        dropped += taken.stale_samples
        assert max(taken.staleness) <= eta  # every trained sample, not an average
        trained.update(p.index for p in taken.prompts)
        version += 1
    assert dropped > 0  # the scenario does exercise the consumption bound
    # Prompts are drawn in epochs of 16: the trained counts differ by at most one epoch.
    assert max(trained.values()) - min(trained.values()) <= 1
    outstanding = buf.outstanding()
    assert len(outstanding) == len(set(outstanding))


def test_outstanding_prompts_are_generated_first_after_restore():
    buf = _buffer(P=4, chunk=2, eta=1)
    a = buf.next_chunk(0)
    b = buf.next_chunk(0)
    _finish(buf, a, 0)
    out = buf.outstanding()
    assert out == [0, 1, 2, 3]
    again = _buffer(P=4, chunk=2, eta=1)
    again.restore(version=3, outstanding=[Prompt(i, "", np.array([1]), {}) for i in out], chunks=2, pulled=4)
    assert again.capacity(3) == 8
    c = again.next_chunk(3)
    assert [p.index for p in c.prompts] == [0, 1] and c.index == 2
    del b


@pytest.mark.parametrize("eta", [0, 2])
def test_capacity_is_never_negative_after_drops(eta):
    buf = _buffer(P=4, chunk=4, eta=eta)
    c = buf.next_chunk(0)
    _finish(buf, c, 0)
    taken = buf.take(eta + 1)  # the learner moved on: everything is stale
    assert taken.stale_prompts == 4 and not taken.parts
    assert buf.capacity(eta + 1) >= 4


def test_adding_a_scored_chunk_twice_changes_nothing():
    buf = _buffer(n_prompts=8, P=4, chunk=2, eta=0)
    chunks = [buf.next_chunk(version=0), buf.next_chunk(version=0)]
    for c in chunks:
        _finish(buf, c, 0)
        buf.add_scored(c)  # a late duplicate result (a re-dispatched call) or a second scoring call
    assert buf.depth() == 4
    taken = buf.take(0)
    assert [p.index for p in taken.prompts] == [0, 1, 2, 3]
    assert buf.depth() == 0 and buf.outstanding() == []
    buf.add_scored(chunks[0])  # after the batch was taken: still nothing
    assert buf.depth() == 0


def test_a_batch_given_back_regenerates_only_the_lost_chunks_prompts():
    """The learner could not read chunk 1's objects (its node died): chunk 1's prompts are generated
    again (slots given back), chunk 0's return to the front of the buffer, and over the epoch every
    prompt is trained exactly once."""
    buf = _buffer(n_prompts=8, P=4, chunk=2, eta=1)
    first = [buf.next_chunk(version=0) for _ in range(4)]  # capacity (1 + 0 + 1) x 4 = 8 prompts
    for c in first:
        _finish(buf, c, 0)
    taken = buf.take(0)
    assert [p.index for p in taken.prompts] == [0, 1, 2, 3]
    admitted = buf.admitted
    assert buf.give_back(taken, {first[1].index}) == 2
    assert buf.admitted == admitted - 2
    assert [(c.index, p.index) for c, p, _ in buf.ready] == [(0, 0), (0, 1), (2, 4), (2, 5), (3, 6), (3, 7)]
    again = buf.next_chunk(version=0)
    assert [p.index for p in again.prompts] == [2, 3] and again.index == 4  # a new chunk, a new seed
    _finish(buf, again, 0)
    trained = collections.Counter()
    for version in (0, 1):
        got = buf.take(version)
        trained.update(p.index for p in got.prompts)
    assert trained == {i: 1 for i in range(8)} and buf.depth() == 0


def test_a_lost_chunk_starts_a_new_round():
    buf = _buffer()
    c = buf.next_chunk(version=0)
    _finish(buf, c, 0)
    c.lost()
    assert (
        c.round == 1
        and c.facts is None
        and c.samples_ref is None
        and c.scores is None
        and c.ref_logprobs_ref is None
    )


# ---------------------------------------------------------------------- dynamic sampling


class _Rewards:
    def __init__(self, values):
        self.scores = self.returns = np.asarray(values, dtype=np.float32)
        self.ok = np.ones(len(values), dtype=bool)


def _finish_rewards(buf, chunk, version, flat, n=2):
    """Score `chunk` with n samples per prompt: all-equal rewards for prompts in `flat`, spread otherwise."""
    chunk.facts = [SampleFacts(p.index, version, 3, "stop") for p in chunk.prompts for _ in range(n)]
    chunk.samples_ref = chunk.ref_logprobs_ref = object()
    chunk.scores = _Rewards([1.0 if f[0] in flat else float(k % 2) for k, f in enumerate(chunk.facts)])
    buf.add_scored(chunk)


def _filtering_buffer(n_prompts=24, P=4, chunk=2, eta=1, max_rounds=8, shuffle=False):
    from cluster.pipeline.dynamic_sampling import nonzero_std

    stream = PromptStream(_prompts(n_prompts), seed=5, shuffle=shuffle)
    return StreamBuffer(
        stream, P, chunk, eta, run_seed=7, group_filter=nonzero_std(1e-6), max_rounds=max_rounds
    )


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_filtered_groups_give_their_slot_back_and_every_prompt_ends_once(eta):
    """Prompts divisible by 3 have all-equal rewards: they never reach the learner, each frees its
    admission slot for a new prompt (the stream never stalls), every batch is full, the admission
    bound holds, and each drawn prompt is trained, filtered or outstanding exactly once."""
    rng = random.Random(eta)
    P, flat = 4, {i for i in range(48) if i % 3 == 0}
    buf = _filtering_buffer(n_prompts=48, P=P, eta=eta, shuffle=True)
    trained, filtered = collections.Counter(), collections.Counter()
    version, inflight = 0, []
    while version < 6:
        while (c := buf.next_chunk(version)) is not None:
            inflight.append((c, version))
            assert buf.admitted <= (eta + version + 1) * P  # filtered prompts count as given back
        rng.shuffle(inflight)
        for c, v in inflight[: max(1, len(inflight) // 2)]:
            _finish_rewards(buf, c, v, flat)
        inflight = inflight[max(1, len(inflight) // 2) :]
        filtered.update(p.index for p in buf.drain_filtered())
        taken = buf.take(version)
        if taken is None or not taken.parts:
            continue
        assert len(taken.items) == P and not {p.index for p in taken.prompts} & flat
        trained.update(p.index for p in taken.prompts)
        version += 1
    assert set(trained.values()) == {1} and set(filtered.values()) == {1}
    assert set(filtered) <= flat and filtered
    drawn = buf.stream.state_dict()["offset"]  # one epoch, not wrapped
    order = buf.stream._order[:drawn]
    outstanding = buf.outstanding()
    assert sorted([*trained, *filtered, *outstanding]) == sorted(int(i) for i in order)


def test_a_batch_is_taken_short_after_max_rounds_and_refused_when_nothing_is_kept():
    P = 4
    buf = _filtering_buffer(n_prompts=40, P=P, chunk=4, eta=2, max_rounds=2)
    chunks = [buf.next_chunk(0) for _ in range(3)]  # prompts 0..11
    _finish_rewards(buf, chunks[0], 0, flat={0, 1, 2})  # 1 kept, 3 filtered
    assert buf.take(0) is None  # seen 4 < max_rounds x P
    _finish_rewards(buf, chunks[1], 0, flat={4, 5, 6, 7})  # seen 8 = 2 x 4: short batch
    taken = buf.take(0)
    assert [p.index for p in taken.prompts] == [3] and taken.filtered == 7
    assert buf.capacity(1) == (2 + 1 + 1) * P - 4 - 4  # the short batch's slots count as used
    _finish_rewards(buf, chunks[2], 1, flat=set(range(8, 12)))
    more = [buf.next_chunk(1) for _ in range(1)]
    _finish_rewards(buf, more[0], 1, flat={p.index for p in more[0].prompts})
    from cluster.pipeline.dynamic_sampling import DynamicSamplingError

    with pytest.raises(DynamicSamplingError, match="data.dynamic_sampling.max_rounds"):
        buf.take(1)


@pytest.mark.parametrize("eta", [0, 1])
def test_a_short_batch_given_back_undoes_what_take_counted(eta):
    """A short batch (max_rounds reached) whose chunk's objects were lost is given back: the slots
    `take` used up for its missing groups and the groups filtered before it are counted as before the
    take, so the buffer admits and takes exactly as if the batch had never been taken. At eta 0 the
    same short batch is then taken again (before the fix: capacity 0 and no count to reach
    max_rounds x P, so nothing could ever be admitted or taken)."""
    P = 4
    buf = _filtering_buffer(n_prompts=40, P=P, chunk=2, eta=eta, max_rounds=1)
    a, b = buf.next_chunk(0), buf.next_chunk(0)  # prompts 0..3
    _finish_rewards(buf, a, 0, flat={0})
    _finish_rewards(buf, b, 0, flat={3})  # seen 4 = 1 x 4: 2 kept, a short batch of 2
    before = (buf.capacity(0), buf.filtered_since_take)
    taken = buf.take(0)
    assert [p.index for p in taken.prompts] == [1, 2] and taken.filtered == 2 and taken.shortfall == 2
    assert buf.give_back(taken, {a.index}) == 1  # prompt 1 generated again, prompt 2 back in the buffer
    assert (buf.capacity(0), buf.filtered_since_take) == (before[0] + 1, before[1])
    again = buf.next_chunk(0)
    assert [p.index for p in again.prompts] == [1]
    _finish_rewards(buf, again, 0, flat=set())
    retaken = buf.take(0)
    assert retaken is not None and sorted(p.index for p in retaken.prompts) == [1, 2]
    # as after a short batch taken once: its step's P slots count as used, the next step's are free
    assert retaken.filtered == 2 and buf.capacity(1) == (eta + 2) * P - P


def test_restore_after_filtering_generates_only_the_outstanding_prompts():
    buf = _filtering_buffer(n_prompts=16, P=4, chunk=2, eta=1)
    a, b, c = (buf.next_chunk(0) for _ in range(3))  # prompts 0..5
    _finish_rewards(buf, a, 0, flat={0})
    _finish_rewards(buf, b, 0, flat=set())
    assert [p.index for p in buf.drain_filtered()] == [0]
    out = buf.outstanding()
    assert out == [1, 2, 3, 4, 5] and 0 not in out  # filtered: used up, not generated again
    again = _filtering_buffer(n_prompts=16, P=4, chunk=2, eta=1)
    again.stream.load_state_dict(buf.stream.state_dict())
    again.restore(0, [Prompt(i, "", np.array([1]), {}) for i in out], buf.chunks, buf.pulled)
    got = []
    while (ch := again.next_chunk(0)) is not None:
        got += [p.index for p in ch.prompts]
    assert got[:5] == [1, 2, 3, 4, 5] and 0 not in got
    del c


@pytest.mark.parametrize("seed", range(5))
def test_wait_policy_drops_nothing_and_keeps_the_bound(seed):
    """stale_policy='wait', the same random completion order as the drop test above: the learner waits
    for the chunks in flight that would be too old after its step, takes the oldest samples first, and
    no sample is ever dropped; every trained sample is within the bound and every prompt is trained once
    per epoch."""
    rng = random.Random(seed)
    P, eta, steps = 4, 1, 16
    buf = StreamBuffer(PromptStream(_prompts(16), seed=3, shuffle=True), P, 2, eta, run_seed=1, wait=True)
    trained = collections.Counter()
    version, waited = 0, 0
    inflight = []
    for _ in range(steps * 10):
        if version == steps:
            break
        inflight = _admit_and_finish_some(buf, version, inflight, rng)
        taken = buf.take(version)
        if taken is None:
            waited += 1
            continue
        assert taken.stale_samples == 0 and max(taken.staleness) <= eta
        trained.update(p.index for p in taken.prompts)
        version += 1
    assert version == steps and waited > 0  # it did wait, and it never stalled
    assert set(trained.values()) == {steps * P // 16}


def test_wait_policy_waits_only_for_chunks_about_to_go_stale():
    buf = _buffer(P=2, chunk=1, eta=1)
    c0, c1 = buf.next_chunk(0), buf.next_chunk(0)  # step 1's prompts, admitted at version 0
    c2 = buf.next_chunk(0)  # step 2's first prompt: eta=1 lets generation run one step ahead
    buf.wait = True
    _finish(buf, c0, 0)
    _finish(buf, c1, 0)
    assert buf.take(0) is not None  # at version 0 nothing in flight is stale after the step
    c3 = buf.next_chunk(1)
    _finish(buf, c3, 1)
    assert buf.take(1) is None  # c2 (admitted at 0) would be 2 versions old after this step: wait
    _finish(buf, c2, 0)
    taken = buf.take(1)
    assert [c.index for c, _pos in taken.parts] == [c2.index, c3.index] and taken.staleness == [1, 0]
