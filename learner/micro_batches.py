"""How a rank cuts its rows into micro-batches: by count (`learner.micro_batch_size`) or under a token
budget (`learner.max_tokens_per_micro_batch`). Pure bookkeeping over sequence lengths, no torch.

The loss of every micro-batch is normalised by its minibatch's global token (or sequence) count
(`ppo_step`), so the gradient of a minibatch is the same however its rows are cut; only memory and
time change. A padded micro-batch costs rows x its longest row (every row is padded to it); a packed
one costs the sum of its rows' lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

BUDGET_FIELD = "learner.max_tokens_per_micro_batch"


def micro_batch_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens one forward over these rows processes."""
    if not lengths:
        return 0
    return int(sum(lengths)) if packed else int(max(lengths)) * len(lengths)


def plan_micro_batches(
    lengths: Sequence[int], *, max_rows: int, max_tokens: int | None = None, packed: bool = False
) -> list[list[int]]:
    """Positions (into `lengths`) of each micro-batch, every position exactly once.

    `max_tokens` None: consecutive runs of `max_rows` (in the given order). Otherwise first-fit
    decreasing on the token cost: rows longest first, each into the first micro-batch it fits under
    the budget, a new one when none does; within a micro-batch the rows keep their given order. A
    row longer than the budget alone is an error naming the field."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    n = len(lengths)
    if max_tokens is None:
        return [list(range(i, min(i + max_rows, n))) for i in range(0, n, max_rows)]
    if max_tokens < 1:
        raise ValueError(f"{BUDGET_FIELD} must be >= 1, got {max_tokens}")
    too_long = [int(length) for length in lengths if length > max_tokens]
    if too_long:
        raise ValueError(
            f"{BUDGET_FIELD}={max_tokens} is below a sequence of {max(too_long)} tokens (prompt + response): "
            f"raise it to at least {max(too_long)}, or lower rollout.max_new_tokens / data.max_prompt_tokens"
        )
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    sums: list[int] = []  # packed: sum of lengths; padded: the first (longest) row's length
    for i in order:
        length = int(lengths[i])
        for b, members in enumerate(bins):
            cost = sums[b] + length if packed else sums[b] * (len(members) + 1)  # rows come longest first
            if cost <= max_tokens:
                members.append(i)
                if packed:
                    sums[b] = cost
                break
        else:
            bins.append([i])
            sums.append(length)
    return [sorted(members) for members in bins]
