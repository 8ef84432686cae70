"""polygw serve with its defaults alone, on a fresh process (SPEC §25; tests/sdk.rs
runs it), as the official SDKs see it: every call streamed, in chat completions,
Responses and Messages, concurrently (each API on its own scopes, so each has its own
hedge budget and retry throttle).

Usage: defaults.py rescue|outage. Environment: POLYGW_ROOT, POLYGW_KEY.

- rescue: scopes `stall_{api}` (a primary that goes silent for 40 s mid-answer, a
  healthy second source), `first_{api}` (a primary whose first token takes 20 s),
  `stall3` (three such stalls within a minute at one call every 5 s, chat). Each
  result is the text the SDK delivered and how long the call took.
- outage: scopes `down_{api}` (two sources answering 503) and `refused` (two sources
  refusing connections): ten calls one second apart each; per call how long it took,
  the status and the headers the SDK saw.

The clients never retry (max_retries=0): what is measured is polygw's own behaviour.
Prints one JSON object.
"""

import json
import os
import sys
import threading
import time

import anthropic
import openai

root, key = os.environ["POLYGW_ROOT"], os.environ["POLYGW_KEY"]
oa = openai.OpenAI(base_url=root + "/v1", api_key=key, max_retries=0, timeout=120)
an = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0, timeout=120)


def chat(model, prompt):
    stream = oa.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], stream=True
    )
    deltas, finish = [], None
    for c in stream:
        if c.choices:
            if c.choices[0].delta.content:
                deltas.append(c.choices[0].delta.content)
            finish = c.choices[0].finish_reason or finish
    assert finish == "stop", finish
    return "".join(deltas)


def responses(model, prompt):
    with oa.responses.stream(model=model, input=prompt) as s:
        deltas = []
        for event in s:
            assert event.type not in ("error", "response.failed"), event
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = s.get_final_response()
    assert final.status == "completed", final.status
    assert final.output_text == "".join(deltas), (final.output_text, deltas)
    return final.output_text


def messages(model, prompt):
    with an.messages.stream(
        model=model, max_tokens=1024, messages=[{"role": "user", "content": prompt}]
    ) as s:
        deltas = list(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason == "end_turn", final.stop_reason
    text = "".join(b.text for b in final.content if b.type == "text")
    assert text == "".join(deltas), (text, deltas)
    return text


API = {"chat": chat, "responses": responses, "messages": messages}
out = {}
lock = threading.Lock()


def timed(name, fn, *args):
    t0 = time.monotonic()
    try:
        text = fn(*args)
        r = {"text": text, "s": round(time.monotonic() - t0, 3)}
    except Exception as e:  # reported, then asserted on by the Rust test
        r = {"error": f"{type(e).__name__}: {e}", "s": round(time.monotonic() - t0, 3)}
    with lock:
        out[name] = r


def failure(api, model, prompt):
    """One streamed call that must fail: how long, and what the SDK raised."""
    t0 = time.monotonic()
    try:
        API[api](model, prompt)
    except (openai.APIStatusError, anthropic.APIStatusError) as err:
        body = err.body if isinstance(err.body, dict) else {}
        if api == "messages":
            kind = (body.get("error") or {}).get("type")
        else:
            kind = body.get("code")
        return {
            "s": round(time.monotonic() - t0, 3),
            "class": type(err).__name__,
            "status": err.status_code,
            "retry_after": err.response.headers.get("retry-after"),
            "should_retry": err.response.headers.get("x-should-retry"),
            "kind": kind,
        }
    except Exception as e:
        return {"s": round(time.monotonic() - t0, 3), "class": type(e).__name__, "error": str(e)}
    raise AssertionError(f"{model} did not fail")


def ten_calls(name, api, model):
    calls = []
    start = time.monotonic()
    for i in range(10):
        due = start + i
        time.sleep(max(0.0, due - time.monotonic()))
        calls.append(failure(api, model, f"question {i}"))
    with lock:
        out[name] = calls


def stall3():
    calls = []
    threads = []
    start = time.monotonic()

    def one(i):
        t0 = time.monotonic()
        try:
            r = {"text": chat("stall3", f"Tell me story number {i}."), "at": round(t0 - start, 3)}
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"}
        r["s"] = round(time.monotonic() - t0, 3)
        calls.append((i, r))

    for i in range(3):
        time.sleep(max(0.0, start + 5 * i - time.monotonic()))
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    with lock:
        out["stall3"] = [r for _, r in sorted(calls)]


mode = sys.argv[1]
jobs = []
if mode == "rescue":
    for api in API:
        jobs.append(threading.Thread(target=timed, args=(f"stall_{api}", API[api], f"stall_{api}", "Tell me a long story.")))
        jobs.append(threading.Thread(target=timed, args=(f"first_{api}", API[api], f"first_{api}", "Tell me a short story.")))
    jobs.append(threading.Thread(target=stall3))
elif mode == "outage":
    for api in API:
        jobs.append(threading.Thread(target=ten_calls, args=(f"down_{api}", api, f"down_{api}")))
    jobs.append(threading.Thread(target=ten_calls, args=("refused", "chat", "refused")))
else:
    raise SystemExit(f"usage: defaults.py rescue|outage (got {mode!r})")
for j in jobs:
    j.start()
for j in jobs:
    j.join()
print(json.dumps(out))
