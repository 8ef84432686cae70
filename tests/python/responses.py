"""The OpenAI Python SDK's Responses API through polygw serve (tests/sdk.rs runs it).

Environment: POLYGW_BASE (http://host:port/v1), POLYGW_KEY. Scopes (mock upstreams
behind them, see tests/sdk.rs): `plain` answers "Hello from polygw"; `tools` asks for
get_weather({"city": "Paris"}) once, then answers "It is 21 °C in Paris."; `json`
answers {"city": "Paris", "temp_c": 21} as text. Every SDK-side check is an assertion
here; the last stdout line is a JSON object of what the Rust test cross-checks against
the mocks' request logs.
"""

import json
import os

import openai
from pydantic import BaseModel

client = openai.OpenAI(
    base_url=os.environ["POLYGW_BASE"], api_key=os.environ["POLYGW_KEY"], max_retries=0
)
out = {}

# Plain: the text, the usage, the ids.
r = client.responses.create(model="plain", input="hi", instructions="Be brief.")
assert r.output_text == "Hello from polygw", r
assert r.status == "completed", r.status
assert r.id.startswith("resp_"), r.id
assert r.usage is not None and r.usage.output_tokens > 0, r.usage
assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage
assert r._request_id, "x-request-id"
assert [o.type for o in r.output] == ["message"], r.output
out["plain_id"] = r.id

# Streamed with the SDK's stream helper: typed events, deltas, the final response.
with client.responses.stream(model="plain", input="stream please") as stream:
    deltas, types = "", []
    for event in stream:
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas += event.delta
    final = stream.get_final_response()
assert types[0] == "response.created" and types[-1] == "response.completed", types
assert "response.output_text.done" in types and "response.output_item.done" in types, types
assert deltas == "Hello from polygw", deltas
assert final.output_text == deltas, final
assert final.usage is not None and final.usage.output_tokens > 0, final.usage
out["stream_text"] = deltas
out["stream_id"] = final.id

# A function-tool loop: the model asks for the tool, the client runs it and sends
# function_call_output, the model answers.
tools = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
]
history = [{"role": "user", "content": "What is the weather in Paris?"}]
r = client.responses.create(model="tools", input=history, tools=tools, store=False)
calls = [o for o in r.output if o.type == "function_call"]
assert len(calls) == 1, r.output
call = calls[0]
assert call.name == "get_weather", call
assert json.loads(call.arguments) == {"city": "Paris"}, call.arguments
history += r.output
history.append(
    {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}
)
r = client.responses.create(model="tools", input=history, tools=tools, store=False)
assert r.output_text == "It is 21 °C in Paris.", r
assert not [o for o in r.output if o.type == "function_call"], r.output
out["tool_call_id"] = call.call_id

# previous_response_id: the second turn's upstream request holds the first turn.
first = client.responses.create(model="plain", input="My name is Ann.")
second = client.responses.create(
    model="plain", input="What is my name?", previous_response_id=first.id
)
assert second.output_text == "Hello from polygw", second
assert second.previous_response_id == first.id, second.previous_response_id
out["first_id"] = first.id

# Stored responses: retrieve, input items, delete (then 404).
got = client.responses.retrieve(first.id)
assert got.id == first.id and got.output_text == first.output_text, got
items = client.responses.input_items.list(first.id)
assert [i.type for i in items.data] == ["message"], items
assert client.responses.delete(first.id) is None
try:
    client.responses.retrieve(first.id)
    raise AssertionError("a deleted response is still there")
except openai.NotFoundError as err:
    assert err.status_code == 404, err


# Structured output: responses.parse with a Pydantic model (text.format json_schema).
class Weather(BaseModel):
    city: str
    temp_c: int


parsed = client.responses.parse(
    model="json", input="The weather in Paris, as JSON.", text_format=Weather
)
assert parsed.output_parsed == Weather(city="Paris", temp_c=21), parsed
out["parsed"] = parsed.output_parsed.model_dump()

print(json.dumps(out))
