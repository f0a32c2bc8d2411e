// The official `openai` Node.js client (pinned in package-lock.json) against
// a disagg HTTP frontend: completions and chat, streamed and not. Prints one
// JSON object with what it got; test_cluster (HttpFrontend.OfficialOpenAiNodeClient)
// compares it with disagg-generate. Exits 1 on any client error.
//
//   node tests/openai/client_test.mjs http://127.0.0.1:8000/v1 "Once upon a time" 40
import OpenAI from "openai";

const [baseURL, prompt, maxTokensText] = process.argv.slice(2);
const max_tokens = Number(maxTokensText);
const client = new OpenAI({ baseURL, apiKey: "none", maxRetries: 0, timeout: 60_000 });

async function main() {
  const models = await client.models.list();
  const model = models.data[0].id;
  const settings = { model, max_tokens, temperature: 0 };

  const completion = await client.completions.create({ ...settings, prompt });
  let streamedCompletion = "";
  let streamUsage = null;
  const stream = await client.completions.create({ ...settings, prompt, stream: true, stream_options: { include_usage: true } });
  for await (const chunk of stream) {
    if (chunk.usage) streamUsage = chunk.usage;
    for (const choice of chunk.choices) streamedCompletion += choice.text;
  }

  const messages = [{ role: "user", content: prompt }];
  const chat = await client.chat.completions.create({ ...settings, messages });
  let streamedChat = "";
  let firstRole = null;
  const chatStream = await client.chat.completions.create({ ...settings, messages, stream: true });
  for await (const chunk of chatStream) {
    const delta = chunk.choices[0]?.delta ?? {};
    if (firstRole === null && delta.role) firstRole = delta.role;
    streamedChat += delta.content ?? "";
  }

  let notFound = null;
  try {
    await client.completions.create({ ...settings, model: "no-such-model", prompt });
  } catch (e) {
    notFound = { status: e.status, code: e.code ?? e.error?.code ?? null };
  }

  // "Retrieve model": its object; another id (one with a "/", which the
  // client sends percent-encoded) a 404.
  const retrieved = await client.models.retrieve(model);
  let retrieveNotFound = null;
  try {
    await client.models.retrieve("org/no-such-model");
  } catch (e) {
    retrieveNotFound = { status: e.status, code: e.code ?? e.error?.code ?? null, message: e.error?.message ?? e.message };
  }

  console.log(JSON.stringify({
    model,
    retrieved: { id: retrieved.id, object: retrieved.object },
    retrieve_not_found: retrieveNotFound,
    completion: completion.choices[0].text,
    completion_finish: completion.choices[0].finish_reason,
    completion_usage: completion.usage,
    streamed_completion: streamedCompletion,
    stream_usage: streamUsage,
    chat: chat.choices[0].message.content,
    chat_role: chat.choices[0].message.role,
    streamed_chat: streamedChat,
    streamed_chat_role: firstRole,
    not_found: notFound,
  }));
}

main().catch((e) => {
  console.error(`openai client error: ${e.status ?? ""} ${e.message}`);
  process.exit(1);
});
