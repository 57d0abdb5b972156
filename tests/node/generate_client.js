// A specwire client built from proto/specwire/v1/generation.proto alone (no generated code, another gRPC
// stack): proof that any language can call Generate. Prints one JSON object:
//   {"text", "token_ids", "finish_reason", "usage", "request_id", "model_info"}
// Usage: node generate_client.js --server HOST:PORT (--prompt TEXT [--chat] | --messages JSON) [--max-tokens N]
//        [--top-p P] [--token T]
// --messages is a conversation, a JSON list of {role, content}: sent as the `messages` prompt.
"use strict";
const path = require("path");
const { parseArgs } = require("util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const { values: args } = parseArgs({
  options: {
    server: { type: "string" },
    prompt: { type: "string" },
    "max-tokens": { type: "string" },
    "top-p": { type: "string" },
    chat: { type: "boolean", default: false },
    messages: { type: "string" },
    token: { type: "string" },
  },
});
if (!args.server || (args.prompt === undefined) === (args.messages === undefined)) {
  console.error("usage: node generate_client.js --server HOST:PORT (--prompt TEXT [--chat] | --messages JSON) "
    + "[--max-tokens N] [--top-p P] [--token T]");
  process.exit(2);
}

const protoDir = path.resolve(__dirname, "..", "..", "proto");
const definition = protoLoader.loadSync(path.join(protoDir, "specwire", "v1", "generation.proto"), {
  keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [protoDir],
});
const specwire = grpc.loadPackageDefinition(definition).specwire.v1;
const client = new specwire.Generation(args.server, grpc.credentials.createInsecure());
const metadata = new grpc.Metadata();
if (args.token) metadata.set("authorization", `Bearer ${args.token}`);

const sampling = { temperature: 0 };
if (args["max-tokens"] !== undefined) sampling.max_tokens = Number(args["max-tokens"]);
if (args["top-p"] !== undefined) sampling.top_p = Number(args["top-p"]);
const request = { request_id: `node-${process.pid}`, sampling };
if (args.messages !== undefined) {
  request.messages = { messages: JSON.parse(args.messages) };
} else {
  Object.assign(request, { text: args.prompt, chat: args.chat });
}

const result = { text: "", token_ids: [], finish_reason: null, usage: null, request_id: null };
const fail = (message) => { console.error(`node client: ${message}`); process.exit(1); };

const call = client.Generate(request, metadata);
call.on("data", (response) => {
  result.request_id = response.request_id;
  if (response.event === "chunk") {
    result.text += response.chunk.text;
    result.token_ids.push(...response.chunk.token_ids);
  } else if (response.event === "complete") {
    result.finish_reason = response.complete.finish_reason;
    result.usage = response.complete.usage;
  } else if (response.event === "error") {
    fail(`${response.error.code}: ${response.error.message}`);
  }
});
call.on("error", (err) => fail(`${grpc.status[err.code]}: ${err.details}`));
call.on("end", () => {
  if (result.finish_reason === null) fail("stream ended without a Complete message");
  client.GetModelInfo({}, metadata, (err, info) => {
    if (err) fail(`GetModelInfo ${grpc.status[err.code]}: ${err.details}`);
    result.model_info = info;
    console.log(JSON.stringify(result));
    client.close();
  });
});
