"""The Anthropic Python SDK's Messages API through polygw serve (tests/sdk.rs runs it).

Environment: POLYGW_ROOT (http://host:port, the SDK adds /v1/messages), POLYGW_KEY
(sent as x-api-key). Scopes: `plain` answers "Hello from polygw"; `tools` asks for
get_weather({"city": "Paris"}) once, then answers "It is 21 °C in Paris.". Every
SDK-side check is an assertion here; the last stdout line is a JSON object of what the
Rust test cross-checks against the mocks' request logs.
"""

import json
import os

import anthropic

client = anthropic.Anthropic(
    base_url=os.environ["POLYGW_ROOT"], api_key=os.environ["POLYGW_KEY"], max_retries=0
)
out = {}

# messages.create: the text, stop reason, usage, ids.
m = client.messages.create(
    model="plain",
    max_tokens=64,
    system="You are terse.",
    messages=[{"role": "user", "content": "hi"}],
)
assert [b.type for b in m.content] == ["text"], m.content
assert m.content[0].text == "Hello from polygw", m
assert m.stop_reason == "end_turn", m.stop_reason
assert m.role == "assistant" and m.type == "message", m
assert m.id.startswith("msg_"), m.id
assert m.usage.output_tokens > 0 and m.usage.input_tokens > 0, m.usage
assert m._request_id, "request-id"
out["plain_id"] = m.id

# messages.stream: text_stream and get_final_message().
with client.messages.stream(
    model="plain", max_tokens=64, messages=[{"role": "user", "content": "stream please"}]
) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
assert streamed == "Hello from polygw", streamed
assert [b.type for b in final.content] == ["text"], final.content
assert final.content[0].text == streamed, final
assert final.stop_reason == "end_turn", final.stop_reason
assert final.usage.output_tokens > 0, final.usage
out["stream_text"] = streamed

# A tool-use loop: tool_use, the client's tool_result, the answer.
tools = [
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]
m = client.messages.create(model="tools", max_tokens=256, messages=messages, tools=tools)
assert m.stop_reason == "tool_use", m
uses = [b for b in m.content if b.type == "tool_use"]
assert len(uses) == 1, m.content
use = uses[0]
assert use.name == "get_weather" and use.input == {"city": "Paris"}, use
messages.append({"role": "assistant", "content": m.content})
messages.append(
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temp_c": 21}'}],
    }
)
m = client.messages.create(model="tools", max_tokens=256, messages=messages, tools=tools)
assert m.stop_reason == "end_turn", m
assert [b.type for b in m.content] == ["text"], m.content
assert m.content[0].text == "It is 21 °C in Paris.", m
out["tool_use_id"] = use.id

# count_tokens: the estimate polygw reserves.
n = client.messages.count_tokens(
    model="plain",
    system="You are terse.",
    messages=[{"role": "user", "content": "How many tokens is this question?"}],
)
assert n.input_tokens > 0, n
out["count_tokens"] = n.input_tokens

print(json.dumps(out))
