"""A request's usage over its choices: one rule for streamed and whole answers."""

from __future__ import annotations

from gateway.output import Usage, request_usage


def test_completion_tokens_add_up_and_the_prompt_is_choice_zeros() -> None:
    # Choice 1 found the prompt cached (choice 0 had just computed it); the request reports
    # choice 0's view, whichever choice finished last.
    choices = [Usage(10, 3, 0), Usage(10, 5, 8)]
    assert request_usage(choices) == Usage(10, 8, 0)


def test_no_finished_choice_reports_nothing() -> None:
    assert request_usage([]) == Usage()
