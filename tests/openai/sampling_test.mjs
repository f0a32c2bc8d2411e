// The official `openai` Node.js client with the options beyond the basics:
// log probabilities (completions' logprobs N, chat's logprobs/top_logprobs),
// streamed and not; the sampling controls (penalties, logit_bias, top_k,
// min_p, min_tokens, ignore_eos, stop_token_ids, seed) streamed and not; n
// and best_of (streamed and not); echo with the prompt's log probabilities; and
// /tokenize and /detokenize (vLLM's shapes, plain fetch: the client has no
// method for them). Prints one JSON object; test_cluster
// (HttpFrontend.OfficialOpenAiNodeClientSamplingAndLogprobs) checks it against
// disagg-generate. Exits 1 on any client error.
//
//   node tests/openai/sampling_test.mjs http://127.0.0.1:8000 "Once upon a time" 24 '{"presence_penalty":0.5}'
import OpenAI from "openai";

const [origin, prompt, maxTokensText, controlsText] = process.argv.slice(2);
const max_tokens = Number(maxTokensText);
const controls = JSON.parse(controlsText);
const client = new OpenAI({ baseURL: `${origin}/v1`, apiKey: "none", maxRetries: 0, timeout: 60_000 });

async function post(path, body) {
  const reply = await fetch(`${origin}${path}`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  return { status: reply.status, body: await reply.json() };
}

async function main() {
  const model = (await client.models.list()).data[0].id;
  const greedy = { model, max_tokens, temperature: 0 };

  // completions, logprobs 3
  const completion = await client.completions.create({ ...greedy, prompt, logprobs: 3 });
  const streamed = { text: "", tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
  for await (const chunk of await client.completions.create({ ...greedy, prompt, logprobs: 3, stream: true })) {
    for (const choice of chunk.choices) {
      streamed.text += choice.text;
      if (!choice.logprobs) continue;
      for (const key of ["tokens", "token_logprobs", "top_logprobs", "text_offset"])
        streamed[key].push(...choice.logprobs[key]);
    }
  }

  // chat, logprobs true with top_logprobs 5
  const messages = [{ role: "user", content: prompt }];
  const chat = await client.chat.completions.create({ ...greedy, messages, logprobs: true, top_logprobs: 5 });
  const streamedChat = { text: "", content: [] };
  for await (const chunk of await client.chat.completions.create({
    ...greedy, messages, logprobs: true, top_logprobs: 5, stream: true,
  })) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    streamedChat.text += choice.delta?.content ?? "";
    if (choice.logprobs?.content) streamedChat.content.push(...choice.logprobs.content);
  }

  // the sampling controls (extra fields pass through the client as sent)
  const sampled = await client.completions.create({ model, prompt, max_tokens, ...controls });
  let sampledStream = "";
  for await (const chunk of await client.completions.create({ model, prompt, max_tokens, ...controls, stream: true }))
    for (const choice of chunk.choices) sampledStream += choice.text;

  let outOfRange = null;
  try {
    await client.completions.create({ model, prompt, max_tokens, presence_penalty: 3 });
  } catch (e) {
    outOfRange = { status: e.status, param: e.param ?? e.error?.param ?? null };
  }

  // n and best_of: several samples, each with its own seed (gpu::sample_seed)
  const several = { model, prompt, max_tokens, temperature: 0.9, seed: 11 };
  const nChoices = (await client.completions.create({ ...several, n: 3, logprobs: 0 })).choices;
  const streamedChoices = ["", "", ""];
  for await (const chunk of await client.completions.create({ ...several, n: 3, stream: true }))
    for (const choice of chunk.choices) streamedChoices[choice.index] += choice.text;
  const best = (await client.completions.create({ ...several, n: 1, best_of: 3 })).choices;
  const chatN = (await client.chat.completions.create({ model, messages, max_tokens, temperature: 0.9, seed: 11, n: 2 }))
    .choices;

  // echo: the prompt's log probabilities (as evaluation harnesses ask), and streamed without them
  const echoed = (await client.completions.create({ model, prompt, max_tokens: 1, temperature: 0, echo: true, logprobs: 1 }))
    .choices[0];
  let echoStream = "";
  for await (const chunk of await client.completions.create({ ...greedy, prompt, echo: true, stream: true }))
    for (const choice of chunk.choices) echoStream += choice.text;

  const tokenized = await post("/tokenize", { model, prompt });
  const detokenized = await post("/detokenize", { model, tokens: tokenized.body.tokens });

  console.log(JSON.stringify({
    completion: { text: completion.choices[0].text, logprobs: completion.choices[0].logprobs, usage: completion.usage },
    streamed_completion: streamed,
    chat: { text: chat.choices[0].message.content, content: chat.choices[0].logprobs?.content ?? null },
    streamed_chat: streamedChat,
    sampled: sampled.choices[0].text,
    sampled_finish: sampled.choices[0].finish_reason,
    sampled_stream: sampledStream,
    out_of_range: outOfRange,
    n_choices: nChoices.map((c) => ({ index: c.index, text: c.text, logprobs: c.logprobs.token_logprobs })),
    streamed_choices: streamedChoices,
    best_of: best.map((c) => ({ index: c.index, text: c.text, logprobs: c.logprobs })),
    echoed: { text: echoed.text, logprobs: echoed.logprobs },
    echo_stream: echoStream,
    chat_n: chatN.map((c) => ({ index: c.index, text: c.message.content })),
    tokenized,
    detokenized,
  }));
}

main().catch((e) => {
  console.error(`openai client error: ${e.status ?? ""} ${e.message}`);
  process.exit(1);
});
