"""learner.bundle_probe: the learner's probe logprobs scored from the exported weights on a skeleton.

Against the model's own forward on real transformers models of every family the tests build: a float32
bundle gives the same logprobs; a bfloat16 bundle scored in float32 gives what the float32 model with
bf16-rounded weights computes (so the weights' rounding is out of the comparison, the arithmetic in);
the bundle's tensors are used in place and left as they were; a bundle that does not match the model
is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, build_causal_lm
from transformers import AutoModelForCausalLM

from kernel.sequences import probe_sequences, right_padded
from learner.bundle_probe import bundle_probe_logprobs


def _own_forward(model, sequences) -> list[np.ndarray]:
    ids, mask = right_padded(sequences)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return [row[: int(n) - 1].numpy() for row, n in zip(logp, mask.sum(-1), strict=True)]


def _gap(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    path = build_causal_lm(tmp_path_factory.mktemp(request.param), request.param)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_a_float32_bundle_scores_what_the_model_computes(family_model):
    sequences = probe_sequences(family_model.config.vocab_size)
    bundle = {k: v.detach().clone() for k, v in family_model.state_dict().items()}
    before = {k: v.clone() for k, v in bundle.items()}
    scored = bundle_probe_logprobs(family_model.config, bundle, sequences)
    assert _gap(scored, _own_forward(family_model, sequences)) <= 1e-5
    assert all(torch.equal(bundle[k], before[k]) and bundle[k].dtype == before[k].dtype for k in bundle)


def test_a_bfloat16_bundle_is_scored_in_float32_on_its_rounded_weights(family_model):
    sequences = probe_sequences(family_model.config.vocab_size)
    bundle = {
        k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()
        for k, v in family_model.state_dict().items()
    }
    rounded = AutoModelForCausalLM.from_config(family_model.config, dtype=torch.float32).eval()
    rounded.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in bundle.items()})
    scored = bundle_probe_logprobs(family_model.config, bundle, sequences, dtype=torch.float32)
    assert _gap(scored, _own_forward(rounded, sequences)) <= 1e-5
    assert all(v.dtype == torch.bfloat16 for v in bundle.values() if v.is_floating_point())
    # and the rounding itself is visible against the float32 weights (the check is not vacuous)
    assert _gap(scored, _own_forward(family_model, sequences)) > 1e-5


def test_a_bundle_that_does_not_match_the_model_is_refused_by_name(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_causal_lm(tmp_path, "llama")).eval()
    sequences = probe_sequences(model.config.vocab_size)
    state = dict(model.state_dict())
    missing = dict(state)
    del missing["model.norm.weight"]
    with pytest.raises(KeyError, match=r"missing \['model.norm.weight'\]"):
        bundle_probe_logprobs(model.config, missing, sequences)
    with pytest.raises(KeyError, match=r"unknown \['model.extra.weight'\]"):
        bundle_probe_logprobs(model.config, {**state, "model.extra.weight": torch.zeros(2)}, sequences)
