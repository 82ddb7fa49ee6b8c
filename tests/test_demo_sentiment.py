"""The offline demo assets: loadable offline, deterministic, built once, published atomically."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from demos.sentiment import FORMAT_VERSION, AssetPaths, ensure_assets, load_prompts, read_manifest
from demos.sentiment_corpus import NEGATIVE, POSITIVE, build_corpus, build_prompts, vocabulary

LM_STEPS, CLF_STEPS = 30, 20


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> AssetPaths:
    return ensure_assets(
        tmp_path_factory.mktemp("demo") / "sentiment_tiny",
        seed=0,
        lm_steps=LM_STEPS,
        clf_steps=CLF_STEPS,
        quiet=True,
    )


def _tree_state(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def test_folders_load_offline_with_special_ids(assets: AssetPaths) -> None:
    for folder in (assets.policy, assets.reward):
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    lm = AutoModelForCausalLM.from_pretrained(assets.policy, local_files_only=True)
    clf = AutoModelForSequenceClassification.from_pretrained(assets.reward, local_files_only=True)
    assert (lm.config.pad_token_id, lm.config.bos_token_id, lm.config.eos_token_id) == (0, 1, 2)
    gen = lm.generation_config
    assert (gen.pad_token_id, gen.bos_token_id, gen.eos_token_id) == (0, 1, 2)
    assert clf.config.num_labels == 2 and clf.config.pad_token_id == 0
    assert clf.config.id2label[1] == "positive"
    dropouts = [getattr(lm.config, k) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")]
    assert dropouts == [0.0, 0.0, 0.0]
    assert lm.config.vocab_size == len(tok) and clf.config.vocab_size == len(tok)


def test_tokenizer_prepends_bos_and_round_trips(assets: AssetPaths) -> None:
    tok = AutoTokenizer.from_pretrained(assets.policy, local_files_only=True)
    for text, _ in build_corpus(0, n_reviews=50):
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
    odd = "Ünïcode & CAPS 123!"  # byte-level: text outside the corpus still round-trips
    assert tok.decode(tok(odd).input_ids, skip_special_tokens=True) == odd


def test_policy_continues_a_prompt_and_classifier_reads_last_real_token(assets: AssetPaths) -> None:
    tok = AutoTokenizer.from_pretrained(assets.policy, local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(assets.policy, local_files_only=True)
    clf = AutoModelForSequenceClassification.from_pretrained(assets.reward, local_files_only=True)
    ids = torch.tensor([tok("the film was").input_ids])
    out = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
    assert out.shape[1] > ids.shape[1] and torch.equal(out[:, : ids.shape[1]], ids)
    texts = ["i watched this movie and it was great", "the film"]
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        batched = clf(**batch).logits
        alone = clf(**tok(texts[1:], return_tensors="pt")).logits
    assert batched.shape == (2, 2)
    torch.testing.assert_close(batched[1:], alone, atol=1e-5, rtol=1e-5)  # pads after "the film" ignored


def test_manifest_records_settings_and_metrics(assets: AssetPaths) -> None:
    m = read_manifest(assets.root)
    assert m is not None
    assert (m["format_version"], m["seed"], m["lm_steps"], m["clf_steps"]) == (
        FORMAT_VERSION,
        0,
        LM_STEPS,
        CLF_STEPS,
    )
    assert m["sizes"]["reviews"] == 20_000 and m["sizes"]["prompts"] == len(load_prompts(assets.prompts))
    metrics = m["metrics"]
    assert math.isfinite(metrics["lm_val_loss"]) and metrics["lm_val_loss"] > 0
    assert 0.0 <= metrics["clf_val_accuracy"] <= 1.0
    assert 0.0 <= metrics["sample_mean_p_positive"] <= 1.0 and metrics["samples_scored"] == 128
    assert {"torch", "transformers", "tokenizers"} <= set(m["versions"])
    assert all(0.0 <= s["p_positive"] <= 1.0 and s["text"] for s in m["samples"])


def test_second_call_is_a_no_op(assets: AssetPaths) -> None:
    before = _tree_state(assets.root)
    again = ensure_assets(assets.root, seed=0, lm_steps=LM_STEPS, clf_steps=CLF_STEPS, quiet=True)
    assert again == assets
    assert _tree_state(assets.root) == before


def test_changed_settings_rebuild_atomically_and_leave_caller_state(
    assets: AssetPaths, tmp_path: Path
) -> None:
    root = tmp_path / "copy"
    shutil.copytree(assets.root, root)
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    ensure_assets(root, seed=0, lm_steps=1, clf_steps=1, quiet=True)
    assert torch.get_num_threads() == threads and torch.equal(torch.random.get_rng_state(), rng)
    m = read_manifest(root)
    assert m is not None and (m["lm_steps"], m["clf_steps"]) == (1, 1)
    leftovers = [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".copy.") and not p.name.endswith(".lock")
    ]
    assert leftovers == []
    # Same seed, same corpus and tokenizer: only the trained weights differ.
    assert (root / "prompts.jsonl").read_bytes() == assets.prompts.read_bytes()
    assert (root / "policy" / "tokenizer.json").read_bytes() == (
        assets.policy / "tokenizer.json"
    ).read_bytes()


def test_held_out_prompts_are_new_and_added_to_an_older_build(assets: AssetPaths, tmp_path: Path) -> None:
    held, train = load_prompts(assets.eval_prompts), load_prompts(assets.prompts)
    assert len(held) == len(set(held)) == 64 and not set(held) & set(train)
    root = tmp_path / "older"  # a folder built before eval_prompts.jsonl existed
    shutil.copytree(assets.root, root)
    (root / "eval_prompts.jsonl").unlink()
    models = {p: p.stat().st_mtime_ns for p in root.rglob("*.safetensors")}
    again = ensure_assets(root, seed=0, lm_steps=LM_STEPS, clf_steps=CLF_STEPS, quiet=True)
    assert load_prompts(again.eval_prompts) == held
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*.safetensors")} == models  # nothing rebuilt


def test_refuses_to_replace_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a demo-assets folder"):
        ensure_assets(tmp_path, seed=0, quiet=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="lm_steps"):
        ensure_assets(tmp_path / "new", lm_steps=0, quiet=True)


def test_corpus_and_prompts_are_deterministic_per_seed(assets: AssetPaths) -> None:
    assert build_corpus(0) == build_corpus(0)
    assert build_corpus(0) != build_corpus(1)
    assert build_prompts(0) == build_prompts(0)
    assert build_prompts(0) != build_prompts(1)
    assert load_prompts(assets.prompts) == build_prompts(0)


def test_corpus_shape_balance_and_clean_labels() -> None:
    corpus = build_corpus(3, n_reviews=4000)
    assert sum(label == POSITIVE for _, label in corpus) == 2000
    assert all(8 <= len(text.split()) <= 20 for text, _ in corpus)
    assert 150 <= len(vocabulary(corpus)) <= 300
    pos_words = vocabulary([r for r in corpus if r[1] == POSITIVE])
    neg_words = vocabulary([r for r in corpus if r[1] == NEGATIVE])
    assert {"great", "loved"} <= pos_words - neg_words and {"boring", "hated"} <= neg_words - pos_words


def test_prompts_are_short_distinct_and_neutral() -> None:
    corpus = build_corpus(0)
    one_sided = vocabulary([r for r in corpus if r[1] == POSITIVE]) ^ vocabulary(
        [r for r in corpus if r[1] == NEGATIVE]
    )
    prompts = build_prompts(0)
    assert len(prompts) == len(set(prompts)) == 512
    assert all(2 <= len(p.split()) <= 6 for p in prompts)
    assert not {w for p in prompts for w in p.split()} & one_sided  # no word that gives the label away


def test_load_prompts_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "the film"}\n\n{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:3"):
        load_prompts(path)
    path.write_text('{"prompt": "the film"}\n\n')
    assert load_prompts(path) == ["the film"]
    path.write_text(json.dumps({"prompt": "a"}) + "\nnot json\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not valid JSON"):
        load_prompts(path)
