"""The official SDKs through polygw serve with a client key whose budget is small
(tests/sdk.rs runs it; issue 39). Environment: POLYGW_ROOT, POLYGW_KEY (the client key).

Scopes: `broken` (its source answers 400 to the first request, then 503), `reasoner`
(a reasoning-model source: it refuses `max_tokens`, polygw learns to send
`max_completion_tokens`).

1. Four calls to `broken` with the OpenAI SDK (its own two retries on a 503): each
   fails; none may cost the key anything (SPEC §24.2).
2. Then to `reasoner`: Chat Completions and Responses (OpenAI SDK) and Messages
   (Anthropic SDK), each with an output cap: all answered, within what is left of the
   budget (the failures left it untouched).

Prints one JSON object: the failures' statuses and the three answers.
"""

import json
import os

import anthropic
import openai

root, key = os.environ["POLYGW_ROOT"], os.environ["POLYGW_KEY"]
oa = openai.OpenAI(base_url=root + "/v1", api_key=key, max_retries=2)
out = {"failures": []}

for i in range(4):
    try:
        oa.chat.completions.create(
            model="broken", max_tokens=50, messages=[{"role": "user", "content": f"try {i}"}]
        )
        out["failures"].append(200)
    except openai.APIStatusError as e:
        out["failures"].append(e.status_code)

chat = oa.chat.completions.create(
    model="reasoner", max_tokens=50, messages=[{"role": "user", "content": "chat"}]
)
out["chat"] = chat.choices[0].message.content
resp = oa.responses.create(model="reasoner", max_output_tokens=50, input="responses")
out["responses"] = resp.output_text
an = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0)
msg = an.messages.create(
    model="reasoner", max_tokens=50, messages=[{"role": "user", "content": "messages"}]
)
out["messages"] = "".join(b.text for b in msg.content if b.type == "text")
print(json.dumps(out))
