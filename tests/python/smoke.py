"""polygw serve with the official OpenAI Python SDK (tests/serve.rs runs it).

Environment: POLYGW_BASE (http://host:port/v1), POLYGW_KEY. The proxy serves `llm`
(alias gpt-4o-mini, a mock that answers "Hello from polygw"), `embed` (an embedding
scope) and `limited` (a mock that answers 429 with Retry-After: 30; the proxy's
--max-wait-s is 1). Prints "ok" at the end; any failure raises.
"""

import os

import openai

client = openai.OpenAI(
    base_url=os.environ["POLYGW_BASE"], api_key=os.environ["POLYGW_KEY"], max_retries=0
)

# Chat: the answer, the usage, and the request id (x-request-id).
r = client.chat.completions.create(
    model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
)
assert r.choices[0].message.content == "Hello from polygw", r
assert r.usage is not None and r.usage.completion_tokens > 0, r.usage
assert r._request_id, "x-request-id"

# Stream with usage: one id, the text, a final usage chunk.
stream = client.chat.completions.create(
    model="llm",
    messages=[{"role": "user", "content": "hi"}],
    stream=True,
    stream_options={"include_usage": True},
)
text, usage, ids = "", None, set()
for chunk in stream:
    ids.add(chunk.id)
    if chunk.usage is not None:
        usage = chunk.usage
    for ch in chunk.choices:
        if ch.delta.content:
            text += ch.delta.content
assert text == "Hello from polygw", text
assert usage is not None and usage.completion_tokens > 0, usage
assert len(ids) == 1, ids

# Embeddings with the SDK's default encoding (it asks for base64 and decodes it).
e = client.embeddings.create(model="embed", input=["one", "two"])
assert len(e.data) == 2 and len(e.data[0].embedding) > 0, e
assert isinstance(e.data[0].embedding[0], float)

# Models: the list, and one of them.
assert any(m.id == "gpt-4o-mini" for m in client.models.list().data)
assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"

# A rate limit reaches the SDK as a rate limit, with the proxy's Retry-After.
try:
    client.chat.completions.create(
        model="limited", messages=[{"role": "user", "content": "hi"}]
    )
    raise AssertionError("expected a RateLimitError")
except openai.RateLimitError as err:
    assert err.code == "rate_limit_exceeded", err
    assert int(err.response.headers["retry-after"]) >= 1, err.response.headers
    assert err.request_id, "x-request-id on errors too"

print("ok")
