// openai-node and anthropic-node through polygw serve (tests/sdk.rs runs it with the
// pinned SDKs of package-lock.json). Environment: POLYGW_ROOT (http://host:port),
// POLYGW_KEY. Scopes: `plain` answers "Hello from polygw"; `limited` answers 429 (its
// first answer with Retry-After: 4, then Retry-After: 30; the proxy runs with
// --keepalive-s 1 --max-wait-s 10). Every SDK-side check throws here; the last stdout
// line is a JSON object the Rust test checks.

import assert from 'node:assert/strict';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const root = process.env.POLYGW_ROOT;
const key = process.env.POLYGW_KEY;
const openai = new OpenAI({ baseURL: `${root}/v1`, apiKey: key, maxRetries: 0 });
const anthropic = new Anthropic({ baseURL: root, apiKey: key, maxRetries: 0 });
const out = {};

// Chat completions, streamed with usage: one id, the text, a usage chunk.
{
  const stream = await openai.chat.completions.create({
    model: 'plain',
    messages: [{ role: 'user', content: 'hi' }],
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = '';
  let usage = null;
  const ids = new Set();
  for await (const chunk of stream) {
    ids.add(chunk.id);
    if (chunk.usage) usage = chunk.usage;
    text += chunk.choices[0]?.delta?.content ?? '';
  }
  assert.equal(text, 'Hello from polygw');
  assert.equal(ids.size, 1);
  assert.ok(usage && usage.completion_tokens > 0, JSON.stringify(usage));
  out.chat_text = text;
}

// The Responses API, streamed with the SDK's helper.
{
  const stream = openai.responses.stream({ model: 'plain', input: 'hi' });
  let deltas = '';
  const types = [];
  for await (const event of stream) {
    types.push(event.type);
    if (event.type === 'response.output_text.delta') deltas += event.delta;
  }
  const final = await stream.finalResponse();
  assert.equal(types[0], 'response.created');
  assert.equal(types.at(-1), 'response.completed');
  assert.equal(deltas, 'Hello from polygw');
  assert.equal(final.output_text, deltas);
  out.responses_text = final.output_text;
}

// A streamed request whose upstream answers 429 (issue 22 item 13): RateLimitError
// with the status and Retry-After — not a 200, keepalives and an error event. The
// first upstream answer's Retry-After (4 s) is within --max-wait-s, so polygw waits it
// out (with --keepalive-s 1, while no attempt runs), retries, and the second answer's
// (30 s) is beyond the bound: the call ends with that 429.
async function rateLimited(what, run) {
  const started = Date.now();
  try {
    await run();
  } catch (err) {
    return {
      what,
      class: err.constructor.name,
      rate_limit_error: err instanceof OpenAI.RateLimitError || err instanceof Anthropic.RateLimitError,
      status: err.status ?? null,
      retry_after: err.headers?.get?.('retry-after') ?? null,
      ms: Date.now() - started,
    };
  }
  throw new Error(`${what}: no error`);
}
out.limited_chat_stream = await rateLimited('chat stream', async () => {
  const stream = await openai.chat.completions.create({
    model: 'limited',
    messages: [{ role: 'user', content: 'hi' }],
    stream: true,
  });
  for await (const _ of stream) {
  }
});
assert.ok(out.limited_chat_stream.rate_limit_error, JSON.stringify(out.limited_chat_stream));
out.limited_responses_stream = await rateLimited('responses stream', async () => {
  const stream = openai.responses.stream({ model: 'limited', input: 'hi' });
  for await (const _ of stream) {
  }
  await stream.finalResponse();
});
assert.ok(out.limited_responses_stream.rate_limit_error, JSON.stringify(out.limited_responses_stream));

// anthropic-node: messages.stream and its final message.
{
  const stream = anthropic.messages.stream({
    model: 'plain',
    max_tokens: 64,
    messages: [{ role: 'user', content: 'hi' }],
  });
  let text = '';
  stream.on('text', (t) => {
    text += t;
  });
  const final = await stream.finalMessage();
  assert.equal(text, 'Hello from polygw');
  assert.deepEqual(
    final.content.map((b) => b.type),
    ['text'],
  );
  assert.equal(final.content[0].text, text);
  assert.equal(final.stop_reason, 'end_turn');
  assert.ok(final.usage.output_tokens > 0);
  out.messages_text = final.content[0].text;
}
out.limited_messages_stream = await rateLimited('messages stream', async () => {
  const stream = anthropic.messages.stream({
    model: 'limited',
    max_tokens: 64,
    messages: [{ role: 'user', content: 'hi' }],
  });
  await stream.finalMessage();
});
assert.ok(out.limited_messages_stream.rate_limit_error, JSON.stringify(out.limited_messages_stream));

console.log(JSON.stringify(out));
