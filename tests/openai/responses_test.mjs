// The official `openai` Node.js client's Responses API (client.responses)
// against a disagg frontend: a reply whole, streamed event by event, and
// through the client's stream helper (all greedy: the same text); its log
// probabilities asked for by include; a json_schema text format; a required function call (its output sent back
// needs a template that takes tool messages, which stories260K's llama2 one
// does not: HttpFrontend/AgentsSdk.*Responses* do it on a Qwen3 template).
// Prints one JSON object; test_cluster
// (HttpFrontend.OfficialOpenAiNodeClientResponses) checks it. Exits 1 on
// any client error.
//
//   node tests/openai/responses_test.mjs http://127.0.0.1:8000/v1
import OpenAI from "openai";

import { person } from "./schemas.mjs";

const [baseURL] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "none", maxRetries: 0, timeout: 60_000 });

const weather = {
  type: "function",
  name: "get_weather",
  description: "The weather of a city",
  parameters: {
    type: "object",
    properties: { city: { type: "string", maxLength: 10 } },
    required: ["city"],
    additionalProperties: false,
  },
  strict: true,
};
// The text of a response's message items (the client adds output_text only to create's replies).
const text_of = (response) =>
  response.output
    .filter((item) => item.type === "message")
    .flatMap((item) => item.content.filter((part) => part.type === "output_text").map((part) => part.text))
    .join("");

async function main() {
  const model = (await client.models.list()).data[0].id;
  const ask = { model, input: "Once upon a time", instructions: "Tell a story.", max_output_tokens: 24, temperature: 0 };
  const whole = await client.responses.create(ask);
  const types = [];
  let deltas = "";
  let streamed = null;
  for await (const event of await client.responses.create({ ...ask, stream: true })) {
    types.push(event.type);
    if (event.type === "response.output_text.delta") deltas += event.delta;
    if (event.type === "response.completed" || event.type === "response.incomplete") streamed = event.response;
  }
  const helper = await client.responses.stream(ask).finalResponse();
  const scored = await client.responses.create({ ...ask, include: ["message.output_text.logprobs"], top_logprobs: 2 });
  const scored_part = scored.output.find((item) => item.type === "message").content[0];
  const structured = await client.responses.create({
    model,
    input: "A person:",
    temperature: 0,
    max_output_tokens: 200,
    text: { format: { type: "json_schema", name: "person", schema: person, strict: true } },
  });
  const question = { role: "user", content: "Weather in Paris?" };
  const called = await client.responses.create({
    model,
    input: [question],
    tools: [weather],
    tool_choice: "required",
    parallel_tool_calls: false,
    temperature: 0,
    max_output_tokens: 200,
  });
  const call = called.output.find((item) => item.type === "function_call");
  console.log(
    JSON.stringify({
      whole: { id: whole.id, object: whole.object, status: whole.status, text: whole.output_text, usage: whole.usage },
      streamed: { status: streamed?.status, text: streamed ? text_of(streamed) : null, deltas, types },
      helper: { status: helper.status, text: text_of(helper) },
      scored: { text: scored.output_text, tokens: scored.usage.output_tokens, logprobs: scored_part.logprobs },
      structured: { status: structured.status, text: structured.output_text },
      called: { status: called.status, call },
    }),
  );
}

main().catch((e) => {
  console.error(e?.stack ?? String(e));
  process.exit(1);
});
