// The OpenAI Agents SDK (npm @openai/agents) running an agent with two
// function tools and a structured final output against a disagg frontend
// serving a model with Qwen3's vocabulary and chat template (random
// weights). Such a model never calls a tool by
// itself, so the agent's first turn requires one (modelSettings.toolChoice
// "required"; the SDK then resets it to auto), and its answer is generated
// under the output type's schema. Prints one JSON object for test_cluster
// (HttpFrontend/AgentsSdk.RunsAnAgentWithToolsAndAStructuredOutput/*);
// exits 1 on any error the SDK raises.
//
// With "responses" after the URL, the agent uses the SDK's default model
// class instead, on the Responses API (/v1/responses), streamed with
// "responses-stream".
//
//   node tests/agents/agent_test.mjs http://127.0.0.1:8000/v1 [responses|responses-stream]
import { Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, run, tool } from "@openai/agents";
import OpenAI from "openai";
import { z } from "zod";

const [baseURL, api = "chat"] = process.argv.slice(2);
// Each request and reply, printed when the run fails (what the SDK sent and got).
const exchanges = [];
async function recordingFetch(url, init) {
  const reply = await fetch(url, init);
  exchanges.push({ request: init?.body ? JSON.parse(init.body) : null, status: reply.status, reply: (await reply.clone().text()).slice(0, 4000) });
  return reply;
}
const client = new OpenAI({ baseURL, apiKey: "none", maxRetries: 0, timeout: 120_000, fetch: recordingFetch });

const calls = [];
const weather = tool({
  name: "get_weather",
  description: "The weather of a city",
  parameters: z.object({ city: z.string().max(12), unit: z.enum(["celsius", "fahrenheit"]) }),
  execute: async ({ city, unit }) => {
    calls.push({ name: "get_weather", city, unit });
    return `18 degrees ${unit} and sunny in ${city}`;
  },
});
const clock = tool({
  name: "get_time",
  description: "The local time of a city",
  parameters: z.object({ city: z.string().max(12) }),
  execute: async ({ city }) => {
    calls.push({ name: "get_time", city });
    return `noon in ${city}`;
  },
});
const Answer = z.object({ summary: z.string().max(40), degrees: z.number().int().min(-60).max(60) });

async function main() {
  const model = (await client.models.list()).data[0].id;
  const agent = new Agent({
    name: "forecaster",
    instructions: "Look the weather up with the tools, then answer.",
    model: api.startsWith("responses") ? new OpenAIResponsesModel(client, model) : new OpenAIChatCompletionsModel(client, model),
    tools: [weather, clock],
    outputType: Answer,
    // Greedy; room for the whitespace a random model writes between JSON tokens (up to 21 a gap).
    // One call a turn: a random model would add calls to the array until the limit.
    modelSettings: { toolChoice: "required", parallelToolCalls: false, maxTokens: 600, temperature: 0 },
  });
  const stream = api === "responses-stream";
  const result = await run(agent, "What is the weather in Paris?", { maxTurns: 6, stream });
  if (stream) await result.completed;
  const output = result.finalOutput;
  console.log(JSON.stringify({ calls, output, valid: Answer.safeParse(output).success, items: result.newItems.length }));
}

main().catch((e) => {
  console.error(e?.stack ?? String(e));
  console.error(JSON.stringify(exchanges, null, 1));
  process.exit(1);
});
