"""A sequence-classification reward model: text in, one scalar per text out."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from reward_service.hf_models import DTYPES, max_positions

ScoreKind = Literal["logit", "logit_diff", "prob"]


class ClassifierReward:
    """Re-tokenizes texts with the reward model's own tokenizer and reads one scalar from its logits.

    Rows are right-padded with the model's pad id (or the tokenizer's pad/eos/unk when the model has
    none); a model with no usable pad id is run one text at a time, which needs no padding at all.
    """

    def __init__(
        self,
        model_path: str,
        score: ScoreKind = "logit_diff",
        positive_label: int = 1,
        batch_size: int = 64,
        dtype: str = "float32",
        device: torch.device | None = None,
    ) -> None:
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, dtype=DTYPES[dtype], local_files_only=True, use_safetensors=True
        )
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        n_labels = int(self.model.config.num_labels)
        if positive_label >= n_labels:
            raise ValueError(f"reward.positive_label={positive_label} but {model_path} has {n_labels} labels")
        if score == "logit_diff" and n_labels != 2:
            raise ValueError(f"reward.score='logit_diff' needs a 2-label model; {model_path} has {n_labels}")
        if score == "prob" and n_labels < 2:
            raise ValueError(f"reward.score='prob' needs at least 2 labels; {model_path} has {n_labels}")
        self.score_kind = score
        self.positive_label = positive_label
        self.max_len = max_positions(self.model.config, self.tokenizer)
        pad = self.model.config.pad_token_id
        if pad is None:
            tok = self.tokenizer
            pad = next(
                (t for t in (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) if t is not None), None
            )
            # Models that pool the last non-pad token find it through config.pad_token_id.
            self.model.config.pad_token_id = pad
        self.pad_id: int | None = pad
        self.batch_size = batch_size if pad is not None else 1

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text, cut on the right to the model's maximum length."""
        ids = self.tokenizer(list(texts), add_special_tokens=True)["input_ids"]
        return [list(x[: self.max_len]) if self.max_len else list(x) for x in ids]

    def score_texts(self, texts: list[str]) -> tuple[np.ndarray, list[str | None]]:
        """float32 scores (NaN where failed) and an error message per text (None where scored)."""
        scores = np.full(len(texts), np.nan, dtype=np.float32)
        errors: list[str | None] = [None] * len(texts)
        ids = self.encode(texts)
        todo = [i for i, x in enumerate(ids) if x]
        for i in range(len(texts)):
            if not ids[i]:
                errors[i] = "text is empty after reward-model tokenization"
        todo.sort(key=lambda i: len(ids[i]))  # similar lengths together: less padding
        for k in range(0, len(todo), self.batch_size):
            rows = todo[k : k + self.batch_size]
            try:
                values = self._forward([ids[i] for i in rows])
            except Exception as e:  # the whole batch fails, the others still run
                for i in rows:
                    errors[i] = f"reward model forward failed: {type(e).__name__}: {e}"
                continue
            for i, v in zip(rows, values, strict=True):
                if np.isfinite(v):
                    scores[i] = v
                else:
                    errors[i] = f"reward model produced a non-finite score ({v})"
        return scores, errors

    @torch.no_grad()
    def _forward(self, rows: list[list[int]]) -> np.ndarray:
        L = max(len(r) for r in rows)
        input_ids = torch.full(
            (len(rows), L), self.pad_id if self.pad_id is not None else 0, dtype=torch.long
        )
        attn = torch.zeros((len(rows), L), dtype=torch.long)
        for j, r in enumerate(rows):
            input_ids[j, : len(r)] = torch.tensor(r, dtype=torch.long)
            attn[j, : len(r)] = 1
        logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device)).logits
        logits = logits.float()
        pos = self.positive_label
        if self.score_kind == "logit":
            out = logits[:, pos]
        elif self.score_kind == "logit_diff":
            out = logits[:, pos] - logits[:, 1 - pos]
        else:
            out = torch.softmax(logits, dim=-1)[:, pos]
        return out.cpu().numpy().astype(np.float32)
