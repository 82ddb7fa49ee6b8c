"""The hf engine records an MoE policy's routing per sample (rollout.record_routing): uint8
[p + r - 1, layers, k], equal to an unpadded transformers forward of the sample's tokens; refused by name
for vLLM, for a dense policy and for multi-turn environments. With a deliberate mismatch (noise on the
engine's routers), a float32 learner forward on the engine's samples picks other experts for a
measurable share of choices; replaying the recorded routing (R3, `kernel.moe_routing.replay_routing`)
makes every choice the engine's and brings the logprobs closer to the engine's."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from engine_contract_shared import INDICES, PROMPTS
from pydantic import ValidationError
from tiny_models import MOE_FAMILIES, build_causal_lm
from transformers import AutoModelForCausalLM

from kernel.moe_routing import NOT_RECORDED, moe_routers, record_routing, replay_routing
from rollout_workers.config import EnvironmentConfig, RolloutConfig, SamplingConfig
from rollout_workers.worker import RolloutWorker

SAMPLING = SamplingConfig(n=2, max_new_tokens=8, temperature=1.0)


def _model(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _learner_view(model, sample, routing=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The response's logprobs and each MoE layer's experts [p + r - 1, k] from one unpadded forward of
    prompt + response but its last token (the last position's logits predict nothing of the sample)."""
    ids = torch.from_numpy(np.concatenate([sample.prompt_ids, sample.response_ids]))
    p = len(sample.prompt_ids)
    replay = (
        replay_routing(model, [torch.from_numpy(routing[:, i]) for i in range(routing.shape[1])])
        if routing is not None
        else torch.no_grad()
    )
    with torch.no_grad(), replay, record_routing(model) as taken:
        logits = model(input_ids=ids[None, :-1]).logits[0]
    logp = torch.log_softmax(logits[p - 1 :].float(), dim=-1).gather(-1, ids[p:, None])[:, 0]
    return logp, [t[0] for t in taken]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_hf_engine_records_each_samples_routing(tmp_path, family):
    path = str(build_causal_lm(tmp_path / "m", family, seed=2))
    worker = RolloutWorker(path, RolloutConfig(engine="hf", record_routing=True), initial_version=0)
    samples = worker.generate(INDICES, PROMPTS, seed=5, sampling=SAMPLING)
    assert len({len(s.prompt_ids) for s in samples}) == 3  # left padding in the engine's batch
    model = _model(path)
    for s in samples:
        T = len(s.prompt_ids) + len(s.response_ids) - 1
        assert s.routing.dtype == np.uint8 and s.routing.shape == (T, 2, 2)
        _, own = _learner_view(model, s)
        assert all(torch.equal(torch.from_numpy(s.routing[:, i]), own[i]) for i in range(2))
    plain = RolloutWorker(path, RolloutConfig(engine="hf"), initial_version=0)
    assert all(s.routing is None for s in plain.generate(INDICES, PROMPTS, seed=5, sampling=SAMPLING))


