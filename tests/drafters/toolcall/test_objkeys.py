"""Keys of objects no schema describes, from the objects seen so far."""

from __future__ import annotations

from toolcall_cases import TOOLS, _texts, tracker

from toolspec_core.drafters.toolcall.candidates import Priors, continuations
from toolspec_core.drafters.toolcall.fsm import ToolIndex

RESULT_CONTEXT = (
    'Tool result: {"name": "get_time", "output_parameters": {"time": {"type": "str", "description": "Local time."}, '
    '"zone": {"type": "str", "description": "Zone name, like \\"CET\\" {not a key}."}}}\n'
)


def test_key_scanner_reads_objects_in_prose_whole_or_in_pieces():
    from toolspec_core.drafters.toolcall.objkeys import KeyScanner, ObjectKeys

    text = (
        'He said "hi": fine. ' + RESULT_CONTEXT + 'Then [{"a": 1, "b": [2]}, {"a": 3}] and a stray " quote\n{"c": {}}'
    )
    whole = KeyScanner().feed(text).index.objects
    pieces = KeyScanner()
    for i in range(0, len(text), 3):
        pieces.feed(text[i : i + 3])
    assert pieces.index.objects == whole
    assert (
        ObjectKeys("output_parameters", ("time", "zone")) in whole
    )  # braces / quotes inside strings are not structure
    assert ObjectKeys("time", ("type", "description")) in whole
    assert ObjectKeys(None, ("name", "output_parameters")) in whole
    assert (
        whole.count(ObjectKeys(None, ("a", "b"))) == 1 and ObjectKeys(None, ("a",)) in whole
    )  # array records: parent of the array
    assert (
        ObjectKeys(None, ("c",)) in whole
    )  # "hi" (no object open) is no key; a quote left open on its line is no string


def test_key_candidates_follow_seen_objects():
    from toolspec_core.drafters.toolcall.objkeys import CLOSE, KeyScanner, key_candidates

    seen = [(KeyScanner().feed(RESULT_CONTEXT + '{"items": [{"id": 1, "tag": "x"}]}').index, 1.0)]
    assert key_candidates(seen, "output_parameters", ["time"])[0][0] == "zone"
    assert key_candidates(seen, "output_parameters", ["time", "zone"])[0][0] == CLOSE
    assert key_candidates(seen, "items", [])[0][0] == "id"  # an array's next record starts like the last one
    assert key_candidates(seen, None, [], "output")[0][0] == "output_parameters"
    assert key_candidates(seen, None, [], "zzz") == []
    assert key_candidates([], None, ["a"], schema_keys=["a", "b"])[0][0] == "b"  # a nested schema's unused keys
    assert all(k != "time" for k, _ in key_candidates(seen, "output_parameters", ["time"]))  # never a used key


def test_objects_no_schema_describes_are_drafted_from_the_objects_seen():
    from toolspec_core.drafters.toolcall.objkeys import KeyScanner
    from toolspec_core.spec.labels import OBJ_KEY

    idx = ToolIndex.from_tools(TOOLS)
    call = '{"name": "get_time", "arguments": {"tz": "UTC"}}\n'

    def texts(out: str) -> list[str]:
        cands = continuations(
            tracker(out), idx, Priors(), [0], levels=2, context_keys=KeyScanner().feed(RESULT_CONTEXT).index
        )
        assert all(seg[1] == OBJ_KEY for c in cands for seg in c.segs)
        return _texts(cands)

    # a made-up tool result after the call, shaped like the result in the context
    assert texts(call + '{"out')[0] == 'put_parameters": '
    assert texts(call + '{"output_parameters": {"time": "10:00"')[0] == ', "zone": '
    assert texts(call + '{"output_parameters": {"time": "10:00", "zone": "CET"')[0] == "}"
    assert texts(call + '{"output_parameters": {"time": "10:00", "zo')[0] == 'ne": '
    assert '": ' in texts(
        call + '{"output_parameters": {"new_key'
    )  # an unseen key most likely ends at the token boundary
    # records of an array (here a nested argument): the next record starts like the previous one
    rec = '{"name": "get_weather", "arguments": {"city": "Oslo", "tags": [{"k": 1, "v": 2}'
    assert texts(rec)[0] == ', {"k": '
    assert texts(rec + ', {"k": 3, ')[0] == '"v": '
    # a call is still a call
    assert _texts(continuations(tracker(call + '{"'), idx, Priors(), [0], levels=1))[0].startswith('name": "')
