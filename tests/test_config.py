"""Config errors name the field and the allowed values; the CLI exits 2 before any actor starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config.schema import ConfigError, apply_overrides, build_config, load_config
from cluster.train import main

BASE = {
    "model": {"policy_path": "p"},
    "data": {"prompts_path": "prompts.jsonl"},
    "reward": {"model_path": "r"},
}


def tree(**sections):
    out = {k: dict(v) for k, v in BASE.items()}
    for key, value in sections.items():
        out.setdefault(key, {}).update(value)
    return out


def test_defaults_fill_every_section():
    cfg = build_config(tree())
    assert (
        cfg.learner.zero_stage == 2
        and cfg.rollout.engine == "hf"
        and cfg.cluster.dashboard_host == "127.0.0.1"
    )
    assert cfg.tokenizer_path == "p" and cfg.reference_path == "p"


def test_unknown_key_is_named_with_its_path():
    with pytest.raises(ConfigError, match=r"learner\.lrr: unknown field"):
        build_config(tree(learner={"lrr": 1.0}))


def test_wrong_literal_names_field_and_allowed_values():
    with pytest.raises(ConfigError) as info:
        build_config(tree(rollout={"engine": "sglang"}))
    assert "rollout.engine" in str(info.value) and "'hf'" in str(info.value) and "'vllm'" in str(info.value)
    with pytest.raises(ConfigError, match=r"learner\.kl\.estimator"):
        build_config(tree(learner={"kl": {"estimator": "k9"}}))


def test_sleep_level_names_the_field_and_allowed_values():
    assert build_config(tree()).rollout.sleep_level == 0
    with pytest.raises(ConfigError) as info:
        build_config(tree(rollout={"sleep_level": 3}))
    assert "rollout.sleep_level" in str(info.value) and "0, 1 or 2" in str(info.value)


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"data\.prompts_per_step"):
        build_config(tree(data={"prompts_per_step": "many"}))


def test_impossible_combinations():
    with pytest.raises(ConfigError, match="num_minibatches"):
        build_config(tree(data={"prompts_per_step": 4}, learner={"num_minibatches": 8}))
    with pytest.raises(ConfigError, match="num_ranks"):
        build_config(tree(data={"prompts_per_step": 2}, learner={"num_ranks": 4}))
    with pytest.raises(ConfigError, match="reward.url"):
        build_config(tree(reward={"kind": "remote"}))
    with pytest.raises(ConfigError, match="num_gpus_per_worker=1.0 with rollout.vllm.tensor_parallel_size=2"):
        build_config(
            tree(rollout={"engine": "vllm", "num_gpus_per_worker": 1, "vllm": {"tensor_parallel_size": 2}})
        )
    with pytest.raises(ConfigError, match="num_gpus_per_worker=2.0 but one vLLM engine"):
        build_config(tree(rollout={"engine": "vllm", "num_gpus_per_worker": 2}))
    build_config(tree(rollout={"engine": "vllm"}))  # vLLM's CPU build: no GPU needed
    build_config(tree(rollout={"weight_sync": "collective"}, pipeline={"mode": "async"}))
    build_config(
        tree(rollout={"engine": "vllm", "num_gpus_per_worker": 4, "vllm": {"tensor_parallel_size": 4}})
    )


def test_overrides_parse_yaml_scalars():
    t = apply_overrides(
        tree(), ["learner.lr=1e-5", "learner.kl.adaptive=true", "run.steps=3", "reference.model_path=null"]
    )
    cfg = build_config(t)
    assert cfg.learner.lr == 1e-5 and cfg.learner.kl.adaptive is True and cfg.run.steps == 3
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides(tree(), ["learner.lr"])


def test_load_config_errors_name_the_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_shipped_configs_are_valid():
    for path in Path(__file__).parent.parent.glob("configs/*.yaml"):
        load_config(path)


def test_cli_exits_2_on_bad_input(tmp_path: Path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tree(learner={"zero_stage": 1})))
    assert main([str(cfg)]) == 2
    assert "learner.zero_stage" in capsys.readouterr().err
    cfg.write_text(yaml.safe_dump(tree()))
    assert main([str(cfg)]) == 2
    assert "model.policy_path: folder not found" in capsys.readouterr().err


def test_environment_combinations_are_named():
    env = {"environment": {"name": "tools", "max_total_tokens": 48}}
    with pytest.raises(ConfigError, match="reward.kind='environment'.*rollout.environment.name"):
        build_config(tree(reward={"kind": "environment"}))
    with pytest.raises(ConfigError, match="data.max_prompt_tokens=64 leaves no room"):
        build_config(tree(rollout=env, data={"max_prompt_tokens": 64}))
    with pytest.raises(ConfigError, match="overlong.buffer"):
        build_config(tree(rollout=env, learner={"overlong": {"buffer": 4}}, data={"max_prompt_tokens": 8}))
    with pytest.raises(ConfigError, match="placement"):
        build_config(tree(rollout={"environment": {"name": "tools", "placement": "sandbox"}}))
    cfg = build_config(tree(rollout=env, reward={"kind": "environment"}, data={"max_prompt_tokens": 8}))
    assert cfg.rollout.environment.enabled and not cfg.rollout.environment.max_turns < 1


def test_bootstrap_truncation_with_an_environment_is_refused():
    """With an environment the state after a cut episode's last model token is always followed by
    observation tokens (masked: the critic is never trained there), so `truncation: bootstrap` would take
    every episode ending at max_turns / max_total_tokens from an untrained value: refused, naming both
    fields and the alternatives."""
    env = {"environment": {"name": "tools", "max_total_tokens": 48}}
    small = {"max_prompt_tokens": 8}
    with pytest.raises(ConfigError) as info:
        build_config(tree(rollout=env, data=small, learner={"truncation": "bootstrap"}))
    message = str(info.value)
    assert "learner.truncation='bootstrap'" in message and "rollout.environment.name" in message
    assert "learner.truncation='terminal'" in message
    assert build_config(tree(rollout=env, data=small)).learner.truncation == "terminal"
    assert build_config(tree(learner={"truncation": "bootstrap"})).learner.truncation == "bootstrap"


def test_the_configuration_reference_is_the_schema():
    """docs/config-reference.md is `python -m cluster.config.fields_doc`'s output: a field added to or
    changed in the schema without regenerating it fails here (regenerate with that command)."""
    from pathlib import Path

    from cluster.config.fields_doc import render, rows
    from cluster.config.schema import RunConfig

    doc = Path(__file__).resolve().parent.parent / "docs" / "config-reference.md"
    assert doc.read_text() == render(), (
        "regenerate: python -m cluster.config.fields_doc > docs/config-reference.md"
    )
    paths = [p for p, *_ in rows(RunConfig)]
    for field in ("learner.dtype", "data.add_bos", "rollout.interruptible", "learner.deepspeed_overrides"):
        assert field in paths
    assert len(paths) == len(set(paths))


def test_the_scorers_reward_function_deadline_is_resolved_in_a_copy_and_checked():
    """reward.function_timeout_s unset: the scorers get half of timeouts.score_s, and the user's config
    keeps what they wrote (None); a set one is passed as it is, and one not below timeouts.score_s is
    refused naming both fields."""
    cfg = build_config(tree(timeouts={"score_s": 40.0}))
    assert cfg.reward.function_timeout_s is None and cfg.scorer_reward.function_timeout_s == 20.0
    assert cfg.scorer_reward.model_path == "r"
    set_one = build_config(tree(reward={"model_path": "r", "function_timeout_s": 3.0}))
    assert set_one.scorer_reward is set_one.reward and set_one.scorer_reward.function_timeout_s == 3.0
    with pytest.raises(
        ConfigError, match=r"reward\.function_timeout_s=40 must be below timeouts\.score_s=40"
    ):
        build_config(tree(reward={"model_path": "r", "function_timeout_s": 40.0}, timeouts={"score_s": 40.0}))


def test_derived_values_live_in_the_resolved_record_and_the_config_keeps_what_was_written():
    """'auto' stays 'auto' and an unset length stays null in the config (and in the run folder's
    config.yaml); `cfg.resolved` holds the decided values and the sections the learner ranks and the
    reference actors start with. A config.yaml written before (the derived values filled in) loads and
    resolves to the same values."""
    from cluster.roles.registry import LEARNER, REFERENCE

    lora = {"lora": {"rank": 4}, "lr_schedule": "cosine", "loss_agg": "seq-mean-token-sum-norm"}
    written = tree(
        learner={**lora, "advantage": "grpo", "grpo": {"norm_adv_by_std": False}, "pack_sequences": True},
        rollout={"sampling": {"n": 2, "max_new_tokens": 24}, "lora_sync": "adapter", "dtype": "bfloat16"},
        reference={"model_path": None},
        run={"steps": 5},
    )
    cfg = build_config(written)
    le, ref = cfg.learner, cfg.reference
    assert (le.off_policy, ref.source, ref.pack_sequences) == ("auto", "auto", None)
    assert (le.overlong.max_tokens, le.loss_norm_tokens, le.lr_schedule_steps) == (None, None, None)
    assert not le.reference_from_base and not le.export_adapter
    r = cfg.resolved
    assert (r.off_policy, r.reference_source, r.reference_pack_sequences) == ("tis", "policy_base", True)
    assert (r.overlong_max_tokens, r.loss_norm_tokens, r.lr_schedule_steps) == (24, 24, 5)
    assert r.reference_from_base and r.export_adapter
    learner = r.learner
    assert (learner.off_policy, learner.overlong.max_tokens, learner.loss_norm_tokens) == ("tis", 24, 24)
    assert (learner.lr_schedule_steps, learner.reference_from_base, learner.export_adapter) == (5, True, True)
    assert (r.reference.source, r.reference.pack_sequences) == ("policy_base", True)
    assert LEARNER.args(cfg, type("P", (), {"slot": 0, "pad_token_id": 0})())[3] == learner
    assert REFERENCE.args(cfg, None)[1] == r.reference and not REFERENCE.runs(cfg)
    assert cfg.learner.off_policy == "auto"  # handing the roles their sections wrote nothing back
    # the record is frozen; the old config.yaml of a run, derived values written in, resolves the same
    with pytest.raises(AttributeError):
        r.off_policy = "none"
    old = cfg.model_dump(mode="json")
    old["learner"].update(
        off_policy="tis",
        loss_norm_tokens=24,
        lr_schedule_steps=5,
        reference_from_base=True,
        export_adapter=True,
    )
    old["learner"]["overlong"].update(max_tokens=24)
    old["reference"].update(source="policy_base", pack_sequences=True)
    again = build_config(yaml.safe_load(yaml.safe_dump(old)))
    assert again.resolved.learner == learner and again.resolved.reference == r.reference
    assert build_config(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))).resolved == r
