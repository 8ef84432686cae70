"""Every client API on every source API through polygw serve, with the official SDKs
(SPEC §23.3; tests/sdk.rs runs it).

Usage: cross.py chat|responses|messages. Environment: POLYGW_ROOT, POLYGW_KEY.
Scopes (model names): `src_chat`, `src_messages`, `src_responses` — one source of that
API each, which asks for get_weather({"city": "Paris"}) on the first turn of a round
and answers "It is 21 °C in Paris." on the second; `limited_API` (the primary answers
429 with Retry-After: 30) and `cut_API` (the primary resets the connection) — each with
a fallback that answers "It is 21 °C in Paris.". The client never retries.

Prints one JSON object: per scope, what the SDK saw.
"""

import json
import os
import sys

api = sys.argv[1]
root, key = os.environ["POLYGW_ROOT"], os.environ["POLYGW_KEY"]
ANSWER = "It is 21 °C in Paris."
Q = "What is the weather in Paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
out = {}

if api in ("chat", "responses"):
    import openai

    client = openai.OpenAI(base_url=root + "/v1", api_key=key, max_retries=0)
else:
    import anthropic

    client = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0)


def chat_turn(scope, messages, stream):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    if not stream:
        r = client.chat.completions.create(model=scope, messages=messages, tools=tools)
        m = r.choices[0].message
        calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        assert r.usage.completion_tokens > 0, r.usage
        return m.content or "", calls, r.choices[0].finish_reason
    text, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(
        model=scope, messages=messages, tools=tools, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, ["", "", ""])
                c[0] += tc.id or ""
                c[1] += (tc.function.name or "") if tc.function else ""
                c[2] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    assert usage and usage.completion_tokens > 0, usage
    return text, [(i, n, json.loads(a)) for i, n, a in calls.values()], finish


def chat_round(scope, stream):
    messages = [{"role": "user", "content": Q}]
    text, calls, finish = chat_turn(scope, messages, stream)
    assert finish == "tool_calls" and [c[1:] for c in calls] == [("get_weather", {"city": "Paris"})], (finish, calls)
    call_id = calls[0][0]
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]})
    messages.append({"role": "tool", "tool_call_id": call_id, "content": "21 °C"})
    text, calls, finish = chat_turn(scope, messages, stream)
    assert text == ANSWER and not calls and finish == "stop", (text, calls, finish)
    return text


def responses_turn(scope, items, stream):
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    kw = dict(model=scope, input=items, tools=tools, store=False)
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    assert r.usage.output_tokens > 0, r.usage
    return r


def responses_round(scope, stream):
    items = [{"role": "user", "content": Q}]
    r = responses_turn(scope, items, stream)
    calls = [i for i in r.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})], r.output
    items += [{"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
               "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 °C"}]
    r = responses_turn(scope, items, stream)
    assert r.output_text == ANSWER, r.output
    assert r.status == "completed", r.status
    return r.output_text


def messages_turn(scope, messages, stream):
    tools = [{"name": "get_weather", "input_schema": SCHEMA}]
    kw = dict(model=scope, max_tokens=300, messages=messages, tools=tools)
    if stream:
        with client.messages.stream(**kw) as s:
            names = [ev.type for ev in s]
            m = s.get_final_message()
        assert names.count("message_start") == 1 and names[-1] == "message_stop", names
    else:
        m = client.messages.create(**kw)
    assert m.usage.output_tokens > 0, m.usage
    return m


def messages_round(scope, stream):
    messages = [{"role": "user", "content": Q}]
    m = messages_turn(scope, messages, stream)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"})], m
    messages += [{"role": "assistant", "content": [u.model_dump(exclude_none=True) for u in uses]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 °C"}]}]
    m = messages_turn(scope, messages, stream)
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text == ANSWER and m.stop_reason == "end_turn", m
    return text


def plain_answer(scope, stream):
    if api == "chat":
        return chat_turn(scope, [{"role": "user", "content": Q}], stream)[0]
    if api == "responses":
        return responses_turn(scope, [{"role": "user", "content": Q}], stream).output_text
    m = messages_turn(scope, [{"role": "user", "content": Q}], stream)
    return "".join(b.text for b in m.content if b.type == "text")


round_trip = {"chat": chat_round, "responses": responses_round, "messages": messages_round}[api]
for src in ("chat", "messages", "responses"):
    out[f"src_{src}"] = [round_trip(f"src_{src}", stream) for stream in (False, True)]
    out[f"limited_{src}"] = plain_answer(f"limited_{src}", False)
    out[f"cut_{src}"] = plain_answer(f"cut_{src}", True)
    assert out[f"limited_{src}"] == ANSWER and out[f"cut_{src}"] == ANSWER, out

print(json.dumps(out))
