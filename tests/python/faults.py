"""Faulty upstreams as an SDK sees them through polygw serve (tests/sdk.rs runs it).

Usage: faults.py openai|anthropic. Environment: POLYGW_ROOT (http://host:port),
POLYGW_KEY. Scopes (see tests/sdk.rs): `cut`, `stall` and `malformed` have a primary
whose stream breaks mid-way (reset, a long silence, an invalid event) and a fallback,
so polygw resumes the stream; `limited` answers 429 with Retry-After: 30; `broken`
answers 500 on every source. The client never retries (max_retries=0).

Prints one JSON object: for each resumed stream the deltas as the SDK delivered them
and the SDK's final text (the Rust test compares both with the answer the primary
planned); for each error, how the SDK raised it (plain and streamed).
"""

import json
import os
import sys

sdk = sys.argv[1]
root, key = os.environ["POLYGW_ROOT"], os.environ["POLYGW_KEY"]
PROMPT = "Tell me a long story."

if sdk == "openai":
    import openai as lib

    client = lib.OpenAI(base_url=root + "/v1", api_key=key, max_retries=0)

    def stream_text(model):
        with client.responses.stream(model=model, input=PROMPT) as s:
            deltas, types = [], []
            for event in s:
                types.append(event.type)
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                assert event.type not in ("error", "response.failed"), event
            final = s.get_final_response()
        assert types[0] == "response.created" and types[-1] == "response.completed", types
        assert final.status == "completed", final.status
        return {"deltas": "".join(deltas), "final": final.output_text, "id": final.id}

    def call(model, stream):
        if stream:
            with client.responses.stream(model=model, input=PROMPT) as s:
                for _ in s:
                    pass
        else:
            client.responses.create(model=model, input=PROMPT)

    def body_kind(err):
        return (err.body or {}).get("code") if isinstance(err.body, dict) else None

elif sdk == "anthropic":
    import anthropic as lib

    client = lib.Anthropic(base_url=root, api_key=key, max_retries=0)

    def stream_text(model):
        with client.messages.stream(
            model=model, max_tokens=1024, messages=[{"role": "user", "content": PROMPT}]
        ) as s:
            deltas = list(s.text_stream)
            final = s.get_final_message()
        assert final.stop_reason == "end_turn", final.stop_reason
        text = "".join(b.text for b in final.content if b.type == "text")
        return {"deltas": "".join(deltas), "final": text, "id": final.id}

    def call(model, stream):
        kw = dict(model=model, max_tokens=64, messages=[{"role": "user", "content": PROMPT}])
        if stream:
            with client.messages.stream(**kw) as s:
                for _ in s.text_stream:
                    pass
        else:
            client.messages.create(**kw)

    def body_kind(err):
        return ((err.body or {}).get("error") or {}).get("type") if isinstance(err.body, dict) else None

else:
    raise SystemExit(f"usage: faults.py openai|anthropic (got {sdk!r})")

out = {}
for scope in ("cut", "stall", "malformed"):
    out[scope] = stream_text(scope)


def failure(model, stream):
    try:
        call(model, stream)
    except lib.APIStatusError as err:
        return {
            "class": type(err).__name__,
            "mro": [c.__name__ for c in type(err).__mro__],
            "status": err.status_code,
            "retry_after": err.response.headers.get("retry-after"),
            "should_retry": err.response.headers.get("x-should-retry"),
            "content_type": err.response.headers.get("content-type"),
            "kind": body_kind(err),
            "request_id": err.request_id,
        }
    raise AssertionError(f"{model} (stream={stream}) did not fail")


for scope in ("limited", "broken"):
    for stream in (False, True):
        out[f"{scope}_{'stream' if stream else 'plain'}"] = failure(scope, stream)

print(json.dumps(out))
