"""A run checkpoint as a Hugging Face model folder: `python -m cluster.export CHECKPOINT OUT`.

CHECKPOINT is a run's `checkpoints/step-N`, checked as a resume checks it (its COMPLETE marker and
state checksum); the run's `config.yaml`, two folders up, names the base policy and the tokenizer.
The weights are the checkpoint's fp32 master weights (`learner.consolidated_checkpoint.read_weights`)
loaded into the base architecture as the learner loads it (dropout off, the fused tanh-GELU name:
`learner.model`), so the folder computes what the learner computed; a `learner.lora` run's checkpoint
holds only adapters, merged here into the base policy's weights (`policy_from_weights`). Every parameter must be
accounted for: a weight the model lacks, or a parameter the checkpoint lacks, is an error naming them.
They are cast to `--dtype` and written with `save_pretrained` (safetensors, config, generation
config); the tokenizer is saved beside them carrying how the run prompted (`cluster.prompts.prompting`:
the chat template of `data.chat_template`, the tokenizer's own or the Jinja file's, with
`data.chat_template_kwargs` and `data.system_prompt` as its defaults where it allows, and
`prompting.json`).
`--value-head` also writes the critic's `value_head.safetensors`. `export.json` records the source and how the run prompted.
Nothing here starts Ray or DeepSpeed: it runs wherever the run folder is readable.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """The checkpoint cannot be exported; the message names the folder and what is wrong."""


def run_config(checkpoint: Path):
    """The RunConfig of the run that wrote `checkpoint` (its `config.yaml`, two folders up)."""
    from cluster.config.schema import load_config

    path = checkpoint.parent.parent / "config.yaml"
    if not path.is_file():
        raise ExportError(f"{checkpoint}: no run config at {path} (a checkpoint lives in <run>/checkpoints/)")
    return load_config(path)


def load_policy(cfg, checkpoint: Path):
    """The base policy with the checkpoint's weights, float32 (a LoRA run's adapters merged in)."""
    from cluster.pipeline.checkpoint import LEARNER_DIR
    from learner.consolidated_checkpoint import read_weights

    try:
        state = read_weights(checkpoint / LEARNER_DIR, "policy.")
    except ValueError as err:
        raise ExportError(str(err)) from None
    try:
        return policy_from_weights(cfg.model.policy_path, cfg.learner.lora, state)
    except ExportError as err:
        raise ExportError(f"{checkpoint}: {err}") from None


def policy_from_weights(policy_path: str, lora, state: dict):
    """The policy at `policy_path` loaded as the learner loads it, its trained parameters (every one,
    tied weights once) set from `state`. With `lora` of rank > 0 (`learner.lora`) the trained parameters
    are the adapters: they are injected as the learner injects them, set from `state`, and merged
    (W + B A alpha/r, learner.lora.merge_weight) into a plain model of the base architecture."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.lora import apply_lora, merged_cpu_state_dict
    from learner.model import learner_config

    config = learner_config(policy_path)

    def base():
        return AutoModelForCausalLM.from_pretrained(
            policy_path, config=config, dtype=torch.float32, local_files_only=True
        )

    model = base()
    if lora is not None and lora.rank > 0:
        apply_lora(model, lora)
    # tied weights appear once, as in the checkpoint; a LoRA model trains its adapters only
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    shaped = sorted(n for n in set(params) & set(state) if params[n].shape != state[n].shape)
    if missing or extra or shaped:
        raise ExportError(
            f"its weights do not fit {policy_path}: only in the model {missing[:5]}, "
            f"only in the checkpoint {extra[:5]}, different shapes {shaped[:5]}"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    if lora is not None and lora.rank > 0:
        merged = merged_cpu_state_dict(model, 1 << 62, keep=True)
        model = base()
        model.load_state_dict(merged)
    return model.eval()


def export(
    checkpoint: str | Path, out: str | Path, dtype: str = "bfloat16", value_head: bool = False
) -> dict:
    """Write the folder `out` from `checkpoint`; returns what `export.json` records."""
    import torch
    from safetensors.torch import save_file

    from cluster.pipeline.checkpoint import LEARNER_DIR, CheckpointError, read_state
    from cluster.prompts.prompting import save_tokenizer
    from learner.consolidated_checkpoint import read_weights
    from learner.model import VALUE_HEAD_FILE

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {list(DTYPES)}")
    checkpoint, out = Path(checkpoint).resolve(), Path(out)
    try:
        state = read_state(checkpoint)
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    cfg = run_config(checkpoint)
    model = load_policy(cfg, checkpoint).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    prompting = save_tokenizer(cfg.data, cfg.tokenizer_path, out)
    if value_head:
        head = read_weights(checkpoint / LEARNER_DIR, "value_head.")
        save_file({k: v.contiguous() for k, v in head.items()}, str(out / VALUE_HEAD_FILE))
    record = {
        "checkpoint": str(checkpoint),
        "step": state.get("step"),
        "base_policy": cfg.model.policy_path,
        "dtype": dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "chat_template": prompting.chat_template,
        # how the run prompted: data.chat_template_kwargs, data.system_prompt (the template's defaults where
        # it allows: defaults_in_template), data.tools; also in prompting.json
        "prompting": asdict(prompting),
        "value_head": value_head,
        "lora_rank": cfg.learner.lora.rank,  # > 0: the adapters are merged into the exported weights
    }
    (out / "export.json").write_text(json.dumps(record, indent=1, default=str))
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.export", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a run's checkpoints/step-N folder")
    p.add_argument("out", help="the folder to write (save_pretrained layout)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weights' dtype (default bfloat16)")
    p.add_argument("--value-head", action="store_true", help="also write value_head.safetensors")
    args = p.parse_args(argv)
    try:
        record = export(args.checkpoint, args.out, args.dtype, args.value_head)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported step {record['step']} ({record['parameters']:,} parameters, {args.dtype}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
