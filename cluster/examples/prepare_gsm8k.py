"""GSM8K as chat prompts for `qwen_gsm8k_gpu.yaml`: run once per split, on a machine that sees the shared storage.

    python cluster/examples/prepare_gsm8k.py GSM8K_FILE OUT.parquet

GSM8K_FILE is a split as published: the parquet file of the `openai/gsm8k` dataset (`main/train-*.parquet`,
`main/test-*.parquet`) or the original `train.jsonl` / `test.jsonl`, any format `data.prompts_path`
reads. Each row {question, answer} becomes {prompt, answer}: the question with INSTRUCTION as one user
message (the chat template adds the system prompt and the assistant header at run time), and the
answer's final number, the text after its last `####` ("... so she has 72 clips.\\n#### 72" -> "72"),
which the `exact_match` rule compares with the response's last \\boxed{}. A row without a question or a
`####` answer stops the script with its file and row.
"""

from __future__ import annotations

import sys
from pathlib import Path

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def final_answer(solution: str) -> str:
    """The ground truth of a GSM8K solution: the text after its last '####'."""
    if "####" not in solution:
        raise ValueError("answer has no '#### <number>' line")
    answer = solution.rsplit("####", 1)[1].strip()
    if not answer:
        raise ValueError("answer is empty after '####'")
    return answer


def to_prompt(question: str, solution: str) -> dict:
    """One GSM8K row as a prompts row: the question as chat messages, the final answer as meta."""
    return {
        "prompt": [{"role": "user", "content": f"{question.strip()}\n{INSTRUCTION}"}],
        "answer": final_answer(solution),
    }


def prepare(source: str, out: Path) -> int:
    """Write `source`'s rows as prompts to the parquet file `out`; returns how many."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cluster.prompts.prompt_files import read_rows

    rows = []
    for row in read_rows(source, "GSM8K_FILE"):
        question, solution = row.columns.get("question"), row.columns.get("answer")
        if not isinstance(question, str) or not isinstance(solution, str):
            raise ValueError(f"{row.where}: expected string fields 'question' and 'answer'")
        try:
            rows.append(to_prompt(question, solution))
        except ValueError as err:
            raise ValueError(f"{row.where}: {err}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    from cluster.config.schema import ConfigError

    try:
        n = prepare(args[0], Path(args[1]))
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"{n} prompts written to {args[1]}; check them: python -m cluster.data cluster/examples/qwen_gsm8k_gpu.yaml"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
