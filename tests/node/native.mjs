// anthropic-node through polygw serve to sources that speak Messages natively (issue
// 35; tests/sdk.rs runs it). Environment: POLYGW_ROOT, POLYGW_KEY. Scopes: `native`
// answers "Hello from polygw"; `tools` asks for get_weather({"city": "Paris"}) once,
// then answers "It is 21 °C in Paris."; `overloaded` has a primary answering 529 and
// a fallback answering "Hello from polygw"; `limited` answers 429 with Retry-After: 30
// (beyond --max-wait-s); `responses` is a source speaking OpenAI's Responses API that
// answers "Hello from polygw". The last stdout line is a JSON object the Rust test
// checks.

import assert from 'node:assert/strict';
import Anthropic from '@anthropic-ai/sdk';
import OpenAI from 'openai';

const anthropic = new Anthropic({
  baseURL: process.env.POLYGW_ROOT,
  apiKey: process.env.POLYGW_KEY,
  maxRetries: 0,
});
const out = {};
const msg = [{ role: 'user', content: 'hi' }];

// Plain and streamed, the source's own message ids.
{
  const m = await anthropic.messages.create({ model: 'native', max_tokens: 64, messages: msg });
  assert.equal(m.content[0].text, 'Hello from polygw');
  assert.ok(m.id.startsWith('msg_mock-'), m.id);
  const stream = anthropic.messages.stream({ model: 'overloaded', max_tokens: 64, messages: msg });
  const types = [];
  for await (const ev of stream) types.push(ev.type);
  const final = await stream.finalMessage();
  assert.equal(types[0], 'message_start');
  assert.equal(types.at(-1), 'message_stop');
  assert.equal(final.content[0].text, 'Hello from polygw');
  out.plain_text = m.content[0].text;
  out.stream_text = final.content[0].text;
}

// A streamed tool round.
{
  const tools = [{
    name: 'get_weather',
    description: 'The current weather in a city.',
    input_schema: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
  }];
  const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];
  const s1 = anthropic.messages.stream({ model: 'tools', max_tokens: 256, messages, tools });
  const first = await s1.finalMessage();
  assert.equal(first.stop_reason, 'tool_use');
  const use = first.content.find((b) => b.type === 'tool_use');
  assert.deepEqual(use.input, { city: 'Paris' });
  messages.push({ role: 'assistant', content: first.content });
  messages.push({ role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: '{"temp_c": 21}' }] });
  const s2 = anthropic.messages.stream({ model: 'tools', max_tokens: 256, messages, tools });
  const second = await s2.finalMessage();
  assert.equal(second.content[0].text, 'It is 21 °C in Paris.');
  out.tool_use_id = use.id;
  out.tool_answer = second.content[0].text;
}

// A 429 beyond --max-wait-s: RateLimitError with the upstream's hint.
try {
  const s = anthropic.messages.stream({ model: 'limited', max_tokens: 64, messages: msg });
  for await (const _ of s) { /* drained */ }
  throw new Error('no error');
} catch (e) {
  assert.ok(e instanceof Anthropic.RateLimitError, String(e));
  out.limited = { status: e.status, retry_after: e.headers?.get?.('retry-after') ?? e.headers?.['retry-after'] };
}

// openai-node's Responses API to a `responses` source: the source's own response.
{
  const openai = new OpenAI({
    baseURL: `${process.env.POLYGW_ROOT}/v1`,
    apiKey: process.env.POLYGW_KEY,
    maxRetries: 0,
  });
  const r = await openai.responses.create({ model: 'responses', input: 'hi' });
  assert.equal(r.output_text, 'Hello from polygw');
  assert.ok(r.id.startsWith('resp_mock-'), r.id);
  const stream = openai.responses.stream({ model: 'responses', input: 'hi' });
  const types = [];
  for await (const ev of stream) types.push(ev.type);
  const final = await stream.finalResponse();
  assert.equal(types[0], 'response.created');
  assert.equal(types.at(-1), 'response.completed');
  assert.equal(final.output_text, 'Hello from polygw');
  out.responses_text = final.output_text;
}

console.log(JSON.stringify(out));
