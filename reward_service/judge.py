"""A causal LM as the reward (reward.kind='judge', a generative judge): each sample is written into the
user's template, the judge reads it, and its verdict becomes the score by the configured rule.

Verdicts (`JudgeConfig.verdict`):
  yes_no  score = P(yes) / (P(yes) + P(no)) = sigmoid(log P(yes) - log P(no)) of the judge's next token
          after the prompt: one batched forward, no generation; in [0, 1].
  score   the first match of `score_pattern` in the judge's greedy reply (at most `max_new_tokens`),
          which must lie in `score_range`.
A sample the judge cannot judge fails, with the reason (its reference missing from the prompt row, a
prompt longer than the judge's context, a reply without a score or outside the range, a non-finite
value, a failed forward): the scorer counts it against `reward.max_failure_frac`, never as a 0.

The judge's model answers two questions, whatever serves it (`JudgeModel`): the next-token logprobs of
the yes and no tokens after each prompt, and the greedy reply to each prompt. `HFJudgeModel` serves
them with transformers (reward.judge.engine='hf'); the vLLM one is built by the cluster over the rollout
engine (`cluster.roles.judge_engines`), since a role imports no other role. The prompts, their
encoding, the verdict's rule and every failure are this module's, so both engines judge alike.

`RewardScorer` with kind='judge' holds one and scores through it; the cluster runs those scorers as a
role of their own, the judge's (`reward.judge.num_replicas` actors, `reward.judge.num_gpus` each,
scaled with `cluster.scale judge=K`), with the scoring deadline (`timeouts.score_s`), failure
accounting and exactly-once of every role; no reward scorer runs beside it.
"""

from __future__ import annotations

import math
import re
from typing import Protocol

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kernel.sequences import pad_id_of, right_padded
from reward_service.config import JudgeConfig, template_fields
from reward_service.functions import RewardInput
from reward_service.hf_models import DTYPES, max_positions
from reward_service.reference import pick_device


class JudgeModel(Protocol):
    """What a judge's model computes, on prompts already encoded by the judge's tokenizer (every row
    fits `max_len`, where it is not None)."""

    max_len: int | None  # the most tokens of a prompt plus the reply it may get (None: no fixed limit)

    def pair_logprobs(self, rows: list[list[int]], first: int, second: int) -> np.ndarray:
        """float [n, 2]: log P(first) and log P(second) as the next token after each row (temperature 1)."""
        ...

    def greedy(self, rows: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """The argmax reply's token ids to each row, at most `max_new_tokens`, up to its EOS token
        (padding may follow; the judge decodes without special tokens)."""
        ...


class HFJudgeModel:
    """The judge's model on transformers (reward.judge.engine='hf'), on `device` (default: a GPU when
    the process has one)."""

    def __init__(self, model_path: str, dtype: str = "float32", device: torch.device | None = None) -> None:
        self.device = device or pick_device()
        tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[dtype], local_files_only=True
        )
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.pad_id = pad_id_of(tok)
        self.max_len = max_positions(self.model.config, tok)  # None: neither says

    @torch.no_grad()
    def pair_logprobs(self, rows: list[list[int]], first: int, second: int) -> np.ndarray:
        """Read at each row's last token of a right-padded batch (causal attention: the padding after
        it changes nothing)."""
        input_ids, attn = right_padded([np.asarray(r) for r in rows], self.device)
        logits = self.model(input_ids=input_ids, attention_mask=attn).logits
        last = logits[torch.arange(len(rows), device=self.device), attn.sum(-1) - 1]
        logp = torch.log_softmax(last.float(), dim=-1)
        return logp[:, [first, second]].cpu().numpy()

    @torch.no_grad()
    def greedy(self, rows: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        width = max(len(r) for r in rows)  # left-padded: every prompt ends where generation starts
        input_ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], device=self.device)
        attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=self.pad_id,
        )
        return out[:, width:].tolist()