def test_recording_is_refused_by_name(tmp_path):
    with pytest.raises(
        ValidationError, match=r"rollout.record_routing with rollout.engine='vllm'.*Model Runner V2"
    ):
        RolloutConfig(engine="vllm", record_routing=True)
    env = EnvironmentConfig(name="anything", max_turns=2)
    with pytest.raises(ValidationError, match=r"rollout.record_routing with rollout.environment"):
        RolloutConfig(record_routing=True, environment=env)
    dense = str(build_causal_lm(tmp_path / "d", "llama", seed=2))
    with pytest.raises(ValueError, match=r"rollout.record_routing: LlamaForCausalLM has no MoE layers"):
        RolloutWorker(dense, RolloutConfig(engine="hf", record_routing=True), initial_version=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_the_engines_routing_removes_the_mismatch(tmp_path, family):
    learner_dir = build_causal_lm(tmp_path / "learner", family, seed=2)
    engine_dir = build_causal_lm(tmp_path / "engine", family, seed=2)
    noisy = _model(engine_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in moe_routers(noisy):
            w = router.weight
            w.add_(0.15 * w.std() * torch.randn(w.shape, generator=gen))
    noisy.save_pretrained(engine_dir)
    worker = RolloutWorker(
        str(engine_dir), RolloutConfig(engine="hf", record_routing=True), initial_version=0
    )
    samples = worker.generate(list(range(6)), PROMPTS * 2, seed=7, sampling=SAMPLING)
    model = _model(learner_dir)
    differ = total = 0
    gap_plain, gap_replay = [], []
    for s in samples:
        behaviour = torch.from_numpy(s.logprobs)
        plain, own = _learner_view(model, s)
        replayed, used = _learner_view(model, s, s.routing)
        for i in range(2):
            engine = torch.from_numpy(s.routing[:, i]).long().sort(-1).values
            differ += int((own[i].long().sort(-1).values != engine).any(-1).sum())
            total += engine.shape[0]
            assert torch.equal(used[i], torch.from_numpy(s.routing[:, i]))  # exactly the engine's experts
        gap_plain.append((plain - behaviour).abs())
        gap_replay.append((replayed - behaviour).abs())
    share = differ / total
    plain_gap, replay_gap = torch.cat(gap_plain).mean().item(), torch.cat(gap_replay).mean().item()
    print(
        f"{family}: {differ}/{total} top-2 sets differ ({share:.1%}); mean |logprob gap| {plain_gap:.4f} -> {replay_gap:.4f}"
    )
    assert share > 0.05
    assert replay_gap < plain_gap


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_router_learns_under_the_engines_routing(tmp_path, family):
    path = str(build_causal_lm(tmp_path / "m", family, seed=2))
    worker = RolloutWorker(path, RolloutConfig(engine="hf", record_routing=True), initial_version=0)
    s = worker.generate(INDICES[:1], PROMPTS[1:2], seed=5, sampling=SAMPLING)[0]
    model = _model(path)
    ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.response_ids]))
    with replay_routing(model, [torch.from_numpy(s.routing[:, i]) for i in range(2)]):
        logits = model(input_ids=ids[None, :-1]).logits[0]
    torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_routing_travels_into_a_padded_learner_batch(tmp_path, family):
    """Sample -> Trajectory -> the learner's padded Batch (a subset taken, as a micro-batch is): replaying
    `Batch.padded_routing` in one padded forward routes every recorded token as the engine did and gives
    the per-sample replayed logprobs; the padding and each row's last token keep the learner's own."""
    from cluster.records.trajectories import to_trajectory
    from learner.batch import pack_trajectories

    path = str(build_causal_lm(tmp_path / "m", family, seed=2))
    worker = RolloutWorker(path, RolloutConfig(engine="hf", record_routing=True), initial_version=0)
    samples = worker.generate(INDICES, PROMPTS, seed=5, sampling=SAMPLING)
    batch = pack_trajectories([to_trajectory(s, None, 1.0) for s in samples], pad_id=0)
    idx = torch.tensor([5, 0, 3])
    b = batch.take(idx)
    assert b.routing.dtype == torch.uint8 and b.routing.shape[:2] == b.input_ids.shape
    model = _model(path)
    with torch.no_grad(), replay_routing(model, b.padded_routing()), record_routing(model) as seen:
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    L = b.input_ids.shape[1]
    for row, j in enumerate(idx.tolist()):
        s = samples[j]
        n, p = len(s.prompt_ids) + len(s.response_ids) - 1, len(s.prompt_ids)
        for i in range(2):
            assert torch.equal(seen[i][0].view(len(idx), L, 2)[row, :n], torch.from_numpy(s.routing[:, i]))
        want, _ = _learner_view(model, s, s.routing)
        ids = b.input_ids[row, p : n + 1]
        got = torch.log_softmax(logits[row, p - 1 : n].float(), -1).gather(-1, ids[:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="carry no routing"):
        traj = [to_trajectory(s, None, 1.0) for s in samples[:2]]
        traj[0].routing = None
        pack_trajectories(traj, pad_id=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_packed_and_padded_replay_agree(tmp_path, family):
    """The packed forward (`pack_rows`, one padding-free row) replaying `Batch.packed_routing` routes every
    token as the padded forward replaying `Batch.padded_routing`, and scores the responses alike."""
    from cluster.records.trajectories import to_trajectory
    from kernel.sequences import pack_rows, packed_response_logits, response_tokens
    from learner.batch import pack_trajectories

    path = str(build_causal_lm(tmp_path / "m", family, seed=2))
    worker = RolloutWorker(path, RolloutConfig(engine="hf", record_routing=True), initial_version=0)
    samples = worker.generate(INDICES, PROMPTS, seed=5, sampling=SAMPLING)
    b = pack_trajectories([to_trajectory(s, None, 1.0) for s in samples], pad_id=0)
    model = _model(path)
    R = b.mask.shape[1]
    with torch.no_grad(), replay_routing(model, b.padded_routing()), record_routing(model) as padded_seen:
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    tokens = response_tokens(b.input_ids, b.prompt_lens, R)
    rows = pack_rows(b.input_ids, b.attention_mask, b.prompt_lens, b.response_lens, R)
    with torch.no_grad(), replay_routing(model, b.packed_routing()), record_routing(model) as packed_seen:
        packed, _ = packed_response_logits(model, rows)
    real = b.attention_mask.bool().flatten()
    recorded = (b.routing[..., 0, 0] != NOT_RECORDED).flatten()[real]
    engine = b.routing[b.attention_mask.bool()]
    for i in range(2):  # the engine's experts where recorded, the same own choice on each last token
        assert torch.equal(packed_seen[i][0], padded_seen[i][0][real])
        assert torch.equal(packed_seen[i][0][recorded], engine[recorded, i])
    packed_lp = rows.unpack(torch.log_softmax(packed, -1).gather(-1, rows.targets[:, None])[:, 0])
    padded_lp = torch.zeros_like(packed_lp)
    for r in range(len(b)):
        p, n = int(b.prompt_lens[r]), int(b.response_lens[r])
        lg = logits[r, p - 1 : p - 1 + n]
        padded_lp[r, :n] = torch.log_softmax(lg, -1).gather(-1, tokens[r, :n, None])[:, 0]
    torch.testing.assert_close(packed_lp * b.mask, padded_lp * b.mask, atol=1e-5, rtol=1e-5)


@contextlib.contextmanager
def _experts_used(model):
    """Each MoE layer's `top_k_index` as its experts module receives it (forward_scores enters its replay
    inside, so a hook on the router registered here would run before the replay's)."""
    blocks = [m for m in model.modules() if getattr(m, "gate", None) in moe_routers(model)]
    taken = [[] for _ in blocks]

    def keep(i):
        def hook(module, args, kwargs):
            taken[i].append((args[1] if len(args) > 1 else kwargs["top_k_index"]).detach())

        return hook

    handles = [b.experts.register_forward_pre_hook(keep(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        yield taken
    finally:
        for h in handles:
            h.remove()


def _noisy_engine_samples(tmp_path, family):
    """The learner's model dir and samples (with routing) from an engine whose routers got noise."""
    learner_dir = build_causal_lm(tmp_path / "learner", family, seed=2)
    engine_dir = build_causal_lm(tmp_path / "engine", family, seed=2)
    noisy = _model(engine_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in moe_routers(noisy):
            router.weight.add_(0.15 * router.weight.std() * torch.randn(router.weight.shape, generator=gen))
    noisy.save_pretrained(engine_dir)
    worker = RolloutWorker(
        str(engine_dir), RolloutConfig(engine="hf", record_routing=True), initial_version=0
    )
    return learner_dir, worker.generate(list(range(6)), PROMPTS * 2, seed=7, sampling=SAMPLING)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_learner_forward_replays_r3(tmp_path, family):
    """learner.forward_scores with replay (learner.router_replay 'R3'), padded and packed: every recorded
    token routed as the engine did, the logprobs closer to the engine's than without replay, packed equal
    to padded, and the routers' weights get gradients; R3 on a batch without routing is refused by name."""
    from cluster.records.trajectories import to_trajectory
    from learner.batch import pack_trajectories
    from learner.config import LearnerConfig
    from learner.context import LearnerContext
    from learner.forward import forward_scores
    from learner.model import PolicyWithValueHead
    from learner.prepare import proximal_pass

    learner_dir, samples = _noisy_engine_samples(tmp_path, family)
    b = pack_trajectories([to_trajectory(s, None, 1.0) for s in samples], pad_id=0)
    model = PolicyWithValueHead.from_pretrained(str(learner_dir), value_head_std=0.1)
    valid = b.mask.bool()
    recorded = (b.routing[..., 0, 0] != NOT_RECORDED).flatten()
    gaps, scores = {}, {}
    for packed in (False, True):
        for replay in (False, True):
            model.zero_grad()
            with _experts_used(model) as seen:  # what the experts get, after every router hook
                s = forward_scores(model, b, 1.0, packed=packed, replay=replay)
            gaps[packed, replay] = (s.logprobs - b.tokens.behaviour_logprobs)[valid].abs().mean().item()
            scores[packed, replay] = s.logprobs[valid].detach()
            if replay:
                routed = [t[0].to(torch.uint8) for t in seen]
                real = b.attention_mask.bool().flatten()
                want = b.routing.flatten(0, 1)[real] if packed else b.routing.flatten(0, 1)
                rec = recorded[real] if packed else recorded
                assert all(torch.equal(routed[i][rec], want[rec, i]) for i in range(2))
                s.logprobs[valid].sum().backward()
                assert all(r.weight.grad.abs().sum() > 0 for r in moe_routers(model))
    print(
        f"{family}: mean |learner - engine logprob| no replay {gaps[False, False]:.4f}, R3 {gaps[False, True]:.4f}"
    )
    assert gaps[False, True] < gaps[False, False]
    torch.testing.assert_close(scores[True, True], scores[False, True], atol=1e-5, rtol=0)
    without = pack_trajectories([to_trajectory(s, None, 1.0) for s in samples], pad_id=0)
    without.routing = None
    ctx = LearnerContext(engine=None, config=LearnerConfig(router_replay="R3"), temperature=1.0, pad_id=0)
    with pytest.raises(ValueError, match=r"learner.router_replay='R3'.*rollout.record_routing"):
        proximal_pass(ctx, without)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_prepare_and_ppo_update_replay_r3(tmp_path, family):
    """The learner's step under learner.router_replay 'R3' (prepare's proximal pass, the PPO passes) on a
    noisy engine's samples: the proximal logprobs are the replayed ones (closer to the engine's), the
    routers get gradients, and packed and padded micro-batches give the same minibatch gradients."""
    from test_learner_packing import GradientTap

    class Tap(GradientTap):  # a DeepSpeed engine is a module holding the model: its routers are found
        def modules(self):
            return self.model.modules()

    from cluster.records.trajectories import to_trajectory
    from learner.batch import pack_trajectories
    from learner.config import LearnerConfig
    from learner.context import LearnerContext
    from learner.model import PolicyWithValueHead
    from learner.ppo_step import ppo_update
    from learner.prepare import prepare

    learner_dir, samples = _noisy_engine_samples(tmp_path, family)
    routers_grads, old = {}, {}
    for replay, packed in (("none", False), ("R3", False), ("R3", True)):
        torch.manual_seed(0)
        tap = Tap(PolicyWithValueHead.from_pretrained(str(learner_dir), value_head_std=0.1))
        config = LearnerConfig(
            ppo_epochs=1, num_minibatches=2, micro_batch_size=3, router_replay=replay, pack_sequences=packed
        )
        batch = pack_trajectories(
            [to_trajectory(s, s.logprobs, float(i % 2)) for i, s in enumerate(samples)], 0
        )
        prepare(LearnerContext(tap, config, 1.0, 0), batch, 0.0)
        ppo_update(LearnerContext(tap, config, 1.0, 0, torch.Generator().manual_seed(3)), batch)
        valid = batch.mask.bool()
        old[replay, packed] = (
            (batch.tokens.old_logprobs - batch.tokens.behaviour_logprobs)[valid].abs().mean()
        )
        names = [n for n in tap.grads[0] if n.endswith("mlp.gate.weight")]
        assert len(names) == 2 and all(g[n].abs().sum() > 0 for g in tap.grads for n in names)
        routers_grads[replay, packed] = tap.grads
    assert old["R3", False] < old["none", False]
    torch.testing.assert_close(old["R3", True], old["R3", False], atol=1e-6, rtol=0)
    for a, c in zip(routers_grads["R3", True], routers_grads["R3", False], strict=True):
        for n in c:
            scale = max(1.0, float(c[n].abs().max()))
            torch.testing.assert_close(a[n], c[n], atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_r2_replays_the_proximal_pass(tmp_path, family):
    """learner.router_replay 'R2': the proximal pass (padded or packed) keeps its own routing in the batch,
    equal to a plain forward's at every real token; after the routers move (noise, as an optimizer step
    between minibatches would), the PPO passes' forwards still route as the proximal pass did; the
    routers get gradients; R2 without a proximal pass (bypass) is refused by name."""
    from test_learner_packing import GradientTap

    from cluster.records.trajectories import to_trajectory
    from learner.batch import pack_trajectories
    from learner.config import LearnerConfig
    from learner.context import LearnerContext
    from learner.forward import forward_scores
    from learner.model import PolicyWithValueHead
    from learner.ppo_step import ppo_update
    from learner.prepare import proximal_pass

    class Tap(GradientTap):
        def modules(self):
            return self.model.modules()

    learner_dir, samples = _noisy_engine_samples(tmp_path, family)
    kept = {}
    for packed in (False, True):
        model = PolicyWithValueHead.from_pretrained(str(learner_dir), value_head_std=0.1)
        config = LearnerConfig(router_replay="R2", pack_sequences=packed, micro_batch_size=5)
        batch = pack_trajectories(
            [to_trajectory(s, s.logprobs, 1.0) for s in samples], 0
        )  # no engine routing
        batch.routing = None
        proximal_pass(LearnerContext(Tap(model), config, 1.0, 0), batch)
        real = batch.attention_mask.bool()
        with torch.no_grad(), record_routing(model) as own:
            forward_scores(model, batch, 1.0)
        own = torch.stack([t[0] for t in own], dim=1).view(*real.shape, 2, 2)
        assert torch.equal(batch.routing[real], own[real])
        assert (batch.routing[~real] == NOT_RECORDED).all()
        kept[packed] = batch.routing
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for r in moe_routers(model):
                r.weight.add_(0.3 * r.weight.std() * torch.randn(r.weight.shape, generator=gen))
        with torch.no_grad(), record_routing(model) as drifted:
            forward_scores(model, batch, 1.0)
        drifted = torch.stack([t[0] for t in drifted], dim=1).view(*real.shape, 2, 2)
        assert not torch.equal(drifted[real], own[real])  # the moved routers alone would route elsewhere
        with _experts_used(model) as used:
            s = forward_scores(model, batch, 1.0, packed=packed, replay=True)
        used = torch.stack([t[0] for t in used], dim=1).to(torch.uint8)
        assert torch.equal(used if packed else used.view(*real.shape, 2, 2)[real], own[real])
        s.logprobs[batch.mask.bool()].sum().backward()
        assert all(r.weight.grad.abs().sum() > 0 for r in moe_routers(model))
        if packed:  # through ppo_update (one minibatch, one packed micro-batch of shuffled rows): the
            # tokens' expert choices are, as a multiset, the proximal pass's, not the drifted routers'
            batch.tokens.old_logprobs = batch.tokens.behaviour_logprobs.clone()
            batch.tokens.advantages = torch.ones_like(batch.mask)
            batch.tokens.returns = torch.zeros_like(batch.mask)
            batch.tokens.old_values = torch.zeros_like(batch.mask)
            config = config.model_copy(update={"num_minibatches": 1, "micro_batch_size": 64})
            with _experts_used(model) as used:
                ppo_update(
                    LearnerContext(Tap(model), config, 1.0, 0, torch.Generator().manual_seed(3)), batch
                )
            used = torch.stack([t[0] for t in used], dim=1).to(torch.uint8).flatten(1)

            def multiset(x):
                return sorted(map(tuple, x.flatten(1).tolist()))

            assert multiset(used) == multiset(own[real]) != multiset(drifted[real])
    assert torch.equal(kept[True], kept[False])
    bypassed = pack_trajectories([to_trajectory(s, s.logprobs, 1.0) for s in samples], 0)
    bypassed.routing = None
    ctx = LearnerContext(None, LearnerConfig(router_replay="R2"), 1.0, 0)
    with pytest.raises(ValueError, match=r"learner.router_replay='R2'.*learner.bypass"):
        ppo_update(ctx, bypassed)


def test_r3_without_engine_recording_is_a_config_error():
    from test_config import tree

    from cluster.config.schema import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"learner.router_replay='R3'.*rollout.record_routing=true"):
        build_config(tree(learner={"router_replay": "R3"}))
    cfg = build_config(tree(learner={"router_replay": "R3"}, rollout={"record_routing": True}))
    assert cfg.learner.router_replay == "R3" and cfg.rollout.record_routing
    assert build_config(tree(learner={"router_replay": "R2"})).learner.router_replay == "R2"
