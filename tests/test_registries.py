"""Every part the config names comes from one registry type (`kernel.registry.Registry`): the config's
allowed values are the registry's names, wherever the field lives (a role's config may not import the
cluster's registries, so for those the equality is checked here)."""

from __future__ import annotations

from typing import get_args

import pytest

from cluster.config.filters import FILTERS
from cluster.config.pipelines import PIPELINES
from cluster.config.schema import RunConfig
from cluster.weights.syncs import WEIGHT_SYNCS
from kernel.registry import Part, Registry
from learner.registry import SCHEDULES
from rollout_workers.engines import ENGINES


def field_values(path: str) -> set[str]:
    model = RunConfig
    *parents, name = path.split(".")
    for p in parents:
        model = model.model_fields[p].annotation
    return set(get_args(model.model_fields[name].annotation))


@pytest.mark.parametrize(
    ("path", "registry"),
    [
        ("pipeline.mode", PIPELINES),
        ("rollout.weight_sync", WEIGHT_SYNCS),
        ("learner.lr_schedule", SCHEDULES),
        ("rollout.engine", ENGINES),
    ],
)
def test_a_fields_allowed_values_are_its_registrys_names(path, registry):
    assert field_values(path) == set(registry.names())
    assert registry.field == path


def test_the_judges_engines_are_the_judge_configs_choices_and_rollout_engines():
    from cluster.roles.judge_engines import JUDGE_ENGINES

    assert field_values("reward.judge.engine") == set(JUDGE_ENGINES.names())
    assert set(JUDGE_ENGINES.names()) <= set(ENGINES.names())


def test_an_engine_declares_its_devices_and_sequence_limit():
    from rollout_workers.config import RolloutConfig

    hf, vllm = RolloutConfig(engine="hf"), RolloutConfig(engine="vllm", vllm={"tensor_parallel_size": 2})
    assert ENGINES["hf"].devices(hf) == 1 and ENGINES["vllm"].devices(vllm) == 2
    assert ENGINES["hf"].fit_length(hf, 99) is hf
    assert ENGINES["vllm"].fit_length(vllm, 99).vllm.max_model_len == 99
    fixed = RolloutConfig(engine="vllm", vllm={"max_model_len": 50})
    assert ENGINES["vllm"].fit_length(fixed, 99).vllm.max_model_len == 50  # the user's limit stays


def test_an_engine_declares_the_room_adapters_need_and_the_users_config_is_never_written():
    """rollout.lora_sync='adapter': the workers' section gets vLLM's max_lora_rank from learner.lora.rank
    (`Engine.fit_adapters`, applied where the workers' section is built); the user's config keeps null."""
    from test_config import tree

    from cluster.config.schema import build_config
    from cluster.placement.rollout_gpus import worker_config

    cfg = build_config(
        tree(rollout={"engine": "vllm", "lora_sync": "adapter"}, learner={"lora": {"rank": 4}})
    )
    assert cfg.rollout.vllm.max_lora_rank is None  # what the user wrote
    assert worker_config(cfg).vllm.max_lora_rank == 4  # what the workers are built with
    hf = build_config(tree(rollout={"lora_sync": "adapter"}, learner={"lora": {"rank": 4}}))
    assert worker_config(hf).vllm.max_lora_rank is None  # the hf engine needs no room
    with pytest.raises(ValueError, match="max_lora_rank=2 is below learner.lora.rank=4"):
        build_config(
            tree(
                rollout={"engine": "vllm", "lora_sync": "adapter", "vllm": {"max_lora_rank": 2}},
                learner={"lora": {"rank": 4}},
            )
        )


def test_every_registered_part_of_the_cluster_resolves():
    for registry in (PIPELINES, WEIGHT_SYNCS, SCHEDULES, FILTERS):
        for part in registry:
            assert registry.function(part.name) is not None


def test_registering_the_same_definition_again_replaces_it_and_another_is_refused():
    reg: Registry[Part] = Registry("widget", "x.widget")

    def make():
        def f():
            return 1

        return f

    first = make()
    reg.register("w")(first)
    reg.register("w")(first)  # its module run again: harmless
    assert reg.function("w") is first
    with pytest.raises(ValueError, match=r"widget 'w' is already registered by .*make\.<locals>\.f"):
        reg.register("w")(lambda: 2)
    with pytest.raises(ValueError, match=r"unknown widget 'v' \(x\.widget\); allowed: w"):
        reg["v"]


def test_a_part_described_in_a_module_of_its_own_is_listed_by_module_attr_and_read_on_first_use(
    tmp_path, monkeypatch
):
    """A part listed by the `"module:attr"` of the part itself (a role in a module of its own): its module
    is imported when the registry is first read, not when the registry is built, and it keeps its
    place in the listed order; a second part of its name is refused then."""
    import sys

    (tmp_path / "own_widget.py").write_text(
        "from kernel.registry import Part\nOWN = Part(name='own', function=len, summary='its own')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    first, last = Part(name="a", function=min), Part(name="z", function=max)
    reg: Registry[Part] = Registry("widget", "x.widget", [first, "own_widget:OWN", last])
    assert "own_widget" not in sys.modules
    assert reg.names() == ("a", "own", "z") and "own_widget" in sys.modules
    assert reg.function("own") is len and reg.describe().startswith("'a'; 'own': its own")
    twice: Registry[Part] = Registry("widget", "x.widget", ["own_widget:OWN", Part(name="own", function=abs)])
    with pytest.raises(ValueError, match="widget 'own' is registered twice"):
        twice.names()
    monkeypatch.delitem(sys.modules, "own_widget")


def test_the_group_filters_are_the_dynamic_sampling_filters_allowed_names():
    """data.dynamic_sampling.filter takes a user function's path too, so its type is a str: its built-in
    names, the refusal's allowed values and its reference text are read from `FILTERS`."""
    from cluster.config.data_section import DynamicSamplingSection
    from cluster.config.filters import check_filter_spec

    assert FILTERS.field == "data.dynamic_sampling.filter" and FILTERS.names() == ("none", "nonzero_std")
    for name in FILTERS.names():
        assert DynamicSamplingSection(filter=name).filter == name
    with pytest.raises(
        ValueError, match=r"unknown filter 'std'; allowed: 'none', 'nonzero_std', or 'package"
    ):
        check_filter_spec("std")
    assert FILTERS.describe() in DynamicSamplingSection.model_fields["filter"].description
    assert (
        FILTERS.function("none")(1e-6) is None
        and FILTERS.function("nonzero_std")(0.5).__name__ == "nonzero_std"
    )
