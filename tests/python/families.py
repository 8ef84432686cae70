"""Signature families through polygw serve with the official SDKs (tests/sdk.rs runs it,
one phase at a time, changing the mocks between phases).

Usage: families.py anthropic|openai PHASE STATE_FILE. Environment: POLYGW_ROOT,
POLYGW_KEY. The scope `fam` has source A (priority 0, signature group fam-a) and B
(priority 1, fam-b); each mock signs its thinking or encrypted reasoning as its group
and refuses another group's with the provider's 400. The client never retries
(max_retries=0): any 400 polygw let through would raise here.

anthropic (thinking on, a tool each turn, plain then streamed):
  start     A up: a tool round answered with a signed thinking block.
  failover  A down: two more rounds on B (the open tool loop, then the next one).
  back      A up again: one more round on A.
openai:
  start     A up: a stored response with encrypted reasoning, plain and streamed.
  failover  A down: previous_response_id continued on B; a stateless request that
            sends A's reasoning items back (as Codex does), plain and streamed.

Prints one JSON object: the signatures or encrypted contents seen, per phase.
"""

import json
import os
import sys

sdk, phase, state_path = sys.argv[1], sys.argv[2], sys.argv[3]
root, key = os.environ["POLYGW_ROOT"], os.environ["POLYGW_KEY"]
state = {} if phase == "start" else json.load(open(state_path))
out = {}

if sdk == "anthropic":
    import anthropic

    client = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0)
    tools = [
        {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    thinking = {"type": "enabled", "budget_tokens": 1024}

    def round_trip(messages, stream):
        kw = dict(model="fam", max_tokens=2048, thinking=thinking, tools=tools, messages=messages)
        if stream:
            with client.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = client.messages.create(**kw)
        assert m.stop_reason == "tool_use", m
        kinds = [b.type for b in m.content]
        assert kinds[0] == "thinking" and "tool_use" in kinds, kinds
        assert m.content[0].signature, m.content[0]
        content = [b.model_dump(exclude_none=True) for b in m.content]
        use = next(b for b in m.content if b.type == "tool_use")
        messages.append({"role": "assistant", "content": content})
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 °C"}],
            }
        )
        return content[0]["signature"]

    rounds = {"start": 1, "failover": 2, "back": 1}[phase]
    for stream in (False, True):
        k = "stream" if stream else "plain"
        messages = state.get(k, [{"role": "user", "content": "What is the weather in Paris?"}])
        out[k] = [round_trip(messages, stream) for _ in range(rounds)]
        state[k] = messages

elif sdk == "openai":
    import openai

    client = openai.OpenAI(base_url=root + "/v1", api_key=key, max_retries=0)

    def respond(stream, **kw):
        if stream:
            with client.responses.stream(model="fam", **kw) as s:
                return s.get_final_response()
        return client.responses.create(model="fam", **kw)

    for stream in (False, True):
        k = "stream" if stream else "plain"
        if phase == "start":
            r = respond(stream, input="My name is Ann.")
            kinds = [i.type for i in r.output]
            assert kinds == ["reasoning", "message"], kinds
            assert r.output[0].encrypted_content, r.output[0]
            assert r.output_text == "Hello there", r.output_text
            state[k] = {
                "id": r.id,
                "items": [i.model_dump(exclude_none=True) for i in r.output],
            }
            out[k] = [r.output[0].encrypted_content]
        else:
            s = state[k]
            # Continued by id: polygw expands it from its store, on any source.
            r = respond(stream, input="Who am I?", previous_response_id=s["id"])
            assert r.output_text == "Hello there", r.output_text
            seen = [r.output[0].encrypted_content]
            # Stateless, as Codex: the reasoning items sent back by the client.
            r = respond(
                stream,
                store=False,
                include=["reasoning.encrypted_content"],
                input=[{"role": "user", "content": "My name is Ann."}]
                + s["items"]
                + [{"role": "user", "content": "Who am I?"}],
            )
            assert r.output_text == "Hello there", r.output_text
            seen.append(r.output[0].encrypted_content)
            out[k] = seen
else:
    raise SystemExit(f"unknown sdk {sdk}")

json.dump(state, open(state_path, "w"))
print(json.dumps(out))
