// The official `openai` Node.js client with structured output and tools:
// response_format json_schema through chat.completions.parse (the client
// parses the reply itself), json_object streamed, tools with tool_choice
// named (streamed: the call assembled from its deltas) and required (one
// call: parallel_tool_calls false). With
// random weights the model never calls a tool by itself, so forced calls and
// schema-constrained answers are what this checks. Prints one JSON object;
// test_cluster (HttpFrontend.OfficialOpenAiNodeClientStructuredOutputAndTools)
// checks it. Exits 1 on any client error.
//
//   node tests/openai/structured_test.mjs http://127.0.0.1:8000/v1
import OpenAI from "openai";

import { person } from "./schemas.mjs";

const [baseURL] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "none", maxRetries: 0, timeout: 60_000 });

const weather = {
  type: "function",
  function: {
    name: "get_weather",
    description: "The weather of a city",
    parameters: {
      type: "object",
      properties: { city: { type: "string", maxLength: 10 }, unit: { enum: ["celsius", "fahrenheit"] } },
      required: ["city", "unit"],
      additionalProperties: false,
    },
    strict: true,
  },
};
const clock = { type: "function", function: { name: "now", parameters: { type: "object", properties: {}, additionalProperties: false } } };

async function main() {
  const model = (await client.models.list()).data[0].id;
  const messages = [{ role: "user", content: "Once upon a time" }];
  const base = { model, messages, max_tokens: 120, temperature: 0.8, seed: 3 };
  const out = {};

  const parsed = await client.chat.completions.parse({
    ...base,
    response_format: { type: "json_schema", json_schema: { name: "person", schema: person, strict: true } },
  });
  out.parsed = parsed.choices[0].message.parsed;
  out.parsed_finish = parsed.choices[0].finish_reason;

  let object = "";
  for await (const chunk of await client.chat.completions.create({ ...base, response_format: { type: "json_object" }, stream: true }))
    for (const c of chunk.choices) object += c.delta.content ?? "";
  out.json_object = object;

  const named = await client.chat.completions.create({
    ...base,
    tools: [weather, clock],
    tool_choice: { type: "function", function: { name: "get_weather" } },
  });
  out.named = named.choices[0].message;
  out.named_finish = named.choices[0].finish_reason;

  // Streamed: the call's index, id and name first, then its arguments in
  // pieces as they are generated.
  const calls = [];
  let finish = null;
  for await (const chunk of await client.chat.completions.create({
    ...base,
    tools: [weather, clock],
    tool_choice: { type: "function", function: { name: "get_weather" } },
    stream: true,
  }))
    for (const c of chunk.choices) {
      for (const d of c.delta.tool_calls ?? []) {
        if (!calls[d.index]) calls[d.index] = { id: d.id, name: d.function?.name, arguments: "", pieces: 0 };
        calls[d.index].arguments += d.function?.arguments ?? "";
        if (d.function?.arguments) calls[d.index].pieces += 1;
      }
      if (c.finish_reason) finish = c.finish_reason;
    }
  out.streamed_named = calls;
  out.streamed_named_finish = finish;

  const required = await client.chat.completions.create({
    ...base,
    tools: [weather, clock],
    tool_choice: "required",
    parallel_tool_calls: false,
  });
  out.required = required.choices[0].message;
  out.required_finish = required.choices[0].finish_reason;
  console.log(JSON.stringify(out));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
