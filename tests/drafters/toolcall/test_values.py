"""Value drafting helpers: dates from the context, copy spans, counting runs."""

from __future__ import annotations

from toolcall_cases import DATE_TOOLS, TOOLS
from toolcall_cases import qwen_tok as qwen_tok

from toolspec_core.drafters.methods import RequestInfo
from toolspec_core.drafters.simulate import oracle_walk
from toolspec_core.drafters.toolcall.drafter import SchemaMethod
from toolspec_core.spec.proposer import DraftContext


def test_context_dates_found_in_the_forms_people_write():
    from toolspec_core.drafters.toolcall.values import context_dates

    text = (
        "The current year is 2023. Cancel the switch for March 19th at 9:30 AM, or on 5 April 2022 at 14:00. "
        "Also 03/07/2021. Not a date: 10000025, version 2.1, room 12."
    )
    assert context_dates(text) == [((2021, 3, 7), None), ((2022, 4, 5), (14, 0)), ((2023, 3, 19), (9, 30))]
    # no year written anywhere: nothing can be rendered; a year written later still counts
    assert context_dates("See you on June 1st.") == []
    assert context_dates("On June 1st at 2pm. (All dates 2024.)") == [((2024, 6, 1), (14, 0))]
    assert context_dates("Meet on February 30, 2023.") == [((2023, 2, 30), None)]  # found; rendering skips it


def test_date_values_use_the_schema_format_first_then_iso_forms():
    from toolspec_core.drafters.toolcall.values import date_values, wants_date

    dates = [((2023, 3, 19), (9, 30)), ((2023, 2, 30), None), ((2022, 4, 5), None)]
    props = DATE_TOOLS[0]["function"]["parameters"]["properties"]
    assert date_values(dates, {"description": "Format: %Y-%m-%d %H:%M:%S"})[0] == "2023-03-19 09:30:00"
    assert date_values(dates, props["date"]) == [
        "2023-03-19",
        "2023-03-19 09:30:00",
        "2023-03-19 09:30",
        "09:30:00",
        "09:30",
        "2022-04-05",
    ]
    assert date_values(dates, props["slot"]) == ["09:30:00", "09:30"]
    assert date_values([((2022, 4, 5), None)], {"description": "Format: %Y-%m-%d %H:%M"}) == [
        "2022-04-05"
    ]  # no time: no made-up 00:00
    assert wants_date("date", props["date"]) and wants_date("time", props["time"]) and wants_date("slot", props["slot"])
    assert not wants_date("city", props["city"])


def test_counting_runs_a_value_has_begun_are_continued(qwen_tok):
    from toolspec_core.drafters.toolcall.values import digit_run
    from toolspec_core.spec.labels import PATTERN

    assert digit_run("123") == "4567890" and digit_run("ID-7890") == "" and digit_run("0123") == "4567890"
    assert digit_run("12") == "" and digit_run("1357") == "" and digit_run("abc") == "" and digit_run("") == ""
    m = SchemaMethod(qwen_tok)
    req = RequestInfo(qwen_tok.encode("Call get_time."), TOOLS)
    out = qwen_tok.encode('{"name": "get_time", "arguments": {"tz": "123')
    tree = m.drafter(req).propose(DraftContext(req.prompt_ids + out, len(req.prompt_ids), 64))
    truth = qwen_tok.encode('4567890"}}')
    path = oracle_walk(tree, truth).path
    assert len(path) >= 7 and tree.labels[path[0]] == PATTERN


def test_value_spans_copy_from_word_starts():
    from toolspec_core.drafters.toolcall.values import value_spans

    src = 'remind me on 2022-05-10 10:00:00 please. {"token": "n9m8k7"} and a 12.5 kg parcel'
    assert value_spans(src, "2", False) == ['022-05-10 10:00:00 please. {"']
    assert value_spans(src, "n9", False) == ['m8k7"']  # a JSON string in the source: closing quote too
    assert value_spans(src, "1", True) == ["2.5", "0"]  # numbers stop where the number stops
    assert value_spans(src, "m8", False) == []  # not at a word start
    assert value_spans(src, "", False) == [] and value_spans(src, '"', False) == []
    assert (
        value_spans(src, "-12", True) == [".5"] and value_spans(src, "-", True) == []
    )  # a sign the source did not write
