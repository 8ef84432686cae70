"""An official SDK through polygw serve to sources that speak its API natively, with
faults before the first content event (tests/sdk.rs runs it).

Usage: native_faults.py anthropic|openai. Environment: POLYGW_ROOT, POLYGW_KEY.
Scopes (see tests/sdk.rs), each with a faulty primary and a healthy fallback that
answers "Rescued by the fallback": `overloaded` (529 for Messages, 500 for Responses),
`overloaded_event` (an `overloaded_error` event, or `response.failed`, before the first
content event), `limited` (429 with Retry-After: 30), `cut_early` (the connection reset
before the first token), `slow_first` (a 20 s first token; the scope hedges after
0.5 s); and mid-answer (SPEC §23.6), `cut_mid` (the connection reset after two content
chunks) and `overloaded_mid` (an `overloaded_error` event, or `response.failed`, after
two), continued on the fallback by replay: the SDK sees one stream; `prefill_mid` and
`prefill_refused` (cut after two chunks; the fallback has `PREFILL=assistant`, and the
second refuses prefill), continued by prefill on a `messages` fallback that takes it and
by replay otherwise. Then `rejected` (a content 400 with the provider's wording) and `badkey` (the
source answers 401). The client never retries (max_retries=0).

Prints one JSON object: per scope the plain and streamed text, and how the errors
were raised.
"""

import json
import os
import sys
import time

sdk = sys.argv[1]
root, key = os.environ["POLYGW_ROOT"], os.environ["POLYGW_KEY"]
out = {}

if sdk == "anthropic":
    import anthropic as lib

    client = lib.Anthropic(base_url=root, api_key=key, max_retries=0)
    MSG = [{"role": "user", "content": "Say something."}]

    def streamed(scope):
        with client.messages.stream(model=scope, max_tokens=64, messages=MSG) as s:
            names = []
            for ev in s:
                names.append(ev.type)
                assert ev.type != "error", ev
            final = s.get_final_message()
        assert names.count("message_start") == 1 and names[-1] == "message_stop", names
        assert final.stop_reason == "end_turn", final
        assert final.id.startswith("msg_mock-"), final.id
        return "".join(b.text for b in final.content if b.type == "text")

    def plain(scope):
        m = client.messages.create(model=scope, max_tokens=64, messages=MSG)
        assert m.id.startswith("msg_mock-"), m.id
        return "".join(b.text for b in m.content if b.type == "text")

    def error_fields(body):
        err = body.get("error", body) if isinstance(body, dict) else {}
        return err.get("type"), err.get("message")

else:
    import openai as lib

    client = lib.OpenAI(base_url=root + "/v1", api_key=key, max_retries=0)

    def streamed(scope):
        with client.responses.stream(model=scope, input="Say something.") as s:
            types = []
            for ev in s:
                types.append(ev.type)
                assert ev.type not in ("error", "response.failed"), ev
            final = s.get_final_response()
        assert types[0] == "response.created" and types[-1] == "response.completed", types
        assert final.id.startswith("resp_mock-"), final.id
        return final.output_text

    def plain(scope):
        r = client.responses.create(model=scope, input="Say something.")
        assert r.id.startswith("resp_mock-"), r.id
        return r.output_text

    def error_fields(body):
        err = body.get("error", body) if isinstance(body, dict) else {}
        return err.get("type"), err.get("message")


for scope in [
    "overloaded",
    "overloaded_event",
    "limited",
    "cut_early",
    "slow_first",
    "cut_mid",
    "overloaded_mid",
    "prefill_mid",
    "prefill_refused",
]:
    t0 = time.monotonic()
    entry = {"stream": streamed(scope), "stream_s": time.monotonic() - t0}
    if scope != "slow_first":
        entry["plain"] = plain(scope)
    out[scope] = entry

for scope in ["rejected", "badkey"]:
    for stream in [False, True]:
        try:
            streamed(scope) if stream else plain(scope)
            raise AssertionError(f"{scope}: no error")
        except lib.APIStatusError as e:
            kind, message = error_fields(e.body)
            out[f"{scope}_{'stream' if stream else 'plain'}"] = {
                "class": type(e).__name__,
                "status": e.status_code,
                "type": kind,
                "message": message,
                "should_retry": e.response.headers.get("x-should-retry"),
            }

print(json.dumps(out))
