"""The server's reliability suite: exact-checked traffic, clients that hang up, fuzzing from the
OpenAPI schema and a table of malformed requests, against `dabba serve`.

    python -m tools.reliability [--url URL] [--model DIR] [--minutes M] [--clients C] [--json-out FILE]

Without --url the script starts the server itself (MODEL: the bundled demo model by default),
with an API key and tight bounds, and stops it with SIGTERM at the end, checking it exits 0 (a
clean drain). Either way it reads the bounds of the server it probes (GET /server/limits) and
sizes every table and case to them. Phases (each a module of this package with a run_* function returning a PhaseResult;
tests/reliability calls them against an in-process server with small counts):

1. soak: C clients send completions and chat requests, streamed or not, n in {1, 2}, with
   ignore_eos (so the token count is known) and some with stop strings; every response is
   checked exactly (tokens counted from logprobs against usage and max_tokens x n).
2. storm: clients hang up at random points; the server must then settle (no request running or
   waiting, no KV block held) and give the same greedy outputs as before.
3. fuzz: schemathesis cases from /openapi.json, valid and invalid: never a 5xx, every 4xx in
   OpenAI's error shape, every 2xx JSON (or a stream ending in [DONE]); then random
   structured-output constraints: valid ones served and satisfied, hostile ones (past a bound,
   admitting nothing, reaching a dead end) refused naming the field (constraints.py).
4. malformed: hand-written bad requests, each with its expected status and param, each followed
   by a good request on the same client; then bytes HTTP's parser refuses (framing, the request
   line) and a foreign Host, on raw sockets, each answered in the error shape.

Phases 1-3 repeat in rounds until --minutes pass (at least one round), then phase 4 runs. The
report (one JSON object on stdout) has every phase's counts and failures and the totals; for a
server the script started, its RSS (at start, after each round, at the end), its exit status and
the error lines of its log (any is a failure: a traceback is a bug even if every answer was
right). Exit status 1 if anything failed.
"""
