"""LoRA vs full fine-tuning on one CPU process: trainable parameters, Adam state bytes, step time.

`python bench/bench_lora.py [tiny-qwen2 qwen2-75m ...]` builds each model of bench/scale_models.SIZES
(random weights) and, for full fine-tuning and `learner.lora` rank 16 (alpha 32, all-linear), loads
the learner's model (`learner.model.PolicyWithValueHead`), then times plain torch AdamW steps on
4 x 64 random tokens (policy log-likelihood + value loss): both sides in one run on one machine. Adam
state bytes are measured from the optimizer's own state tensors. No DeepSpeed: the learner's ZeRO
ranks add their partitioning on top; the trainable/optimizer ratios are the same.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def measure(path: str, lora, steps: int = 3, batch: int = 4, length: int = 64) -> dict:
    """Trainable parameters, Adam state bytes and mean seconds per step (after one warm-up step)."""
    from learner.model import PolicyWithValueHead

    torch.manual_seed(0)
    model = PolicyWithValueHead.from_pretrained(path, lora=lora)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    vocab = model.policy.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (batch, length))
    mask = torch.ones_like(ids)
    prompt = torch.full((batch,), 8)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        logits, values = model(ids, mask, prompt, length - 8)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 8:].unsqueeze(-1)).mean()
        (-logp + values.pow(2).mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in params),
        "adam_state_bytes": state,
        "step_s": sum(times[1:]) / steps,
    }


def main(names: list[str]) -> None:
    from scale_models import SIZES, build_model

    from learner.config import LoRAConfig

    torch.set_num_threads(1)
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            folder = str(Path(tmp) / name)
            build_model(folder, SIZES[name])
            for label, lora in (("full", LoRAConfig()), ("lora-r16", LoRAConfig(rank=16, alpha=32.0))):
                print(json.dumps({"model": name, "mode": label, **measure(folder, lora)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["tiny-qwen2", "qwen2-75m"])
