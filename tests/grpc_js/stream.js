// A stock grpc-js client built from feeder.proto alone, with grpc-js's defaults
// (4 MiB receive limit). Streams one epoch and prints a JSON summary on stdout:
//   node stream.js ADDRESS 'SAMPLING_PARAMS_JSON' [BATCHES_PER_MESSAGE]
// Checks each batch's tokens against a positional store (token i == i mod 2^bits).
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const proto = path.join(__dirname, "..", "..", "protos", "tokenfeed", "v1", "feeder.proto");
const def = protoLoader.loadSync(proto, { keepCase: true, longs: Number, defaults: true, oneofs: true });
const { Feeder } = grpc.loadPackageDefinition(def).tokenfeed.v1;

const [address, params, perMessage] = process.argv.slice(2);
const client = new Feeder(address, grpc.credentials.createInsecure());
const call = client.StreamBatches({
  params: JSON.parse(params),
  batches_per_message: Number(perMessage || 0),
});
const out = { messages: 0, steps: [], max_batches_per_message: 0, tokens_ok: true };
call.on("data", (response) => {
  out.messages += 1;
  out.max_batches_per_message = Math.max(out.max_batches_per_message, response.batches.length);
  for (const b of response.batches) {
    out.steps.push(b.step);
    const width = b.dtype === "uint16" ? 2 : 4;
    const modulo = 2 ** (8 * width);
    for (let r = 0; r < b.rows; r += 1) {
      for (const c of [0, b.cols - 1]) {
        const at = (r * b.cols + c) * width;
        const token = width === 2 ? b.tokens.readUInt16LE(at) : b.tokens.readUInt32LE(at);
        if (token !== (b.starts[r] + c) % modulo) out.tokens_ok = false;
      }
    }
  }
});
call.on("error", (e) => {
  console.log(JSON.stringify({ ...out, error: { code: e.code, details: e.details } }));
  process.exit(0);
});
call.on("end", () => {
  console.log(JSON.stringify(out));
  process.exit(0);
});
