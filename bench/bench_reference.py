"""What `reference.source: policy_base` saves and costs, both sides in one run (LoRA runs).

`python bench/bench_reference.py [qwen2-75m ...]` builds each model of bench/scale_models.SIZES (random
weights) and measures, each side in a fresh process on one torch thread, on the same 8 x 128 tokens:

- **actors**: a reference actor's process (`reward_service.reference.ReferencePolicy`, float32, the
  default `reference.dtype`): its resident memory after loading and its peak while scoring, and the
  seconds per scoring call. This is what `policy_base` removes, per reference replica.
- **policy_base**: the learner's LoRA model (`learner.model.PolicyWithValueHead`, rank 16, all-linear):
  the extra peak memory and seconds of the one more no-grad forward with the adapters off
  (`learner.lora.adapters_off`) that replaces the reference's.

The bare interpreter with torch and transformers imported is measured too, so the model's own share of
the reference process is visible.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MIB = 2**20
BATCH, LENGTH, PROMPT = 8, 128, 16


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tokens(vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (BATCH, LENGTH), generator=g)


def side_bare(_path: str) -> dict:
    import torch  # noqa: F401
    import transformers  # noqa: F401

    return {"rss_mib": _rss() / MIB, "peak_mib": _peak() / MIB}


def side_actors(path: str) -> dict:
    import numpy as np

    from reward_service.config import ReferenceConfig
    from reward_service.reference import ReferencePolicy

    ref = ReferencePolicy(path, ReferenceConfig(), temperature=1.0)
    loaded = _rss()
    ids = _tokens(ref.model.config.get_text_config().vocab_size).numpy()
    prompts = [np.asarray(r[:PROMPT]) for r in ids]
    responses = [np.asarray(r[PROMPT:]) for r in ids]
    ref.logprobs(prompts, responses)  # warm-up
    t0 = time.perf_counter()
    ref.logprobs(prompts, responses)
    return {"rss_mib": loaded / MIB, "peak_mib": _peak() / MIB, "seconds": time.perf_counter() - t0}


def side_policy_base(path: str) -> dict:
    import torch

    from learner.config import LoRAConfig
    from learner.lora import adapters_off
    from learner.model import PolicyWithValueHead
    from learner.sequences import response_tokens

    torch.manual_seed(0)
    model = PolicyWithValueHead.from_pretrained(path, lora=LoRAConfig(rank=16, alpha=32.0)).eval()
    ids = _tokens(model.policy.config.get_text_config().vocab_size)
    mask = torch.ones_like(ids)
    prompt = torch.full((BATCH,), PROMPT)
    R = LENGTH - PROMPT
    targets = response_tokens(ids, prompt, R)  # logprobs of the tokens only, as the learner scores
    with torch.no_grad():
        model(ids, mask, prompt, R, targets=targets)  # the proximal pass the learner makes anyway
        before, t0 = _peak(), time.perf_counter()
        with adapters_off(model.policy):
            model(ids, mask, prompt, R, targets=targets)
        seconds = time.perf_counter() - t0
    return {"rss_mib": _rss() / MIB, "extra_peak_mib": (_peak() - before) / MIB, "seconds": seconds}


SIDES = {"bare": side_bare, "actors": side_actors, "policy_base": side_policy_base}


def main(names: list[str]) -> None:
    from scale_models import SIZES, build_model

    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            folder = str(Path(tmp) / name)
            build_model(folder, SIZES[name])
            for side in SIDES:
                out = subprocess.run(
                    [sys.executable, __file__, "--side", side, folder],
                    capture_output=True,
                    text=True,
                    check=True,
                    env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                print(json.dumps({"model": name, "side": side, **row}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--side"]:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(SIDES[sys.argv[2]](sys.argv[3])))
    else:
        main(sys.argv[1:] or ["qwen2-75m"])
