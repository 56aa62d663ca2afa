// A Node agent as users write one: the official openai SDK, pointed at the worker's proxy by OPENAI_BASE_URL and
// OPENAI_API_KEY (the SDK reads both). The job's data arrives as JSON on stdin; the reward is the last line printed.
import OpenAI from "openai";

const TOOLS = [
  {
    type: "function",
    function: {
      name: "add",
      description: "Add two integers.",
      parameters: {
        type: "object",
        properties: { a: { type: "integer" }, b: { type: "integer" } },
        required: ["a", "b"],
      },
    },
  },
];

async function readStdin() {
  let text = "";
  for await (const chunk of process.stdin) text += chunk;
  return JSON.parse(text);
}

const data = await readStdin();
const client = new OpenAI();
const messages = [{ role: "user", content: data.question }];
let reward = 0.0;
for (let turn = 0; turn < 4; turn++) {
  const resp = await client.chat.completions.create({
    model: "policy",
    messages,
    tools: TOOLS,
    max_tokens: 64,
    logprobs: true,
  });
  const message = resp.choices[0].message;
  console.log(`turn ${turn}: ${resp.id} ${resp.choices[0].finish_reason}`); // not the last line: logged, ignored
  messages.push(message);
  if (!message.tool_calls || message.tool_calls.length === 0) {
    reward = message.content && message.content.includes("5") ? 1.0 : 0.0;
    break;
  }
  for (const call of message.tool_calls) {
    const args = JSON.parse(call.function.arguments);
    messages.push({ role: "tool", tool_call_id: call.id, content: String(args.a + args.b) });
  }
}
console.log(JSON.stringify(reward));
