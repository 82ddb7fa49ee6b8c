"""What `reference.source: policy_base` saves and costs, both sides in one run (LoRA runs).

`python bench/bench_reference.py [qwen2-75m ...]` builds each model of bench/scale_models.SIZES (random
weights) and measures, each side in a fresh process on one torch thread, on the same 8 x 128 tokens:

- **actors**: a reference actor's process (`reward_service.reference.ReferencePolicy`, float32, the
  default `reference.dtype`): its resident memory once it has scored (every weight page touched), the
  transient memory of one scoring call above that, and its seconds. `policy_base` removes this
  process, per reference replica.
- **policy_base**: the learner's LoRA model (`learner.model.PolicyWithValueHead`, rank 16, all-linear):
  the transient memory and seconds of the one more no-grad forward with the adapters off
  (`learner.lora.adapters_off`) that replaces the reference's call; nothing stays resident.

The bare interpreter with torch and transformers imported is measured too, so the model's own share of
the reference process is visible.
"""

from __future__ import annotations

import contextlib
import json
import resource
import subprocess
import sys
import tempfile
import threading
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


@contextlib.contextmanager
def _peak_over(out: dict, key: str):
    """`out[key]`: the most resident memory above the level at entry while the block runs (sampled
    every 2 ms by a thread: `ru_maxrss` would be the process's all-time peak, loading included)."""
    start, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        out[key] = max(0, max(peak[0], _rss()) - start) / MIB


def _tokens(vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (BATCH, LENGTH), generator=g)


def side_bare(_path: str) -> dict:
    import torch  # noqa: F401
    import transformers  # noqa: F401

    return {"rss_mib": _rss() / MIB}


def side_actors(path: str) -> dict:
    """A reference actor's memory once it has scored (its weights touched), and one scoring call."""
    import numpy as np

    from reward_service.config import ReferenceConfig
    from reward_service.reference import ReferencePolicy

    ref = ReferencePolicy(path, ReferenceConfig(), temperature=1.0)
    ids = _tokens(ref.model.config.get_text_config().vocab_size).numpy()
    prompts = [np.asarray(r[:PROMPT]) for r in ids]
    responses = [np.asarray(r[PROMPT:]) for r in ids]
    ref.logprobs(prompts, responses)  # warm-up: every weight page is resident from here on
    out = {"rss_mib": _rss() / MIB}
    t0 = time.perf_counter()
    with _peak_over(out, "call_peak_mib"):
        ref.logprobs(prompts, responses)
    return {**out, "seconds": time.perf_counter() - t0}


def side_policy_base(path: str) -> dict:
    """The learner's LoRA model: the adapters-off forward that replaces the reference actor's."""
    import torch

    from kernel.sequences import response_tokens
    from learner.config import LoRAConfig
    from learner.lora import adapters_off
    from learner.model import PolicyWithValueHead

    torch.manual_seed(0)
    model = PolicyWithValueHead.from_pretrained(path, lora=LoRAConfig(rank=16, alpha=32.0)).eval()
    ids = _tokens(model.policy.config.get_text_config().vocab_size)
    mask = torch.ones_like(ids)
    prompt = torch.full((BATCH,), PROMPT)
    R = LENGTH - PROMPT
    targets = response_tokens(ids, prompt, R)  # logprobs of the tokens only, as the learner scores
    out: dict = {}
    with torch.no_grad():
        model(ids, mask, prompt, R, targets=targets)  # the proximal pass the learner makes anyway
        out["rss_mib"] = _rss() / MIB
        t0 = time.perf_counter()
        with _peak_over(out, "call_peak_mib"), adapters_off(model.policy):
            model(ids, mask, prompt, R, targets=targets)
    return {**out, "seconds": time.perf_counter() - t0}


SIDES = {"bare": side_bare, "actors": side_actors, "policy_base": side_policy_base}


def _child(*args: str) -> dict:
    """Run this file with `args` in a fresh process on one thread; its last printed JSON line."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(names: list[str]) -> None:
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            folder = str(Path(tmp) / name)
            _child("--build", name, folder)  # built in a process of its own: the sides start small
            for side in SIDES:
                print(json.dumps({"model": name, "side": side, **_child("--side", side, folder)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build"]:
        from scale_models import SIZES, build_model

        build_model(sys.argv[3], SIZES[sys.argv[2]])
        print("{}")
    elif sys.argv[1:2] == ["--side"]:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(SIDES[sys.argv[2]](sys.argv[3])))
    else:
        main(sys.argv[1:] or ["qwen2-75m"])
