"""Stored Responses conversations through polygw serve, by two client keys (tests/sdk.rs
runs it; SPEC §24.5). Environment: POLYGW_ROOT, POLYGW_KEY_A, POLYGW_KEY_B. The scope
`plain` stores responses with RESPONSES__MAX_BYTES_PER_KEY at its minimum, 64 KiB.

1. Key A: a conversation of 12 turns (about 2 KB of input each), each turn continuing
   the previous one with previous_response_id; streamed every third turn.
2. Key B: a conversation of 3 turns; its stored input items, read back, are the whole
   conversation in order.
3. Key A: 12 more turns of about 8 KB: A's store passes its bound, so A's oldest turns
   leave, and continuing A's conversation is refused (404 naming the lost turn), never
   answered from a shortened history. B's conversation is untouched: it continues.
4. Key B cannot read A's responses (404), nor delete them.

Prints one JSON object: the ids of each conversation and what the refusals said.
"""

import json
import os

import openai

root = os.environ["POLYGW_ROOT"]
a = openai.OpenAI(base_url=root + "/v1", api_key=os.environ["POLYGW_KEY_A"], max_retries=0)
b = openai.OpenAI(base_url=root + "/v1", api_key=os.environ["POLYGW_KEY_B"], max_retries=0)
out = {}


def turn(client, i, size, previous, stream=False):
    text = f"turn {i}: " + ("lorem ipsum " * (size // 12))
    if not stream:
        r = client.responses.create(
            model="plain", input=text, previous_response_id=previous, max_output_tokens=20
        )
        assert r.output_text == "Hello from polygw", r
        assert r.previous_response_id == previous, (r.previous_response_id, previous)
        return r.id
    done = None
    with client.responses.stream(
        model="plain", input=text, previous_response_id=previous, max_output_tokens=20
    ) as s:
        for event in s:
            if event.type == "response.completed":
                done = event.response
    assert done is not None and done.output_text == "Hello from polygw", done
    return done.id


prev = None
a_ids = []
for i in range(12):
    prev = turn(a, i, 2000, prev, stream=i % 3 == 2)
    a_ids.append(prev)
out["a"] = a_ids

prev = None
b_ids = []
for i in range(3):
    prev = turn(b, i, 500, prev)
    b_ids.append(prev)
out["b"] = b_ids
items = b.responses.input_items.list(b_ids[-1])
kinds = [(i.type, getattr(i, "role", None)) for i in items.data]
assert kinds == [("message", "user"), ("message", "assistant")] * 2 + [("message", "user")], kinds

prev = a_ids[-1]
for i in range(12, 24):
    try:
        prev = turn(a, i, 8000, prev)
        a_ids.append(prev)
    except openai.NotFoundError as e:
        out["a_refused_at"] = i
        out["a_refusal"] = e.message
        break
assert "a_refusal" in out, "A's conversation outgrew its bound and was still continued"

# B's conversation is whole: it continues.
b_ids.append(turn(b, 3, 500, b_ids[-1]))
out["b"] = b_ids

# Another key's response: not found, not deletable.
for call in (lambda: b.responses.retrieve(a_ids[-1]), lambda: b.responses.delete(a_ids[-1])):
    try:
        call()
        raise AssertionError("key B reached key A's response")
    except openai.NotFoundError:
        pass
assert a.responses.retrieve(a_ids[-1]).id == a_ids[-1]

print(json.dumps(out))
