"""Fitting a chat into the context: the oldest turns left out, in steps that keep the prefix."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxkv.chat.context_window import MESSAGE_OVERHEAD, fit_messages

OVERHEAD = 3  # what this test's "template" adds per message


def count(message: dict) -> int:
    return len(message["content"].split())


def measure(messages: list[dict]) -> int:
    return sum(count(m) + OVERHEAD for m in messages)


def turn(role: str, words: int, tag: str = "w") -> dict:
    return {"role": role, "content": " ".join([tag] * words)}


def chat(turns: int, words: int = 10, system: bool = True) -> list[dict]:
    head = [turn("system", 5, "s")] if system else []
    return head + [turn("user" if i % 2 == 0 else "assistant", words, f"t{i}") for i in range(turns)]


def test_a_chat_that_fits_is_sent_whole():
    messages = chat(6)
    assert fit_messages(messages, measure(messages), measure, count) == (messages, 0)


def test_the_system_prompt_and_the_newest_turns_are_kept_from_a_user_message():
    for system in (True, False):
        messages = chat(40, system=system)
        kept, left_out = fit_messages(messages, 100, measure, count)
        assert measure(kept) <= 100 and left_out > 0
        head = messages[:1] if system else []
        assert kept == head + messages[len(head) + left_out:]
        assert kept[len(head)]["role"] == "user"


def sliding(messages: list[dict], limit: int) -> int:
    """Turns left out by the naive fit: as few as possible, which moves the start every turn."""
    head = 1
    for left_out in range(0, len(messages) - head, 2):
        if measure(messages[:head] + messages[head + left_out:]) <= limit:
            return left_out
    raise AssertionError("no fit")


def moves(starts: list[int]) -> int:
    return sum(1 for a, b in zip(starts, starts[1:]) if a != b)


def test_the_window_moves_in_steps_so_a_growing_chat_keeps_its_prefix():
    limit, starts, naive, last = 400, [], [], None  # turns of 13 tokens: ~15 exchanges fill the limit
    for n in range(1, 160, 2):  # a user message, then its reply and the next message
        kept, left_out = fit_messages(chat(n), limit, measure, count)
        assert measure(kept) <= limit
        if last is not None and left_out == starts[-1]:
            assert kept[: len(last)] == last  # same start: the last prompt is this one's prefix
        starts.append(left_out)
        naive.append(sliding(chat(n), limit))
        last = kept
    # Each move leaves out about half the limit, so the prompt keeps its
    # start for several turns; the naive fit recomputes on every turn.
    assert moves(naive) >= len(starts) - 16
    assert 0 < moves(starts) <= moves(naive) / 4, (moves(starts), moves(naive))


def test_a_last_message_longer_than_the_limit_is_left_to_the_engine_to_refuse():
    messages = chat(4) + [turn("user", 500)]
    assert fit_messages(messages, 100, measure, count) == (messages, 0)


def test_the_steps_fall_on_estimated_positions_and_the_fit_is_measured_exactly():
    # An estimate that is far off still gives a window that fits exactly.
    messages = chat(40)
    kept, left_out = fit_messages(messages, 100, measure, lambda m: 0)
    assert measure(kept) <= 100 and left_out > 0 and MESSAGE_OVERHEAD > 0


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 60), min_size=1, max_size=40), limit=st.integers(20, 300),
       system=st.booleans())
def test_any_growing_chat_fits_and_its_start_only_moves_forward(sizes, limit, system):
    head = [turn("system", 4, "s")] if system else []
    previous_left_out, previous = 0, None
    for n in range(1, len(sizes) + 1, 2):  # the chat as it grows, each time ending on a user message
        messages = head + [turn("user" if i % 2 == 0 else "assistant", w, f"t{i}") for i, w in enumerate(sizes[:n])]
        kept, left_out = fit_messages(messages, limit, measure, count)
        if left_out == 0:
            assert kept == messages  # fits, or nothing fits and the engine refuses it
        else:
            assert measure(kept) <= limit and kept == head + messages[len(head) + left_out:]
            assert kept[len(head)]["role"] == "user"
        if left_out and previous_left_out:  # (0 after a start: a last message too long to send at all)
            assert left_out >= previous_left_out  # never back to a start already left behind
            if left_out == previous_left_out:
                assert kept[: len(previous)] == previous  # the last prompt is this one's prefix
        previous_left_out, previous = left_out, kept
