// client.mjs drives stripe-node, unchanged, for interop/stripe_test.go: it
// reads one command per line on stdin (JSON), runs it through the SDK against
// the API at argv[2], and writes one JSON line per command on stdout: the
// object's id, or the typed error the SDK raised, and the attempts it made.
import Stripe from 'stripe';
import readline from 'node:readline';

const stripe = new Stripe('sk_test_node', {
  host: new URL(process.argv[2]).hostname,
  port: new URL(process.argv[2]).port,
  protocol: 'http',
  // maxNetworkRetries is the SDK's default: 2.
});
const attempts = new Map();
stripe.on('request', (e) => {
  const key = e.idempotency_key || '';
  attempts.set(key, (attempts.get(key) || 0) + 1);
});

for await (const line of readline.createInterface({ input: process.stdin })) {
  const cmd = JSON.parse(line);
  const opts = cmd.key ? { idempotencyKey: cmd.key } : {};
  let out;
  try {
    const pi = await stripe.paymentIntents.create({ amount: cmd.amount, currency: 'eur' }, opts);
    out = { id: pi.id };
  } catch (err) {
    out = { error: err.type, type: (err.raw && err.raw.type) || '', code: err.code || '', message: err.message || '',
      status: err.statusCode || 0 };
  }
  out.attempts = attempts.get(cmd.key || '') || 0;
  process.stdout.write(JSON.stringify(out) + '\n');
}
