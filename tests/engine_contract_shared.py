"""What the rollout engine contract modules share: the engines (every entry of
`rollout_workers.engines.ENGINES`; `vllm` marked `vllm` and skipped where vLLM does not import), the two tiny GPT-2 policies (tied embeddings, head_dim 32: vLLM's
CPU attention needs >= 32), the per-engine `worker` fixture, and the float32 transformers references
the engines are held to (teacher-forced logprobs, probe logprobs, bundles).

tests/test_engine_contract.py (generation) and tests/test_engine_weights_contract.py (weights, sleep /
wake-up) import the fixtures; both are module-scoped, so each module builds its own policies and
workers.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from extras import needs
from transformers import AutoModelForCausalLM

from kernel.sequences import (
    gather_response,
    pack_sequences,
    probe_sequences,
    response_tokens,
    sequence_logprobs,
)
from rollout_workers.config import RolloutConfig
from rollout_workers.engines import ENGINES as _REGISTRY
from rollout_workers.hf_engine import truncate_logits
from rollout_workers.types import Sample
from rollout_workers.worker import RolloutWorker

TOL = 1e-4  # float32 engines against a float32 transformers forward
EOS, VOCAB, CONTEXT = 2, 28, 64
PROMPTS = [np.array([1]), np.array([1, 4, 5, 6]), np.array([1, 4, 5, 6, 9, 10, 11, 12, 13])]
INDICES = [7, 3, 11]

NO_VLLM = importlib.util.find_spec("vllm") is None  # for the tests of vLLM's own paths


def _engine_param(name: str):
    """A registered engine as a parameter; one with an optional package (`Engine.extra`) needs it."""
    extra = _REGISTRY[name].extra
    return pytest.param(name, id=name, marks=needs(extra) if extra else ())


ENGINES = [_engine_param(name) for name in _REGISTRY.names()]  # every registered engine


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> tuple[str, str]:
    from tiny_models import build_policy

    root = tmp_path_factory.mktemp("contract")
    return str(build_policy(root / "a", seed=0, n_embd=64)), str(build_policy(root / "b", seed=1, n_embd=64))


@pytest.fixture(scope="module", params=ENGINES)
def worker(request, policies) -> RolloutWorker:
    """One worker per engine for the module; tests that swap weights put policy A back (version up)."""
    return RolloutWorker(policies[0], RolloutConfig(engine=request.param), initial_version=0)


def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def teacher_forced_gap(
    path: str, samples: list[Sample], temperature: float, top_k: int = 0, top_p: float = 1.0
) -> float:
    """Max |behaviour logprob - float32 teacher-forced logprob| over every response token, under the
    distribution sampled from (tempered, truncated to top_k/top_p and renormalised)."""
    ids, attn, prompt_lens, rmask = pack_sequences(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples], 0
    )
    with torch.no_grad():
        logits = hf_model(path)(input_ids=ids, attention_mask=attn).logits.float()
    R = rmask.shape[1]
    scaled = truncate_logits(gather_response(logits, prompt_lens, R) / temperature, top_k, top_p)
    logp = torch.log_softmax(scaled, dim=-1)
    expected = logp.gather(-1, response_tokens(ids, prompt_lens, R).unsqueeze(-1)).squeeze(-1)
    got = torch.zeros_like(expected)
    for i, s in enumerate(samples):
        got[i, : len(s.logprobs)] = torch.from_numpy(s.logprobs)
    return float(torch.where(rmask.bool(), (expected - got).abs(), 0.0).max())  # padding may be -inf


def probe_reference(path: str) -> list[np.ndarray]:
    model = hf_model(path)
    out = []
    with torch.no_grad():
        for seq in probe_sequences(VOCAB):
            ids = torch.from_numpy(seq)
            out.append(sequence_logprobs(model(input_ids=ids[None]).logits[0], ids).numpy())
    return out


def probe_gap(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def sample_key(samples: list[Sample]) -> list[tuple]:
    return [(s.prompt_index, s.sample_index, s.response_ids.tolist()) for s in samples]


def bundle_of(path: str) -> dict[str, torch.Tensor]:
    return hf_model(path).state_dict()
