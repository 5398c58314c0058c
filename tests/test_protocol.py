"""The wire protocol: what a job and a reply look like on the wire, and what is refused."""

from __future__ import annotations

import msgpack
import pytest

from tokenq.protocol import (
    PROTOCOL_VERSION,
    DoneEvent,
    ErrorEvent,
    JobRequest,
    Keys,
    ProtocolError,
    RestartEvent,
    Timings,
    TokenEvent,
    Usage,
    decode_event,
    decode_job,
    encode_event,
    pack,
)


def wire(fields: dict) -> dict[bytes, bytes]:
    """What redis-py hands the worker: bytes keys and values."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


def test_keys_live_under_one_namespace() -> None:
    keys = Keys("ns")
    names = [keys.jobs, keys.dead, keys.job("a"), keys.reply("a"), keys.cancel("a")]
    names += [keys.owner("a"), keys.metrics("w1")]
    assert all(n.startswith("ns:") for n in names)
    assert len(set(names)) == len(names)
    assert Keys().jobs == "tokenq:jobs"


def test_job_round_trip_keeps_every_field() -> None:
    job = JobRequest(
        messages=[{"role": "user", "content": "hi"}],
        params={"temperature": 0.5, "max_tokens": 7, "stop": ["\n"], "logit_bias": {5: -1.0}},
        job_id="job-1",
        priority=-3,
        deadline=1e10,
        model="smollm2-135m",
        metadata={"user": 42, "tags": ["a"]},
        submitted_at=123.5,
    )
    fields = job.to_fields()
    assert fields["v"] == str(PROTOCOL_VERSION) and fields["id"] == "job-1"
    back = decode_job(wire(fields))
    assert back == job


def test_payload_is_plain_msgpack_with_vllm_names() -> None:
    fields = JobRequest(prompt="x", params={"top_k": 3}, job_id="j").to_fields()
    data = msgpack.unpackb(fields["data"])
    assert data == {"prompt": "x", "params": {"top_k": 3}}


def entry(data: object, **overrides: object) -> dict:
    return {"v": "2", "id": "j", "data": pack(data), **overrides}


@pytest.mark.parametrize(
    ("fields", "code", "job_id"),
    [
        ({"v": "2", "id": "j", "data": b"\xc1\xc1"}, "invalid_payload", "j"),
        (entry([1, 2]), "invalid_payload", "j"),
        ({"v": "2", "id": "j"}, "invalid_payload", "j"),
        ({"v": "2", "data": pack({"prompt": "x"})}, "invalid_request", None),
        (entry({"prompt": "x"}, v="9"), "unsupported_version", "j"),
        ({"id": "j", "data": pack({"prompt": "x"})}, "unsupported_version", "j"),
        (entry({"prompt": "x"}, id="bad id!"), "invalid_request", None),
        (entry({}), "invalid_request", "j"),
        (entry({"prompt": "x", "messages": []}), "invalid_request", "j"),
        (entry({"prompt": 5}), "invalid_request", "j"),
        (entry({"messages": [{"role": "user"}]}), "invalid_request", "j"),
        (entry({"prompt_token_ids": [1, -2]}), "invalid_request", "j"),
        (entry({"prompt_token_ids": [1, True]}), "invalid_request", "j"),
        (entry({"prompt_token_ids": [1, 2.0]}), "invalid_request", "j"),
        (entry({"prompt_token_ids": ["1"]}), "invalid_request", "j"),
        (entry({"prompt": "x", "colour": 1}), "invalid_request", "j"),
        (entry({"prompt": "x", "params": {"tempreature": 1}}), "invalid_params", "j"),
        (entry({"prompt": "x", "params": [1]}), "invalid_params", "j"),
        (entry({"prompt": "x", "priority": "high"}), "invalid_request", "j"),
        (entry({"prompt": "x", "deadline": "soon"}), "invalid_request", "j"),
        # docs/protocol.md: a deadline must be finite; -inf is refused, not taken as past
        (entry({"prompt": "x", "deadline": float("-inf")}), "invalid_request", "j"),
        (entry({"prompt": "x", "deadline": float("nan")}), "invalid_request", "j"),
    ],
)
def test_bad_jobs_are_refused_with_a_code(fields: dict, code: str, job_id: str | None) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_job(wire(fields))
    assert info.value.code == code
    assert info.value.job_id == job_id


def test_events_round_trip() -> None:
    events = [
        TokenEvent(3, [5, 6], "ab", [[(5, -0.1), (9, -2.5)], [(6, -0.3)]]),
        TokenEvent(0, [1], "x"),
        DoneEvent("abc", "stop", [1, 2], Usage(4, 2), Timings(0.1, 0.2, 0.3), {"k": "v"}),
        ErrorEvent("invalid_params", "top_p: must be in (0, 1]", None),
        RestartEvent("diverged"),
    ]
    for event in events:
        fields = {
            k.encode(): v if isinstance(v, bytes) else v.encode()
            for k, v in encode_event(event).items()
        }
        back = decode_event(b"1-1", fields)
        event.event_id = "1-1"
        assert back == event
    assert Usage(4, 2).total_tokens == 6


def test_done_event_carries_usage_total_on_the_wire() -> None:
    fields = encode_event(DoneEvent("t", "length", [1], Usage(3, 1), Timings(1.0, 2.0, 3.0)))
    data = msgpack.unpackb(fields["data"])
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert data["timings"] == {"queue_time": 1.0, "time_to_first_token": 2.0, "total": 3.0}
    assert fields["type"] == "done"
