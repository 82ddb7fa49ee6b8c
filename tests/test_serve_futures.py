"""`cluster.serve.futures.FutureBook` without a service: calls of one model run in seq_id order
whatever order they arrive in, a call whose predecessor never arrives fails after `order_wait_s`
naming it, and a call past `call_timeout_s` fails naming that."""

from __future__ import annotations

import asyncio

from cluster.serve.futures import Done, Failed, FutureBook


def test_calls_run_in_seq_id_order_whatever_order_they_arrive():
    async def scenario() -> list[int]:
        book, ran = FutureBook(), []

        def work(n):
            async def run():
                ran.append(n)
                return Done(n)

            return run

        ids = [book.submit("k", work(n), f"key{n}", model_id="m", seq_id=n) for n in (3, 2, 1)]
        assert (
            book.submit("k", work(99), "other", model_id="m", seq_id=2) == ids[1]
        )  # same seq_id: same future
        # without a seq_id the idempotency key decides, per API key
        once = book.submit("k", work(7), "create-1")
        assert book.submit("k", work(8), "create-1") == once != book.submit("k2", work(9), "create-1")
        for rid in [*ids, once]:
            await book.result(rid)
        return ran

    ran = asyncio.run(scenario())
    assert [n for n in ran if n <= 3] == [1, 2, 3] and sorted(ran) == [1, 2, 3, 7, 9]


def test_a_call_whose_predecessor_never_arrives_fails_naming_order_wait_s():
    """seq_id 2 without seq_id 1: it fails after order_wait_s, unapplied; seq_id 1 arriving after that
    is refused too (applying it now would break the order); seq_id 3 runs."""

    async def scenario():
        book, ran = FutureBook(order_wait_s=0.2), []

        def work(n):
            async def run():
                ran.append(n)
                return Done(n)

            return run

        late = await book.result(book.submit("k", work(2), None, model_id="m", seq_id=2), wait_s=30)
        early = await book.result(book.submit("k", work(1), None, model_id="m", seq_id=1), wait_s=30)
        third = await book.result(book.submit("k", work(3), None, model_id="m", seq_id=3), wait_s=30)
        return late, early, third, ran

    late, early, third, ran = asyncio.run(scenario())
    assert isinstance(late, Failed) and "waited 0.2s (order_wait_s) for seq_id 1" in late.error
    assert isinstance(early, Failed) and "arrived after a later call stopped waiting" in early.error
    assert third == Done(3) and ran == [3]


def test_a_call_past_call_timeout_s_fails_naming_it():
    async def scenario():
        book = FutureBook(call_timeout_s=0.2)

        async def stuck():
            await asyncio.Event().wait()

        return await book.result(book.submit("k", stuck, "a"), wait_s=30)

    out = asyncio.run(scenario())
    assert isinstance(out, Failed) and out.category == "server"
    assert "did not finish within 0.2s (call_timeout_s)" in out.error
