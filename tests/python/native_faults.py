"""The Anthropic Python SDK through polygw serve to sources that speak Messages
natively, with faults before the first content event (tests/sdk.rs runs it).

Environment: POLYGW_ROOT, POLYGW_KEY. Scopes (see tests/sdk.rs), each with a faulty
primary and a healthy fallback that answers "Rescued by the fallback": `overloaded`
(529), `overloaded_event` (an `overloaded_error` event before the first content event),
`limited` (429 with Retry-After: 30), `cut_early` (the connection reset before the first
token), `slow_first` (a 20 s first token; the scope hedges after 0.5 s). Then
`rejected` (a content 400 with Anthropic's wording) and `badkey` (the source answers
401). The client never retries (max_retries=0).

Prints one JSON object: per scope the plain and streamed text, and how the errors
were raised.
"""

import json
import os
import time

import anthropic

client = anthropic.Anthropic(
    base_url=os.environ["POLYGW_ROOT"], api_key=os.environ["POLYGW_KEY"], max_retries=0
)
MSG = [{"role": "user", "content": "Say something."}]
out = {}

for scope in ["overloaded", "overloaded_event", "limited", "cut_early", "slow_first"]:
    t0 = time.monotonic()
    with client.messages.stream(model=scope, max_tokens=64, messages=MSG) as s:
        names = []
        for ev in s:
            names.append(ev.type)
            assert ev.type != "error", ev
        final = s.get_final_message()
    assert names.count("message_start") == 1 and names[-1] == "message_stop", names
    assert final.stop_reason == "end_turn", final
    assert final.id.startswith("msg_mock-"), final.id
    streamed = "".join(b.text for b in final.content if b.type == "text")
    entry = {"stream": streamed, "stream_s": time.monotonic() - t0}
    if scope != "slow_first":
        m = client.messages.create(model=scope, max_tokens=64, messages=MSG)
        assert m.id.startswith("msg_mock-"), m.id
        entry["plain"] = "".join(b.text for b in m.content if b.type == "text")
    out[scope] = entry

for scope in ["rejected", "badkey"]:
    for stream in [False, True]:
        try:
            if stream:
                with client.messages.stream(model=scope, max_tokens=64, messages=MSG) as s:
                    for _ in s:
                        pass
            else:
                client.messages.create(model=scope, max_tokens=64, messages=MSG)
            raise AssertionError(f"{scope}: no error")
        except anthropic.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}
            err = body.get("error", body) if isinstance(body, dict) else {}
            out[f"{scope}_{'stream' if stream else 'plain'}"] = {
                "class": type(e).__name__,
                "status": e.status_code,
                "type": err.get("type"),
                "message": err.get("message"),
                "should_retry": e.response.headers.get("x-should-retry"),
            }

print(json.dumps(out))
