"""The Tinker cookbook's `rl_loop` recipe (tinker_cookbook 0.5.8, `recipes/rl_loop.py`), run unchanged against
`cluster.serve`; run in `.venv-cookbook` by tests/test_tinker_cookbook.py:

    .venv-cookbook/bin/python tests/cookbook_rl.py TOKENIZER_DIR MODEL_NAME key=value...

What differs from running the recipe on Tinker, and nothing else:
- the tokenizer: `tinker_cookbook.tokenizer_utils.register_tokenizer(MODEL_NAME, ...)` (the cookbook's own
  hook for a local tokenizer) points the recipe's `get_tokenizer(model_name)` at TOKENIZER_DIR;
- `base_url`, `model_name` and the loop's sizes are the recipe's own command-line config fields (chz),
  passed through as `key=value`;
- the data and the hub: the caller sets `HF_HUB_OFFLINE=1` and `HF_DATASETS_CACHE` to a cache holding
  the `openai/gsm8k` the test built (tests/cookbook_assets.py), and `TINKER_API_KEY`.
"""

from __future__ import annotations

import runpy
import sys

from tinker_cookbook.tokenizer_utils import register_tokenizer
from transformers import AutoTokenizer


def main() -> None:
    tokenizer_dir, model_name, *config = sys.argv[1:]
    register_tokenizer(model_name, lambda: AutoTokenizer.from_pretrained(tokenizer_dir))
    sys.argv = ["rl_loop", f"model_name={model_name}", *config]
    runpy.run_module("tinker_cookbook.recipes.rl_loop", run_name="__main__")


if __name__ == "__main__":
    main()
