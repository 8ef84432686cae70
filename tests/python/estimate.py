"""What polygw estimates for what agents send, as the official SDKs read it
(tests/sdk.rs runs it; SPEC §24.3): `messages.count_tokens` (Anthropic SDK) and
`responses.input_tokens.count` (OpenAI SDK) on a scope whose sources speak chat, so
polygw answers with its own estimate. Environment: POLYGW_ROOT, POLYGW_KEY; argv[1] is
a 1024×768 PNG's header in base64.

Counts: a short text; the same with the image inline (30 KB of base64); a 40 KB tool
call sent back (Messages `tool_use` input, Responses `function_call` arguments) with its
result. Prints one JSON object of the counts.
"""

import json
import os
import sys

import anthropic
import openai

root, key = os.environ["POLYGW_ROOT"], os.environ["POLYGW_KEY"]
png = sys.argv[1] + "A" * 30_000
corpus = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "polygw", "benches",
                      "estimate_corpus", "code.txt")
code = open(corpus).read()  # the benchmark's code corpus
old = (code * (40_000 // len(code) + 1))[:40_000]
out = {}

an = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0)
text = [{"role": "user", "content": "What is in this picture?"}]
out["messages_text"] = an.messages.count_tokens(model="plain", messages=text).input_tokens
image = [{"role": "user", "content": [
    {"type": "text", "text": "What is in this picture?"},
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
]}]
out["messages_image"] = an.messages.count_tokens(model="plain", messages=image).input_tokens
tool = [
    {"role": "user", "content": "Apply the edit."},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "edit_file",
        "input": {"file_path": "/src/app.py", "old_string": old, "new_string": "x"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "applied"}]},
]
out["messages_tool"] = an.messages.count_tokens(model="plain", messages=tool).input_tokens

oa = openai.OpenAI(base_url=root + "/v1", api_key=key, max_retries=0)
out["responses_image"] = oa.responses.input_tokens.count(model="plain", input=[
    {"role": "user", "content": [
        {"type": "input_text", "text": "What is in this picture?"},
        {"type": "input_image", "image_url": "data:image/png;base64," + png, "detail": "auto"},
    ]}]).input_tokens
out["responses_tool"] = oa.responses.input_tokens.count(model="plain", input=[
    {"role": "user", "content": "Apply the edit."},
    {"type": "function_call", "call_id": "call_1", "name": "edit_file",
     "arguments": json.dumps({"file_path": "/src/app.py", "old_string": old, "new_string": "x"})},
    {"type": "function_call_output", "call_id": "call_1", "output": "applied"},
]).input_tokens
print(json.dumps(out))
