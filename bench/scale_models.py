"""The model sizes `bench_scale.py` measures, and building each once into a cache folder.

Each size is a real architecture's config (Qwen2-0.5B's, GPT-2 124M's, smaller Qwen2 shapes) with
random float32 weights and the tests' word-level tokenizer (tests/tiny_models.py): nothing is
downloaded. A build runs in a Ray task of its own, so its memory never shows in the driver; a folder
holding `bench_scale.json` with the same spec is reused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

QWEN2_05B = {  # Qwen/Qwen2-0.5B's config.json (random weights here)
    "family": "qwen2",
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "sliding_window": 131072,
    "max_window_layers": 24,
}
SIZES: dict[str, dict] = {
    "qwen2-75m": {  # Qwen2-0.5B's head size (64) and MLP ratio; 6.6x fewer parameters
        "family": "qwen2",
        "hidden_size": 512,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 2752,
        "vocab_size": 32768,
        "max_position_embeddings": 4096,
    },
    "gpt2-124m": {"family": "gpt2"},  # transformers' GPT2Config defaults are gpt2's
    "qwen2-0.5b": QWEN2_05B,
    "tiny-qwen2": {
        "family": "qwen2",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 704,
        "vocab_size": 8192,
        "max_position_embeddings": 4096,
    },
    "tiny-gpt2": {"family": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 2, "vocab_size": 8192},
}
FULL = ["qwen2-75m", "gpt2-124m", "qwen2-0.5b"]
SMOKE = ["tiny-qwen2"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def build_model(folder: str, spec: dict) -> dict:
    """Build `spec`'s model (float32, seed 0) with the tests' word-level tokenizer into `folder`; returns
    its facts (parameters, bundle bytes per dtype), also written to `folder`/bench_scale.json last, so a
    folder with that file is complete. Runs in a Ray task (it holds the whole model while it builds)."""
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tokenizer

    fields = {k: v for k, v in spec.items() if k != "family"}
    tokenizer = build_tokenizer()
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # the tokenizer's
    if spec["family"] == "gpt2":
        cfg = GPT2Config(activation_function="gelu_pytorch_tanh", **fields, **ids)
        cls = GPT2LMHeadModel
    else:
        cfg = Qwen2Config(tie_word_embeddings=True, **fields, **ids)
        cls = Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).float()
    tmp = Path(folder).with_name(Path(folder).name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # tied weights are one tensor
    facts = {
        "spec": spec,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": cfg.vocab_size,
        "bundle_bytes": {
            dt: sum(
                t.numel() * (size if t.is_floating_point() else t.element_size()) for t in unique.values()
            )
            for dt, size in DTYPE_BYTES.items()
        },
    }
    (tmp / "bench_scale.json").write_text(json.dumps(facts))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return facts


def cached_model(models: Path, name: str, timeout: float) -> tuple[str, dict]:
    """(folder, facts) of size `name`, built first unless `models`/`name` holds it with the same spec."""
    import ray

    folder = models / name
    marker = folder / "bench_scale.json"
    if marker.exists():
        facts = json.loads(marker.read_text())
        if facts.get("spec") == SIZES[name]:
            return str(folder), facts
    print(f"building {name} into {folder} ...", file=sys.stderr, flush=True)
    models.mkdir(parents=True, exist_ok=True)
    task = ray.remote(num_cpus=1, max_calls=1)(build_model)
    return str(folder), ray.get(task.remote(str(folder), SIZES[name]), timeout=timeout)
