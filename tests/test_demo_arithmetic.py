"""The arithmetic demo: its task split and corpus, its offline build, and a few real PPO steps with
held-out evaluation (sync and streaming) on prompts the run never trains on."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from demos.arithmetic import (
    BAND,
    LM_MIN_LR_RATE,
    LM_WARMUP_FRAC,
    MAX_OPERAND,
    N_EVAL,
    N_RL,
    N_VAL,
    AssetPaths,
    Band,
    BuildQualityError,
    char_tokenizer,
    corpus,
    ensure_assets,
    lr_schedule,
    near_miss,
    pretrain,
    split_problems,
)
from demos.common import read_manifest, selection_steps

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "arithmetic_tiny.yaml"


def test_split_is_a_seeded_partition_of_all_problems():
    held_out, rl, pre_only = split_problems(0)
    assert (len(held_out), len(rl)) == (N_EVAL, N_RL)
    every = set(held_out) | set(rl) | set(pre_only)
    assert len(every) == len(held_out) + len(rl) + len(pre_only) == (MAX_OPERAND + 1) ** 2
    assert split_problems(0) == (held_out, rl, pre_only) and split_problems(1)[0] != held_out


def test_corpus_has_the_right_share_of_correct_sums_and_never_a_held_out_problem():
    held_out, rl, pre_only = split_problems(0)
    texts = corpus(0, rl + pre_only, 0.4, 20_000)
    parsed = [tuple(int(x) for x in t.replace("=", "+").split("+")) for t in texts]
    assert not {(a, b) for a, b, _ in parsed} & set(held_out)
    right = sum(a + b == c for a, b, c in parsed) / len(parsed)
    assert right == pytest.approx(0.4, abs=0.015)  # binomial sd ~0.0035
    rng = random.Random(0)
    for total in [0, 1, 9, 10, 55, 198]:
        misses = {near_miss(rng, total) for _ in range(200)}
        assert total not in misses and min(misses) >= 0


def test_char_tokenizer_prepends_bos_and_round_trips():
    tok = char_tokenizer()
    ids = tok("12+35=").input_ids
    assert ids[0] == tok.bos_token_id == 1 and len(ids) == 7
    assert tok.decode(ids, skip_special_tokens=True) == "12+35="
    assert tok.decode([*tok("47").input_ids[1:], tok.eos_token_id], skip_special_tokens=True) == "47"


def test_lr_schedule_warms_up_then_decays_by_cosine_to_the_floor():
    import torch

    steps = 200
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = lr_schedule(opt, steps)
    lrs = []
    for _ in range(steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    warm = round(LM_WARMUP_FRAC * steps)
    assert lrs[0] == 0.0 and lrs[warm] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:warm], lrs[1 : warm + 1], strict=True))  # rising
    assert all(a >= b for a, b in zip(lrs[warm:], lrs[warm + 1 :], strict=False))  # then never rising
    mid = warm + (steps - warm) // 2  # half-way through the cosine: half-way to the floor
    assert lrs[mid] == pytest.approx((1 + LM_MIN_LR_RATE) / 2, abs=0.01)
    assert lrs[-1] == pytest.approx(LM_MIN_LR_RATE, abs=0.001)


def test_selection_steps_are_the_second_half_and_the_last():
    assert selection_steps(1000, 100) == [600, 700, 800, 900, 1000]
    assert selection_steps(1050, 100) == [600, 700, 800, 900, 1000, 1050]
    assert selection_steps(10, 100) == [10]


def test_pretrain_keeps_the_weights_with_the_best_selection_score_ties_to_the_later():
    import torch

    torch.manual_seed(0)
    lm = torch.nn.Linear(3, 1)
    x = torch.randn(8, 3)
    scores = iter([0.5, 0.9, 0.7, 0.9, 0.6])  # steps 6, 7, 8, 9, 10: the best twice, at 7 and 9
    snapshots = {}

    def select() -> float:
        snapshots[len(snapshots)] = [p.detach().clone() for p in lm.parameters()]
        return next(scores)

    loss = lambda rows: lm(x[rows]).pow(2).mean()  # noqa: E731
    curve = pretrain(lm, 10, 8, loss, select, seed=0, log=lambda _m: None, select_every=1)
    assert curve["accuracy_by_step"] == {6: 0.5, 7: 0.9, 8: 0.7, 9: 0.9, 10: 0.6}
    assert (curve["selected_step"], curve["selected_accuracy"]) == (9, 0.9)
    picked = snapshots[3]  # scored at step 9, then trained on: the weights must be step 9's
    assert all(torch.equal(a, b) for a, b in zip(lm.parameters(), picked, strict=True))
    assert not lm.training


def test_band_names_itself_and_what_missed():
    band = Band(greedy_min=0.85, sampled_min=0.15, sampled_max=0.6)
    good = {"held_out_greedy_accuracy": 0.9, "held_out_sampled_accuracy": 0.35}
    assert band.misses(good) == [] and BAND.misses(good) == []
    band.check(good, seed=0, lm_steps=10)
    bad = {"held_out_greedy_accuracy": 0.555, "held_out_sampled_accuracy": 0.152}  # the build
    with pytest.raises(BuildQualityError, match=r"greedy accuracy >= 0\.85.*0\.555 < 0\.85"):
        band.check(bad, seed=3, lm_steps=10)
    too_sharp = {"held_out_greedy_accuracy": 0.97, "held_out_sampled_accuracy": 0.8}
    assert band.misses(too_sharp) == ["held-out sampled accuracy 0.800 outside [0.15, 0.6]"]


@pytest.fixture(scope="module")
def arithmetic_assets(tmp_path_factory) -> AssetPaths:
    """A quick build (few pretraining steps: the mechanics, not the accuracy, are under test)."""
    root = tmp_path_factory.mktemp("demo") / "arithmetic_tiny"
    return ensure_assets(root, lm_steps=10, check_band=False, quiet=True)


def test_a_build_that_misses_the_band_fails_and_publishes_nothing(tmp_path):
    root = tmp_path / "arithmetic_tiny"
    with pytest.raises(BuildQualityError, match="missed its quality band"):
        ensure_assets(root, lm_steps=10, quiet=True)
    assert not root.exists() or not any(root.iterdir())


def test_build_writes_loadable_disjoint_prompt_files(arithmetic_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = arithmetic_assets
    train = [json.loads(x) for x in a.prompts.read_text().splitlines()]
    held = [json.loads(x) for x in a.eval_prompts.read_text().splitlines()]
    assert (len(train), len(held)) == (N_RL, N_EVAL)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(int(r["answer"]) == sum(int(x) for x in r["prompt"][:-1].split("+")) for r in held)
    lm = AutoModelForCausalLM.from_pretrained(a.policy, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(a.policy, local_files_only=True)
    assert lm.config.vocab_size == len(tok) == 15
    m = read_manifest(a.root)
    assert m["lm_steps"] == 10 and 0.0 <= m["metrics"]["held_out_sampled_accuracy"] <= 1.0
    assert (m["band_checked"], m["band"], m["selection"]["step"]) == (False, None, 10)
    assert m["sizes"]["problems_selection"] == N_VAL


def _overrides(assets: AssetPaths, steps: int, **extra) -> list[str]:
    sets = {
        "model.policy_path": assets.policy,
        "model.demo_assets": None,
        "data.prompts_path": assets.prompts,
        "eval.prompts_path": assets.eval_prompts,
        "eval.max_prompts": 24,
        "eval.samples_per_prompt": 2,
        "eval.pass_k": "[1, 2]",
        "eval.every_steps": 1,
        "data.prompts_per_step": 8,  # x n = 16 samples per step
        "rollout.sampling.n": 2,
        "data.dynamic_sampling.filter": "none",  # exact sample counts (dynamic sampling has its own tests)
        "rollout.chunk_size": 8,
        "learner.micro_batch_size": 8,
        "run.steps": steps,
        "run.progress_bar": False,
        "run.sample_log_count": 3,
        "run.loggers": "[jsonl,prometheus]",
        "cluster.dashboard": False,
        "learner.torch_threads": 1,
        **extra,
    }
    return [f"{k}={'null' if v is None else v}" for k, v in sets.items()]


@pytest.mark.slow
def test_a_few_sync_steps_evaluate_on_held_out_prompts_only(ray_local, arithmetic_assets, tmp_path, capsys):
    from cluster.config.schema import load_config
    from cluster.pipeline.evaluation import headline
    from cluster.pipeline.run import Run
    from cluster.reporting.metrics import held_out_only, read_metrics

    cfg = load_config(CONFIG, _overrides(arithmetic_assets, 2))
    trainer = Run(cfg, tmp_path / "run")
    try:
        summary = trainer.train()
        metrics, batch = trainer.evaluator.evaluate()
        samples = [s for c in batch.chunks for s in ray_local.get(c.samples_ref)]  # the driver needs none
    finally:
        trainer.close()
    held = [json.loads(x)["prompt"] for x in arithmetic_assets.eval_prompts.read_text().splitlines()][:24]
    train = {json.loads(x)["prompt"] for x in arithmetic_assets.prompts.read_text().splitlines()}
    seen = {trainer.tokenizer.decode(s.prompt_ids, skip_special_tokens=True) for s in samples}
    assert seen == set(held) and not seen & train
    assert all(c.ref_logprobs_ref is None for c in batch.chunks)  # never trainable: no reference pass
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # the 'before' row, steps 1 and 2, then the 'after' row: a second row of the last step
    assert [r["step"] for r in rows] == [0, 1, 2, 2]
    assert [held_out_only(r) for r in rows] == [True, False, False, True]  # held-out numbers only
    assert "rollout/reward_mean" not in rows[0] and "rollout/reward_mean" not in rows[3]
    assert "eval/accuracy" in rows[1] and "eval/accuracy" not in rows[2]  # step 2's evaluation is the 'after'
    after = json.loads((tmp_path / "run" / "summary.json").read_text())["eval_after"]
    exactly = {"rel": 0, "abs": 0, "nan_ok": True}  # the curves' last point is the summary's, the evaluator's
    assert rows[3] == pytest.approx({"step": 2, **after}, **exactly)
    assert rows[3] == pytest.approx({"step": 2, **trainer.evaluator.after}, **exactly)
    for m in (rows[0], rows[1], rows[3], metrics):
        assert m["eval/samples"] + m["eval/reward_failures"] == 48
        assert 0.0 <= m["eval/accuracy"] <= 1.0 and 1.0 <= m["eval/response_length"] <= 4.0
    assert [rows[i]["eval/policy_version"] for i in (0, 1, 3)] == [0, 1, 2]
    assert metrics["eval/policy_version"] == 2 and metrics == pytest.approx(
        {**trainer.evaluator.after, "time/eval": metrics["time/eval"]}
    )  # the same seeds and weights give the same answers
    out = capsys.readouterr().out
    assert "held-out prompts before training" in out and "held-out prompts after training" in out
    assert out.count("held-out prompts after training") == 1  # one 'after' evaluation
    assert headline(rows[3]) in out.split("held-out prompts after training")[1]  # the printed numbers
    assert any(line.startswith("held-out (24 prompts): reward_mean") for line in summary.lines())


@pytest.mark.slow
def test_streaming_mode_evaluates_between_steps(ray_local, arithmetic_assets, tmp_path):
    from cluster.config.schema import load_config
    from cluster.pipeline.run import Run

    cfg = load_config(
        CONFIG,
        _overrides(arithmetic_assets, 4, **{"pipeline.mode": "async", "cluster.placement": "separate"}),
    )
    trainer = Run(cfg, tmp_path / "run")
    try:
        rows = [trainer.iteration() for _ in range(4)]
    finally:
        trainer.close()
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals, "no held-out round finished within 4 steps"
    for r in evals:
        assert r["eval/samples"] + r["eval/reward_failures"] == 48
        assert r["eval/policy_version"] >= r["eval/requested_at_step"]  # weights no older than asked for
    assert sum(r["rollout/samples"] for r in rows) == 4 * 16  # eval samples never trained on


def test_config_names_the_demo_and_eval_fields():
    from cluster.config.schema import ConfigError, load_config
    from cluster.pipeline.evaluation import eval_sampling

    cfg = load_config(CONFIG)
    assert (cfg.model.demo_assets.demo, cfg.eval.enabled) == ("arithmetic", True)
    # the default run: PPO + GAE on one sample per prompt (what bench-algos measured fastest), and
    # pass@k beside mean@n on the held-out set
    assert (cfg.learner.advantage, cfg.rollout.sampling.n, cfg.data.dynamic_sampling.enabled) == (
        "gae",
        1,
        False,
    )
    assert max(cfg.eval.pass_k) == cfg.eval.samples_per_prompt > 1
    # the GRPO + dynamic sampling alternative the config's header names is a valid run of the same config
    grpo = load_config(
        CONFIG,
        [
            "learner.advantage=grpo",
            "data.prompts_per_step=64",
            "rollout.sampling.n=8",
            "data.dynamic_sampling.filter=nonzero_std",
        ],
    )
    assert grpo.data.prompts_per_step * grpo.rollout.sampling.n == cfg.data.prompts_per_step
    assert "--set data.dynamic_sampling.filter=nonzero_std" in CONFIG.read_text()
    with pytest.raises(
        ConfigError, match="model.demo_assets.demo: .*one of arithmetic, calculator, sentiment"
    ):
        load_config(CONFIG, ["model.demo_assets.demo=chess"])
    assert load_config(
        CONFIG, ["eval.greedy=true", "rollout.engine=vllm"]
    ).eval.greedy  # top_k=1 on every engine
    assert not load_config(CONFIG, ["eval.prompts_path=null"]).eval.enabled
    greedy = eval_sampling(
        load_config(CONFIG, ["eval.greedy=true", "eval.samples_per_prompt=3", "eval.pass_k=[1]"])
    )
    assert (greedy.top_k, greedy.n, greedy.max_new_tokens) == (1, 3, 4)


def test_a_build_that_misses_its_band_is_a_config_error_naming_the_field(monkeypatch):
    """`make train` / `python -m cluster.train`: a demo build outside its band ends the start with one
    clear line (ConfigError naming model.demo_assets), not a traceback."""
    import demos
    from cluster.config.schema import ConfigError, load_config
    from cluster.train import preflight

    def missed(name, folder, quiet=False):
        raise BuildQualityError("held-out greedy accuracy 0.555 < 0.85: missed its quality band")

    monkeypatch.setattr(demos, "ensure_demo", missed)
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "arithmetic_tiny.yaml")
    with pytest.raises(ConfigError, match=r"model\.demo_assets: held-out greedy accuracy 0\.555"):
        preflight(cfg)
