"""Bad input has a defined outcome: prompts counted and dropped or truncated, checkpoints refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import build_tokenizer

from cluster.config.schema import ConfigError, DataSection
from cluster.pipeline.checkpoint import COMPLETE, STATE_FILE, CheckpointError, latest_checkpoint, read_state
from cluster.prompts.loader import PromptStream, read_prompts, tokenize_prompts
from cluster.train import main


def write_prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def test_empty_and_long_prompts_are_counted(tmp_path):
    tok = build_tokenizer()
    path = write_prompts(
        tmp_path / "p.jsonl", ["the movie was", "", "   ", "the film was very very very good and fun"]
    )
    cfg = DataSection(prompts_path=str(path), max_prompt_tokens=5, long_prompt="truncate")
    prompts, stats = tokenize_prompts(read_prompts(cfg), tok, cfg)
    assert (stats.empty, stats.truncated, stats.skipped_long) == (2, 1, 0)
    assert [p.index for p in prompts] == [0, 3]
    # truncation keeps the last tokens (the words right before the response)
    assert len(prompts[1].ids) == 5 and tok.decode(prompts[1].ids[-2:]) == "and fun"
    cfg_skip = cfg.model_copy(update={"long_prompt": "skip"})
    prompts, stats = tokenize_prompts(read_prompts(cfg_skip), tok, cfg_skip)
    assert (stats.empty, stats.truncated, stats.skipped_long) == (2, 0, 1) and len(prompts) == 1


def test_a_truncated_prompt_keeps_its_bos(tmp_path):
    tok = build_tokenizer()  # word-level: one token per word, <bos> = 1
    path = write_prompts(tmp_path / "p.jsonl", ["the film was very very very good and fun", "good fun"])
    cfg = DataSection(prompts_path=str(path), max_prompt_tokens=5)
    prompts, stats = tokenize_prompts(read_prompts(cfg), tok, cfg)
    # 9 words > 5 - 1 = 4 places beside the BOS: the last 4 words, then the BOS in front.
    assert stats.truncated == 1
    assert prompts[0].ids.tolist() == [
        tok.bos_token_id,
        *tok.convert_tokens_to_ids(["very", "good", "and", "fun"]),
    ]
    assert prompts[1].ids.tolist() == [tok.bos_token_id, *tok.convert_tokens_to_ids(["good", "fun"])]
    # without a BOS the whole budget is text
    no_bos = cfg.model_copy(update={"add_bos": False})
    prompts, _ = tokenize_prompts(read_prompts(no_bos), tok, no_bos)
    assert tok.decode(prompts[0].ids) == "very very good and fun"
    with pytest.raises(ConfigError, match="max_prompt_tokens=1 leaves no room"):
        one = cfg.model_copy(update={"max_prompt_tokens": 1})
        tokenize_prompts(read_prompts(one), tok, one)


def test_unusable_prompt_files_name_the_problem(tmp_path):
    tok = build_tokenizer()
    with pytest.raises(ConfigError, match="holds no prompts"):
        read_prompts(DataSection(prompts_path=str(write_prompts(tmp_path / "e.jsonl", []))))
    only_empty = DataSection(prompts_path=str(write_prompts(tmp_path / "b.jsonl", ["", " "])))
    with pytest.raises(ConfigError, match="no usable prompts"):
        tokenize_prompts(read_prompts(only_empty), tok, only_empty)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        read_prompts(DataSection(prompts_path=str(tmp_path / "bad.jsonl")))
    (tmp_path / "key.jsonl").write_text('{"text": "ok"}\n')
    with pytest.raises(ConfigError, match=r"key.jsonl:1: missing field 'prompt' \(data.prompt_key\)"):
        read_prompts(DataSection(prompts_path=str(tmp_path / "key.jsonl")))


def test_prompt_stream_resumes_at_the_same_position():
    a = PromptStream(list(range(10)), seed=3, shuffle=True)
    a.next_batch(7)
    b = PromptStream(list(range(10)), seed=3, shuffle=True)
    b.load_state_dict(a.state_dict())
    assert a.next_batch(8) == b.next_batch(8)
    epoch = PromptStream(list(range(10)), seed=3, shuffle=True).next_batch(10)
    assert sorted(epoch) == list(range(10))


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    ckpt = run_dir / "checkpoints" / f"step-{step:06d}"
    (ckpt / "learner").mkdir(parents=True)
    state = ckpt / STATE_FILE
    state.write_text(json.dumps({"format": 1, "step": step}))
    import hashlib

    (ckpt / COMPLETE).write_text(hashlib.sha256(state.read_bytes()).hexdigest())
    return ckpt


def test_corrupt_or_missing_checkpoints_are_errors(tmp_path):
    with pytest.raises(CheckpointError, match="run folder not found"):
        latest_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        latest_checkpoint(tmp_path / "empty")
    run = tmp_path / "run"
    (run / "checkpoints" / ".step-000004.partial").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"only incomplete: \.step-000004\.partial"):
        latest_checkpoint(run)
    ckpt = fake_checkpoint(run, 2)
    assert latest_checkpoint(run) == ckpt and read_state(ckpt)["step"] == 2
    (ckpt / STATE_FILE).write_text(json.dumps({"format": 1, "step": 3}))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        latest_checkpoint(run)
    (ckpt / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        latest_checkpoint(run)


def test_cli_resume_of_an_empty_run_folder_exits_2(tmp_path, tiny_policy_dir, tiny_reward_dir, capsys):
    """On the tests' tiny models (no demo build: a fast test)."""
    (tmp_path / "run").mkdir()
    from demo_run import CONFIG, demo_overrides

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the movie was"}\n{"prompt": "i loved it"}\n')
    tiny = SimpleNamespace(policy=tiny_policy_dir, prompts=prompts, reward=tiny_reward_dir)
    sets = sum((["--set", s] for s in demo_overrides(tiny, 2)), [])
    assert main([str(CONFIG), "--resume", str(tmp_path / "run"), *sets]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