class JudgeReward:
    def __init__(
        self,
        config: JudgeConfig,
        batch_size: int = 8,
        dtype: str = "float32",
        device: torch.device | None = None,
        model: JudgeModel | None = None,
    ) -> None:
        """`model`: what serves the judge (default: `HFJudgeModel` of `config.model_path`)."""
        if not config.model_path:
            raise ValueError("reward.kind='judge' needs reward.judge.model_path")
        if model is None and config.engine != "hf":
            raise ValueError(
                f"reward.judge.engine={config.engine!r} is served by the model the cluster builds "
                "(cluster.roles.judge_engines); pass it as `model`"
            )
        self.config, self.batch_size = config, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.model = model if model is not None else HFJudgeModel(config.model_path, dtype, device)
        tok = self.tokenizer
        self.max_len = self.model.max_len
        self.chat = config.chat_template == "auto" and bool(getattr(tok, "chat_template", None))
        self.uses_reference = "reference" in template_fields(config.template)
        self.pattern = re.compile(config.score_pattern)
        if config.verdict == "yes_no":
            self.yes_id = self._one_token(config.yes, "yes")
            self.no_id = self._one_token(config.no, "no")
            if self.yes_id == self.no_id:
                raise ValueError(f"reward.judge.yes and reward.judge.no are the same token ({self.yes_id})")

    def _one_token(self, text: str, field: str) -> int:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(
                f"reward.judge.{field}={text!r} is {len(ids)} tokens of the judge's tokenizer "
                f"({self.config.model_path}); it must be exactly one"
            )
        return int(ids[0])

    # ------------------------------------------------------------------ prompts

    def prompt_text(self, x: RewardInput) -> str:
        """The filled template (KeyError naming the field when the row has no reference)."""
        question = x.prompt
        if x.messages:
            users = [
                m["content"]
                for m in x.messages
                if m.get("role") == "user" and isinstance(m.get("content"), str)
            ]
            question = users[-1] if users else x.prompt
        reference = ""
        if self.uses_reference:
            if self.config.reference_key not in x.meta:
                raise KeyError(
                    f"the prompt row has no {self.config.reference_key!r} (reward.judge.reference_key), which "
                    "reward.judge.template's {reference} reads"
                )
            reference = str(x.meta[self.config.reference_key])
        return self.config.template.format(question=question, response=x.response, reference=reference)

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if self.chat:
            rendered = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return list(tok(rendered, add_special_tokens=False)["input_ids"])
        return list(tok(text)["input_ids"])

    # ------------------------------------------------------------------ scoring

    def score(self, inputs: list[RewardInput]) -> tuple[np.ndarray, list[str | None], list[str | None]]:
        """float32 scores (NaN where failed), an error per input (None where scored) and the judge's
        reply per input (verdict 'score'; None otherwise or where it did not run)."""
        n = len(inputs)
        scores = np.full(n, np.nan, dtype=np.float32)
        errors: list[str | None] = [None] * n
        replies: list[str | None] = [None] * n
        ids: dict[int, list[int]] = {}
        for i, x in enumerate(inputs):
            try:
                row = self.encode(self.prompt_text(x))
            except KeyError as e:
                errors[i] = f"judge: {e.args[0]}"
                continue
            if self.max_len is not None:
                room = self.max_len - (self.config.max_new_tokens if self.config.verdict == "score" else 0)
                if len(row) > room:
                    errors[i] = (
                        f"judge: the prompt is {len(row)} tokens, more than the judge's context allows ({room})"
                    )
                    continue
            ids[i] = row
        todo = sorted(ids, key=lambda i: len(ids[i]))  # similar lengths together: less padding
        for k in range(0, len(todo), self.batch_size):
            rows = todo[k : k + self.batch_size]
            try:
                if self.config.verdict == "yes_no":
                    values = self._yes_no([ids[i] for i in rows])
                    texts = [None] * len(rows)
                else:
                    texts = self._generate([ids[i] for i in rows])
                    values = [self._parse(t) for t in texts]
            except Exception as e:  # noqa: BLE001 - the whole batch fails, the others still run
                for i in rows:
                    errors[i] = f"judge forward failed: {type(e).__name__}: {e}"
                continue
            for i, v, t in zip(rows, values, texts, strict=True):
                replies[i] = t
                if isinstance(v, str):
                    errors[i] = v
                elif not math.isfinite(v):
                    errors[i] = f"judge produced a non-finite score ({v})"
                else:
                    scores[i] = v
        return scores, errors, replies

    def _yes_no(self, rows: list[list[int]]) -> list[float]:
        """sigmoid(log P(yes) - log P(no)) of the next token after each prompt."""
        logp = self.model.pair_logprobs(rows, self.yes_id, self.no_id)
        return torch.sigmoid(torch.as_tensor(logp[:, 0] - logp[:, 1], dtype=torch.float64)).tolist()

    def _generate(self, rows: list[list[int]]) -> list[str]:
        """The judge's greedy reply to each prompt, decoded without special tokens."""
        replies = self.model.greedy(rows, self.config.max_new_tokens)
        return [self.tokenizer.decode(r, skip_special_tokens=True) for r in replies]

    def _parse(self, reply: str) -> float | str:
        """The score in `reply`, or the reason there is none (a str)."""
        m = self.pattern.search(reply)
        shown = reply if len(reply) <= 200 else reply[:200] + "..."
        if m is None:
            return f"judge reply has no score (reward.judge.score_pattern): {shown!r}"
        try:
            value = float(m.group(1) if m.groups() else m.group(0))
        except ValueError:
            return f"judge reply's match {m.group(0)!r} is no number: {shown!r}"
        lo, hi = self.config.score_range
        if not lo <= value <= hi:
            return f"judge score {value:g} is outside reward.judge.score_range [{lo:g}, {hi:g}]: {shown!r}"
        return value
